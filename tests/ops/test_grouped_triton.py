"""The GPU prefills' sync-free expert path (hetmoe/moe/grouped.py ``grouped_swiglu`` with
hetmoe/ops/triton/grouped.py): here under Triton's interpreter on CPU tensors, with ``torch._grouped_mm`` replaced by
a loop over the offsets that leaves the rows past the last offset NaN (as unwritten GPU memory may be), so a
skipped slot's row leaking into the sum would show. On a GPU the same path is covered end to end by the layerwise
GPU tests (tests/moe/streamed/test_layerwise.py, prefill logits against the CPU engine)."""

import pytest
import torch

from tests.triton_interp import triton_module


def _emulated_grouped_mm(a, b, offs):
    """a [M, K] @ b [G, K, N] per group of rows given by the cumulative offsets; rows past offs[-1]: NaN."""
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=a.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[g]
        start = end
    return out


def test_swiglu_and_combine_kernels_match_torch():
    gt = triton_module("hetmoe.ops.triton.grouped", on_cpu=True)
    gen = torch.Generator().manual_seed(3)
    M, I, T, k, H = 24, 40, 8, 3, 72
    gu = torch.randn(M, 2 * I, generator=gen)
    ref = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
    assert (gt.swiglu(gu) - ref).abs().max() < 1e-6  # fp32: silu as g / (1 + exp(-g)), measured 2.4e-7
    y = torch.randn(M, H, generator=gen)
    pos = torch.randperm(M, generator=gen).view(T, k)
    ids = torch.randint(0, 5, (T, k), generator=gen)
    ids[2, 1] = ids[5, 0] = -1
    y[pos[2, 1]] = y[pos[5, 0]] = float("nan")  # a skipped slot's row is never read
    w = torch.rand(T, k, generator=gen)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            if ids[t, j] >= 0:
                want[t] += w[t, j] * y[pos[t, j]]
    got = gt.combine_slots(y, pos, ids, w)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)  # the same fp32 adds in the same (slot) order


@pytest.mark.parametrize("T,k", [(1, 1), (17, 4), (64, 8)])
def test_sync_free_path_matches_the_loop(monkeypatch, T, k):
    triton_module("hetmoe.ops.triton.grouped", on_cpu=True)
    from hetmoe.moe import grouped

    gen = torch.Generator().manual_seed(T + k)
    E, H, I = 9, 48, 20
    x = torch.randn(T, H, generator=gen)
    w_gu, w_down = torch.randn(E, 2 * I, H, generator=gen) / 7, torch.randn(E, H, I, generator=gen) / 5
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    ids.view(-1)[:: 5] = -1  # skipped slots, first of all (t = 0, j = 0)
    w = torch.rand(T, k, generator=gen)
    ref = grouped.grouped_swiglu(x, ids, w, w_gu, w_down)  # the loop over experts (no grouped GEMM on a CPU)
    monkeypatch.setattr(grouped, "_grouped_mm_ok", lambda _w: True)
    monkeypatch.setattr(torch, "_grouped_mm", _emulated_grouped_mm, raising=False)
    got = grouped.grouped_swiglu(x, ids, w, w_gu, w_down)
    assert torch.isfinite(got).all()
    # fp32, summation order: measured 1e-7 of the largest value (T = k = 1: the one slot skipped, all zeros)
    assert (got - ref).abs().max().item() <= 1e-5 * max(ref.abs().max().item(), 1.0)
