"""Decode steps that every GPU graph test compares: the same prompts and tokens through a Runner, graph or eager,
fused or not (tests/ops/test_fused_decode.py, tests/models/test_glm4_minimax.py); and a sparse-attention model's
steps as a graph captures them against the same steps decided on the host (tests/models/test_deepseek_v32.py,
test_minimax_m3.py)."""

from __future__ import annotations

import torch

STEPS = 6


def graph_decode(loaded, batch: int, fused: bool, graph: bool = True, steps: int = STEPS) -> torch.Tensor:
    """Logits [steps, batch, V] of ``batch`` sequences prefilled with 14..21-token prompts (the steps cross the
    16-position page boundary of some rows), then decoded ``steps`` tokens at once, on the CUDA graph (``graph``) or
    eagerly, with the fused decode path on or off."""
    from hetmoe.engine.runner import Runner

    runner = Runner(loaded, cuda_graph=graph, fused_decode=fused)
    assert runner.decoder.fused is fused
    slots = list(range(batch))
    for s in slots:
        runner.prefill([(37 * s + 11 * j) % 250 + 3 for j in range(14 + (3 * s) % 8)], slot=s)
    out = [runner.decode_batch([(13 * i + 29 * s) % 250 + 3 for s in slots], slots).cpu() for i in range(steps)]
    runner.decoder.close()
    return torch.stack(out)


def captured_against_host(model, dense: int, prompts: tuple, steps: int, max_context: int, paged: bool,
                          seed: int = 3, ids_below: int = 256) -> tuple:
    """A sparse-attention model (dense while every position is below ``dense``) over two caches: prompts of
    ``prompts`` tokens in slots 2 and 0, then ``steps`` decode steps of the batch, once as a CUDA graph captures them
    (``Step.captured``, kv_len from ``sparse_kv_len``) and once deciding on the host (kv_len the runner's eager bound,
    max_context; token ids below ``ids_below``) -> (max relative difference per step, kv_len per step)."""
    from hetmoe.layers.attention import Step
    from hetmoe.layers.sparse_attention import sparse_kv_len
    from parity import max_rel

    layout = dict(page_size=4, initial_tokens=8) if paged else {}
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(ids_below, model.config.vocab_size), (2, max(prompts) + steps), generator=gen)
    slots = torch.tensor([2, 0])
    caches = [model.make_cache(3, max_context, **layout) for _ in range(2)]
    errs, lens = [], []
    with torch.inference_mode():
        for cache in caches:
            for b, n in enumerate(prompts):
                cache.reserve(int(slots[b]), n)
                model(ids[b:b + 1, :n], Step(torch.arange(n)[None], slots[b:b + 1], start=0), cache)
        for i in range(steps):
            pos = torch.tensor([[prompts[0] + i], [prompts[1] + i]])
            for s, p in zip(slots.tolist(), pos[:, 0].tolist()):
                for cache in caches:
                    cache.reserve(s, p + 1)
            tok = ids[:, max(prompts) + i:max(prompts) + i + 1]
            kv = sparse_kv_len(int(pos.max()), dense, max_context)
            lens.append(kv)
            host = model.logits(model(tok, Step(pos, slots, kv_len=max_context), caches[0]))
            captured = model.logits(model(tok, Step(pos, slots, kv_len=kv, captured=True), caches[1]))
            errs.append(max_rel(captured, host))
    return errs, lens
