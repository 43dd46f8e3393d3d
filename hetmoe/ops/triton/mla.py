"""MLA's absorbed decode products in Triton (the fused decode path, docs/decode-step.md#fused-decode): per query
head, the query's no-RoPE part times W_uk into the latent space, and the attention's latent output times W_uv out of
it (hetmoe/models/deepseek_v2.py). Each is ``torch.einsum("thk,hkn->thn", x, w)`` over a decode step's row, done as
one GEMV-shaped kernel: every program reads one tile of one head's matrix once and multiplies it by each row on the
CUDA cores, one node of the decode graph where einsum's batched GEMM is more (BENCHMARKS.md, "GPU part of the decode
step"). Tested against einsum in tests/ops/test_fused_decode.py (Triton's interpreter without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.ops.triton import pdl as triton_pdl
from hetmoe.ops.triton.fused import store_rows
from hetmoe.ops.triton.pdl import pdl_begin


@triton.jit
def _head_gemv(X, W, OUT, T, K, N, sx_t, sx_h, sw_h, sw_k, sw_n, so_t, so_h,
               BT: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """Program (h, j): OUT[t, h, n] = sum_k X[t, h, k] W[h, k, n] for the T <= BT rows and the BN outputs of block j,
    products summed in fp32 and rounded once. The [BK, BN] weight tile is read once (along whichever of k and n
    has unit stride) and multiplied by each row on the CUDA cores, as the dense GEMV is."""
    pdl_begin(PDL)
    h = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N
    rows = tl.arange(0, BT)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        w = tl.load(W + h * sw_h + k[:, None] * sw_k + n[None, :] * sw_n, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        for t in tl.static_range(BT):
            x = tl.load(X + t * sx_t + h * sx_h + k, mask=k_ok & (t < T), other=0.0).to(tl.float32)
            acc += tl.where(rows[:, None] == t, tl.sum(w * x[:, None], axis=0)[None, :], 0.0)
    store_rows(OUT + rows[:, None] * so_t + h * so_h + n[None, :], acc, (rows < T)[:, None] & n_ok[None, :])


HEAD_GEMV_ROWS = 8  # rows of x one head_gemv call takes (each program multiplies its tile by every row)
# rows up to which a fused decode step takes head_gemv, above them torch.einsum (cuBLAS's batched GEMM): each row
# more costs head_gemv a pass of CUDA-core products over its tile, and from two rows on it was slower than einsum on
# an H200, where at one row it made the decode step faster (bench/device/mla_head_gemv.py; BENCHMARKS.md, "GPU part
# of the decode step")
HEAD_GEMV_MAX_T = 1
# (BK, BN, warps) of a program's tile at most, by the weight's unit-stride axis: the fastest of
# bench/device/mla_head_gemv.py --sweep at one row on an H200 (DeepSeek-V3's W_uk and W_uv^T; BENCHMARKS.md)
HEAD_GEMV_TILES = {"n": (128, 64, 2), "k": (256, 8, 4)}


def head_gemv(x: torch.Tensor, w: torch.Tensor, tile: tuple | None = None) -> torch.Tensor:
    """x [T, h, K], w [h, K, N] (any strides; T <= HEAD_GEMV_ROWS) -> [T, h, N] in x's dtype: per head, x times
    that head's matrix (``torch.einsum("thk,hkn->thn", x, w)``), summed in fp32 and rounded once. ``tile``: (BK, BN,
    warps) instead of the planned ones (bench/device/mla_head_gemv.py --sweep)."""
    T, h, K = x.shape
    if w.dim() != 3 or w.shape[0] != h or w.shape[1] != K or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"head_gemv: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}: expected w "
                         f"[{h}, {K}, N] in x's dtype on x's device")
    if T > HEAD_GEMV_ROWS:
        raise ValueError(f"head_gemv: {T} rows, at most {HEAD_GEMV_ROWS}")
    N = w.shape[2]
    out = torch.empty(T, h, N, dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    bk, bn, warps = tile or HEAD_GEMV_TILES["n" if w.stride(2) == 1 else "k"]  # rows of n, or of k, contiguous
    if tile is None:
        bk, bn = min(bk, triton.next_power_of_2(K)), min(bn, triton.next_power_of_2(N))
    if T and N:
        _head_gemv[(h, triton.cdiv(N, bn))](x, w, out, T, K, N, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                                            w.stride(2), out.stride(0), out.stride(1),
                                            BT=triton.next_power_of_2(T), BK=bk, BN=bn, num_warps=warps,
                                            **triton_pdl.launch(x.device))
    return out
