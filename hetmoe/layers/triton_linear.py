"""Weight-only quantized linears in Triton: ``y [M, N] = x [M, K] @ dequant(W) [N, K]^T (+ bias)``, the weights
dequantized inside the K loop, never materialised in bf16.

Packed layouts (made by hetmoe/layers/gpu_linear.py; K padded with zeros to a whole group, Kp):
* int8: ``W`` int8 [N, Kp], one fp32 scale per 64 weights along K: ``S`` [N, Kp/64]; w = q * s.
* int4: ``W`` uint8 [N, Kp/2]; in group g (64 weights along K), byte i holds weight g*64+i in its low nibble and
  weight g*64+32+i in its high nibble, each stored as q + 8 (q in [-8, 7]); ``S`` [N, Kp/64]. The two halves of a
  group are then two contiguous slices of x, so no interleave is needed in the kernel.
* fp8: ``W`` float8_e4m3fn [N, Kp] (Kp a multiple of 128), ``S`` fp32 [ceil(N/128), Kp/128]: DeepSeek's
  ``weight_scale_inv``, one per 128 x 128 block; w = q * s. Where the GPU has no fp8 conversion (compute capability
  below 8.9) the kernel reads the bytes and decodes e4m3 with integer arithmetic (``fp8_bits``).

One kernel serves decode and prefill. Each K step is one scale group (64 weights; fp8: one 128 block): the step's
dot product runs on the raw codes (int8, int4 and e4m3 values are exact in bf16) and its [BM, BN] partial is
multiplied by the group's scales, so the only rounding is bf16 x and fp32 accumulation. Decode (M <= 16) tiles
16 rows of x (the minimum of tl.dot) and splits K over programs until the GPU holds about PROGRAMS_PER_SM
programs per SM, so one token reads the weights at the memory's rate; the splits' fp32 partials are summed in a
fixed order by a second kernel (bitwise reproducible, no atomics). Prefill tiles 64 or 128 rows of x; programs
walk M fastest so the tiles of one weight block run together and the weights are read from memory once.

Every launch depends only on shapes (M, N, K) and the device, so a CUDA graph captured for a fixed M replays it.
In Triton's interpreter (CPU tensors, tests) tl.dot runs in fp32: its bf16 dot is wrong there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FORMATS = {"int8": 0, "int4": 1, "fp8": 2}
GROUP = {"int8": 64, "int4": 64, "fp8": 128}  # weights along K per scale
SCALE_ROWS = {"int8": 1, "int4": 1, "fp8": 128}  # weight rows per scale
DECODE_M = 16  # at most this many rows of x take the split-K (decode) configuration
PROGRAMS_PER_SM = 4


@triton.jit
def fp8_bits(b):
    """e4m3fn bytes (as uint8) -> fp32, exactly: normal values (8 + m) 2^(e - 10), subnormal m 2^-9."""
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = b & 7
    normal = (((b & 128) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    sub = tl.where((b & 128) != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def _codes(W, n, kk, stride_wn, FMT: tl.constexpr, FP8_BITS: tl.constexpr, DOT_T: tl.constexpr):
    """[len(kk), BN] weight codes of rows ``n`` at packed columns ``kk``, in the dot dtype (exact)."""
    w = tl.load(W + n[None, :].to(tl.int64) * stride_wn + kk[:, None])
    if FMT == 2 and FP8_BITS:
        return fp8_bits(w).to(DOT_T)
    return w.to(DOT_T)


@triton.jit
def _wq_linear(X, W, S, BIAS, OUT, M, N, K, n_groups, groups_per_split,
               stride_xm, stride_wn, stride_sn, stride_os, stride_om,
               FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FP8_BITS: tl.constexpr,
               DOT_T: tl.constexpr):
    """One [BM, BN] tile of y over the K groups of one split. PARTIAL: store fp32 to OUT[split] (no bias)."""
    num_m = tl.cdiv(M, BM)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    split = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_ok = m < M
    n_ok = n < N
    n_in = tl.where(n_ok, n, 0)  # rows past N read row 0 (in bounds); their outputs are never stored
    x_rows = X + m[:, None].to(tl.int64) * stride_xm
    s_rows = S + (n_in // SCALE_ROWS).to(tl.int64) * stride_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    g0 = split * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, n_groups)
    for g in range(g0, g1):
        s = tl.load(s_rows + g)  # [BN]
        if FMT == 1:
            i = tl.arange(0, GROUP // 2)
            b = tl.load(W + n_in[None, :].to(tl.int64) * stride_wn + (g * (GROUP // 2) + i)[:, None]).to(tl.int32)
            lo = ((b & 15) - 8).to(DOT_T)  # [half, BN]
            hi = ((b >> 4) - 8).to(DOT_T)
            k = g * GROUP + i
            x_lo = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0).to(DOT_T)
            x_hi = tl.load(x_rows + (k + GROUP // 2)[None, :], mask=m_ok[:, None] & (k[None, :] + GROUP // 2 < K),
                           other=0.0).to(DOT_T)
            part = tl.dot(x_lo, lo) + tl.dot(x_hi, hi)
        else:
            k = g * GROUP + tl.arange(0, GROUP)
            w = _codes(W, n_in, k, stride_wn, FMT, FP8_BITS, DOT_T)  # [GROUP, BN]
            xk = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0).to(DOT_T)
            part = tl.dot(xk, w)
        acc += part * s[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(OUT + split * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :], acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + n_in)[None, :]
        tl.store(OUT + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(OUT.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _sum_splits(P, BIAS, OUT, M, N, n_splits, stride_ps, stride_pm, stride_om, HAS_BIAS: tl.constexpr,
                RM: tl.constexpr, RN: tl.constexpr):
    """OUT[m, n] = sum over splits of P[split, m, n] (in split order) + bias[n], for an [RM, RN] tile."""
    m = tl.program_id(0) * RM + tl.arange(0, RM)
    n = tl.program_id(1) * RN + tl.arange(0, RN)
    ok = (m < M)[:, None] & (n < N)[None, :]
    offs = m[:, None].to(tl.int64) * stride_pm + n[None, :]
    acc = tl.zeros((RM, RN), dtype=tl.float32)
    for s in range(n_splits):
        acc += tl.load(P + s * stride_ps + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=n < N, other=0.0)[None, :]
    tl.store(OUT + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class Launch:
    """A kernel configuration: rows/columns of y per program, K splits (groups each), warps and stages."""
    bm: int
    bn: int
    splits: int
    groups_per_split: int
    num_warps: int
    num_stages: int


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (tests): few enough that small shapes still get one split and many
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def plan(M: int, N: int, n_groups: int, n_sm: int) -> Launch:
    """The launch for an [M, K] x [N, K] product of ``n_groups`` K groups on a GPU of ``n_sm`` SMs: tiles from
    M; K split until the tiles and splits fill the GPU (decode) -- a function of the shapes only."""
    if M <= DECODE_M:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif M <= 64:
        bm, bn, warps, stages = 64, 128, 4, 4
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    tiles = -(-M // bm) * -(-N // bn)
    splits = max(1, min(n_groups, (PROGRAMS_PER_SM * n_sm) // tiles))
    per = -(-n_groups // splits)
    return Launch(bm, bn, -(-n_groups // per), per, warps, stages)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fmt: str,
           n_out: int, *, fp8_bits: bool = False, launch: Launch | None = None) -> torch.Tensor:
    """x [M, K] (bf16 on the GPU; any float on the interpreter) times the packed ``weight``/``scale`` of ``fmt``
    (layouts above) + ``bias`` [N] fp32 -> [M, N] in x's dtype. ``launch`` overrides the planned configuration
    (benchmarks, tests)."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    group = GROUP[fmt]
    n_groups = scale.shape[1]
    if launch is None:
        launch = plan(M, n_out, n_groups, sm_count(x.device))
    out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    w = weight.view(torch.uint8) if fmt == "fp8" and fp8_bits else weight
    dot_t = tl.bfloat16 if x.is_cuda else tl.float32
    grid = (-(-M // launch.bm) * -(-n_out // launch.bn), launch.splits)
    partial = launch.splits > 1
    dest = torch.empty(launch.splits, M, n_out, dtype=torch.float32, device=x.device) if partial else out
    has_bias = bias is not None
    _wq_linear[grid](x, w, scale, bias if has_bias else scale, dest, M, n_out, K, n_groups, launch.groups_per_split,
                     x.stride(0), w.stride(0), scale.stride(0), dest.stride(0) if partial else 0, dest.stride(-2),
                     FMT=FORMATS[fmt], GROUP=group, SCALE_ROWS=SCALE_ROWS[fmt], BM=launch.bm, BN=launch.bn,
                     HAS_BIAS=has_bias, PARTIAL=partial, FP8_BITS=fp8_bits, DOT_T=dot_t,
                     num_warps=launch.num_warps, num_stages=launch.num_stages)
    if partial:
        rm, rn = 16, 256
        _sum_splits[(-(-M // rm), -(-n_out // rn))](dest, bias if has_bias else dest, out, M, n_out, launch.splits,
                                                    dest.stride(0), dest.stride(1), out.stride(0),
                                                    HAS_BIAS=has_bias, RM=rm, RN=rn)
    return out
