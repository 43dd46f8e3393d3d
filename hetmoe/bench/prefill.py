"""Prefill by path, for ``hetmoe bench e2e`` on a GPU: per prompt length, the routed experts on the CPU engine, on
the layerwise GPU path (hetmoe/moe/streamed/layerwise.py) and with the automatic choice between them, beside the PCIe
roofline of the GPU path: a prompt of T tokens cannot prefill faster than T / (one pass over every layer's packed
experts at the measured H2D rate); in chunks of C < T tokens every chunk makes that pass (the chunked roofline,
printed beside it). The GPU path's time per MoE layer is split into its copy, its expert compute, the
CPU's share (hetmoe/moe/streamed/cpu_share.py) and the main stream's idle time waiting for either (CUDA events); they
overlap, so a layer takes about the largest of the first three. With a CPU share, the GPU path is also timed without
it (``gpu_no_share``: the A/B in one run). Where layers copied only their routed experts
(hetmoe/moe/streamed/copy.py), the line says how many per layer."""

from __future__ import annotations

import statistics
import time

import torch

from hetmoe.engine.runner import Runner
from hetmoe.load.loader import LoadedModel


def time_prefill(runner: Runner, n: int, repeats: int, gen: torch.Generator) -> list:
    """Seconds of ``repeats`` prefills of ``n`` random tokens into slot 0, after one warm-up."""
    times = []
    for i in range(1 + repeats):
        ids = torch.randint(runner.vocab_size, (n,), generator=gen).tolist()
        runner.synchronize()
        t0 = time.perf_counter()
        runner.prefill(ids)
        runner.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def prefill_paths(loaded: LoadedModel, prompts: list, repeats: int, seed: int, log=print) -> dict:
    """{"rates": the layerwise rates measured now, "expert_bytes", "rows": per prompt length {tokens, cpu/gpu/auto
    (gpu_no_share) tok/s, pcie_roofline_tok_s, pct_roofline, copy/compute/cpu/idle ms per layer, cpu_experts}}."""
    lw = loaded.layerwise
    runner = Runner(loaded)
    gen = torch.Generator().manual_seed(seed)
    auto = lw.min_tokens
    rates = lw.measure()
    total = sum(lw.layer_bytes(i) for i in range(len(lw.layers)))
    rows = []
    try:
        for n in prompts:
            row = {"tokens": n, "chunk": runner.prefill_chunk, "min_tokens_auto": auto}
            for path in ("cpu", "gpu", "auto") + (("gpu_no_share",) if lw.share is not None else ()):
                runner.layerwise = None if path == "cpu" else lw
                lw.min_tokens = auto if path == "auto" else 1
                lw.profiling = path == "gpu"
                if path == "gpu_no_share":
                    mode, lw.share.mode = lw.share.mode, "off"
                times = time_prefill(runner, n, repeats, gen)
                if path == "gpu_no_share":
                    lw.share.mode = mode
                row[f"{path}_tok_s"] = n / statistics.median(times)
                if path == "gpu":
                    row.update(lw.profile())
                lw.profiling = False
            row["pcie_roofline_tok_s"] = n / (total / (rates["copy_gbps"] * 1e9))
            row["pct_roofline"] = 100 * row["gpu_tok_s"] / row["pcie_roofline_tok_s"]
            passes = -(-n // runner.prefill_chunk)  # each chunk streams every layer once
            row["chunk_roofline_tok_s"] = row["pcie_roofline_tok_s"] / passes
            rows.append(row)
            log(f"  prefill {n:6d} tokens: cpu {row['cpu_tok_s']:9.1f}  gpu {row['gpu_tok_s']:9.1f}  auto "
                f"{row['auto_tok_s']:9.1f} tok/s; PCIe roofline {row['pcie_roofline_tok_s']:9.1f} "
                f"({row['pct_roofline']:.0f}%; {row['chunk_roofline_tok_s']:.1f} in chunks of {runner.prefill_chunk}, "
                f"{100 * row['gpu_tok_s'] / row['chunk_roofline_tok_s']:.0f}%); per MoE layer: copy "
                f"{row['copy_ms']:.2f} ms, experts "
                f"{row['compute_ms']:.2f} ms, CPU share {row['cpu_ms']:.2f} ms ({row['cpu_experts']:.0f} experts), "
                f"idle {row['idle_ms']:.2f} ms"
                + (f"; routed-only copies: {row['routed_experts']:.1f} of {lw.layouts[0].num_experts} experts per "
                   "layer" if row.get("routed_layers") else "")
                + (f"; gpu without the share {row['gpu_no_share_tok_s']:9.1f} tok/s" if lw.share is not None else ""))
    finally:
        lw.min_tokens, lw.profiling = auto, False
        runner.layerwise = lw
    return {"rates": rates, "expert_bytes": total, "rows": rows}
