"""Attention kernels over the paged KV cache, in Triton (which PyTorch's CUDA builds ship): split-KV decode
("flash decoding") and causal prefill from token positions. Nothing here materialises a mask.

Why our own kernels: decode needs per-sequence lengths read from a device tensor inside one CUDA graph (no
re-capture as the context grows, no host sync) and a split over the sequence so one token keeps every SM busy;
prefill needs causality from each token's absolute position over a cached prefix, with pages. PyTorch's SDPA
takes no per-sequence lengths without a mask, and FlexAttention needs torch.compile and a block mask per length.

Both kernels read the cache through a page table: ``pages`` [n_pages, P, kv_heads, D] per layer, ``table`` [rows,
pages_per_row] int32 (row r's position p lives in page table[r, p // P] at offset p % P), ``slots`` the row of
each sequence. A query at position p attends to positions 0..p of its row; with a sliding window W (``window``) to
p - W < j <= p only (Transformers' sliding-window mask: the query's own position counts in W).

Attention sinks (gpt-oss: ``sinks`` [H], one logit per query head): each head's softmax runs over its scores and the
sink's logit, which takes its share of the probability and adds no value. Decode's split kernel never sees it: the
reduce adds e^sink to the denominator of the splits' merge; prefill adds it to each row's sum at the end.

The key may come in two parts (q·k = q1·k1 + q2·k2): MLA scores the latent and the rope part apart, and its
absorbed decode reads the latent as both key (part 1) and value (``v_is_k1``). A part's head stride may be 0 (one
rope key shared by every head). Shapes: N query rows, H query heads, G = H / kv_heads query heads per kv head.

Tested against SDPA's math backend in fp32 (tests/ops/test_attention_kernels.py); run with TRITON_INTERPRET=1 on a
machine without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.ops.triton import pdl as triton_pdl
from hetmoe.ops.triton.pdl import pdl_begin

# the split over the sequence aims at up to this many programs per SM (more splits even out a batch of mixed lengths:
# BENCHMARKS.md#attention-kernels)
DECODE_PROGRAMS_PER_SM = 8
MAX_SPLITS = 128
LOG2E = 1.4426950408889634  # the prefill kernel's softmax runs in base 2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _decode_split(Q1, Q2, K1, K2, V, TABLE, SLOTS, POS, PART_O, PART_L,
                  sq1_n, sq1_h, sq2_n, sq2_h,
                  sk1_p, sk1_t, sk1_h, sk2_p, sk2_t, sk2_h, sv_p, sv_t, sv_h, st_r, ss_n, spos_n,
                  spo_n, spo_h, spo_s, spl_n, spl_h,
                  scale, G, HEAD_BLOCKS, WINDOW,
                  D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                  BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr,
                  BLOCK_G: tl.constexpr, P: tl.constexpr, NSPLIT: tl.constexpr,
                  HAS_Q2: tl.constexpr, V_IS_K1: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """One (query row, block of a kv head's query heads, split of the sequence): the softmax-weighted values
    of its pages, normalised, and their log-sum-exp (-inf for a split with no page). WINDOW > 0: the pages from
    the one holding position pos - WINDOW + 1 on, positions before it masked (every page of that range holds at
    least one visible position, so no page's max is -inf)."""
    pdl_begin(PDL)
    n = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    g0 = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_G
    sp = tl.program_id(2)
    pos = tl.load(POS + n * spos_n)
    slot = tl.load(SLOTS + n * ss_n).to(tl.int64)  # ss_n may be 0: MLA's rows of one sequence share its slot
    n_pages = pos // P + 1
    lo = pos * 0  # the first visible position (in pos's type: both branches must agree for the compiler)
    if WINDOW > 0:
        lo = tl.maximum(pos - WINDOW + 1, 0)
    page0 = lo // P
    per = tl.cdiv(n_pages - page0, NSPLIT)
    first = page0 + sp * per
    last = tl.minimum(first + per, n_pages)

    gs = g0 + tl.arange(0, BLOCK_G)
    heads = kvh * G + gs
    gmask = gs < G
    d1 = tl.arange(0, BD1)
    q1 = tl.load(Q1 + n * sq1_n + heads[:, None] * sq1_h + d1[None, :],
                 mask=gmask[:, None] & (d1[None, :] < D1), other=0.0)
    if HAS_Q2:
        d2 = tl.arange(0, BD2)
        q2 = tl.load(Q2 + n * sq2_n + heads[:, None] * sq2_h + d2[None, :],
                     mask=gmask[:, None] & (d2[None, :] < D2), other=0.0)
    dv = tl.arange(0, BDV)
    t = tl.arange(0, P)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BDV], tl.float32)
    for pg in range(first, last):
        page = tl.load(TABLE + slot * st_r + pg).to(tl.int64)
        valid = (pg * P + t <= pos) & (pg * P + t >= lo)
        k1 = tl.load(K1 + page * sk1_p + t[:, None] * sk1_t + kvh * sk1_h + d1[None, :],
                     mask=valid[:, None] & (d1[None, :] < D1), other=0.0)
        s = _dot(q1, tl.trans(k1), IEEE)
        if HAS_Q2:
            k2 = tl.load(K2 + page * sk2_p + t[:, None] * sk2_t + kvh * sk2_h + d2[None, :],
                         mask=valid[:, None] & (d2[None, :] < D2), other=0.0)
            s += _dot(q2, tl.trans(k2), IEEE)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_IS_K1:
            v = k1
        else:
            v = tl.load(V + page * sv_p + t[:, None] * sv_t + kvh * sv_h + dv[None, :],
                        mask=valid[:, None] & (dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    # a split past the row's pages stores its -inf only: the reduce reads no values where the lse is -inf, so
    # short rows in a batch with long ones cost a few bytes per empty split, not BLOCK_G x DV floats
    has_pages = (dv * 0 + first) < last  # [BLOCK_DV], all equal: Triton 3.9's interpreter refuses a scalar in a mask
    tl.store(PART_O + n * spo_n + heads[:, None] * spo_h + sp * spo_s + dv[None, :], out,
             mask=gmask[:, None] & (dv[None, :] < DV) & has_pages[None, :])
    tl.store(PART_L + n * spl_n + heads * spl_h + sp, lse, mask=gmask)


@triton.jit
def _decode_reduce(PART_O, PART_L, SINKS, OUT, spo_n, spo_h, spo_s, spl_n, spl_h, so_n, so_h, H,
                   DV: tl.constexpr, BDV: tl.constexpr, NSPLIT: tl.constexpr, HAS_SINKS: tl.constexpr,
                   PDL: tl.constexpr):
    """Merge a (row, head)'s splits by their log-sum-exp, for BDV of the value dims (program axis 2); the head's
    sink (HAS_SINKS) joins the denominator: sum_sp e^lse_sp o_sp / (sum_sp e^lse_sp + e^sink)."""
    pdl_begin(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, NSPLIT)
    lse = tl.load(PART_L + n * spl_n + h * spl_h + sp)
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        m = tl.maximum(m, sink)
        w = tl.exp(lse - m)
        w = w / (tl.sum(w, 0) + tl.exp(sink - m))
    else:
        w = tl.exp(lse - m)
        w = w / tl.sum(w, 0)
    dv = tl.program_id(2) * BDV + tl.arange(0, BDV)
    o = tl.load(PART_O + n * spo_n + h * spo_h + sp[:, None] * spo_s + dv[None, :],
                mask=(lse[:, None] > float("-inf")) & (dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0)
    tl.store(OUT + n * so_n + h * so_h + dv, out.to(OUT.dtype.element_ty), mask=dv < DV)


@triton.jit
def _prefill_page(acc, l_i, m_i, q1, q2, pos, page, kpos, K1, K2, V, kvh,
                  sk1_t, sk1_h, sk2_t, sk2_h, sv_t, sv_h, sk1_p, sk2_p, sv_p, qk_scale,
                  D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                  BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr, P: tl.constexpr,
                  HAS_Q2: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr, WINDOW):
    """One page of keys/values into a block's online softmax (base 2: qk_scale holds log2(e)). MASKED: a page
    with positions past some query's own (the diagonal) or, WINDOW > 0, before some query's window; else every
    position is visible to every query. A row that has seen nothing yet keeps its max at -inf."""
    t = tl.arange(0, P)
    d1 = tl.arange(0, BD1)
    dv = tl.arange(0, BDV)
    k1 = tl.load(K1 + page * sk1_p + t[:, None] * sk1_t + kvh * sk1_h + d1[None, :], mask=d1[None, :] < D1,
                 other=0.0)
    s = _dot(q1, tl.trans(k1), IEEE)
    if HAS_Q2:
        d2 = tl.arange(0, BD2)
        k2 = tl.load(K2 + page * sk2_p + t[:, None] * sk2_t + kvh * sk2_h + d2[None, :], mask=d2[None, :] < D2,
                     other=0.0)
        s += _dot(q2, tl.trans(k2), IEEE)
    s = s * qk_scale
    m_ref = tl.maximum(m_i, tl.max(s, 1))  # (unmasked: finite)
    if MASKED:
        visible = kpos[None, :] <= pos[:, None]
        if WINDOW > 0:
            visible = visible & (kpos[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet (or padding)
    else:
        m_new = m_ref
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + page * sv_p + t[:, None] * sv_t + kvh * sv_h + dv[None, :], mask=dv[None, :] < DV, other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return acc, l_i, m_new


@triton.jit
def _prefill(Q1, Q2, K1, K2, V, TABLE, SLOTS, POS, OUT, SINKS,
             sq1_b, sq1_s, sq1_h, sq2_b, sq2_s, sq2_h,
             sk1_p, sk1_t, sk1_h, sk2_p, sk2_t, sk2_h, sv_p, sv_t, sv_h, st_r, ss_b,
             sp_b, so_b, so_s, so_h,
             S, H, G, qk_scale, WINDOW,
             D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
             BD1: tl.constexpr, BD2: tl.constexpr, BDV: tl.constexpr,
             BLOCK_M: tl.constexpr, P: tl.constexpr, HAS_Q2: tl.constexpr, IEEE: tl.constexpr,
             HAS_SINKS: tl.constexpr):
    """One (block of BLOCK_M query tokens, sequence, head): flash attention over the row's pages up to the
    block's last position: first the pages every query of the block sees whole, without masks, then the pages
    on the diagonal, each token masked to the positions <= its own. With a window (WINDOW > 0) every page from the
    one holding the block's first visible position on is masked (a block spans at most (BLOCK_M + WINDOW) / P + 1
    pages). The head's sink (HAS_SINKS) joins each row's sum at the end."""
    mb = tl.program_id(0)
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    kvh = h // G
    ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < S
    pos = tl.load(POS + b * sp_b + ms, mask=mmask, other=-1)
    slot = tl.load(SLOTS + b * ss_b).to(tl.int64)
    d1 = tl.arange(0, BD1)
    q1 = tl.load(Q1 + b * sq1_b + ms[:, None] * sq1_s + h * sq1_h + d1[None, :],
                 mask=mmask[:, None] & (d1[None, :] < D1), other=0.0)
    q2 = q1
    if HAS_Q2:
        d2 = tl.arange(0, BD2)
        q2 = tl.load(Q2 + b * sq2_b + ms[:, None] * sq2_s + h * sq2_h + d2[None, :],
                     mask=mmask[:, None] & (d2[None, :] < D2), other=0.0)
    t = tl.arange(0, P)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BDV], tl.float32)
    top = tl.max(pos, 0)
    low = tl.min(tl.where(mmask, pos, top), 0)  # the block's first real position
    whole = (low + 1) // P  # pages 0 .. whole - 1 end at or before it
    first = whole * 0
    if WINDOW > 0:
        first = tl.maximum(low - WINDOW + 1, 0) // P
        whole = first
    for pg in range(first, whole):
        page = tl.load(TABLE + slot * st_r + pg).to(tl.int64)
        acc, l_i, m_i = _prefill_page(acc, l_i, m_i, q1, q2, pos, page, pg * P + t, K1, K2, V, kvh,
                                      sk1_t, sk1_h, sk2_t, sk2_h, sv_t, sv_h, sk1_p, sk2_p, sv_p, qk_scale,
                                      D1, D2, DV, BD1, BD2, BDV, P, HAS_Q2, False, IEEE, WINDOW)
    for pg in range(whole, top // P + 1):
        page = tl.load(TABLE + slot * st_r + pg).to(tl.int64)
        acc, l_i, m_i = _prefill_page(acc, l_i, m_i, q1, q2, pos, page, pg * P + t, K1, K2, V, kvh,
                                      sk1_t, sk1_h, sk2_t, sk2_h, sv_t, sv_h, sk1_p, sk2_p, sv_p, qk_scale,
                                      D1, D2, DV, BD1, BD2, BDV, P, HAS_Q2, True, IEEE, WINDOW)
    if HAS_SINKS:  # base 2, as the scores: the sink's logit times log2(e)
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.exp2(sink - m_f)
        acc = acc * alpha[:, None]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dv = tl.arange(0, BDV)
    tl.store(OUT + b * so_b + ms[:, None] * so_s + h * so_h + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=mmask[:, None] & (dv[None, :] < DV))


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(int(n)))


def _page_strides(x: torch.Tensor) -> tuple:
    """(page, position, head) strides of a [n_pages, P, heads, D] tensor whose last dim is contiguous."""
    if x.stride(-1) != 1:
        raise ValueError("the cache pages' last dimension must be contiguous")
    return x.stride(0), x.stride(1), x.stride(2)


_SM_COUNT: dict = {}


def _programs_wanted(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter (tests): a few splits, so the reduction is exercised
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return DECODE_PROGRAMS_PER_SM * _SM_COUNT[device]


def decode_splits(program_rows: int, pages_per_row: int, device: torch.device) -> int:
    """Splits of each query row's pages: a power of two, enough programs for the GPU from one row alone, at most
    the pages a row can have. Sized for one row, not divided among the batch's rows: in a batch of mixed lengths
    the longest row alone must fill the GPU, or its few programs walk its pages long after the short rows are done
    (empty splits of short rows exit at once and store only their -inf). Depends only on shapes fixed at capture,
    so a CUDA graph keeps it."""
    want = max(1, _programs_wanted(device) // max(1, program_rows))
    floor_pow2 = triton.next_power_of_2(want + 1) // 2  # the largest power of two <= want
    return max(1, min(floor_pow2, MAX_SPLITS, triton.next_power_of_2(pages_per_row)))


def _check_sinks_window(name: str, sinks, window, H: int, device) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window must be an int >= 1 (or None), got {window!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (H,)
                              or not sinks.dtype.is_floating_point or sinks.device != device):
        raise ValueError(f"{name}: sinks must be a float tensor [{H}] on {device}, got "
                         f"{getattr(sinks, 'dtype', type(sinks).__name__)} {tuple(getattr(sinks, 'shape', ()))} "
                         f"on {getattr(sinks, 'device', None)}")


def decode(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor | None, table: torch.Tensor, slots: torch.Tensor,
           positions: torch.Tensor, scale: float, *, q2: torch.Tensor | None = None, k2: torch.Tensor | None = None,
           v_is_k1: bool = False, sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """One query token per row: q1 [N, H, D1] (q2 [N, H, D2]) at ``positions`` [N] of cache rows ``slots`` [N]
    -> [N, H, DV] in q1's dtype. k1 [n_pages, P, kv, D1], k2 [n_pages, P, kv or 1, D2], v [n_pages, P, kv, DV]
    (``v_is_k1``: the values are k1 itself). ``slots`` and ``positions`` are read through their strides: a stride-0
    ``slots`` (one sequence's S tokens as S rows, ``mla_latent_paged``) needs no copy and is read at its one
    element only. ``sinks`` [H] (any float dtype, on q1's device): each head's sink logit, unscaled. ``window``: an
    int >= 1, each row attends to its last ``window`` positions (its own included)."""
    N, H, D1 = q1.shape
    _check_sinks_window("decode", sinks, window, H, q1.device)
    n_pages, P, KV = k1.shape[:3]
    if v_is_k1:
        v = k1
    DV = v.shape[-1]
    G = H // KV
    # query heads per program: a kv head's group (GQA); MLA's 512-wide latent value holds 32 heads' accumulators
    BLOCK_G = _pow2(min(G, 32 if DV > 256 else 64))
    head_blocks = -(-G // BLOCK_G)
    nsplit = decode_splits(KV * head_blocks, table.shape[1], q1.device)
    part_o = torch.empty(N, H, nsplit, DV, dtype=torch.float32, device=q1.device)
    part_l = torch.empty(N, H, nsplit, dtype=torch.float32, device=q1.device)
    out = torch.empty(N, H, DV, dtype=q1.dtype, device=q1.device)
    has_q2 = q2 is not None
    q2_, k2_ = (q2, k2) if has_q2 else (q1, k1)
    D2 = q2_.shape[-1] if has_q2 else 16
    ieee = q1.dtype == torch.float32
    _decode_split[(N, KV * head_blocks, nsplit)](
        q1, q2_, k1, k2_, v, table, slots, positions, part_o, part_l,
        q1.stride(0), q1.stride(1), q2_.stride(0), q2_.stride(1),
        *_page_strides(k1), *_page_strides(k2_), *_page_strides(v), table.stride(0), slots.stride(0),
        positions.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0), part_l.stride(1),
        scale, G, head_blocks, window or 0,
        D1=D1, D2=D2, DV=DV, BD1=_pow2(D1), BD2=_pow2(D2), BDV=_pow2(DV),
        BLOCK_G=BLOCK_G, P=P, NSPLIT=nsplit, HAS_Q2=has_q2, V_IS_K1=v_is_k1, IEEE=ieee,
        num_warps=4 if max(D1, DV) <= 128 else 8, num_stages=2,
        **triton_pdl.launch(q1.device),
    )
    bd_reduce = min(_pow2(DV), 128)
    sinks_ = sinks.contiguous() if sinks is not None else part_l
    _decode_reduce[(N, H, -(-DV // bd_reduce))](
        part_o, part_l, sinks_, out, part_o.stride(0), part_o.stride(1), part_o.stride(2), part_l.stride(0),
        part_l.stride(1), out.stride(0), out.stride(1), H, DV=DV, BDV=bd_reduce, NSPLIT=nsplit,
        HAS_SINKS=sinks is not None, num_warps=4,
        **triton_pdl.launch(q1.device),
    )
    return out


# (query tokens per program, warps, pipeline stages) by head size: the fastest of bench/device/attention_kernels.py
# --configs on the H200 (BENCHMARKS.md#attention-kernels)
PREFILL_CONFIGS = {
    "small": (64, 4, 3),  # q/k and v head dims <= 128
    "big": (64, 4, 2),  # MLA's expanded form (q/k 128 + 64, v 128)
}


def prefill(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, table: torch.Tensor, slots: torch.Tensor,
            positions: torch.Tensor, scale: float, *, q2: torch.Tensor | None = None,
            k2: torch.Tensor | None = None, config: tuple | None = None, sinks: torch.Tensor | None = None,
            window: int | None = None) -> torch.Tensor:
    """q1 [B, S, H, D1] (q2 [B, S, H, D2]) at ``positions`` [B, S] of cache rows ``slots`` [B] -> [B, S, H, DV]
    in q1's dtype; every token's key/value must be in the cache already. Pages, ``sinks`` and ``window`` as in
    ``decode``. ``config``: (BLOCK_M, num_warps, num_stages) instead of PREFILL_CONFIGS' (benchmarks)."""
    B, S, H, D1 = q1.shape
    _check_sinks_window("prefill", sinks, window, H, q1.device)
    KV = k1.shape[2]
    DV = v.shape[-1]
    P = k1.shape[1]
    out = torch.empty(B, S, H, DV, dtype=q1.dtype, device=q1.device)
    has_q2 = q2 is not None
    q2_, k2_ = (q2, k2) if has_q2 else (q1, k1)
    D2 = q2_.shape[-1] if has_q2 else 16
    positions = positions.contiguous()
    big = max(D1 + (D2 if has_q2 else 0), DV) > 128
    block_m, warps, stages = config or PREFILL_CONFIGS["big" if big else "small"]
    if q1.dtype == torch.float32 or q1.device.type != "cuda":
        block_m, warps, stages = 64, 4, 1  # fp32 tiles (tests, the interpreter)
    _prefill[(-(-S // block_m), B * H)](
        q1, q2_, k1, k2_, v, table, slots, positions, out, sinks.contiguous() if sinks is not None else positions,
        q1.stride(0), q1.stride(1), q1.stride(2), q2_.stride(0), q2_.stride(1), q2_.stride(2),
        *_page_strides(k1), *_page_strides(k2_), *_page_strides(v), table.stride(0), slots.stride(0),
        positions.stride(0), out.stride(0), out.stride(1), out.stride(2),
        S, H, H // KV, scale * LOG2E, window or 0,
        D1=D1, D2=D2, DV=DV, BD1=_pow2(D1), BD2=_pow2(D2), BDV=_pow2(DV),
        BLOCK_M=block_m, P=P, HAS_Q2=has_q2, IEEE=q1.dtype == torch.float32, HAS_SINKS=sinks is not None,
        num_warps=warps, num_stages=stages,
    )
    return out
