"""Attention over the KV cache (layers/kv_cache.py), and the step metadata every model forward receives.

New keys/values are written at their absolute positions, and a query at position p attends to cached positions
<= p. Right-padded batches are safe: a padding token writes positions that its sequence's real tokens never
attend to and later overwrite.

Two ways to attend (``attend_cache``): over a paged cache on a GPU, the Triton kernels of
ops/triton/attention.py read the pages in place, causal from each token's position, no mask anywhere (measured
faster than the SDPA flash kernel the engine runs, BENCHMARKS.md#attention-kernels); else (CPU, no Triton,
``--attention sdpa``) PyTorch's SDPA over the cache rows: ``is_causal`` for a prompt from position 0, the lower-right
causal bias after a cached prefix, an additive mask for batches of several sequences. A decode step over the contiguous
cache on the CPU (one token per sequence) runs on the CPU engine's threads instead (``cpu_decode``,
hetmoe/cpu/attention.py).

Attention sinks and a sliding window (gpt-oss: ``attend_cache``'s ``sinks`` and ``window``) run in the same kernels:
the paged Triton kernels (decode and prefill) and the CPU engine's decode attention; every other call (a prefill
chunk over the contiguous cache, the contiguous cache on a GPU) runs ``attend_sinks`` (SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.rope import apply_rope


@dataclass
class Step:
    """What the runner tells a model about one forward call (prefill or decode). One per call: it keeps the
    attention masks derived from ``positions`` (``attn_mask``) for the layers of that call."""

    positions: torch.Tensor  # [B, S] int64: absolute position of each token of this call
    slots: torch.Tensor  # [B] int64: the cache row of each sequence
    # Optional host-side facts that let attention read less of the cache (the runner knows them without a
    # device sync): kv_len > every position of this call; first_slot when slots are first_slot, first_slot+1, ...
    kv_len: int | None = None
    first_slot: int | None = None
    start: int | None = None  # when every row's positions are start, start + 1, ...: that start
    # [B] int64: the real tokens of each row of a right-padded batch (None: all S). Attention needs no such thing
    # (padding sits past a row's tokens); a recurrent layer must not fold the padding into its state
    lengths: torch.Tensor | None = None
    # a decode step of the fused path (the CUDA graph's, engine/cuda_graph.py): layers run their element-wise work
    # as the Triton kernels of ops/triton/fused.py (PreNormDecoderLayer.forward_fused)
    fused: bool = False
    # a step a CUDA graph captures (engine/cuda_graph.py): no layer may read a device tensor on the host; whatever
    # depends on the context length is decided from kv_len alone
    captured: bool = False
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # attn_mask's, once per call

    def attn_mask(self, ctx: int, dtype: torch.dtype, group: int = 1) -> torch.Tensor:
        """Additive attention mask [B, 1, S * group, ctx] in ``dtype``: 0 where a query may attend (cached position
        <= its own), -inf elsewhere; row s * group + j belongs to position s (``group`` query heads per position,
        see ``attend``). Built on first use and shared by every layer of the call."""
        mask = self._masks.get((ctx, dtype, group))
        if mask is None:
            B, S = self.positions.shape
            base = self._masks.get((ctx, dtype, 1))
            if base is None:
                later = torch.arange(ctx, device=self.positions.device) > self.positions.unsqueeze(-1)  # [B, S, ctx]
                base = torch.zeros(B, 1, S, ctx, dtype=dtype, device=later.device).masked_fill_(later.unsqueeze(1),
                                                                                                   float("-inf"))
                self._masks[(ctx, dtype, 1)] = base
            # S = 1: a broadcast view (stride 0 over the group), no copy
            mask = base.unsqueeze(3).expand(B, 1, S, group, ctx).reshape(B, 1, S * group, ctx)
            self._masks[(ctx, dtype, group)] = mask
        return mask


def paged_kernels(device) -> bool:
    """Whether the paged cache and its Triton kernels can run on ``device`` (a GPU, Triton importable)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def cpu_decode(q: torch.Tensor, cache: KVCache):
    """The CPU engine's decode attention (hetmoe/cpu/attention.py) when it applies: one token per sequence over a
    contiguous CPU cache, fp32 or bf16. Else None: the torch path."""
    dtypes = (torch.float32, torch.bfloat16)
    if not (q.shape[1] == 1 and not cache.paged and cache.device.type == "cpu" and q.device.type == "cpu"
            and q.dtype in dtypes and cache.dtype in dtypes):
        return None
    from hetmoe.cpu.attention import decode_attention

    return decode_attention


