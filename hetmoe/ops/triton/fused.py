"""Fused decode kernels in Triton: the small element-wise steps around each layer's matmuls done by one kernel each,
so that a decode step launches fewer kernels per layer (docs/decode-step.md#fused-decode).

* ``add_rms_norm``: residual add + RMSNorm at a layer boundary: writes the new residual x + delta and the
  normalised input weight * rms_norm(x + delta) (delta None: the norm alone), the normalised x rounded before the
  weight (Hugging Face's RMSNorm) or not (``round_normed=False``: gpt-oss's, the product rounded once).
* ``qkv_epilogue``: after GQA's fused q/k/v projection: per-head q/k RMSNorm (Qwen3), RoPE (half-split) and the
  write of k and v into the KV cache; returns q.
* ``mla_epilogue``: after MLA's kv_a projection: kv_a_layernorm of the latent, RoPE of k_pe and both written to the
  latent cache, and RoPE of the query's rope part; returns q_pe.
* ``silu_mul``: silu(gate) * up of a SwiGLU MLP (shared experts, dense MLPs).
* ``router_stage``: a MoE layer's router logits x @ W.T written straight into the pinned host buffer the CPU job
  routes from, and x itself into the job's input buffer: one kernel instead of the router GEMM and two copies.
* ``add_rows``: a + b rounded once (the CPU experts' output read from pinned host memory plus the shared experts):
  the combine and the copy back in one kernel.

Host buffers are pinned CPU tensors: a kernel reads and writes them over PCIe through their mapped address (with
unified addressing, pinned memory is the same pointer on the device), so no copy-engine node sits between the
kernels of a decode graph.

Each kernel rounds to the model dtype where the unfused PyTorch code does (the cast after RMSNorm, after the
norm's weight, after each product and sum of RoPE), so the fused path differs from the unfused one only by the
order of a reduction: tests/ops/test_fused_decode.py measures the difference under Triton's interpreter. The
cache is the paged layout (``table`` given: position p of row r in page table[r, p // P] at offset p % P) or the
contiguous one (``table`` None: row r is page r, P its capacity). Shapes: T tokens (B * S), H query heads, K kv
heads, D head dim; nothing reads the host, so each call is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hetmoe.ops.triton import pdl as triton_pdl
from hetmoe.ops.triton.pdl import pdl_begin


@triton.jit
def round_to(x, DT: tl.constexpr):
    """x (fp32) rounded to nearest even in DT, kept in fp32: one rounding point of the unfused code. bf16 by its
    bits (exact on the GPU, and in Triton's interpreter, whose own casts truncate)."""
    if DT == tl.float32:
        return x
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DT).to(tl.float32)


@triton.jit
def store_rows(ptrs, x, mask):
    """Store fp32 x in the pointers' dtype, rounded to nearest even."""
    DT: tl.constexpr = ptrs.dtype.element_ty
    tl.store(ptrs, round_to(x, DT).to(DT), mask=mask)


@triton.jit
def _rotate(a, b, c, s, ROUND: tl.constexpr, DT: tl.constexpr):
    """One RoPE rotation of the pairs (a, b) by (cos, sin): (a c - b s, b c + a s), each product and the sum
    rounded to DT when ROUND (the unfused code's elementwise ops in the model dtype), else computed in fp32."""
    if ROUND:
        lo = round_to(a * c, DT) - round_to(b * s, DT)
        hi = round_to(b * c, DT) + round_to(a * s, DT)
    else:
        lo = a * c - b * s
        hi = b * c + a * s
    return lo, hi


@triton.jit
def _rms(a, b, n, eps):
    """1 / sqrt(mean of squares + eps) over the two halves a, b of one vector of n elements (masked lanes 0)."""
    return tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / n + eps)


