"""Weight-only quantized linears in Triton: ``y [M, N] = x [M, K] @ dequant(W) [N, K]^T (+ bias)``.

Packed layouts (made by hetmoe/layers/gpu_linear.py; K padded with zeros to a whole group, Kp):
* int8: ``W`` int8 [N, Kp], one fp32 scale per 64 weights along K: ``S`` [N, Kp/64]; w = q * s.
* int4: ``W`` uint8 [N, Kp/2]; in group g (64 weights along K), byte i holds weight g*64+i in its low nibble and
  weight g*64+32+i in its high nibble, each stored as q + 8 (q in [-8, 7]); ``S`` [N, Kp/64]. The two halves of a
  group are then two contiguous slices of x, so no interleave is needed in the kernel.
* fp8: ``W`` float8_e4m3fn [N, Kp] (Kp a multiple of 128), ``S`` fp32 [ceil(N/128), Kp/128]: DeepSeek's
  ``weight_scale_inv``, one per 128 x 128 block; w = q * s. Where the GPU has no fp8 conversion (compute capability
  below 8.9) the kernel reads the bytes and decodes e4m3 with integer arithmetic (``fp8_bits``).

Three kernels, chosen by ``plan`` from M (the A/B behind each choice: bench/device/gpu_linear.py --variants):
* ``gemv`` (M <= 4, decode): each program reads a [16, 512] tile of weight rows along K (wide contiguous loads),
  dequantizes it once and multiplies it by each row of x on the CUDA cores; K is split over programs until the GPU
  holds about DECODE_PROGRAMS_PER_SM programs per SM, so one token reads the weights at the memory's rate. A tensor-core
  tile would spend 15 of its 16 rows on nothing and read the weights at a fraction of that rate.
* ``dot`` (4 < M < DEQUANT_M): tensor-core tiles of 16/64 rows of x, one scale group per K step, the weights
  scaled and rounded to bf16 before the dot (``scale_after``: the dot on the raw codes, its partial scaled --
  exact, but slower), K split the same way.
* ``dequant`` (M >= DEQUANT_M, prefill): slabs of the weights dequantized to bf16 into a bounded scratch and
  multiplied by cuBLAS, writing each slab's columns of y in place. Prefill is bound by the tensor cores, not by
  the weights' bytes, and cuBLAS's bf16 GEMM outruns a dequantizing Triton GEMM by more than the extra pass costs.
Split-K partials (fp32) are summed in split order by the tile's last split to finish (hetmoe/ops/triton/tickets.py),
or by a second kernel where tickets are off: bitwise the same either way.

Every launch depends only on shapes (M, N, K) and the device, so a CUDA graph captured for a fixed M replays it.
In Triton's interpreter (CPU tensors, tests) tl.dot runs in fp32: its bf16 dot is wrong there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hetmoe.ops.triton import pdl as triton_pdl
from hetmoe.ops.triton import tickets as triton_tickets
from hetmoe.ops.triton.fused import round_to
from hetmoe.ops.triton.pdl import pdl_begin
from hetmoe.ops.triton.tickets import last_to_arrive

FORMATS = {"int8": 0, "int4": 1, "fp8": 2}
GROUP = {"int8": 64, "int4": 64, "fp8": 128}  # weights along K per scale
SCALE_ROWS = {"int8": 1, "int4": 1, "fp8": 128}  # weight rows per scale
GEMV_M = 4  # at most this many rows of x take the CUDA-core GEMV
DECODE_M = 16  # at most this many rows take tensor-core tiles of 16 rows, K split (decode)
DEQUANT_M = 256  # at least this many rows dequantize slabs of the weights to bf16 for cuBLAS
DEQUANT_ELEMENTS = 1 << 25  # weights per dequantized slab (64 MiB of bf16 scratch)
# (rows, K, defer) of a GEMV program's weight tile: the best geometric mean over bench/device/gpu_linear.py's
# shapes on an H200 (--variants); deferring the reduction helps int4 only
GEMV_TILE = {"int8": (16, 512, False), "int4": (16, 512, True), "fp8": (16, 512, False)}
PROGRAMS_PER_SM = 4
# programs per SM a decode launch (the GEMV, and the tensor-core tiles of M <= DECODE_M) splits K until: fp8 takes 8,
# where the sweeps over DeepSeek-V3's decode linears on an H200 found the wider split faster at M = 1 and at M = 8
# (BENCHMARKS.md, "GPU part of the decode step"); int8 / int4 keep 4 (their own A/B)
DECODE_PROGRAMS_PER_SM = {"int8": PROGRAMS_PER_SM, "int4": PROGRAMS_PER_SM, "fp8": 8}


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
def code_f32(w, FMT: tl.constexpr, FP8_BITS: tl.constexpr):
    """int8 or fp8 codes -> fp32, exactly."""
    if FMT == 2 and FP8_BITS:
        return fp8_bits(w)
    return w.to(tl.float32)


@triton.jit
def nibbles_f32(b):
    """int4 bytes (as int32) -> (low, high) codes in fp32, q = nibble - 8: the float whose bits are
    0x4B000000 | nibble is 2^23 + nibble (an OR and a subtraction instead of a conversion instruction)."""
    lo = ((b & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    hi = (((b >> 4) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    return lo, hi


@triton.jit
def _x_load(X, offs, mask, UP, SWIGLU: tl.constexpr):
    """Values of x at ``offs`` as fp32; SWIGLU: X holds gate | up rows (the up half UP columns on) and x = silu(gate)
    * up, rounded where triton_fused.silu_mul rounds (silu, then the product), so the GEMV reads what it would have
    read from silu_mul's output."""
    if SWIGLU:
        DT: tl.constexpr = X.dtype.element_ty
        g = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + UP + offs, mask=mask, other=0.0).to(tl.float32)
        return round_to(round_to(g / (1.0 + tl.exp(-g)), DT) * u, DT)
    return tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _codes(W, n, kk, stride_wn, FMT: tl.constexpr, FP8_BITS: tl.constexpr):
    """[len(kk), BN] int8 or fp8 weight codes of rows ``n`` at columns ``kk``, as fp32 (exact)."""
    return code_f32(tl.load(W + n[None, :].to(tl.int64) * stride_wn + kk[:, None]), FMT, FP8_BITS)


