"""Decode steps that every GPU graph test compares: the same prompts and tokens through a Runner, graph or eager,
fused or not (tests/ops/test_fused_decode.py, tests/models/test_glm4_minimax.py)."""

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
