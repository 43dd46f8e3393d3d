"""The elementwise ends of the layerwise prefill's grouped GEMMs (hetmoe/moe/streamed/layerwise.py) in Triton, so that a
layer's experts take no host synchronization and no fp32 copies of the [M, 2I] / [M, H] intermediates:

* ``swiglu(gu [M, 2I])`` -> silu(gate) * up [M, I] in gu's dtype, computed in fp32 and rounded once (as the torch
  path does: ``(F.silu(gu.float()[:, :I]) * gu.float()[:, I:]).to(dtype)``; hetmoe/ops/triton/fused.py's
  ``silu_mul`` kernel);
* ``combine_slots(y [M, H], pos [T, k], ids [T, k], weights [T, k])`` -> fp32 [T, H]: out[t] = the sum over the
  slots j with ids[t, j] >= 0, in slot order, of weights[t, j] * y[pos[t, j]] (pos: the row of slot (t, j) in the
  expert-sorted order). Skipped slots' rows are never read, so rows the grouped GEMM left unwritten (the skipped
  slots sort past the last expert's offset) cannot leak in; the fixed order makes the sum bitwise reproducible
  (``index_add_`` on a GPU adds in any order).

Shape letters: T tokens, k slots per token, M = T·k rows, H hidden, I expert intermediate.
"""

from __future__ import annotations

from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch: no Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _combine_slots(Y, POS, IDS, W, OUT, H, K: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < H
        if ACC:
            acc = tl.load(OUT + t * H + i, mask=m, other=0.0)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            e = tl.load(IDS + t * K + j)
            if e >= 0:
                row = tl.load(POS + t * K + j).to(tl.int64)
                w = tl.load(W + t * K + j).to(tl.float32)
                acc += w * tl.load(Y + row * H + i, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + t * H + i, acc, mask=m)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu [M, 2I] (gate | up) -> [M, I] in gu's dtype: the fused decode path's kernel, rounded once."""
    from hetmoe.ops.triton.fused import silu_mul

    return silu_mul(gu, round_silu=False)


def combine_slots(y: torch.Tensor, pos: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The weighted sum of each token's routed rows of ``y`` (see the module's docstring) -> fp32 [T, H]; with
    ``out`` (fp32 [T, H], contiguous) the sum is added to it in place (each token's slots in slot order after what
    ``out`` holds: a layer computed a group of experts at a time sums its groups in order)."""
    T, k = ids.shape
    H = y.shape[1]
    acc = out is not None
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=y.device)
    elif out.shape != (T, H) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{T}, {H}] tensor, got {out.dtype} {tuple(out.shape)}")
    block = min(1024, triton.next_power_of_2(H))
    if T:
        _combine_slots[(T, triton.cdiv(H, block))](y.contiguous(), pos.contiguous(), ids.contiguous(),
                                                  weights.float().contiguous(), out, H, K=k, BLOCK=block, ACC=acc,
                                                  num_warps=4)
    return out