@triton.jit
def _cache_place(TABLE, SLOTS, POS, t, S, st_r, P, PAGED: tl.constexpr):
    """(page, offset) where token t (row t // S of the batch) writes its keys and values."""
    slot = tl.load(SLOTS + t // S).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    if PAGED:
        page = tl.load(TABLE + slot * st_r + pos // P).to(tl.int64)
        off = pos % P
    else:
        page = slot
        off = pos
    return page, off


@triton.jit
def _store_halves(dst, i, m, lo, hi, HALF: tl.constexpr):
    store_rows(dst + i, lo, m)
    store_rows(dst + HALF + i, hi, m)


@triton.jit
def _load_host(ptrs, mask):
    """A load from pinned host memory that a CPU thread wrote since the last kernel: no cached line counts (.cv)."""
    return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cv")


@triton.jit
def _store_host(ptrs, x, mask):
    """store_rows into pinned host memory, written through to it (.wt): a CPU thread reads it after this kernel."""
    DT: tl.constexpr = ptrs.dtype.element_ty
    tl.store(ptrs, round_to(x, DT).to(DT), mask=mask, cache_modifier=".wt")


@triton.jit
def _add_rms_norm(X, DELTA, W, RES, OUT, sx, sd, sr, so, N, eps, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                  DELTA_HOST: tl.constexpr, ROUND_NORMED: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(X + t * sx + i, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        if DELTA_HOST:
            d = _load_host(DELTA + t * sd + i, m).to(tl.float32)
        else:
            d = tl.load(DELTA + t * sd + i, mask=m, other=0.0).to(tl.float32)
        x = round_to(x + d, RES.dtype.element_ty)
        store_rows(RES + t * sr + i, x, m)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + i, mask=m, other=0.0).to(tl.float32)
    normed = x * r
    if ROUND_NORMED:
        normed = round_to(normed, OUT.dtype.element_ty)
    store_rows(OUT + t * so + i, normed * w, m)


@triton.jit
def _qkv_epilogue(QKV, QW, KW, COS, SIN, Q, KC, VC, TABLE, SLOTS, POS,
                  s_qkv, s_cs, sq_t, sq_h, skc_p, skc_t, skc_h, svc_p, svc_t, svc_h, st_r,
                  S, H, K, P, eps,
                  D: tl.constexpr, BH: tl.constexpr, NORM: tl.constexpr, PAGED: tl.constexpr, PDL: tl.constexpr):
    """One (token, head) of the projection's output [T, (H + 2K) * D]: heads < H are q (norm, rope -> Q), then K
    key heads (norm, rope -> the cache), then K value heads (-> the cache). COS: cos of the first half of each
    token's table row, SIN: the positive sin (the second half of the signed table)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    DT: tl.constexpr = Q.dtype.element_ty
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, BH)
    m = i < HALF
    src = QKV + t * s_qkv + h * D
    a = tl.load(src + i, mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + HALF + i, mask=m, other=0.0).to(tl.float32)
    page, off = _cache_place(TABLE, SLOTS, POS, t, S, st_r, P, PAGED)
    if h < H + K:
        if NORM:  # weight * rms_norm(x): rounded after the norm and after the weight
            r = _rms(a, b, D, eps)
            if h < H:
                wa = tl.load(QW + i, mask=m, other=0.0).to(tl.float32)
                wb = tl.load(QW + HALF + i, mask=m, other=0.0).to(tl.float32)
            else:
                wa = tl.load(KW + i, mask=m, other=0.0).to(tl.float32)
                wb = tl.load(KW + HALF + i, mask=m, other=0.0).to(tl.float32)
            a = round_to(round_to(a * r, DT) * wa, DT)
            b = round_to(round_to(b * r, DT) * wb, DT)
        c = tl.load(COS + t * s_cs + i, mask=m, other=0.0).to(tl.float32)
        s = tl.load(SIN + t * s_cs + i, mask=m, other=0.0).to(tl.float32)
        lo, hi = _rotate(a, b, c, s, True, DT)
        # each branch stores itself: Q and the cache may differ in dtype, so no pointer is chosen across branches
        if h < H:
            _store_halves(Q + t * sq_t + h * sq_h, i, m, lo, hi, HALF)
        else:
            _store_halves(KC + page * skc_p + off * skc_t + (h - H) * skc_h, i, m, lo, hi, HALF)
    else:
        _store_halves(VC + page * svc_p + off * svc_t + (h - H - K) * svc_h, i, m, a, b, HALF)


@triton.jit
def _load_pairs(src, j, m, IN_IL: tl.constexpr, HALF: tl.constexpr):
    """The pairs a RoPE rotates: interleaved (x0, x1), (x2, x3), ... or the halves (x_j, x_{j + D/2})."""
    if IN_IL:
        first, second = src + 2 * j, src + 2 * j + 1
    else:
        first, second = src + j, src + HALF + j
    return tl.load(first, mask=m, other=0.0).to(tl.float32), tl.load(second, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_pairs(dst, j, m, lo, hi, OUT_IL: tl.constexpr, HALF: tl.constexpr):
    if OUT_IL:
        store_rows(dst + 2 * j, lo, m)
        store_rows(dst + 2 * j + 1, hi, m)
    else:
        store_rows(dst + j, lo, m)
        store_rows(dst + HALF + j, hi, m)


@triton.jit
def _mla_epilogue(KVA, W, COS, SIN, Q, QPE, CC, PC, TABLE, SLOTS, POS,
                  s_kva, s_cs, sq_t, sq_h, sqpe_t, sqpe_h, scc_p, scc_t, spc_p, spc_t, st_r,
                  S, P, R, NOPE, eps,
                  BR: tl.constexpr, HALF: tl.constexpr, BHALF: tl.constexpr,
                  IN_IL: tl.constexpr, OUT_IL: tl.constexpr, ROUND: tl.constexpr, PAGED: tl.constexpr,
                  PDL: tl.constexpr):
    """Program (t, 0): token t's latent (norm -> the cache's c_kv) and k_pe (rope -> the cache's k_pe); program
    (t, 1 + h): query head h's rope part (rope -> QPE)."""
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    DT: tl.constexpr = QPE.dtype.element_ty
    j = tl.arange(0, BHALF)
    mj = j < HALF
    c = tl.load(COS + t * s_cs + j, mask=mj, other=0.0).to(tl.float32)
    s = tl.load(SIN + t * s_cs + j, mask=mj, other=0.0).to(tl.float32)
    if h == 0:
        page, off = _cache_place(TABLE, SLOTS, POS, t, S, st_r, P, PAGED)
        k = tl.arange(0, BR)
        mk = k < R
        x = tl.load(KVA + t * s_kva + k, mask=mk, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / R + eps)
        w = tl.load(W + k, mask=mk, other=0.0).to(tl.float32)
        store_rows(CC + page * scc_p + off * scc_t + k, round_to(x * r, DT) * w, mk)
        a, b = _load_pairs(KVA + t * s_kva + R, j, mj, IN_IL, HALF)
        lo, hi = _rotate(a, b, c, s, ROUND, DT)
        _store_pairs(PC + page * spc_p + off * spc_t, j, mj, lo, hi, OUT_IL, HALF)  # (see _qkv_epilogue's stores)
    else:
        a, b = _load_pairs(Q + t * sq_t + (h - 1) * sq_h + NOPE, j, mj, IN_IL, HALF)
        lo, hi = _rotate(a, b, c, s, ROUND, DT)
        _store_pairs(QPE + t * sqpe_t + (h - 1) * sqpe_h, j, mj, lo, hi, OUT_IL, HALF)


@triton.jit
def _silu_mul(GU, OUT, s_gu, s_o, N, BLOCK: tl.constexpr, ROUND_SILU: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(GU + t * s_gu + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + t * s_gu + N + i, mask=m, other=0.0).to(tl.float32)
    silu = g / (1.0 + tl.exp(-g))
    if ROUND_SILU:
        silu = round_to(silu, OUT.dtype.element_ty)
    store_rows(OUT + t * s_o + i, silu * u, m)


@triton.jit
def _router_stage(X, W, LOGITS, XH, T, N, E, sx, sw, sl, sxh,
                  BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, STAGE_X: tl.constexpr, PDL: tl.constexpr):
    """Program (e, t): logits of experts [e * BE, (e + 1) * BE) for tokens [t * BT, (t + 1) * BT), fp32 products
    summed in fp32, stored in LOGITS' dtype; the programs of expert block 0 also copy their tokens' x to XH. A
    broadcast product, not tl.dot: a decode batch is a few rows, and a GEMV spread over E / BE programs reads the
    weight at HBM speed where a few tl.dot programs each walked their slice of K one latency at a time."""
    pdl_begin(PDL)
    pe = tl.program_id(0)
    rt = tl.program_id(1) * BT + tl.arange(0, BT)
    re = pe * BE + tl.arange(0, BE)
    mt, me = rt < T, re < E
    acc = tl.zeros([BT, BE], dtype=tl.float32)
    for k0 in range(0, N, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < N
        mx = mt[:, None] & mk[None, :]
        x = tl.load(X + rt[:, None].to(tl.int64) * sx + rk[None, :], mask=mx, other=0.0)
        if STAGE_X:
            if pe == 0:
                tl.store(XH + rt[:, None].to(tl.int64) * sxh + rk[None, :], x, mask=mx, cache_modifier=".wt")
        w = tl.load(W + re[:, None].to(tl.int64) * sw + rk[None, :], mask=me[:, None] & mk[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    _store_host(LOGITS + rt[:, None].to(tl.int64) * sl + re[None, :], acc, mt[:, None] & me[None, :])


@triton.jit
def _add_rows(A, B, OUT, sa, sb, so, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    a = _load_host(A + t * sa + i, m).to(tl.float32)
    b = tl.load(B + t * sb + i, mask=m, other=0.0).to(tl.float32)
    store_rows(OUT + t * so + i, a + b, m)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as [T, N] with unit stride along N (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(x: torch.Tensor, delta, weight: torch.Tensor, eps: float, round_normed: bool = True) -> tuple:
    """x [..., N] (+ delta [..., N]) -> (residual = x + delta rounded to x's dtype (x itself when delta is None),
    weight * rms_norm(residual)), both [..., N] in x's dtype. delta may be a pinned host tensor (read over PCIe:
    a MoE layer's CPU output, hetmoe/moe/stream.py). ``round_normed``: rms_norm(residual) rounded to x's dtype
    before the weight multiplies it (else the fp32 product is rounded once)."""
    N = x.shape[-1]
    x2 = _rows(x)
    T = x2.shape[0]
    res = torch.empty_like(x2) if delta is not None else x2
    out = torch.empty_like(x2)
    d2 = _rows(delta) if delta is not None else x2
    if T:
        block = triton.next_power_of_2(N)
        _add_rms_norm[(T,)](x2, d2, weight, res, out, x2.stride(0), d2.stride(0), res.stride(0), out.stride(0), N,
                            eps, BLOCK=block, HAS_DELTA=delta is not None, DELTA_HOST=d2.device != x2.device,
                            ROUND_NORMED=round_normed, num_warps=_warps(block), **triton_pdl.launch(x2.device))
    return (res.view(x.shape) if delta is not None else x), out.view(x.shape)


def qkv_epilogue(qkv: torch.Tensor, n_heads: int, n_kv: int, q_weight, k_weight, eps: float, cos: torch.Tensor,
                 signed_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table, page_size: int,
                 slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """qkv [B, S, (H + 2K) * D] (q | k | v heads), the RoPE table of layers/rope.py ``cos_sin`` ([B, S, 1, D]
    each), the per-head norm weights [D] (None: no q/k norm) -> q [B, S, H, D]; k and v written to the cache
    (``k_cache``/``v_cache`` [pages, P, K, D] of one layer)."""
    B, S, width = qkv.shape
    H, K = n_heads, n_kv
    D = width // (H + 2 * K)
    q = torch.empty(B, S, H, D, dtype=qkv.dtype, device=qkv.device)
    qkv2, cos2, sin2 = _rows(qkv), cos.reshape(B * S, D), signed_sin.reshape(B * S, D)[:, D // 2:]
    norm = q_weight is not None
    table_ = table if table is not None else slots
    if B * S:
        _qkv_epilogue[(B * S, H + 2 * K)](
            qkv2, q_weight if norm else qkv2, k_weight if norm else qkv2, cos2, sin2, q, k_cache, v_cache, table_,
            slots, positions.contiguous(), qkv2.stride(0), cos2.stride(0), q.stride(1), q.stride(2),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), table_.stride(0), S, H, K, page_size, eps if norm else 0.0,
            D=D, BH=triton.next_power_of_2(D // 2), NORM=norm, PAGED=table is not None, num_warps=1,
            **triton_pdl.launch(qkv.device))
    return q


ROPE_LAYOUTS = {  # rope form -> (pairs read interleaved, written interleaved, rounded like the model dtype's ops)
    "complex": (True, True, False),  # DeepSeek-V2: complex rotation in fp32, result interleaved
    "interleave": (True, False, True),  # DeepSeek-V3 rope_interleave: interleaved pairs, written as halves
    "half": (False, False, True),  # rotate_half
}


def mla_epilogue(kv_a: torch.Tensor, q: torch.Tensor, nope: int, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, rope_form: str, c_cache: torch.Tensor, pe_cache: torch.Tensor,
                 table, page_size: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """kv_a [B, S, r + rope] (latent | k_pe), q [B, S, h, nope + rope], the half-size RoPE table cos/sin
    [B, S, rope / 2] -> q_pe [B, S, h, rope] rotated; c_kv = weight * rms_norm(latent) and the rotated k_pe written
    to the latent cache (``c_cache`` [pages, P, 1, r], ``pe_cache`` [pages, P, 1, rope])."""
    if rope_form not in ROPE_LAYOUTS:
        raise ValueError(f"rope form must be one of {', '.join(ROPE_LAYOUTS)}, got {rope_form!r}")
    B, S, h, qd = q.shape
    rope = qd - nope
    R = kv_a.shape[-1] - rope
    in_il, out_il, rnd = ROPE_LAYOUTS[rope_form]
    q_pe = torch.empty(B, S, h, rope, dtype=q.dtype, device=q.device)
    kva2 = _rows(kv_a)
    q3 = q.reshape(B * S, h, qd)
    cos2, sin2 = cos.reshape(B * S, rope // 2), sin.reshape(B * S, rope // 2)
    table_ = table if table is not None else slots
    if B * S:
        _mla_epilogue[(B * S, 1 + h)](
            kva2, weight, cos2, sin2, q3, q_pe, c_cache, pe_cache, table_, slots, positions.contiguous(),
            kva2.stride(0), cos2.stride(0), q3.stride(0), q3.stride(1), q_pe.stride(1), q_pe.stride(2),
            c_cache.stride(0), c_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1), table_.stride(0),
            S, page_size, R, nope, eps, BR=triton.next_power_of_2(R), HALF=rope // 2,
            BHALF=triton.next_power_of_2(rope // 2), IN_IL=in_il, OUT_IL=out_il, ROUND=rnd,
            PAGED=table is not None, num_warps=_warps(triton.next_power_of_2(R)) // 2,
            **triton_pdl.launch(q.device))
    return q_pe


def silu_mul(gate_up: torch.Tensor, round_silu: bool = True) -> torch.Tensor:
    """gate_up [..., 2I] (gate | up) -> silu(gate) * up [..., I]: silu rounded to the dtype as F.silu is, or with
    ``round_silu=False`` the product computed in fp32 and rounded once (the layerwise prefill's SwiGLU)."""
    I = gate_up.shape[-1] // 2
    gu = _rows(gate_up)
    out = torch.empty(gu.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    if gu.shape[0]:
        _silu_mul[(gu.shape[0], triton.cdiv(I, block))](gu, out, gu.stride(0), out.stride(0), I, BLOCK=block,
                                                         ROUND_SILU=round_silu, num_warps=4,
                                                         **triton_pdl.launch(gu.device))
    return out.view(*gate_up.shape[:-1], I)


def router_stage(x: torch.Tensor, weight: torch.Tensor, logits: torch.Tensor, x_host=None) -> None:
    """x [T, N] (the MoE layer's input), weight [E, N] -> logits [T, E] = x @ weight.T accumulated in fp32, stored in
    ``logits``' dtype (the model dtype, or fp32 for DeepSeek's routers); ``x_host`` [T, N] (x's dtype): a copy of x.
    ``logits`` and ``x_host`` may be pinned host tensors (written over PCIe), every row of their first T."""
    T, N = x.shape
    E = weight.shape[0]
    if weight.shape[1] != N or weight.dtype != x.dtype or tuple(logits.shape) != (T, E):
        raise ValueError(f"router_stage: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"logits {tuple(logits.shape)}: expected weight [E, {N}] in x's dtype and logits [{T}, E]")
    if x_host is not None and (tuple(x_host.shape) != (T, N) or x_host.dtype != x.dtype):
        raise ValueError(f"router_stage: x_host {tuple(x_host.shape)} {x_host.dtype}, expected [{T}, {N}] {x.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or logits.stride(-1) != 1:
        raise ValueError("router_stage: x, weight and logits need unit stride along their last dimension")
    if not T:
        return
    xh = x_host if x_host is not None else logits
    bt, be = min(4, triton.next_power_of_2(T)), 2  # a product of BT * BE * BK = 4096 values per step
    _router_stage[(triton.cdiv(E, be), triton.cdiv(T, bt))](
        x, weight, logits, xh, T, N, E, x.stride(0), weight.stride(0), logits.stride(0), xh.stride(0), BT=bt, BE=be,
        BK=min(triton.next_power_of_2(N), 4096 // (bt * be)), STAGE_X=x_host is not None, num_warps=4,
        **triton_pdl.launch(x.device))


def add_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [T, N] + b [T, N] -> [T, N] in b's dtype on b's device, the sum rounded once (as ``a.to(b.dtype) + b`` when
    a is in b's dtype); a may be a pinned host tensor (read over PCIe)."""
    if a.shape != b.shape:
        raise ValueError(f"add_rows: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    a2, b2 = _rows(a), _rows(b)
    out = torch.empty(b2.shape, dtype=b.dtype, device=b.device)
    N = b2.shape[-1]
    block = min(1024, triton.next_power_of_2(max(N, 1)))
    if b2.shape[0] and N:
        _add_rows[(b2.shape[0], triton.cdiv(N, block))](a2, b2, out, a2.stride(0), b2.stride(0), out.stride(0), N,
                                                          BLOCK=block, num_warps=4, **triton_pdl.launch(b.device))
    return out.view(b.shape)