def attend_cache(q: torch.Tensor, cache: KVCache, layer: int, step: Step, scale: float,
                 sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q [B, S, heads, D] over this layer's cache (written already for this step) -> [B, S, heads, Dv].
    ``sinks`` [heads] (gpt-oss's attention sinks) and, with them, ``window`` (attend to the last ``window``
    positions only): see ``attend_sinks``."""
    if window is not None and sinks is None:
        raise ValueError("attend_cache: a sliding window is implemented together with attention sinks only")
    decode = cpu_decode(q, cache)
    if decode:  # lens = positions + 1: each token attends to its own position and those before
        out = decode(q[:, 0], cache.k[layer], cache.v[layer], step.slots, step.positions[:, 0] + 1, scale,
                     sinks=sinks, window=window)
        return out.unsqueeze(1)
    if cache.paged:
        from hetmoe.ops.triton import attention as triton_attention

        k, v = cache.pages(layer)
        if q.shape[1] == 1:
            out = triton_attention.decode(q[:, 0], k, v, cache.table, step.slots, step.positions[:, 0], scale,
                                          sinks=sinks, window=window)
            return out.unsqueeze(1)
        return triton_attention.prefill(q, k, v, cache.table, step.slots, step.positions, scale, sinks=sinks,
                                        window=window)
    k, v = cache.rows(layer, step)
    if sinks is not None:
        return attend_sinks(q, k, v, step, scale, sinks, window)
    return attend(q, k, v, step, scale)


def mla_latent_paged(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: KVCache, layer: int, step: Step,
                     scale: float) -> torch.Tensor:
    """MLA's absorbed attention over a paged latent cache (k: c_kv [.., 1, r], v: k_pe): q_lat [B, S, h, r],
    q_pe [B, S, h, rope] -> [B, S, h, r]. One decode row per query token; the latent is key part 1 and the
    value, read once per page."""
    from hetmoe.ops.triton import attention as triton_attention

    B, S, h, r = q_lat.shape
    c, pe = cache.pages(layer)
    rows = step.slots.unsqueeze(1).expand(B, S).reshape(-1)
    out = triton_attention.decode(q_lat.reshape(B * S, h, r), c, None, cache.table, rows, step.positions.reshape(-1),
                                  scale, q2=q_pe.reshape(B * S, h, -1), k2=pe, v_is_k1=True)
    return out.view(B, S, h, r)


def mla_latent_cpu(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: KVCache, layer: int, step: Step,
                   scale: float) -> torch.Tensor | None:
    """MLA's absorbed attention on the CPU engine's threads over a contiguous latent cache (k: c_kv [.., 1, r], v:
    k_pe), one decode token per sequence: q_lat [B, 1, h, r], q_pe [B, 1, h, rope] -> [B, 1, h, r]; None where
    ``cpu_decode`` does not apply (the caller's torch path)."""
    decode = cpu_decode(q_lat, cache)
    if not decode:
        return None
    out = decode(q_lat[:, 0], cache.k[layer], None, step.slots, step.positions[:, 0] + 1, scale, q2=q_pe[:, 0],
                 k2=cache.v[layer], v_is_k1=True)
    return out.unsqueeze(1)


def mla_expanded_paged(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, pe: torch.Tensor, page_size: int,
                       step: Step, scale: float) -> torch.Tensor:
    """MLA's expanded attention: q_nope [B, S, h, nope] and q_pe [B, S, h, rope] over the expanded rows kv [B, ctx,
    h, nope + v] (whole pages, from KVCache.rows) and the rope keys pe [B, ctx, 1, rope] shared by the heads ->
    [B, S, h, v]. The rows are handed to the prefill kernel as pages of an identity table."""
    from hetmoe.ops.triton import attention as triton_attention

    B, ctx, h, _ = kv.shape
    nope, n = q_nope.shape[-1], B * ctx // page_size
    pages = kv.view(n, page_size, h, -1)
    pe_pages = pe.view(n, page_size, 1, -1).expand(-1, -1, h, -1)  # head stride 0
    table = torch.arange(n, dtype=torch.int32, device=kv.device).view(B, ctx // page_size)
    return triton_attention.prefill(q_nope, pages[..., :nope], pages[..., nope:], table,
                                    torch.arange(B, device=kv.device), step.positions, scale, q2=q_pe, k2=pe_pages)


def _lower_right(step: Step, S: int, L: int):
    """The causal mask of S queries that are the last S of L keys, or None when L == S (SDPA's own is_causal).

    torch.nn.attention.bias.causal_lower_right is what torch itself would run, but importing it imports
    torch._dynamo (~1 s, paid by the first prefill of a process). On the CPU it only materializes this boolean mask
    (the same SDPA call, bitwise); only on a GPU, where it selects the flash kernel, is it imported, on first use."""
    if L == S:
        return None
    device = step.positions.device
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(S, L)
    mask = step._masks.get(("lower_right", S, L))
    if mask is None:
        mask = torch.ones(S, L, dtype=torch.bool, device=device).tril(diagonal=L - S)  # [S, L]
        step._masks[("lower_right", S, L)] = mask
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float) -> torch.Tensor:
    """q [B, S, heads, D] over cache rows k/v [B, ctx, kv_heads, D] -> [B, S, heads, Dv] (causal by position).

    One sequence's consecutive positions (``step.start`` given) need no additive mask: from position 0 SDPA's own
    causal case, after a cached prefix the lower-right causal mask (``_lower_right``; the flash kernel on a GPU).
    Otherwise the g = heads / kv_heads query heads that share a kv head (head h reads kv head h // g) are folded
    into the query length: q [B, kv_heads, S * g, D], row s * g + j, with the mask repeated per row (exact: the
    mask depends on the position only). SDPA then sees plain multi-head attention with an additive mask, which its
    fused kernels take (memory-efficient on CUDA, flash on the CPU); enable_gqa together with a mask would send it
    to the math fallback. For S = 1 the fold is a view of q."""
    B, S, H, D = q.shape
    ctx, n_kv = k.shape[1], k.shape[2]
    g = H // n_kv
    if step.start is not None and S > 1:  # one sequence's consecutive positions: causal, no mask
        # its keys end with its own tokens: causality aligned to the last row and column
        L = step.start + S
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k[:, :L].transpose(1, 2).to(q.dtype),
                                             v[:, :L].transpose(1, 2).to(q.dtype), attn_mask=_lower_right(step, S, L),
                                             is_causal=L == S, scale=scale, enable_gqa=g > 1)
        return out.transpose(1, 2)
    qf = q.reshape(B, S, n_kv, g, D).transpose(1, 2).reshape(B, n_kv, S * g, D)
    kt, vt = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(qf, kt, vt, attn_mask=step.attn_mask(ctx, q.dtype, g), scale=scale)
    return out.reshape(B, n_kv, S, g, -1).transpose(1, 2).reshape(B, S, H, -1)


SINK_CHUNK_ELEMS = 1 << 24  # mask elements (query rows x keys) of one SDPA call of attend_sinks


def attend_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float, sinks: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
    """q [B, S, heads, D] over cache rows k/v [B, ctx, kv_heads, D] -> [B, S, heads, Dv], causal by position, with a
    learned logit per head in each softmax's denominator (``sinks`` [heads]: gpt-oss's attention sinks, which attend
    to nothing) and, with ``window``, over the last ``window`` positions only (position p sees p - window < j <= p).

    The sink is one more key that every query sees, placed first: the key [0, .., 0, 1] with a zero value, the
    query extended by sinks[h] / scale in the new dimension, so that its score is sinks[h] while every other score
    is the unextended one (the keys' extra dimension is zero). SDPA then computes the rest with a boolean mask over
    chunks of queries (the mask of a chunk, [rows, keys], stays below SINK_CHUNK_ELEMS); a windowed chunk of one
    sequence (``step.start``) reads only the keys its window reaches. Calls over the paged cache and the CPU
    engine's decode steps take their kernels instead (``attend_cache``)."""
    B, S, H, D = q.shape
    ctx, n_kv = k.shape[1], k.shape[2]
    g, dtype, device = H // n_kv, q.dtype, q.device
    pad = 8 if device.type == "cuda" else 1  # SDPA's fused GPU kernels take head sizes in multiples of 8
    extra = torch.zeros(B, S, H, pad, dtype=dtype, device=device)
    extra[..., 0] = (sinks.float() / scale).to(dtype)
    qx = torch.cat((q, extra), dim=-1)  # [B, S, H, D + pad]
    sink_k = torch.zeros(B, 1, n_kv, D + pad, dtype=dtype, device=device)
    sink_k[..., D] = 1
    sink_v = torch.zeros(B, 1, n_kv, v.shape[-1], dtype=dtype, device=device)
    rows = max(1, SINK_CHUNK_ELEMS // max(1, B * g * (ctx + 1)))
    out = []
    for s0 in range(0, S, rows):
        s1 = min(S, s0 + rows)
        lo, hi = 0, ctx
        if step.start is not None:  # one sequence's consecutive positions: the keys this chunk can see
            hi = min(ctx, step.start + s1)
            if window is not None:
                lo = max(0, step.start + s0 - window + 1)
        kc = torch.cat((k[:, lo:hi].to(dtype), torch.zeros(B, hi - lo, n_kv, pad, dtype=dtype, device=device)), dim=-1)
        kc = torch.cat((sink_k, kc), dim=1).transpose(1, 2)  # [B, kv_heads, 1 + L, D + pad]
        vc = torch.cat((sink_v, v[:, lo:hi].to(dtype)), dim=1).transpose(1, 2)
        pos = step.positions[:, s0:s1].unsqueeze(-1)  # [B, Sc, 1]
        kpos = torch.arange(lo, hi, device=device)
        seen = kpos <= pos
        if window is not None:
            seen &= kpos > pos - window
        seen = torch.cat((torch.ones_like(seen[..., :1]), seen), dim=-1)  # [B, Sc, 1 + L]: the sink first
        Sc = s1 - s0
        mask = seen.unsqueeze(2).expand(B, Sc, g, seen.shape[-1]).reshape(B, 1, Sc * g, seen.shape[-1])
        qf = qx[:, s0:s1].reshape(B, Sc, n_kv, g, D + pad).transpose(1, 2).reshape(B, n_kv, Sc * g, D + pad)
        o = F.scaled_dot_product_attention(qf, kc, vc, attn_mask=mask, scale=scale)  # [B, kv_heads, Sc * g, Dv]
        out.append(o.reshape(B, n_kv, Sc, g, -1).transpose(1, 2).reshape(B, Sc, H, -1))
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


class GQAAttention(nn.Module):
    """Grouped-query attention with Hugging Face parameter names (q_proj, k_proj, v_proj, o_proj and, for
    Qwen3, per-head q_norm/k_norm applied before RoPE). Models subclass it under their own class names.

    Once ``fuse_projections`` has run (the loader calls it), q/k/v are one matmul; q and k then share one RMSNorm
    call and one RoPE (same rounding points as the separate calls)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, layer_idx: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv, self.head_dim = layer_idx, n_heads, n_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)
        self.qk_norm_eps = qk_norm_eps
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.qkv = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.qkv is None:  # once: the loader may have fused (and packed, load/dense.py) this layer already
            self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)  # [B, S, (H + 2K) * D]
        if step.fused:  # q/k norm + RoPE + the cache write in one kernel
            q = self._fused_epilogue(qkv, rope, step, cache)
            return self.o_proj(attend_cache(q, cache, self.layer_idx, step, D**-0.5).reshape(B, S, -1))
        qk = qkv[..., :(H + K) * D].view(B, S, H + K, D)
        v = qkv[..., (H + K) * D:].view(B, S, K, D)
        if self.qk_norm_eps is not None:  # RMSNorm's weight * normalised x, with a per-head weight [H + K, D]
            weight = torch.cat((self.q_norm.weight.expand(H, D), self.k_norm.weight.expand(K, D)))
            qk = weight * F.rms_norm(qk, (D,), eps=self.qk_norm_eps)
        qk = apply_rope(qk, *rope)
        q, k = qk.split((H, K), dim=2)
        cache.write(self.layer_idx, step, k, v)
        out = attend_cache(q, cache, self.layer_idx, step, D**-0.5)  # [B, S, heads, D]
        return self.o_proj(out.reshape(B, S, -1))

    def _fused_epilogue(self, qkv: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        from hetmoe.ops.triton.fused import qkv_epilogue

        norm = self.qk_norm_eps is not None
        k, v, table, page = cache.layout(self.layer_idx)
        return qkv_epilogue(qkv, self.n_heads, self.n_kv, self.q_norm.weight if norm else None,
                            self.k_norm.weight if norm else None, self.qk_norm_eps or 0.0, *rope, k, v, table, page,
                            step.slots, step.positions)
