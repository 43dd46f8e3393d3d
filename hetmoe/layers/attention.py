"""Attention over a preallocated KV cache, and the step metadata every model forward receives.

Shapes are static: the cache holds ``max_batch x max_context`` slots per layer, new keys/values are written
at their absolute positions, and a query at position p attends to cached positions <= p. Right-padded
batches are safe: a padding token writes slots that its sequence's real tokens never attend to and later
overwrite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Step:
    """What the runner tells a model about one forward call (prefill or decode)."""

    positions: torch.Tensor  # [B, S] int64: absolute position of each token of this call
    slots: torch.Tensor  # [B] int64: the cache row of each sequence


class KVCache:
    """Keys and values of every layer: [layers, max_batch, max_context, kv_heads, head_dim] each."""

    def __init__(self, n_layers: int, max_batch: int, max_context: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device="cpu", v_head_dim: int | None = None):
        self.max_context = max_context
        self.k = torch.zeros(n_layers, max_batch, max_context, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_layers, max_batch, max_context, kv_heads, v_head_dim or head_dim, dtype=dtype,
                             device=device)

    def write(self, layer: int, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple:
        """Store k/v [B, S, kv_heads, D] at their positions; return this layer's cache rows [B, ctx, kv, D]."""
        if int(step.positions.max()) >= self.max_context:
            raise ValueError(f"position {int(step.positions.max())} is beyond max_context={self.max_context}")
        rows = step.slots.unsqueeze(1).expand_as(step.positions)
        self.k[layer].index_put_((rows, step.positions), k.to(self.k.dtype))
        self.v[layer].index_put_((rows, step.positions), v.to(self.v.dtype))
        return self.k[layer][step.slots], self.v[layer][step.slots]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float) -> torch.Tensor:
    """q [B, S, heads, D] over cache rows k/v [B, ctx, kv_heads, D] -> [B, S, heads, Dv] (causal by position)."""
    ctx = k.shape[1]
    mask = torch.arange(ctx, device=q.device).view(1, 1, 1, ctx) <= step.positions.unsqueeze(1).unsqueeze(-1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype), attn_mask=mask,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