@triton.jit
def _finish_splits(P, FINAL, BIAS, TICKETS, group, n_splits, m, n, n_in, mask, stride_ps, stride_pm, stride_fm,
                   HAS_BIAS: tl.constexpr, RM: tl.constexpr, RN: tl.constexpr):
    """The last split of tile ``group`` to finish: FINAL[m, n] = its splits' partials summed in split order
    (bitwise ``_sum_splits``) + bias[n]."""
    if last_to_arrive(TICKETS, group, n_splits):
        offs = m[:, None].to(tl.int64) * stride_pm + n[None, :]
        acc = tl.zeros((RM, RN), dtype=tl.float32)
        for s in range(n_splits):
            acc += tl.load(P + s * stride_ps + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(BIAS + n_in)[None, :]
        tl.store(FINAL + m[:, None].to(tl.int64) * stride_fm + n[None, :], acc.to(FINAL.dtype.element_ty),
                 mask=mask)


@triton.jit
def _wq_linear(X, W, S, BIAS, OUT, FINAL, TICKETS, M, N, K, n_groups, groups_per_split,
               stride_xm, stride_wn, stride_sn, stride_os, stride_om, stride_fm,
               FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FP8_BITS: tl.constexpr,
               DOT_T: tl.constexpr, SCALE_AFTER: tl.constexpr, TICKET: tl.constexpr, PDL: tl.constexpr):
    """One [BM, BN] tile of y over the K groups of one split. PARTIAL: store fp32 to OUT[split] (no bias); with
    TICKET the tile's last split to finish sums them into FINAL (``_finish_splits``).
    The weights are scaled before the dot (bf16 weights into the accumulating tensor-core dot), or with
    SCALE_AFTER the dot runs on the raw codes and its partial is scaled."""
    pdl_begin(PDL)
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
        s = tl.load(s_rows + g)[None, :]  # [1, BN]
        if FMT == 1:
            i = tl.arange(0, GROUP // 2)
            b = tl.load(W + n_in[None, :].to(tl.int64) * stride_wn + (g * (GROUP // 2) + i)[:, None]).to(tl.int32)
            k = g * GROUP + i
            x_lo = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0).to(DOT_T)
            x_hi = tl.load(x_rows + (k + GROUP // 2)[None, :], mask=m_ok[:, None] & (k[None, :] + GROUP // 2 < K),
                           other=0.0).to(DOT_T)
            lo, hi = nibbles_f32(b)  # [GROUP / 2, BN]
            if SCALE_AFTER:
                acc += (tl.dot(x_lo, lo.to(DOT_T)) + tl.dot(x_hi, hi.to(DOT_T))) * s
            else:
                acc = tl.dot(x_lo, (lo.to(tl.float32) * s).to(DOT_T), acc)
                acc = tl.dot(x_hi, (hi.to(tl.float32) * s).to(DOT_T), acc)
        else:
            k = g * GROUP + tl.arange(0, GROUP)
            w = _codes(W, n_in, k, stride_wn, FMT, FP8_BITS)  # [GROUP, BN] fp32
            xk = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k[None, :] < K), other=0.0).to(DOT_T)
            if SCALE_AFTER:
                acc += tl.dot(xk, w.to(DOT_T)) * s
            else:
                acc = tl.dot(xk, (w * s).to(DOT_T), acc)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(OUT + split * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :], acc, mask=out_mask)
        if TICKET:
            _finish_splits(OUT, FINAL, BIAS, TICKETS, tl.program_id(0), tl.num_programs(1), m, n, n_in, out_mask,
                           stride_os, stride_om, stride_fm, HAS_BIAS, BM, BN)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + n_in)[None, :]
        tl.store(OUT + m[:, None].to(tl.int64) * stride_om + n[None, :], acc.to(OUT.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _wq_gemv(X, W, S, BIAS, OUT, FINAL, TICKETS, M, N, K, KP, n_kb, kb_per_split,
             stride_xm, stride_wn, stride_sn, stride_os, stride_om, stride_fm,
             FMT: tl.constexpr, GROUP: tl.constexpr, SCALE_ROWS: tl.constexpr, BMV: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FP8_BITS: tl.constexpr,
             DEFER: tl.constexpr, TICKET: tl.constexpr, SWIGLU: tl.constexpr, PDL: tl.constexpr):
    """Few rows of x (M <= BMV <= 4): [BN, BK] weight tiles along K (rows contiguous, wide loads), dequantized
    once and multiplied by each row of x on the CUDA cores (no tensor-core tile of 16 mostly empty rows).
    SWIGLU: x is silu(gate) * up of X's gate | up halves (``_x_load``)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    n_in = tl.where(n_ok, n, 0)
    rows = tl.arange(0, BMV)
    w_rows = W + n_in[:, None].to(tl.int64) * stride_wn
    s_rows = S + (n_in // SCALE_ROWS)[:, None].to(tl.int64) * stride_sn
    n_groups = KP // GROUP
    acc = tl.zeros((BMV, BN), dtype=tl.float32)
    # DEFER (one row of x): products summed elementwise over the K loop, reduced across threads once at the end
    acc_e = tl.zeros((BN, BK // 2 if FMT == 1 else BK), dtype=tl.float32)
    kb0 = split * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, n_kb)
    pdl_begin(PDL)
    for kb in range(kb0, kb1):
        k0 = kb * BK
        gi = k0 // GROUP + tl.arange(0, BK // GROUP)
        s = tl.load(s_rows + gi[None, :], mask=(gi < n_groups)[None, :], other=0.0)  # [BN, BK / GROUP]
        if FMT == 1:
            c = tl.arange(0, BK // 2)
            b = tl.load(w_rows + (k0 // 2 + c)[None, :], mask=(k0 // 2 + c < KP // 2)[None, :], other=0)
            lo, hi = nibbles_f32(b.to(tl.int32))  # [BN, BK / 2]
            kl = k0 + (c // (GROUP // 2)) * GROUP + c % (GROUP // 2)  # the weight in each byte's low nibble
            for m in tl.static_range(BMV):
                x_lo = _x_load(X, m * stride_xm + kl, (kl < K) & (m < M), K, SWIGLU)
                x_hi = _x_load(X, m * stride_xm + kl + GROUP // 2, (kl + GROUP // 2 < K) & (m < M), K, SWIGLU)
                p = tl.reshape(lo * x_lo[None, :] + hi * x_hi[None, :], (BN, BK // GROUP, GROUP // 2))
                if DEFER:
                    acc_e += tl.reshape(p * s[:, :, None], (BN, BK // 2))
                else:
                    part = tl.sum(tl.sum(p, axis=2) * s, axis=1)
                    acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
        else:
            kk = k0 + tl.arange(0, BK)
            w = code_f32(tl.load(w_rows + kk[None, :], mask=(kk < KP)[None, :], other=0.0), FMT, FP8_BITS)
            for m in tl.static_range(BMV):
                xm = _x_load(X, m * stride_xm + kk, (kk < K) & (m < M), K, SWIGLU)
                p = tl.reshape(w * xm[None, :], (BN, BK // GROUP, GROUP))
                if DEFER:
                    acc_e += tl.reshape(p * s[:, :, None], (BN, BK))
                else:
                    part = tl.sum(tl.sum(p, axis=2) * s, axis=1)
                    acc += tl.where(rows[:, None] == m, part[None, :], 0.0)
    if DEFER:
        acc += tl.sum(acc_e, axis=1)[None, :]
    out_mask = (rows < M)[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(OUT + split * stride_os + rows[:, None] * stride_om + n[None, :], acc, mask=out_mask)
        if TICKET:
            _finish_splits(OUT, FINAL, BIAS, TICKETS, pid_n, tl.num_programs(1), rows, n, n_in, out_mask,
                           stride_os, stride_om, stride_fm, HAS_BIAS, BMV, BN)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + n_in)[None, :]
        tl.store(OUT + rows[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _dequantize(W, S, OUT, N, K, KP, stride_wn, stride_sn, stride_on, FMT: tl.constexpr, GROUP: tl.constexpr,
                SCALE_ROWS: tl.constexpr, FP8_BITS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """OUT [N, K] = the packed weights times their scales, for a [BR, BK] tile (BK a multiple of GROUP)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    r_ok = r < N
    r_in = tl.where(r_ok, r, 0)
    k0 = tl.program_id(1) * BK
    gi = k0 // GROUP + tl.arange(0, BK // GROUP)
    s = tl.load(S + (r_in // SCALE_ROWS)[:, None].to(tl.int64) * stride_sn + gi[None, :],
                mask=(gi < KP // GROUP)[None, :], other=0.0)[:, :, None]  # [BR, BK / GROUP, 1]
    w_rows = W + r_in[:, None].to(tl.int64) * stride_wn
    o_rows = OUT + r[:, None].to(tl.int64) * stride_on
    if FMT == 1:
        c = tl.arange(0, BK // 2)
        b = tl.load(w_rows + (k0 // 2 + c)[None, :], mask=(k0 // 2 + c < KP // 2)[None, :], other=0)
        lo, hi = nibbles_f32(b.to(tl.int32))  # [BR, BK / 2]
        lo = tl.reshape(tl.reshape(lo, (BR, BK // GROUP, GROUP // 2)) * s, (BR, BK // 2))
        hi = tl.reshape(tl.reshape(hi, (BR, BK // GROUP, GROUP // 2)) * s, (BR, BK // 2))
        kl = k0 + (c // (GROUP // 2)) * GROUP + c % (GROUP // 2)
        tl.store(o_rows + kl[None, :], lo.to(OUT.dtype.element_ty), mask=r_ok[:, None] & (kl < K)[None, :])
        tl.store(o_rows + (kl + GROUP // 2)[None, :], hi.to(OUT.dtype.element_ty),
                 mask=r_ok[:, None] & (kl + GROUP // 2 < K)[None, :])
    else:
        k = k0 + tl.arange(0, BK)
        w = code_f32(tl.load(w_rows + k[None, :], mask=(k < KP)[None, :], other=0.0), FMT, FP8_BITS)
        w = tl.reshape(tl.reshape(w, (BR, BK // GROUP, GROUP)) * s, (BR, BK))
        tl.store(o_rows + k[None, :], w.to(OUT.dtype.element_ty), mask=r_ok[:, None] & (k < K)[None, :])


@triton.jit
def _sum_splits(P, BIAS, OUT, M, N, n_splits, stride_ps, stride_pm, stride_om, HAS_BIAS: tl.constexpr,
                RM: tl.constexpr, RN: tl.constexpr, PDL: tl.constexpr):
    """OUT[m, n] = sum over splits of P[split, m, n] (in split order) + bias[n], for an [RM, RN] tile."""
    pdl_begin(PDL)
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
    """A kernel configuration. kernel: "gemv" (M <= 4: CUDA-core dot products, ``bk`` weights along K per step),
    "dot" (tensor-core tiles of bm x bn, one scale group per step), or "dequant" (the weights to bf16 in slabs of
    ``bn`` rows, then cuBLAS). splits: K splits, ``per_split`` steps each. scale_after (dot): scale each step's
    partial instead of the weights; defer (gemv, M = 1): reduce across threads once, after the K loop."""
    kernel: str
    bm: int
    bn: int
    bk: int
    splits: int
    per_split: int
    num_warps: int
    num_stages: int
    scale_after: bool = False
    defer: bool = True


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (tests): few enough that small shapes still get one split and many
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def split_k(tiles: int, steps: int, n_sm: int, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple:
    """(splits, steps per split): K split until tiles x splits reach programs_per_sm per SM; no empty split."""
    splits = max(1, min(steps, (programs_per_sm * n_sm) // max(tiles, 1)))
    per = -(-steps // splits)
    return -(-steps // per), per


def plan(M: int, N: int, K: int, fmt: str, n_sm: int) -> Launch:
    """The launch for x [M, K] times an [N, K] weight of ``fmt`` on a GPU of ``n_sm`` SMs -- a function of the
    shapes only, so a CUDA graph captured for one M keeps it."""
    group = GROUP[fmt]
    kp = -(-K // group) * group
    if M <= GEMV_M:
        bn, bk, defer = GEMV_TILE[fmt]
        splits, per = split_k(-(-N // bn), -(-kp // bk), n_sm, DECODE_PROGRAMS_PER_SM[fmt])
        return Launch("gemv", triton.next_power_of_2(M), bn, bk, splits, per, 4, 3, defer=defer)
    if M <= DECODE_M:  # fp8: K split to 8 programs per SM and the scales applied to the dot's partials
        bm, bn, warps, stages, pps, after = 16, 64, 4, 4, DECODE_PROGRAMS_PER_SM[fmt], fmt == "fp8"
    elif M < DEQUANT_M:
        bm, bn, warps, stages, pps, after = 64, 128, 4, 4, PROGRAMS_PER_SM, False
    else:
        return Launch("dequant", M, max(group, DEQUANT_ELEMENTS // kp // group * group), kp, 1, 1, 4, 1)
    splits, per = split_k(-(-M // bm) * -(-N // bn), kp // group, n_sm, pps)
    return Launch("dot", bm, bn, group, splits, per, warps, stages, after)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: str, k: int, *, fp8_bits: bool = False,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The packed weights (rows of ``weight`` with their ``scale`` rows) -> [N, k] in ``dtype``."""
    N = weight.shape[0]
    out = torch.empty(N, k, dtype=dtype, device=weight.device)
    w = _as_codes(weight, fmt, fp8_bits)
    br, bk = 16, 256
    kp = scale.shape[1] * GROUP[fmt]
    _dequantize[(-(-N // br), -(-k // bk))](w, scale, out, N, k, kp, w.stride(0), scale.stride(0), out.stride(0),
                                            FMT=FORMATS[fmt], GROUP=GROUP[fmt], SCALE_ROWS=SCALE_ROWS[fmt],
                                            FP8_BITS=fp8_bits, BR=br, BK=bk)
    return out


def _as_codes(weight: torch.Tensor, fmt: str, fp8_bits: bool) -> torch.Tensor:
    """The weight tensor as the kernels read it: fp8 as uint8 where it is decoded from its bits."""
    return weight.view(torch.uint8) if fmt == "fp8" and fp8_bits else weight


def _dequant_matmul(x, weight, scale, bias, fmt, n_out, fp8_bits, rows) -> torch.Tensor:
    """y = x W^T through cuBLAS, the weights dequantized to bf16 ``rows`` at a time (a bounded scratch)."""
    M, K = x.shape
    out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    for r0 in range(0, n_out, rows):
        r1 = min(n_out, r0 + rows)
        s0, s1 = r0 // SCALE_ROWS[fmt], -(-r1 // SCALE_ROWS[fmt])
        w = dequantize(weight[r0:r1], scale[s0:s1], fmt, K, fp8_bits=fp8_bits, dtype=x.dtype)  # whole scale rows
        torch.mm(x, w.t(), out=out[:, r0:r1])  # cuBLAS writes the column block in place (row stride N)
    if bias is not None:
        out += bias.to(out.dtype)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fmt: str,
           n_out: int, *, fp8_bits: bool = False, launch: Launch | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 on the GPU; any float on the interpreter) times the packed ``weight``/``scale`` of ``fmt``
    (layouts above) + ``bias`` [N] fp32 -> [M, N] in x's dtype. ``launch`` overrides the planned configuration
    (benchmarks, tests). ``swiglu``: x is [M, 2K], gate | up, and the product is silu(gate) * up times the weight
    (``triton_fused.silu_mul``'s roundings), computed by the GEMV as it reads x (M <= GEMV_M only)."""
    M, K = x.shape
    if swiglu:
        K //= 2
    if x.stride(1) != 1:
        x = x.contiguous()
    if launch is None:
        launch = plan(M, n_out, K, fmt, sm_count(x.device))
    if swiglu and launch.kernel != "gemv":
        raise ValueError(f"swiglu is fused into the GEMV (at most {GEMV_M} rows), not the {launch.kernel} kernel")
    if M == 0:
        return torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    if launch.kernel == "dequant":
        return _dequant_matmul(x, weight, scale, bias, fmt, n_out, fp8_bits, launch.bn)
    out = torch.empty(M, n_out, dtype=x.dtype, device=x.device)
    w = _as_codes(weight, fmt, fp8_bits)
    partial = launch.splits > 1
    dest = torch.empty(launch.splits, M, n_out, dtype=torch.float32, device=x.device) if partial else out
    has_bias = bias is not None
    tiles = -(-n_out // launch.bn) * (1 if launch.kernel == "gemv" else -(-M // launch.bm))
    tickets = triton_tickets.counters(x.device, tiles) if partial else None
    common = dict(FMT=FORMATS[fmt], GROUP=GROUP[fmt], SCALE_ROWS=SCALE_ROWS[fmt], BN=launch.bn, HAS_BIAS=has_bias,
                  PARTIAL=partial, FP8_BITS=fp8_bits, TICKET=tickets is not None, num_warps=launch.num_warps,
                  num_stages=launch.num_stages, **triton_pdl.launch(x.device))
    args = (x, w, scale, bias if has_bias else scale, dest, out, tickets if tickets is not None else scale)
    strides = (x.stride(0), w.stride(0), scale.stride(0), dest.stride(0) if partial else 0, dest.stride(-2),
               out.stride(0))
    kp = scale.shape[1] * GROUP[fmt]
    if launch.kernel == "gemv":
        n_kb = -(-kp // launch.bk)
        _wq_gemv[(-(-n_out // launch.bn), launch.splits)](*args, M, n_out, K, kp, n_kb, launch.per_split, *strides,
                                                          BMV=launch.bm, BK=launch.bk,
                                                          DEFER=launch.bm == 1 and launch.defer, SWIGLU=swiglu,
                                                          **common)
    else:
        dot_t = tl.bfloat16 if x.is_cuda else tl.float32  # the interpreter's bf16 dot is wrong
        grid = (tiles, launch.splits)
        _wq_linear[grid](*args, M, n_out, K, kp // GROUP[fmt], launch.per_split, *strides, BM=launch.bm,
                         DOT_T=dot_t, SCALE_AFTER=launch.scale_after, **common)
    if partial and tickets is None:
        rm, rn = 16, 256
        _sum_splits[(-(-M // rm), -(-n_out // rn))](dest, bias if has_bias else dest, out, M, n_out, launch.splits,
                                                    dest.stride(0), dest.stride(1), out.stride(0),
                                                    HAS_BIAS=has_bias, RM=rm, RN=rn,
                                                    **triton_pdl.launch(x.device))
    return out
