"""Decode variants of the hybrid placement, for ``hetmoe bench e2e`` on a GPU: the same loaded model decoded
eagerly, as a CUDA graph, as a graph with Expert Deferral d = 1, 2, 3, and (with ``--gpu-experts N``) as a graph with
GPU-resident experts — each at batch 1 beside the decode roofline, with a one-step time split:

* step   median wall time of a decode step (the graph replayed, the GPU synchronized);
* GPU    the same step with the CPU left out (no host functions: the routed experts' outputs are stale) — what the
         GPU and the small copies alone cost;
* CPU    the CPU jobs of one step (the buffers of the last real step) run back to back on the expert pool, no GPU;
* overlap = GPU + CPU - step: the time both were busy at once (0 would be fully serial).
"""

from __future__ import annotations

import statistics
import time

import torch

from hetmoe.engine.runner import Runner
from hetmoe.load.loader import LoadedModel, moe_blocks
from hetmoe.load.rules import defer_layers
from hetmoe.moe import defer_experts

DEFER = (1, 2, 3, 4, 5, 6, 7)  # d < top_k only
SPLIT_STEPS = 10


def set_deferral(model, d: int) -> None:
    """Expert Deferral of ``d`` experts per token on every MoE layer (0: none)."""
    defer_experts(model, d)


def _offloaded(model) -> list:
    """The MoE layers whose experts run on the CPU behind the GPU model."""
    return [layer for _, layer in moe_blocks(model) if layer.staging is not None]


def _set_gpu_experts(model, saved: list, on: bool) -> None:
    for layer, gpu in zip(_offloaded(model), saved):
        layer.set_gpu_experts(gpu if on else None)


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def time_split(runner: Runner, steps: int = SPLIT_STEPS) -> dict:
    """GPU / CPU / overlap of one batch-1 decode step of slot 0, re-running its last step in place (its KV entry is
    rewritten: the runner is not used for generation afterwards)."""
    dec, hyb = runner.decoder, runner.hybrid
    pos, tok = max(0, runner.lengths[0] - 1), 1
    dec.step([tok], [pos], [0], cpu=False)  # captures the GPU-only graph (untimed)
    gpu_ms = median_ms(lambda: dec.step([tok], [pos], [0], cpu=False), steps)
    dec.step([tok], [pos], [0])
    step_ms = median_ms(lambda: dec.step([tok], [pos], [0]), steps)
    jobs = list(hyb.last_jobs) if hyb is not None else []

    def cpu_alone():
        for pool, job in jobs:
            pool.submit(job)
        for pool in {p for p, _ in jobs}:
            pool.sync()

    cpu_ms = median_ms(cpu_alone, steps) if jobs else 0.0
    return {"step_ms": step_ms, "gpu_ms": gpu_ms, "cpu_ms": cpu_ms, "overlap_ms": gpu_ms + cpu_ms - step_ms,
            "cpu_jobs_per_step": len(jobs)}


def _decode_times(runner: Runner, prompt: list, steps: int, warmup: int, gen: torch.Generator) -> list:
    runner.prefill(prompt)
    times = []
    for i, tok in enumerate(torch.randint(runner.vocab_size, (warmup + steps,), generator=gen).tolist()):
        t0 = time.perf_counter()
        runner.decode(tok)  # synchronizes: the logits are on the host side of the step's end
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


TOPK_ON_GPU = "+topk-gpu"  # a switch on any graph variant: the top-k on the GPU instead of inside the CPU jobs


def variant_names(k: int, gpu_n: int = 0) -> list:
    """Every variant name for a model with top-``k`` routing (and ``gpu_n`` GPU-resident experts per layer): the
    default runs, in order, and then the switches that are off by default (``graph...+topk-gpu``)."""
    names = ["eager", "graph"] + [f"graph+d{d}" for d in DEFER if d < k]
    if gpu_n:
        names += [f"graph+gpu{gpu_n}"] + [f"graph+gpu{gpu_n}+d{d}" for d in DEFER if d < k]
    return names + [n + TOPK_ON_GPU for n in names if n.startswith("graph") and "+gpu" not in n]


def _parse_variant(name: str) -> tuple:
    """name -> (cuda graph, d, GPU experts on, route on host)."""
    route_on_host = not name.endswith(TOPK_ON_GPU)
    parts = name.removesuffix(TOPK_ON_GPU).split("+")
    d = next((int(p[1:]) for p in parts if p.startswith("d")), 0)
    return parts[0] == "graph", d, any(p.startswith("gpu") for p in parts), route_on_host


