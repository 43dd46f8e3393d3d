"""Decode and prefill attention at long contexts, for ``hetmoe bench e2e --kv-contexts N,N,...`` on a GPU.

Per attention path (``triton``: the paged cache and hetmoe's kernels; ``sdpa``: PyTorch's SDPA over the contiguous
cache, one CUDA graph per 64-position bucket — engine/cuda_graph.py), in a cache of max(contexts) positions:

* batch-1 graph decode tok/s with the sequence near each context, and the GPU part of that step (the same step with
  the CPU jobs left out). The sequence is placed there by setting its cached length (the KV entries are whatever
  the cache holds: decode cost does not depend on them), decoded once untimed (captures what it needs), then
  rewound and timed;
* (triton, ``batch`` > 1) a decode step of ``batch`` sequences at lengths spread from min to max(contexts)
  against the same batch all at min(contexts);
* the attention alone of a prefill of each context up to PREFILL_MAX: every layer's attention kernel over the
  prompt in chunks of the runner's prefill_chunk, on random q/k/v of the model's shape (the projections, experts
  and the rest are what ``bench e2e``'s prefill rows time).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from hetmoe.bench.decode_variants import median_ms, time_split
from hetmoe.engine.runner import Runner
from hetmoe.layers.attention import paged_kernels
from hetmoe.load.loader import LoadedModel

PREFILL_MAX = 32768  # prefill attention is timed up to this length (past it: minutes, and the sdpa path's masks)


def _runner(loaded: LoadedModel, max_context: int, attention: str, max_batch: int = 1) -> Runner:
    paged = loaded.plan.kv_paged and attention != "sdpa"
    plan = dataclasses.replace(loaded.plan, max_context=max_context, kv_paged=paged)
    options = dataclasses.replace(loaded.options, attention=attention, max_batch=max_batch)
    return Runner(dataclasses.replace(loaded, plan=plan, options=options), cuda_graph=True)


def decode_at(runner: Runner, ctx: int, steps: int, gen: torch.Generator) -> dict:
    """Batch-1 decode of slot 0 around position ``ctx``: tok/s, median step and its GPU part (ms)."""
    start = ctx - steps - 1
    tokens = torch.randint(runner.vocab_size, (steps,), generator=gen).tolist()
    for _ in range(2):  # the first pass captures what this range needs, the second is timed
        runner.lengths[0] = start
        times = []
        for tok in tokens:
            t0 = time.perf_counter()
            runner.decode(tok)
            times.append(time.perf_counter() - t0)
    return {"decode_tok_s": steps / sum(times), "step_ms": 1e3 * statistics.median(times),
            "gpu_ms": time_split(runner)["gpu_ms"]}


def batch_decode(runner: Runner, lengths: list, tokens: list, steps: int) -> float:
    """Median ms of a decode step of len(lengths) sequences at those lengths (slots 0..n-1), fed ``tokens`` (one per
    sequence: distinct tokens route to as many experts whatever the lengths, so only attention differs)."""
    slots = list(range(len(lengths)))
    times = []
    for i in range(steps + 2):
        for s, n in zip(slots, lengths):
            runner.lengths[s] = n
        t0 = time.perf_counter()
        runner.decode_batch(tokens, slots)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def prefill_attention_ms(loaded: LoadedModel, runner: Runner, n_tokens: int) -> float:
    """The attention of every layer over an ``n_tokens`` prompt from position 0, chunked as the runner prefills, on
    random inputs of the model's shape (one layer timed, times the layers)."""
    from hetmoe.layers.attention import Step, attend, attend_cache, mla_expanded_paged

    cfg, cache, dev, dt = loaded.config, runner.cache, runner.device, runner.dtype
    H, chunk, scale = cfg.num_attention_heads, runner.prefill_chunk, 0.1
    cache.reserve(0, n_tokens)

    def mla(S: int, step: Step) -> None:  # the expanded form over the latent rows
        rope, nope, dv = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        ctx = -(-step.kv_len // 64) * 64
        kv = torch.randn(1, ctx, H, nope + dv, device=dev, dtype=dt)
        pe = torch.randn(1, ctx, 1, rope, device=dev, dtype=dt)
        qn, qp = (torch.randn(1, S, H, d, device=dev, dtype=dt) for d in (nope, rope))
        if cache.paged:
            mla_expanded_paged(qn, qp, kv, pe, cache.page_size, step, scale)
        else:
            k = torch.cat((kv[..., :nope], pe.expand(-1, -1, H, -1)), -1)
            attend(torch.cat((qn, qp), -1), k, kv[..., nope:], step, scale)

    def one_layer():
        for i in range(0, n_tokens, chunk):
            S = min(chunk, n_tokens - i)
            pos = torch.arange(i, i + S, device=dev)[None]
            step = Step(pos, torch.zeros(1, dtype=torch.int64, device=dev), kv_len=i + S, first_slot=0, start=i)
            if cfg.get("kv_lora_rank"):
                mla(S, step)
            else:
                attend_cache(torch.randn(1, S, H, cache.head_dim, device=dev, dtype=dt), cache, 0, step, scale)

    one_layer()  # compiles
    torch.cuda.synchronize()
    return cfg.num_hidden_layers * median_ms(lambda: (one_layer(), torch.cuda.synchronize()), 1)


def kv_contexts(loaded: LoadedModel, contexts: list, steps: int, seed: int = 0, batch: int = 16, log=print) -> list:
    """The records described in the module docstring, one per (attention path, context) and per batch test."""
    contexts = sorted(contexts)
    if contexts[0] < steps + 16:
        raise ValueError(f"context {contexts[0]} is too short for {steps} decode steps")
    max_ctx = max(contexts)
    paths = (["triton"] if paged_kernels(loaded.plan.device) else []) + ["sdpa"]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for attention in paths:
        runner = _runner(loaded, max_ctx, attention)
        try:
            runner.prefill(torch.randint(runner.vocab_size, (8,), generator=gen).tolist())
            base = None
            for ctx in contexts:
                rec = {"attention": attention, "context": ctx, "max_context": max_ctx,
                       **decode_at(runner, ctx, steps, gen),
                       "prefill_attention_ms": (prefill_attention_ms(loaded, runner, ctx)
                                                if ctx <= PREFILL_MAX else float("nan"))}
                base = base or rec["decode_tok_s"]
                rec["vs_first_context"] = rec["decode_tok_s"] / base
                out.append(rec)
                log(f"  {attention:6s} context {ctx:7d}: decode {rec['decode_tok_s']:7.2f} tok/s "
                    f"({100 * rec['vs_first_context']:5.1f}% of {contexts[0]}), step {rec['step_ms']:6.2f} ms, "
                    f"GPU part {rec['gpu_ms']:6.2f} ms; prefill attention {rec['prefill_attention_ms']:8.1f} ms")
        finally:
            runner.decoder.close()
            del runner
        torch.cuda.empty_cache()
    if batch > 1 and "triton" in paths:
        runner = _runner(loaded, max_ctx, "triton", max_batch=batch)
        try:
            lo, hi = contexts[0], min(max_ctx - 1, 32768)
            mixed = [int(lo * (hi / lo) ** (i / (batch - 1))) for i in range(batch)]
            tokens = torch.randint(runner.vocab_size, (batch,), generator=gen).tolist()
            same_ms = batch_decode(runner, [lo] * batch, tokens, steps)
            mixed_ms = batch_decode(runner, mixed, tokens, steps)
            rec = {"attention": "triton", "batch": batch, "lengths": mixed, "step_ms_same": same_ms,
                   "step_ms_mixed": mixed_ms, "mixed_vs_same": mixed_ms / same_ms}
            out.append(rec)
            log(f"  triton batch {batch}: step {same_ms:.2f} ms all at {lo}, {mixed_ms:.2f} ms at {lo}..{hi} "
                f"(+{100 * (rec['mixed_vs_same'] - 1):.1f}%)")
        finally:
            runner.decoder.close()
            del runner
    return out
