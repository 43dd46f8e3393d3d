"""The decode path of GPU-resident experts in Triton: reads only the weights of the resident experts a token routed to.

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
