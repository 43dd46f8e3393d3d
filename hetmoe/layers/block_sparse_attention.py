"""MiniMax sparse attention (MiniMax-M3): GQA whose every query attends to a few *blocks* of keys that a small
lightning indexer picks, with Transformers' MiniMaxM3VLAttention / MiniMaxM3VLIndexer parameter names as the
checkpoint stores them (``index_q_proj``, ``index_k_proj``, ``index_q_norm``, ``index_k_norm`` on the attention).

Every layer: q/k/v projections, a per-head RMSNorm of q and k in the (1 + weight) form (``OffsetRMSNorm``), RoPE
over the leading rope dims of each head (half-split, the model's table), and GQA attention with scale D^-1/2. A
sparse layer ("minimax_m3_sparse") also runs its indexer, for a query at position p and a key position t:

    qi = index_q_norm(index_q_proj(x)) per indexer head    [B, S, Hi, Di]   RoPE'd with the same table
    ki = index_k_norm(index_k_proj(x))                     [B, S, Di]       one key per position, cached
    score[s, h, t]  = qi[s, h] . ki[t]  (fp32, no scale),  -inf for t > p
    block score     = max of its keys' scores over each block of ``block`` positions (block j: t in [j b, j b + b))
    the ``local`` blocks ending at the query's own (p // b, p // b - 1, ... clamped at 0) score +inf,
    and the ``topk`` best blocks with a finite score are kept: query s, in every attention head of indexer head h's
    group (heads / Hi attention heads each), attends to the keys t <= p of those blocks only.

While no query of a call has more than ``topk`` blocks in its past (positions < topk x block), every block is
kept: attention is the dense causal one, with its kernels (layers/attention.py ``attend_cache``); the indexer then
only writes its keys, which the KV cache holds from the first token on (layers/kv_cache.py ``indexer``: one key of
Di per position and sparse layer, cut back with the keys and values, so prefix reuse works). Past that, the
selection is made per block of queries (bounded fp32 scores, ``BLOCK_ELEMS``) and attention runs as SDPA over the
cached rows with a boolean mask of the selected blocks: plain PyTorch, on the CPU and on a GPU; a block-sparse
kernel that reads the selected blocks only is a later step.

Shape letters: H attention heads, K kv heads, D head size, Hi / Di the indexer's heads / head size, b the block size,
k the blocks kept per query, n the blocks of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import Step, attend_cache
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.norm import OffsetRMSNorm
from hetmoe.layers.rope import apply_rope
from hetmoe.layers.sparse_attention import SparseCall

BLOCK_ELEMS = 1 << 24  # fp32 elements of one block of queries' scores or mask: 64 MiB


@dataclass(frozen=True)
class BlockSparseShape:
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    sparse: bool = False  # whether the layer runs an indexer
    index_heads: int = 0
    index_dim: int = 0
    block: int = 0  # key positions per block
    topk: int = 0  # blocks kept per query
    local: int = 0  # blocks ending at the query's own that are always kept

    @property
    def dense_positions(self) -> int:
        """Contexts up to this many positions keep every block: attention is dense."""
        return self.topk * self.block


def _query_blocks(S: int, per_row: int):
    n = max(1, BLOCK_ELEMS // max(1, per_row))
    return ((s0, min(S, s0 + n)) for s0 in range(0, S, n))


def select_blocks(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, block: int, topk: int,
                  local: int) -> torch.Tensor:
    """The indexer's choice (module docstring): q [B, S, Hi, Di], the cached keys [B, ctx, Di] (positions past a
    query's own are masked, whatever they hold) and each query's position [B, S] -> the kept blocks [B, S, Hi,
    min(topk, n)] int64, -1 where a query has fewer blocks in its past."""
    B, S, Hi, _ = q.shape
    ctx = keys.shape[1]
    n = -(-ctx // block)
    k = min(topk, n)
    kt = keys.float().transpose(1, 2).unsqueeze(1)  # [B, 1, Di, ctx]
    cols = torch.arange(ctx, device=q.device)
    out = torch.empty(B, S, Hi, k, dtype=torch.int64, device=q.device)
    for s0, s1 in _query_blocks(S, B * Hi * n * block):
        pos = positions[:, s0:s1]  # [B, s]
        scores = torch.matmul(q[:, s0:s1].float(), kt)  # [B, s, Hi, ctx]
        scores = scores.masked_fill((cols > pos.unsqueeze(-1)).unsqueeze(2), float("-inf"))
        if n * block > ctx:
            scores = F.pad(scores, (0, n * block - ctx), value=float("-inf"))
        best = scores.view(B, s1 - s0, Hi, n, block).amax(dim=-1)  # [B, s, Hi, n]
        if local > 0:
            own = pos // block  # [B, s]
            near = (own.unsqueeze(-1) - torch.arange(local, device=q.device)).clamp(min=0)  # [B, s, local]
            best.scatter_(-1, near.unsqueeze(2).expand(-1, -1, Hi, -1), float("inf"))
        top = best.topk(k, dim=-1)
        out[:, s0:s1] = top.indices.masked_fill(top.values == float("-inf"), -1)
    return out


def block_sparse_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor,
                        positions: torch.Tensor, block: int, scale: float) -> torch.Tensor:
    """q [B, S, H, D] over the cached rows k / v [B, ctx, K, D], each query restricted to the keys t <= its position
    of its indexer head's kept ``blocks`` [B, S, Hi, k] (-1: none) -> [B, S, H, D]. One boolean mask per block of
    queries, SDPA (the H / Hi heads of an indexer head share its mask)."""
    B, S, H, _ = q.shape
    ctx, Hi = k.shape[1], blocks.shape[2]
    n = -(-ctx // block)
    kt, vt = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # [B, K, ctx, D]
    cols = torch.arange(ctx, device=q.device)
    out = q.new_empty(B, S, H, v.shape[-1])
    for s0, s1 in _query_blocks(S, B * H * ctx):
        sel = blocks[:, s0:s1]  # [B, s, Hi, k]
        kept = torch.zeros(B, s1 - s0, Hi, n + 1, dtype=torch.bool, device=q.device)
        kept.scatter_(-1, sel.masked_fill(sel < 0, n), True)  # -1 lands in the dropped column n
        mask = kept[..., :n].repeat_interleave(block, dim=-1)[..., :ctx]  # [B, s, Hi, ctx]
        mask &= (cols <= positions[:, s0:s1].unsqueeze(-1)).unsqueeze(2)
        mask = mask.transpose(1, 2).repeat_interleave(H // Hi, dim=1)  # [B, H, s, ctx]
        o = F.scaled_dot_product_attention(q[:, s0:s1].transpose(1, 2), kt, vt, attn_mask=mask, scale=scale,
                                           enable_gqa=H != kt.shape[1])
        out[:, s0:s1] = o.transpose(1, 2)
    return out


class BlockSparseAttention(nn.Module):
    """One MiniMax-M3 attention layer (module docstring). ``index_layer``: its rows among the cache's indexer keys
    (sparse layers only). forward(x [B, S, hidden], rope (cos, signed sin) of the model's table, step, cache, call:
    the forward call's ``SparseCall`` (topk x block positions)) -> [B, S, hidden]."""

    def __init__(self, shape: BlockSparseShape, layer_idx: int, index_layer: int = 0):
        super().__init__()
        self.shape, self.layer_idx, self.index_layer = shape, layer_idx, index_layer
        H, K, D = shape.n_heads, shape.n_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(shape.hidden, H * D, bias=False)
        self.k_proj = nn.Linear(shape.hidden, K * D, bias=False)
        self.v_proj = nn.Linear(shape.hidden, K * D, bias=False)
        self.o_proj = nn.Linear(H * D, shape.hidden, bias=False)
        self.q_norm = OffsetRMSNorm(D, shape.eps)
        self.k_norm = OffsetRMSNorm(D, shape.eps)
        if shape.sparse:
            self.index_q_proj = nn.Linear(shape.hidden, shape.index_heads * shape.index_dim, bias=False)
            self.index_k_proj = nn.Linear(shape.hidden, shape.index_dim, bias=False)
            self.index_q_norm = OffsetRMSNorm(shape.index_dim, shape.eps)
            self.index_k_norm = OffsetRMSNorm(shape.index_dim, shape.eps)
        self.qkv = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.qkv is None:
            self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache, call: SparseCall) -> torch.Tensor:
        B, S, _ = x.shape
        H, K, D = self.shape.n_heads, self.shape.n_kv_heads, self.shape.head_dim
        q, k, v = self.qkv.parts(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = apply_rope(self.q_norm(q.view(B, S, H, D)), *rope)
        k = apply_rope(self.k_norm(k.view(B, S, K, D)), *rope)
        v = v.view(B, S, K, D)
        cache.write(self.layer_idx, step, k, v)
        if not self.shape.sparse or call.dense:
            if self.shape.sparse:
                cache.write_index(self.index_layer, step, self._index_keys(x, rope))
            out = attend_cache(q, cache, self.layer_idx, step, D**-0.5)
            return self.o_proj(out.reshape(B, S, -1))
        cache.write_index(self.index_layer, step, self._index_keys(x, rope))
        rows = call.rows_step()
        qi = self.index_q_norm(self.index_q_proj(x).view(B, S, self.shape.index_heads, self.shape.index_dim))
        qi = apply_rope(qi, *rope)
        blocks = select_blocks(qi, cache.index_rows(self.index_layer, rows), step.positions, self.shape.block,
                               self.shape.topk, self.shape.local)
        k_all, v_all = cache.rows(self.layer_idx, rows)
        out = block_sparse_attend(q, k_all, v_all, blocks, step.positions, self.shape.block, D**-0.5)
        return self.o_proj(out.reshape(B, S, -1))

    def _index_keys(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """x [B, S, hidden] -> the positions' indexer keys [B, S, Di] (normalised, RoPE'd)."""
        B, S, _ = x.shape
        ki = self.index_k_norm(self.index_k_proj(x).view(B, S, 1, self.shape.index_dim))
        return apply_rope(ki, *rope).view(B, S, -1)
