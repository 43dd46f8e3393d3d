"""Attention over a preallocated KV cache, and the step metadata every model forward receives.

Shapes are static: the cache holds ``max_batch x max_context`` slots per layer, new keys/values are written
at their absolute positions, and a query at position p attends to cached positions <= p. Right-padded
batches are safe: a padding token writes slots that its sequence's real tokens never attend to and later
overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

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


class KVCache:
    """Keys and values of every layer: [layers, max_batch, max_context, kv_heads, head_dim] each."""

    def __init__(self, n_layers: int, max_batch: int, max_context: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu", v_head_dim: int | None = None):
        self.max_context = max_context
        self.k = torch.zeros(n_layers, max_batch, max_context, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_layers, max_batch, max_context, kv_heads, v_head_dim or head_dim, dtype=dtype,
                             device=device)

    def write(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Store k/v [B, S, kv_heads, D] at their positions; return this layer's cache rows [B, ctx, kv, D]
        (ctx = step.kv_len when given, else max_context; views, not copies, when step.first_slot is given)."""
        if step.kv_len is None and int(step.positions.max()) >= self.max_context:
            raise ValueError(f"position {int(step.positions.max())} is beyond max_context={self.max_context}")
        rows = step.slots.unsqueeze(1).expand_as(step.positions)
        self.k[layer].index_put_((rows, step.positions), k.to(self.k.dtype))
        self.v[layer].index_put_((rows, step.positions), v.to(self.v.dtype))
        n = step.kv_len or self.max_context
        if step.first_slot is not None:
            b = slice(step.first_slot, step.first_slot + step.slots.shape[0])
            return self.k[layer, b, :n], self.v[layer, b, :n]
        return self.k[layer][step.slots, :n], self.v[layer][step.slots, :n]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float) -> torch.Tensor:
    """q [B, S, heads, D] over cache rows k/v [B, ctx, kv_heads, D] -> [B, S, heads, Dv] (causal by position).

    The g = heads / kv_heads query heads that share a kv head (head h reads kv head h // g) are folded into the query
    length: q [B, kv_heads, S * g, D], row s * g + j, with the mask repeated per row (exact: the mask depends on the
    position only). SDPA then sees plain multi-head attention with an additive mask, which its fused kernels take
    (memory-efficient on CUDA, flash on the CPU); enable_gqa together with a mask would send it to the math
    fallback. For S = 1 the fold is a view of q."""
    B, S, H, D = q.shape
    ctx, n_kv = k.shape[1], k.shape[2]
    g = H // n_kv
    qf = q.reshape(B, S, n_kv, g, D).transpose(1, 2).reshape(B, n_kv, S * g, D)
    out = F.scaled_dot_product_attention(
        qf, k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=step.attn_mask(ctx, q.dtype, g),
        scale=scale,
    )  # [B, kv_heads, S * g, Dv]
    return out.reshape(B, n_kv, S, g, -1).transpose(1, 2).reshape(B, S, H, -1)


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
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)  # [B, S, (H + 2K) * D]
        qk = qkv[..., :(H + K) * D].view(B, S, H + K, D)
        v = qkv[..., (H + K) * D:].view(B, S, K, D)
        if self.qk_norm_eps is not None:  # RMSNorm's weight * normalised x, with a per-head weight [H + K, D]
            weight = torch.cat((self.q_norm.weight.expand(H, D), self.k_norm.weight.expand(K, D)))
            qk = weight * F.rms_norm(qk, (D,), eps=self.qk_norm_eps)
        qk = apply_rope(qk, *rope)
        q, k = qk.split((H, K), dim=2)
        k_all, v_all = cache.write(self.layer_idx, step, k, v)
        out = attend(q, k_all, v_all, step, D**-0.5)  # [B, S, heads, D]
        return self.o_proj(out.reshape(B, S, -1))
