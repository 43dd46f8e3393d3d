"""Prefill by path, for ``hetmoe bench e2e`` on a GPU: per prompt length, the routed experts on the CPU engine, on
the layerwise GPU path (hetmoe/moe/layerwise.py) and with the automatic choice between them, beside the PCIe
roofline of the GPU path: a prompt of T tokens cannot prefill faster than T / (one pass over every layer's packed
experts at the measured H2D rate). The GPU path's time per MoE layer is split into its copy and its expert compute
(CUDA events); they overlap, so a layer takes about the larger of the two."""

from __future__ import annotations

import statistics
import time

import torch

from hetmoe.engine.loader import LoadedModel
from hetmoe.engine.runner import Runner


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
    tok/s, pcie_roofline_tok_s, pct_roofline, copy_ms/compute_ms per layer}}."""
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
            for path in ("cpu", "gpu", "auto"):
                runner.layerwise = None if path == "cpu" else lw
                lw.min_tokens = 1 if path == "gpu" else auto
                lw.profiling = path == "gpu"
                times = time_prefill(runner, n, repeats, gen)
                row[f"{path}_tok_s"] = n / statistics.median(times)
                if path == "gpu":
                    row.update(lw.profile())
                lw.profiling = False
            row["pcie_roofline_tok_s"] = n / (total / (rates["copy_gbps"] * 1e9))
            row["pct_roofline"] = 100 * row["gpu_tok_s"] / row["pcie_roofline_tok_s"]
            rows.append(row)
            log(f"  prefill {n:6d} tokens: cpu {row['cpu_tok_s']:9.1f}  gpu {row['gpu_tok_s']:9.1f}  auto "
                f"{row['auto_tok_s']:9.1f} tok/s; PCIe roofline {row['pcie_roofline_tok_s']:9.1f} "
                f"({row['pct_roofline']:.0f}%); per MoE layer: copy {row['copy_ms']:.2f} ms, experts "
                f"{row['compute_ms']:.2f} ms")
    finally:
        lw.min_tokens, lw.profiling = auto, False
        runner.layerwise = lw
    return {"rates": rates, "expert_bytes": total, "rows": rows}
