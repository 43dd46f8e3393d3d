"""The decode path of GPU-resident experts in Triton: reads only the weights of the resident experts a token routed to.
Experts stored in bf16 (or fp32) take ``routed``, those stored in int8/int4 ``routed_int`` (the same programs with the
weights dequantized in the K loop; the format a compile-time constant of the kernels: below).

``routed(x [T, H], topk_ids [T, k], topk_weights [T, k], ...) -> fp32 [T, H]``, the same result as
``GpuExperts._dense`` (hetmoe/moe/gpu_resident/experts.py), whose weights it reads as stored there: ``w_gate_up`` [N*2I,
H] (rows of resident expert r: gate_r then up_r) and ``w_down`` [H, N*I] (columns of r: down_r).

Two kernels over the T*k (token, slot) pairs, a program per (pair, block of outputs):
* ``_gate_up``: h [T, k, I] = silu(x W_gate^T) * (x W_up^T) of the pair's expert (fp32);
* ``_down``: P [T, k, H] = topk_weight * (h W_down^T) (fp32); then y = P summed over k in slot order.
A pair is *valid* when its id is >= 0, its expert resident (``slot_of``), not in ``skip_mask`` and its weight is not
0. A valid pair's program computes only if it is its expert's *leader* (the first token that routed to that
expert); the leader computes every token routed to the expert, so each expert's weights are read once per call,
however many tokens chose it. Every other program returns at once after reading the [T, k] routing (a few hundred
bytes). The weight bytes read per call are therefore (distinct valid experts) x 3*H*I x dtype size, not N x that.
Each output element is written by exactly one program, in a fixed order: bitwise reproducible, no atomics; the
rows of P of invalid pairs are written as zeros by their own program.

Rows of x: ``ROWS`` = T rounded up to a power of two. Up to GEMV_ROWS rows (decode at batch <= 4) each weight tile is
multiplied by each row on the CUDA cores; above, tensor-core tiles of max(16, ROWS) rows (bf16 weights and
activations, fp32 accumulation; fp32 weights in IEEE fp32). Launches depend on (T, k, H, I) only: capturable into a
CUDA graph, no host sync, no data-dependent shapes. In Triton's interpreter (CPU tensors, tests) dots run in fp32.

Shape letters: T tokens, k experts per token, N resident experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hetmoe.ops.triton.linear import nibbles_f32

GEMV_ROWS = 4  # at most this many rows of x (T rounded up to a power of two) take the CUDA-core path
MAX_ROWS = 64  # the kernels' token tile; GpuExperts falls back to the torch path above this many tokens


@triton.jit
def gather_pairs(IDS, WTS, SLOT_OF, SKIP, T, stride_id, stride_wt, t, j,
           K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr, N_EXPERTS: tl.constexpr):
    """The routing seen from pair (t, j): (me, leader, hit [ROWS], jj [ROWS], wj [ROWS]). me: the pair's resident
    index, -1 when the pair is not valid; leader: t is the first token routed to ``me``; hit: the tokens routed to
    it, jj: in which of their slots, wj: with what weight."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, KP)
    ok = (rows < T)[:, None] & (cols < K)[None, :]
    ids = tl.load(IDS + rows[:, None] * stride_id + cols[None, :], mask=ok, other=-1).to(tl.int32)  # [ROWS, KP]
    wts = tl.load(WTS + rows[:, None] * stride_wt + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    e = tl.where(ids < 0, N_EXPERTS, ids)  # slot_of[E] = -1: empty slots are not resident
    sl = tl.load(SLOT_OF + e).to(tl.int32)
    if HAS_SKIP:
        skip = tl.load(SKIP + tl.where(ids < 0, 0, ids))
        sl = tl.where(skip != 0, -1, sl)
    sl = tl.where(wts != 0.0, sl, -1)
    me = tl.sum(tl.where((rows[:, None] == t) & (cols[None, :] == j), sl, 0))
    match = (sl == me) & (me >= 0)
    hit = tl.max(match.to(tl.int32), axis=1)  # [ROWS]; a token's ids are distinct: at most one slot matches
    first = tl.min(tl.where(hit != 0, rows, ROWS))
    jj = tl.sum(tl.where(match, cols[None, :], 0), axis=1)
    wj = tl.sum(tl.where(match, wts, 0.0), axis=1)
    return me, first == t, hit, jj, wj


@triton.jit
def _gate_up(X, WGU, IDS, WTS, SLOT_OF, SKIP, HS, T, H, I, stride_x, stride_id, stride_wt,
             K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr,
             N_EXPERTS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, GEMV: tl.constexpr,
             DEFER: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """HS[t, j, i-block] = silu(gate) * up for every token t routed to this program's expert (leaders only)."""
    t = tl.program_id(0) // K
    j = tl.program_id(0) % K
    me, leader, hit, jj, _ = gather_pairs(IDS, WTS, SLOT_OF, SKIP, T, stride_id, stride_wt, t, j, K, KP, ROWS, HAS_SKIP,
                                    N_EXPERTS)
    if (me < 0) | (leader == 0):
        return
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    i_ok = i < I
    i_in = tl.where(i_ok, i, 0)
    g_rows = WGU + (me.to(tl.int64) * 2 * I + i_in)[:, None] * H  # [BI, 1]
    u_rows = g_rows + I * H
    rows = tl.arange(0, ROWS)
    if DEFER:  # one row of x: products summed elementwise over the K loop, reduced across threads once at the end
        acc_ge = tl.zeros((BI, BK), dtype=tl.float32)
        acc_ue = tl.zeros((BI, BK), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < H
            xm = tl.load(X + kk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc_ge += tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32) * xm
            acc_ue += tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32) * xm
        acc_g = tl.sum(acc_ge, axis=1)[None, :]
        acc_u = tl.sum(acc_ue, axis=1)[None, :]
    elif GEMV:
        acc_g = tl.zeros((ROWS, BI), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BI), dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < H
            g = tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)  # [BI, BK]
            u = tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            for m in tl.static_range(ROWS):
                xm = tl.load(X + m * stride_x + kk, mask=k_ok & (m < T), other=0.0).to(tl.float32)
                acc_g += tl.where(rows[:, None] == m, tl.sum(g * xm[None, :], axis=1)[None, :], 0.0)
                acc_u += tl.where(rows[:, None] == m, tl.sum(u * xm[None, :], axis=1)[None, :], 0.0)
    else:
        acc_g = tl.zeros((ROWS, BI), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BI), dtype=tl.float32)
        x_rows = X + rows[:, None] * stride_x
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < H
            xt = tl.load(x_rows + kk[None, :], mask=(hit != 0)[:, None] & k_ok[None, :], other=0.0).to(DOT_T)
            g = tl.trans(tl.load(g_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(DOT_T))  # [BK, BI]
            u = tl.trans(tl.load(u_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(DOT_T))
            if IEEE:
                acc_g = tl.dot(xt, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(xt, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xt, g, acc_g)
                acc_u = tl.dot(xt, u, acc_u)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    dst = HS + (rows * K + jj).to(tl.int64)[:, None] * I + i[None, :]
    tl.store(dst, h, mask=(hit != 0)[:, None] & i_ok[None, :])


@triton.jit
def _down(HS, WD, IDS, WTS, SLOT_OF, SKIP, P, T, H, I, stride_wd, stride_id, stride_wt,
          K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr,
          N_EXPERTS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, GEMV: tl.constexpr,
          DEFER: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """P[t, j, h-block] = weight * (h W_down^T) for every token routed to this program's expert (leaders), zeros for
    an invalid pair (its own row)."""
    t = tl.program_id(0) // K
    j = tl.program_id(0) % K
    me, leader, hit, jj, wj = gather_pairs(IDS, WTS, SLOT_OF, SKIP, T, stride_id, stride_wt, t, j, K, KP, ROWS,
                                           HAS_SKIP, N_EXPERTS)
    o = tl.program_id(1) * BH + tl.arange(0, BH)
    o_ok = o < H
    if me < 0:
        tl.store(P + ((t * K + j).to(tl.int64) * H + o), tl.zeros((BH,), dtype=tl.float32), mask=o_ok)
        return
    if leader == 0:
        return
    w_rows = WD + tl.where(o_ok, o, 0).to(tl.int64)[:, None] * stride_wd + me.to(tl.int64) * I  # [BH, 1]
    rows = tl.arange(0, ROWS)
    if DEFER:
        acc_e = tl.zeros((BH, BK), dtype=tl.float32)
        h_row = HS + (t * K + j).to(tl.int64) * I  # T = 1: this pair is the expert's only row
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < I
            hv = tl.load(h_row + kk, mask=k_ok, other=0.0)[None, :]
            acc_e += tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32) * hv
        acc = tl.sum(acc_e, axis=1)[None, :]
    elif GEMV:
        acc = tl.zeros((ROWS, BH), dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < I
            w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)  # [BH, BK]
            for m in tl.static_range(ROWS):
                hm = tl.sum(tl.where(rows == m, hit, 0))
                jm = tl.sum(tl.where(rows == m, jj, 0))
                hv = tl.load(HS + (m * K + jm).to(tl.int64) * I + kk, mask=k_ok & (hm != 0), other=0.0)
                acc += tl.where(rows[:, None] == m, tl.sum(w * hv[None, :], axis=1)[None, :], 0.0)
    else:
        acc = tl.zeros((ROWS, BH), dtype=tl.float32)
        h_rows = HS + (rows * K + jj).to(tl.int64)[:, None] * I
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < I
            ht = tl.load(h_rows + kk[None, :], mask=(hit != 0)[:, None] & k_ok[None, :], other=0.0).to(DOT_T)
            w = tl.trans(tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0).to(DOT_T))  # [BK, BH]
            if IEEE:
                acc = tl.dot(ht, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(ht, w, acc)
    dst = P + (rows * K + jj).to(tl.int64)[:, None] * H + o[None, :]
    tl.store(dst, acc * wj[:, None], mask=(hit != 0)[:, None] & o_ok[None, :])


@dataclass(frozen=True)
class Launch:
    """Tiles of the two kernels: gate/up programs cover ``bi`` rows of I, stepping ``bk_gu`` along H; down programs
    ``bh`` rows of H, stepping ``bk_down`` along I. gemv: CUDA-core products (few rows of x) instead of dots;
    defer (gemv, T = 1): products summed elementwise along K, reduced across threads once after the loop."""
    gemv: bool
    bi: int
    bk_gu: int
    bh: int
    bk_down: int
    num_warps: int = 4
    num_stages: int = 3
    defer: bool = False


def plan(T: int, on_gpu: bool = True) -> Launch:
    """The launch for T tokens -- a function of T only, so a graph captured for one batch size keeps it. At T = 1 a
    token hits ~k*N/E resident experts; narrow row blocks (8 rows of I, 16 of H) give each hit I/8 + H/16 programs,
    enough to keep the SMs reading weights. In the interpreter (``on_gpu`` False): wide tiles, few programs."""
    gemv = triton.next_power_of_2(max(T, 1)) <= GEMV_ROWS
    if not on_gpu:
        return Launch(gemv, 64, 64, 64, 64)
    if gemv:
        return Launch(True, 8, 512, 16, 256)
    return Launch(False, 32, 64, 32, 64)


def routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor, slot_of: torch.Tensor, skip_mask: torch.Tensor | None, num_experts: int,
           intermediate: int, launch: Launch | None = None) -> torch.Tensor:
    """fp32 [T, H]: the resident experts' part of the layer for x [T, H] routed by topk_ids/topk_weights [T, k]
    (-1 = empty slot). ``slot_of`` [E + 1]: resident index of each expert, -1 for the others and at index E;
    ``skip_mask`` bool [E] or None: experts not computed. ``launch`` overrides ``plan`` (benchmarks, tests)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    if T > MAX_ROWS:
        raise ValueError(f"the Triton decode path takes at most {MAX_ROWS} tokens, got {T}")
    if T == 0 or k == 0:
        return torch.zeros(T, H, dtype=torch.float32, device=x.device)
    launch = launch or plan(T, x.is_cuda)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.contiguous()
    skip = skip_mask.to(torch.uint8) if skip_mask is not None else slot_of  # any pointer when unused
    rows = triton.next_power_of_2(T) if launch.gemv else max(16, triton.next_power_of_2(T))  # dots: >= 16 rows
    fp32 = w_gate_up.dtype == torch.float32
    dot_t = tl.float32 if (fp32 or not x.is_cuda) else tl.bfloat16  # the interpreter's bf16 dot is wrong
    common = dict(K=k, KP=triton.next_power_of_2(k), ROWS=rows, HAS_SKIP=skip_mask is not None,
                  N_EXPERTS=num_experts, GEMV=launch.gemv, DEFER=launch.gemv and launch.defer and T == 1,
                  DOT_T=dot_t, IEEE=fp32,
                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    hs = torch.empty(T, k, intermediate, dtype=torch.float32, device=x.device)
    _gate_up[(T * k, triton.cdiv(intermediate, launch.bi))](
        x, w_gate_up, ids, wts, slot_of, skip, hs, T, H, intermediate, x.stride(0), ids.stride(0), wts.stride(0),
        BI=launch.bi, BK=launch.bk_gu, **common)
    p = torch.empty(T, k, H, dtype=torch.float32, device=x.device)
    _down[(T * k, triton.cdiv(H, launch.bh))](
        hs, w_down, ids, wts, slot_of, skip, p, T, H, intermediate, w_down.stride(0), ids.stride(0), wts.stride(0),
        BH=launch.bh, BK=launch.bk_down, **common)
    return p.sum(dim=1)


def weight_bytes_read(topk_ids: torch.Tensor, slot_of: torch.Tensor, hidden: int, intermediate: int,
                      element_size: int) -> int:
    """Bytes of expert weights one call reads for this routing: each distinct resident expert routed to, once
    (host side; for benchmarks)."""
    ids = topk_ids.long().cpu()
    slots = slot_of.cpu()[ids.masked_fill(ids < 0, slot_of.shape[0] - 1)]
    return int((slots[slots >= 0]).unique().numel()) * 3 * hidden * intermediate * element_size


# ---------------------------------------------------------------------------------------------- int8 / int4 weights
# The routed decode kernels of GPU-resident experts stored in int8/int4 (hetmoe/moe/gpu_resident/format.py): the
# programs above -- a program per ((token, slot) pair, block of outputs), only each routed
# resident expert's leader computing, every weight of it read once per call -- with the weights dequantized in the K
# loop: codes and their fp32 scales loaded, ``scale * q`` in fp32 (the very values the CPU engine multiplies by when the
# codes are its own), fp32 accumulation. Affine matrices (a CPU engine's K-quant codes) have fp32 mins beside the
# scales, [rows, Kp/group] too, and the value ``scale * u - min`` with u = q + 128 (int8) or the nibble (int4).
#
# Weights: ``w_gate_up`` codes [N*2I, Hp(/2)] with scales [N*2I, Hp/group] (rows of resident expert r: gate_r then
# up_r), ``w_down`` codes [N*H, Ip(/2)] with scales [N*H, Ip/group_down] (rows of r: down_r). Each K step takes a
# [rows, BK] tile as its two group halves (int4: the low and the high nibbles of the same bytes; int8: two loads),
# [rows, BK/2] each, multiplied by the matching halves of x (or h). GEMV (T <= 4): fp32 products on the CUDA cores;
# dots: the dequantized tile rounded to bf16 for the tensor cores (fp32 x: IEEE fp32 dots; the interpreter: fp32).
# Launches depend on (T, k, H, I) only: capturable.
#
# Shape letters: T tokens, k experts per token, N resident experts, H hidden, I expert intermediate.

INT_FMT = {"int8": 0, "int4": 1, "lut4": 2}


@triton.jit
def _halves(W, S, MN, LUT, w_off, s_off, k0, KP, R: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
            BK: tl.constexpr, AFFINE: tl.constexpr):
    """(lo, hi, kl, kh): fp32 weights [R, BK/2] of the rows whose codes start at W + w_off and scales at S + s_off
    ([R] int64 each; AFFINE: mins at MN + s_off), columns kl and kh = kl + GROUP/2 (kl [BK/2]: the first half of each
    group of K step k0). lut4 (FMT 2): int4's bytes, each nibble an index into LUT (16 fp32 codebook values)."""
    c = tl.arange(0, BK // 2)
    kl = k0 + (c // (GROUP // 2)) * GROUP + c % (GROUP // 2)
    ok = (kl < KP)[None, :]
    gi = k0 // GROUP + tl.arange(0, BK // GROUP)
    s = tl.load(S + s_off[:, None] + gi[None, :], mask=(gi < KP // GROUP)[None, :], other=0.0)  # [R, BK/GROUP]
    if FMT == 1:
        b = tl.load(W + w_off[:, None] + (k0 // 2 + c)[None, :], mask=ok, other=0)
        lo, hi = nibbles_f32(b.to(tl.int32))
    elif FMT == 2:
        b = tl.load(W + w_off[:, None] + (k0 // 2 + c)[None, :], mask=ok, other=0).to(tl.int32)
        lo = tl.load(LUT + (b & 15))
        hi = tl.load(LUT + ((b >> 4) & 15))
    else:
        lo = tl.load(W + w_off[:, None] + kl[None, :], mask=ok, other=0).to(tl.float32)
        hi = tl.load(W + w_off[:, None] + (kl + GROUP // 2)[None, :], mask=ok, other=0).to(tl.float32)
    if AFFINE:  # scale * u - min, u = q + 128 (int8) or q + 8 (int4): exact integers in fp32
        m = tl.load(MN + s_off[:, None] + gi[None, :], mask=(gi < KP // GROUP)[None, :], other=0.0)
        off = 8.0 if FMT == 1 else 128.0
        lo = tl.reshape(lo + off, (R, BK // GROUP, GROUP // 2)) * s[:, :, None] - m[:, :, None]
        hi = tl.reshape(hi + off, (R, BK // GROUP, GROUP // 2)) * s[:, :, None] - m[:, :, None]
        lo, hi = tl.reshape(lo, (R, BK // 2)), tl.reshape(hi, (R, BK // 2))
    else:
        lo = tl.reshape(tl.reshape(lo, (R, BK // GROUP, GROUP // 2)) * s[:, :, None], (R, BK // 2))
        hi = tl.reshape(tl.reshape(hi, (R, BK // GROUP, GROUP // 2)) * s[:, :, None], (R, BK // 2))
    return lo, hi, kl, kl + GROUP // 2


@triton.jit
def _dot(a, w, acc, DOT_T: tl.constexpr, IEEE: tl.constexpr):
    """acc + a [M, K] @ w [N, K]^T: w (fp32 values) rounded to DOT_T for the tensor cores, or IEEE fp32."""
    if IEEE:
        return tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w.to(DOT_T)), acc)


@triton.jit
def _gate_up_int(X, WGU, SGU, MGU, LUT, IDS, WTS, SLOT_OF, SKIP, HS, T, H, I, HP, stride_x, stride_w, stride_s,
                 stride_id, stride_wt, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr,
                 N_EXPERTS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, GEMV: tl.constexpr,
                 DEFER: tl.constexpr, DOT_T: tl.constexpr, IEEE: tl.constexpr, FMT: tl.constexpr,
                 GROUP: tl.constexpr, AFFINE: tl.constexpr):
    """HS[t, j, i-block] = silu(gate) * up for every token t routed to this program's expert (leaders only)."""
    t = tl.program_id(0) // K
    j = tl.program_id(0) % K
    me, leader, hit, jj, wj = gather_pairs(IDS, WTS, SLOT_OF, SKIP, T, stride_id, stride_wt, t, j, K, KP, ROWS,
                                    HAS_SKIP, N_EXPERTS)
    if (me < 0) | (leader == 0):
        return
    i = tl.program_id(1) * BI + tl.arange(0, BI)
    i_ok = i < I
    g_row = me.to(tl.int64) * 2 * I + tl.where(i_ok, i, 0)  # [BI]
    gw, gs = g_row * stride_w, g_row * stride_s
    uw, us = (g_row + I) * stride_w, (g_row + I) * stride_s
    rows = tl.arange(0, ROWS)
    if DEFER:  # one row of x: products summed elementwise over the K loop, reduced once at the end
        acc_ge = tl.zeros((BI, BK // 2), dtype=tl.float32)
        acc_ue = tl.zeros((BI, BK // 2), dtype=tl.float32)
        for k0 in range(0, HP, BK):
            g_lo, g_hi, kl, kh = _halves(WGU, SGU, MGU, LUT, gw, gs, k0, HP, BI, FMT, GROUP, BK, AFFINE)
            u_lo, u_hi, kl_u, kh_u = _halves(WGU, SGU, MGU, LUT, uw, us, k0, HP, BI, FMT, GROUP, BK, AFFINE)
            x_lo = tl.load(X + kl, mask=kl < H, other=0.0).to(tl.float32)[None, :]
            x_hi = tl.load(X + kh, mask=kh < H, other=0.0).to(tl.float32)[None, :]
            acc_ge += g_lo * x_lo + g_hi * x_hi
            acc_ue += u_lo * x_lo + u_hi * x_hi
        acc_g = tl.sum(acc_ge, axis=1)[None, :]
        acc_u = tl.sum(acc_ue, axis=1)[None, :]
    elif GEMV:
        acc_g = tl.zeros((ROWS, BI), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BI), dtype=tl.float32)
        for k0 in range(0, HP, BK):
            g_lo, g_hi, kl, kh = _halves(WGU, SGU, MGU, LUT, gw, gs, k0, HP, BI, FMT, GROUP, BK, AFFINE)
            u_lo, u_hi, kl_u, kh_u = _halves(WGU, SGU, MGU, LUT, uw, us, k0, HP, BI, FMT, GROUP, BK, AFFINE)
            for m in tl.static_range(ROWS):
                x_lo = tl.load(X + m * stride_x + kl, mask=(kl < H) & (m < T), other=0.0).to(tl.float32)[None, :]
                x_hi = tl.load(X + m * stride_x + kh, mask=(kh < H) & (m < T),
                               other=0.0).to(tl.float32)[None, :]
                acc_g += tl.where(rows[:, None] == m, tl.sum(g_lo * x_lo + g_hi * x_hi, axis=1)[None, :], 0.0)
                acc_u += tl.where(rows[:, None] == m, tl.sum(u_lo * x_lo + u_hi * x_hi, axis=1)[None, :], 0.0)
    else:
        acc_g = tl.zeros((ROWS, BI), dtype=tl.float32)
        acc_u = tl.zeros((ROWS, BI), dtype=tl.float32)
        x_rows = X + rows[:, None] * stride_x
        for k0 in range(0, HP, BK):
            g_lo, g_hi, kl, kh = _halves(WGU, SGU, MGU, LUT, gw, gs, k0, HP, BI, FMT, GROUP, BK, AFFINE)
            u_lo, u_hi, kl_u, kh_u = _halves(WGU, SGU, MGU, LUT, uw, us, k0, HP, BI, FMT, GROUP, BK, AFFINE)
            x_lo = tl.load(x_rows + kl[None, :], mask=(hit != 0)[:, None] & (kl < H)[None, :], other=0.0).to(DOT_T)
            x_hi = tl.load(x_rows + kh[None, :], mask=(hit != 0)[:, None] & (kh < H)[None, :],
                           other=0.0).to(DOT_T)
            acc_g = _dot(x_lo, g_lo, acc_g, DOT_T, IEEE)
            acc_g = _dot(x_hi, g_hi, acc_g, DOT_T, IEEE)
            acc_u = _dot(x_lo, u_lo, acc_u, DOT_T, IEEE)
            acc_u = _dot(x_hi, u_hi, acc_u, DOT_T, IEEE)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    dst = HS + (rows * K + jj).to(tl.int64)[:, None] * I + i[None, :]
    tl.store(dst, h, mask=(hit != 0)[:, None] & i_ok[None, :])


@triton.jit
def _down_int(HS, WD, SD, MD, LUT, IDS, WTS, SLOT_OF, SKIP, P, T, H, I, IP, stride_w, stride_s, stride_id, stride_wt,
          K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr, N_EXPERTS: tl.constexpr,
          BH: tl.constexpr, BK: tl.constexpr, GEMV: tl.constexpr, DEFER: tl.constexpr, DOT_T: tl.constexpr,
          IEEE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, AFFINE: tl.constexpr):
    """P[t, j, h-block] = weight * (h W_down^T) for every token routed to this program's expert (leaders), zeros for
    an invalid pair (its own row)."""
    t = tl.program_id(0) // K
    j = tl.program_id(0) % K
    me, leader, hit, jj, wj = gather_pairs(IDS, WTS, SLOT_OF, SKIP, T, stride_id, stride_wt, t, j, K, KP, ROWS,
                                           HAS_SKIP, N_EXPERTS)
    o = tl.program_id(1) * BH + tl.arange(0, BH)
    o_ok = o < H
    if me < 0:
        tl.store(P + ((t * K + j).to(tl.int64) * H + o), tl.zeros((BH,), dtype=tl.float32), mask=o_ok)
        return
    if leader == 0:
        return
    d_row = me.to(tl.int64) * H + tl.where(o_ok, o, 0)  # [BH]
    dw, ds = d_row * stride_w, d_row * stride_s
    rows = tl.arange(0, ROWS)
    if DEFER:
        acc_e = tl.zeros((BH, BK // 2), dtype=tl.float32)
        h_row = HS + (t * K + j).to(tl.int64) * I  # T = 1: this pair is the expert's only row
        for k0 in range(0, IP, BK):
            w_lo, w_hi, kl, kh = _halves(WD, SD, MD, LUT, dw, ds, k0, IP, BH, FMT, GROUP, BK, AFFINE)
            h_lo = tl.load(h_row + kl, mask=kl < I, other=0.0)[None, :]
            h_hi = tl.load(h_row + kh, mask=kh < I, other=0.0)[None, :]
            acc_e += w_lo * h_lo + w_hi * h_hi
        acc = tl.sum(acc_e, axis=1)[None, :]
    elif GEMV:
        acc = tl.zeros((ROWS, BH), dtype=tl.float32)
        for k0 in range(0, IP, BK):
            w_lo, w_hi, kl, kh = _halves(WD, SD, MD, LUT, dw, ds, k0, IP, BH, FMT, GROUP, BK, AFFINE)
            for m in tl.static_range(ROWS):
                hm = tl.sum(tl.where(rows == m, hit, 0))
                jm = tl.sum(tl.where(rows == m, jj, 0))
                h_row = HS + (m * K + jm).to(tl.int64) * I
                h_lo = tl.load(h_row + kl, mask=(kl < I) & (hm != 0), other=0.0)[None, :]
                h_hi = tl.load(h_row + kh, mask=(kh < I) & (hm != 0), other=0.0)[None, :]
                acc += tl.where(rows[:, None] == m, tl.sum(w_lo * h_lo + w_hi * h_hi, axis=1)[None, :], 0.0)
    else:
        acc = tl.zeros((ROWS, BH), dtype=tl.float32)
        h_rows = HS + (rows * K + jj).to(tl.int64)[:, None] * I
        for k0 in range(0, IP, BK):
            w_lo, w_hi, kl, kh = _halves(WD, SD, MD, LUT, dw, ds, k0, IP, BH, FMT, GROUP, BK, AFFINE)
            h_lo = tl.load(h_rows + kl[None, :], mask=(hit != 0)[:, None] & (kl < I)[None, :], other=0.0).to(DOT_T)
            h_hi = tl.load(h_rows + kh[None, :], mask=(hit != 0)[:, None] & (kh < I)[None, :],
                           other=0.0).to(DOT_T)
            acc = _dot(h_lo, w_lo, acc, DOT_T, IEEE)
            acc = _dot(h_hi, w_hi, acc, DOT_T, IEEE)
    dst = P + (rows * K + jj).to(tl.int64)[:, None] * H + o[None, :]
    tl.store(dst, acc * wj[:, None], mask=(hit != 0)[:, None] & o_ok[None, :])


def routed_int(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: tuple, down: tuple,
           storage, slot_of: torch.Tensor, skip_mask: torch.Tensor | None, num_experts: int, intermediate: int,
           launch: Launch | None = None, luts: tuple | None = None) -> torch.Tensor:
    """fp32 [T, H]: the resident experts' part for x [T, H] routed by topk_ids/topk_weights [T, k] (-1 = empty slot),
    the weights ``gate_up`` and ``down`` each (codes, scales), or (codes, scales, mins) where affine, in ``storage``
    (a resident_format.Storage, both matrices int8/int4/lut4). ``slot_of``, ``skip_mask``, ``launch``: as
    ``routed``. ``luts``: the lut4 matrices' (gate/up, down) codebooks, fp32 [16] each on x's device (None for a
    matrix that is not lut4), made by the caller once (a copy from the host cannot happen inside a graph capture)."""
    T, H = x.shape
    k = topk_ids.shape[1]
    if T > MAX_ROWS:
        raise ValueError(f"the Triton decode path takes at most {MAX_ROWS} tokens, got {T}")
    if T == 0 or k == 0:
        return torch.zeros(T, H, dtype=torch.float32, device=x.device)
    launch = launch or plan(T, x.is_cuda)
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, wts = topk_ids.contiguous(), topk_weights.contiguous()
    skip = skip_mask.to(torch.uint8) if skip_mask is not None else slot_of  # any pointer when unused
    rows = triton.next_power_of_2(T) if launch.gemv else max(16, triton.next_power_of_2(T))  # dots: >= 16 rows
    common = dict(K=k, KP=triton.next_power_of_2(k), ROWS=rows, HAS_SKIP=skip_mask is not None,
                  N_EXPERTS=num_experts, GEMV=launch.gemv, DEFER=launch.gemv and launch.defer and T == 1,
                  DOT_T=tl.bfloat16 if x.is_cuda and x.dtype != torch.float32 else tl.float32,  # the
                  IEEE=x.is_cuda and x.dtype == torch.float32,  # interpreter's bf16 dot is wrong; fp32 x: IEEE dots
                  num_warps=launch.num_warps, num_stages=launch.num_stages)
    (wgu, sgu, mgu), (wd, sd, md) = ((*w, None)[:3] for w in (gate_up, down))
    for what, mins, affine in (("gate/up", mgu, storage.gate_up_affine), ("down", md, storage.down_affine)):
        if (mins is None) == affine:
            raise ValueError(f"routed_int: {what} is {'affine and needs' if affine else 'symmetric and takes no'} mins")
    lut_gu, lut_d = luts or (None, None)
    for fmt, lut in ((storage.gate_up, lut_gu), (storage.down, lut_d)):
        if fmt == "lut4" and (lut is None or lut.dtype != torch.float32 or lut.numel() != 16):
            raise ValueError("routed_int: a lut4 matrix needs its codebook's 16 fp32 values (luts)")
    lut_gu, lut_d = sgu if lut_gu is None else lut_gu, sd if lut_d is None else lut_d  # unread unless lut4
    hs = torch.empty(T, k, intermediate, dtype=torch.float32, device=x.device)
    _gate_up_int[(T * k, triton.cdiv(intermediate, launch.bi))](
        x, wgu, sgu, sgu if mgu is None else mgu, lut_gu, ids, wts, slot_of, skip, hs, T, H, intermediate,
        sgu.shape[1] * storage.group, x.stride(0),
        wgu.stride(0), sgu.stride(0), ids.stride(0), wts.stride(0), BI=launch.bi,
        BK=max(launch.bk_gu, storage.group), FMT=INT_FMT[storage.gate_up], GROUP=storage.group,
        AFFINE=storage.gate_up_affine, **common)
    p = torch.empty(T, k, H, dtype=torch.float32, device=x.device)
    _down_int[(T * k, triton.cdiv(H, launch.bh))](
        hs, wd, sd, sd if md is None else md, lut_d, ids, wts, slot_of, skip, p, T, H, intermediate,
        sd.shape[1] * storage.down_group,
        wd.stride(0), sd.stride(0), ids.stride(0), wts.stride(0), BH=launch.bh,
        BK=max(launch.bk_down, storage.down_group), FMT=INT_FMT[storage.down], GROUP=storage.down_group,
        AFFINE=storage.down_affine, **common)
    return p.sum(dim=1)


# ------------------------------------------------------------------------------ prefill: unpacking into a scratch
# The resident prefill (hetmoe/moe/gpu_resident/experts.py) runs the layer's experts as grouped GEMMs on bf16
# weights (hetmoe/moe/grouped.py); this kernel writes the stored int8/int4/lut4 rows of the experts a chunk routes
# to into the model-dtype scratch in one pass, with the decode kernels' K-loop dequantization (``_halves``: the same
# values, scale * q in fp32, then rounded once to the scratch's dtype). Rows of unrouted experts are not written.


@triton.jit
def _unpack_rows(W, S, MN, LUT, USED, OUT, R, K, KP, ROWS_PER, stride_w, stride_s, stride_o, FMT: tl.constexpr,
                 GROUP: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, AFFINE: tl.constexpr):
    """OUT[r, :K] = the values of stored row r, for the rows r < R whose expert r // ROWS_PER is marked in USED."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = r < R
    rr = tl.where(ok, r, 0).to(tl.int64)
    used = ok & (tl.load(USED + rr // ROWS_PER, mask=ok, other=0) != 0)  # [BR]
    if tl.max(used.to(tl.int32), axis=0) == 0:
        return
    k0 = tl.program_id(1) * BK
    lo, hi, kl, kh = _halves(W, S, MN, LUT, rr * stride_w, rr * stride_s, k0, KP, BR, FMT, GROUP, BK, AFFINE)
    dst = OUT + rr[:, None] * stride_o
    tl.store(dst + kl[None, :], lo.to(OUT.dtype.element_ty), mask=used[:, None] & (kl < K)[None, :])
    tl.store(dst + kh[None, :], hi.to(OUT.dtype.element_ty), mask=used[:, None] & (kh < K)[None, :])


UNPACK_ROWS = 32  # rows per program of the unpack
UNPACK_K = 128  # columns per program (at least one group)


def unpack_rows(codes: torch.Tensor, scales: torch.Tensor, fmt: str, group: int, out: torch.Tensor,
                used: torch.Tensor, rows_per_expert: int, lut: torch.Tensor | None = None,
                mins: torch.Tensor | None = None) -> None:
    """Stored rows ``codes`` / ``scales`` (hetmoe/moe/gpu_resident/format.py: [R, Kp] int8 or [R, Kp / 2] uint8, fp32
    [R, Kp / group]) of ``fmt`` (int8, int4, lut4 with its 16 fp32 codebook values ``lut``) -> ``out`` [R, K] (K <= Kp,
    rows contiguous in K), only the rows of the experts ``used`` marks (bool / uint8 [R / rows_per_expert], on the
    device: no host sync); the other rows of ``out`` are left as they are. ``mins`` (fp32, as ``scales``): an affine
    matrix's, value = scale * u - min, rounded twice as the CPU engine does (no fused multiply-add)."""
    R, K = out.shape
    if codes.shape[0] != R or scales.shape[0] != R or out.stride(1) != 1:
        raise ValueError(f"unpack_rows: {codes.shape[0]} rows of codes, {scales.shape[0]} of scales, out "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if fmt == "lut4" and (lut is None or lut.dtype != torch.float32 or lut.numel() != 16):
        raise ValueError("unpack_rows: lut4 needs its codebook's 16 fp32 values (lut)")
    if mins is not None and (fmt == "lut4" or mins.shape != scales.shape):
        raise ValueError(f"unpack_rows: mins {tuple(mins.shape)} for {fmt} scales {tuple(scales.shape)}")
    if R == 0:
        return
    kp = scales.shape[1] * group
    bk = max(UNPACK_K, group)
    used = used.to(torch.uint8) if used.dtype == torch.bool else used
    grid = (triton.cdiv(R, UNPACK_ROWS), triton.cdiv(K, bk))
    _unpack_rows[grid](codes, scales, scales if mins is None else mins, lut if lut is not None else scales, used, out,
                       R, K, kp, rows_per_expert, codes.stride(0), scales.stride(0), out.stride(0), FMT=INT_FMT[fmt],
                       GROUP=group, BR=UNPACK_ROWS, BK=bk, AFFINE=mins is not None, num_warps=4,
                       enable_fp_fusion=mins is None)
