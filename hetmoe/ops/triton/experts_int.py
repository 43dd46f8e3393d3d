"""The routed decode kernels of GPU-resident experts stored in int8/int4 (hetmoe/moe/gpu_resident/format.py): the
programs of hetmoe/ops/triton/experts.py -- a program per ((token, slot) pair, block of outputs), only each routed
resident expert's leader computing, every weight of it read once per call -- with the weights dequantized in the K
loop: codes and their fp32 scales loaded, ``scale * q`` in fp32 (the very values the CPU engine multiplies by when the
codes are its own), fp32 accumulation.

Weights: ``w_gate_up`` codes [N*2I, Hp(/2)] with scales [N*2I, Hp/group] (rows of resident expert r: gate_r then
up_r), ``w_down`` codes [N*H, Ip(/2)] with scales [N*H, Ip/group_down] (rows of r: down_r). Each K step takes a
[rows, BK] tile as its two group halves (int4: the low and the high nibbles of the same bytes; int8: two loads),
[rows, BK/2] each, multiplied by the matching halves of x (or h). GEMV (T <= 4): fp32 products on the CUDA cores;
dots: the dequantized tile rounded to bf16 for the tensor cores (fp32 x: IEEE fp32 dots; the interpreter: fp32).
Launches depend on (T, k, H, I) only: capturable.

Shape letters: T tokens, k experts per token, N resident experts, H hidden, I expert intermediate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.ops.triton.experts import MAX_ROWS, Launch, gather_pairs, plan
from hetmoe.ops.triton.linear import nibbles_f32

FMT = {"int8": 0, "int4": 1}


@triton.jit
def _halves(W, S, w_off, s_off, k0, KP, R: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, BK: tl.constexpr):
    """(lo, hi, kl, kh): fp32 weights [R, BK/2] of the rows whose codes start at W + w_off and scales at S + s_off
    ([R] int64 each), columns kl and kh = kl + GROUP/2 (kl [BK/2]: the first half of each group of K step k0)."""
    c = tl.arange(0, BK // 2)
    kl = k0 + (c // (GROUP // 2)) * GROUP + c % (GROUP // 2)
    ok = (kl < KP)[None, :]
    gi = k0 // GROUP + tl.arange(0, BK // GROUP)
    s = tl.load(S + s_off[:, None] + gi[None, :], mask=(gi < KP // GROUP)[None, :], other=0.0)  # [R, BK/GROUP]
    if FMT == 1:
        b = tl.load(W + w_off[:, None] + (k0 // 2 + c)[None, :], mask=ok, other=0)
        lo, hi = nibbles_f32(b.to(tl.int32))
    else:
        lo = tl.load(W + w_off[:, None] + kl[None, :], mask=ok, other=0).to(tl.float32)
        hi = tl.load(W + w_off[:, None] + (kl + GROUP // 2)[None, :], mask=ok, other=0).to(tl.float32)
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
def _gate_up(X, WGU, SGU, IDS, WTS, SLOT_OF, SKIP, HS, T, H, I, HP, stride_x, stride_w, stride_s, stride_id,
             stride_wt, K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr,
             N_EXPERTS: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, GEMV: tl.constexpr, DEFER: tl.constexpr,
             DOT_T: tl.constexpr, IEEE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr):
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
            g_lo, g_hi, kl, kh = _halves(WGU, SGU, gw, gs, k0, HP, BI, FMT, GROUP, BK)
            u_lo, u_hi, kl_u, kh_u = _halves(WGU, SGU, uw, us, k0, HP, BI, FMT, GROUP, BK)
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
            g_lo, g_hi, kl, kh = _halves(WGU, SGU, gw, gs, k0, HP, BI, FMT, GROUP, BK)
            u_lo, u_hi, kl_u, kh_u = _halves(WGU, SGU, uw, us, k0, HP, BI, FMT, GROUP, BK)
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
            g_lo, g_hi, kl, kh = _halves(WGU, SGU, gw, gs, k0, HP, BI, FMT, GROUP, BK)
            u_lo, u_hi, kl_u, kh_u = _halves(WGU, SGU, uw, us, k0, HP, BI, FMT, GROUP, BK)
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
def _down(HS, WD, SD, IDS, WTS, SLOT_OF, SKIP, P, T, H, I, IP, stride_w, stride_s, stride_id, stride_wt,
          K: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr, HAS_SKIP: tl.constexpr, N_EXPERTS: tl.constexpr,
          BH: tl.constexpr, BK: tl.constexpr, GEMV: tl.constexpr, DEFER: tl.constexpr, DOT_T: tl.constexpr,
          IEEE: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr):
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
            w_lo, w_hi, kl, kh = _halves(WD, SD, dw, ds, k0, IP, BH, FMT, GROUP, BK)
            h_lo = tl.load(h_row + kl, mask=kl < I, other=0.0)[None, :]
            h_hi = tl.load(h_row + kh, mask=kh < I, other=0.0)[None, :]
            acc_e += w_lo * h_lo + w_hi * h_hi
        acc = tl.sum(acc_e, axis=1)[None, :]
    elif GEMV:
        acc = tl.zeros((ROWS, BH), dtype=tl.float32)
        for k0 in range(0, IP, BK):
            w_lo, w_hi, kl, kh = _halves(WD, SD, dw, ds, k0, IP, BH, FMT, GROUP, BK)
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
            w_lo, w_hi, kl, kh = _halves(WD, SD, dw, ds, k0, IP, BH, FMT, GROUP, BK)
            h_lo = tl.load(h_rows + kl[None, :], mask=(hit != 0)[:, None] & (kl < I)[None, :], other=0.0).to(DOT_T)
            h_hi = tl.load(h_rows + kh[None, :], mask=(hit != 0)[:, None] & (kh < I)[None, :],
                           other=0.0).to(DOT_T)
            acc = _dot(h_lo, w_lo, acc, DOT_T, IEEE)
            acc = _dot(h_hi, w_hi, acc, DOT_T, IEEE)
    dst = P + (rows * K + jj).to(tl.int64)[:, None] * H + o[None, :]
    tl.store(dst, acc * wj[:, None], mask=(hit != 0)[:, None] & o_ok[None, :])


def routed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: tuple, down: tuple,
           storage, slot_of: torch.Tensor, skip_mask: torch.Tensor | None, num_experts: int, intermediate: int,
           launch: Launch | None = None) -> torch.Tensor:
    """fp32 [T, H]: the resident experts' part for x [T, H] routed by topk_ids/topk_weights [T, k] (-1 = empty slot),
    the weights ``gate_up`` and ``down`` each (codes, scales) in ``storage`` (a resident_format.Storage, both
    matrices int8/int4). ``slot_of``, ``skip_mask``, ``launch``: as gpu_experts_triton.routed."""
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
    (wgu, sgu), (wd, sd) = gate_up, down
    hs = torch.empty(T, k, intermediate, dtype=torch.float32, device=x.device)
    _gate_up[(T * k, triton.cdiv(intermediate, launch.bi))](
        x, wgu, sgu, ids, wts, slot_of, skip, hs, T, H, intermediate, sgu.shape[1] * storage.group, x.stride(0),
        wgu.stride(0), sgu.stride(0), ids.stride(0), wts.stride(0), BI=launch.bi,
        BK=max(launch.bk_gu, storage.group), FMT=FMT[storage.gate_up], GROUP=storage.group, **common)
    p = torch.empty(T, k, H, dtype=torch.float32, device=x.device)
    _down[(T * k, triton.cdiv(H, launch.bh))](
        hs, wd, sd, ids, wts, slot_of, skip, p, T, H, intermediate, sd.shape[1] * storage.down_group, wd.stride(0),
        sd.stride(0), ids.stride(0), wts.stride(0), BH=launch.bh, BK=max(launch.bk_down, storage.down_group),
        FMT=FMT[storage.down], GROUP=storage.down_group, **common)
    return p.sum(dim=1)