def decode_variants(loaded: LoadedModel, prompt_tokens: int, steps: int, repeats: int, roofline_tok_s,
                    seed: int = 0, warmup: int = 2, log=print, stream=None, bytes_per_token: float = 0,
                    only=None) -> list:
    """Batch-1 decode tok/s per variant (median of ``repeats`` runs of ``steps`` steps after a prompt), with the
    roofline and the time split. The model's own deferral and GPU experts are restored afterwards.

    ``stream`` (a function returning GB/s) is also probed right before and after each variant's runs: on a machine
    whose bandwidth drifts within minutes, ``roofline_adjacent_tok_s`` (their mean / ``bytes_per_token``) is the
    roofline of the minute the variant ran in, beside the run-wide ``roofline_tok_s``."""
    model = loaded.model
    k = loaded.config.num_experts_per_tok
    gpu_saved = [off.gpu for off in _offloaded(model)]
    has_gpu = any(g is not None for g in gpu_saved)
    blocks = moe_blocks(model)
    n = max((len(g.expert_ids) for g in gpu_saved if g is not None), default=0)
    known = variant_names(k, n)
    if only is None:
        names = [v for v in known if not v.endswith(TOPK_ON_GPU)]
    else:  # "gpu" without a count names the model's own GPU experts (e.g. a --gpu-experts auto plan's)
        only = ["+".join(f"gpu{n}" if p == "gpu" else p for p in v.split("+")) for v in only]
        unknown = [v for v in only if v not in known]
        if unknown:
            raise ValueError(f"unknown decode variant {unknown[0]!r} for this model; known: {', '.join(known)}")
        names = list(only)
    gen = torch.Generator().manual_seed(seed)
    records = []
    try:
        for name in names:
            graph, d, gpu, route_on_host = _parse_variant(name)
            set_deferral(model, d)
            if has_gpu:
                _set_gpu_experts(model, gpu_saved, gpu)
            runner = Runner(loaded, cuda_graph=graph)
            if runner.hybrid is not None:
                runner.hybrid.route_on_host = route_on_host
            try:
                prompt = torch.randint(runner.vocab_size, (prompt_tokens,), generator=gen).tolist()
                around = [stream()] if stream else []
                runs = [_decode_times(runner, prompt, steps, warmup, gen) for _ in range(repeats)]
                around += [stream()] if stream else []
                rates = [len(r) / sum(r) for r in runs]
                tok_s = statistics.median(rates)
                steps_ms = [1e3 * t for r in runs for t in r]  # every timed step: a slow few show here, not in step_ms
                step_median = statistics.median(steps_ms)
                adjacent = (statistics.mean(around) * 1e9 / bytes_per_token) if around and bytes_per_token else None
                rec = {"variant": name, "cuda_graph": graph, "defer_experts": d, "gpu_experts": gpu,
                       "route_on_host": route_on_host,
                       "decode_tok_s": tok_s, "decode_tok_s_all": rates, "ms_per_token": 1e3 / tok_s,
                       "roofline_tok_s": roofline_tok_s,
                       "pct_roofline": 100 * tok_s / roofline_tok_s if roofline_tok_s else None,
                       "decode_step_median_ms": step_median, "decode_step_max_ms": max(steps_ms),
                       "decode_slow_steps": sum(t > 2 * step_median for t in steps_ms),
                       "stream_gbps_adjacent": around or None, "roofline_adjacent_tok_s": adjacent,
                       "pct_roofline_adjacent": 100 * tok_s / adjacent if adjacent else None,
                       **time_split(runner), "decoder": runner.decoder.stats()}
            finally:
                runner.decoder.close()
                del runner
            records.append(rec)
            log(f"  {name:16s} {rec['decode_tok_s']:7.2f} tok/s  step {rec['step_ms']:6.2f} ms"
                f" = GPU {rec['gpu_ms']:6.2f}"
                f" + CPU {rec['cpu_ms']:6.2f} - overlap {rec['overlap_ms']:6.2f}; decode steps: median"
                f" {step_median:.2f}, max {rec['decode_step_max_ms']:.2f} ms, {rec['decode_slow_steps']} of"
                f" {len(steps_ms)} over twice the median")
    finally:
        defer_layers(blocks, loaded.plan)  # the model's own deferral back (per layer, as its plan says)
        if has_gpu:
            _set_gpu_experts(model, gpu_saved, True)
    return records


def fmt_variants(records: list) -> list:
    """The variants' table; "adj." columns: the roofline from the STREAM probed around each variant's runs."""
    nan = float("nan")
    head = (f"{'variant':18s} {'decode':>8s} {'roofline':>9s} {'%roof':>6s} {'adj.roof':>9s} {'%adj':>6s}"
            f" {'step':>7s} {'GPU':>7s} {'CPU':>7s} {'overlap':>8s} {'capture':>8s}")
    units = (f"{'':18s} {'tok/s':>8s} {'tok/s':>9s} {'':>6s} {'tok/s':>9s} {'':>6s}"
             + "".join(f" {'ms':>{w}s}" for w in (7, 7, 7, 8, 8)))
    lines = [head, units]
    for r in records:
        cap = sum(r["decoder"]["capture_ms"].values())
        roof, adj = r["roofline_tok_s"], r.get("roofline_adjacent_tok_s")
        pct, pct_adj = r["pct_roofline"], r.get("pct_roofline_adjacent")
        lines.append(
            f"{r['variant']:18s} {r['decode_tok_s']:8.2f} {roof if roof is not None else nan:9.2f}"
            f" {pct if pct is not None else nan:5.1f}% {adj if adj is not None else nan:9.2f}"
            f" {pct_adj if pct_adj is not None else nan:5.1f}% {r['step_ms']:7.2f}"
            f" {r['gpu_ms']:7.2f} {r['cpu_ms']:7.2f} {r['overlap_ms']:8.2f} {cap:8.0f}"
        )
    return lines
