"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer picks, for each query, the
``index_topk`` cached positions it attends to, and MLA (models/deepseek_v2.py) attends over those alone.

The indexer (Transformers' DeepseekV32Indexer, under its parameter names), for a query token s and a cached position t:

    q = wq_b(q_resid)            [B, S, Hi, Di]   q_resid: MLA's q_a_layernorm(q_a_proj(x))
    k = k_norm(wk(x))            [B, S, Di]       a LayerNorm with bias (eps 1e-6); one key per position, cached
    RoPE turns the first qk_rope_head_dim dims of q and k (the model's table; DeepSeek-V3.2 half-split, GLM-5
    interleaved pairs)
    w = weights_proj(x) / sqrt(Hi)                         [B, S, Hi], fp32
    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] / sqrt(Di))   fp32, for t <= position(s)

and keeps the min(index_topk, positions) best t per query. DeepSeek's reference code rotates q and k by a Hadamard
transform and scores in FP8; Transformers leaves both out (the transform keeps dot products; FP8 is for speed), and
so does hetmoe.

While every query's context holds at most index_topk positions (a prompt shorter than that, and its decode until
then) the choice is every position: attention is MLA's own, dense, and the indexer only writes its keys, which the
cache keeps from the first token (layers/kv_cache.py ``indexer``) for when the context grows. Past that,
``select`` gives each query its positions ([B, S, k]) and which of them are real (a query with fewer than k
positions gets padding picks, masked), and attention runs over those positions only:

* a few query tokens per sequence (decode): the selected latents are gathered, [B, S, k, r + rope], and MLA's
  absorbed form attends over them (``sparse_latent_attention``);
* a prefill chunk: MLA's expanded form with a mask of the selected positions, made per block of queries
  (``sparse_masked_attention``: SDPA over the expanded keys and values).

Both are plain PyTorch, on the CPU and on a GPU: a fused sparse kernel (FlashMLA's sparse decode and prefill, or
one of ours) is a later step. Scores are made per block of queries so that their [B, s, Hi, ctx] fp32 intermediate
stays bounded (``BLOCK_ELEMS``).

Shape letters: Hi indexer heads, Di their size, k the positions kept per query, h attention heads, r the latent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import GROW_ALIGN, KVCache

BLOCK_ELEMS = 1 << 24  # fp32 elements of one block's scores [B, s, heads, ctx]: 64 MiB


@dataclass
class Selection:
    """The cached positions each query attends to: ``index`` [B, S, k] int64 (row positions in the cache),
    ``valid`` [B, S, k] bool (False: a padding pick of a query with fewer than k positions)."""

    index: torch.Tensor
    valid: torch.Tensor


class SparseCall:
    """What the sparse-attention layers of one forward call share: whether the call is dense (every query's
    context within ``topk``), how many cache positions the sparse path reads, and the latest layer's
    ``selection`` (GLM-5's layers that reuse the previous indexer's choice read it)."""

    def __init__(self, step: Step, topk: int):
        self.step, self.topk = step, topk
        self.selection: Optional[Selection] = None
        self._top: Optional[int] = None
        self._rows: Optional[Step] = None

    @property
    def top(self) -> int:
        """The largest position of the call + 1: read once per call (a device sync on a GPU; never in a captured
        step)."""
        if self._top is None:
            self._top = int(self.step.positions.max()) + 1
        return self._top

    @property
    def dense(self) -> bool:
        """Every query attends to at most ``topk`` positions: the selection would be all of them. A captured step
        decides by its kv_len alone (the graph decoder makes it at most topk exactly while every position is:
        ``sparse_kv_len``); past topk the selection of a shorter context is all its positions, the same attention."""
        kv = self.step.kv_len
        if self.step.captured:
            return kv <= self.topk
        return (kv is not None and kv <= self.topk) or self.top <= self.topk

    def rows_step(self) -> Step:
        """The step whose ``kv_len`` bounds the cache rows the sparse path reads: the positions in use, rounded up to
        GROW_ALIGN (within the runner's own bound; a decoder step may give the whole max_context); a captured step's
        own kv_len."""
        if self.step.captured:
            return self.step
        if self._rows is None:
            need = -(-self.top // GROW_ALIGN) * GROW_ALIGN
            kv = self.step.kv_len
            self._rows = dataclasses.replace(self.step, kv_len=need if kv is None else min(kv, need))
        return self._rows


class LightningIndexer(nn.Module):
    """The DSA indexer of one attention layer (module docstring), Transformers' names: wq_b [Hi * Di, q_lora_rank],
    wk [Di, hidden], k_norm (LayerNorm Di), weights_proj [Hi, hidden]. ``index_layer``: its rows in the cache's
    indexer keys; ``rope_fn(x, cos, sin)``: the model's rotation of the first ``rope_dim`` dims."""

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int,
                 index_layer: int, rope_fn: Callable):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.index_layer, self.rope_fn = index_layer, rope_fn
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)
        self.scale = head_dim**-0.5

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        R = self.rope_dim
        return torch.cat((self.rope_fn(x[..., :R], cos, sin), x[..., R:]), dim=-1)

    def keys(self, x: torch.Tensor, rope: tuple) -> torch.Tensor:
        """x [B, S, hidden] -> the positions' keys [B, S, Di] (normalised, turned)."""
        return self._rotate(self.k_norm(self.wk(x)), *rope)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple) -> tuple:
        """-> (q [B, S, Hi, Di] turned, w [B, S, Hi] fp32 head weights / sqrt(Hi))."""
        B, S, _ = x.shape
        cos, sin = (t.unsqueeze(2) for t in rope)
        q = self._rotate(self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim), cos, sin)
        proj = self.weights_proj
        # fp32 as Transformers keeps it; a packed weights_proj (a dense format) computes in its own
        w = F.linear(x.float(), proj.weight.float()) if isinstance(proj, nn.Linear) else proj(x).float()
        return q, w * self.n_heads**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, rope: tuple, step: Step, cache: KVCache,
                call: SparseCall) -> Optional[Selection]:
        """Write this call's keys to the cache; the selection of its queries, or None when the call is dense."""
        cache.write_index(self.index_layer, step, self.keys(x, rope))
        if call.dense:
            return None
        q, w = self.queries(x, q_resid, rope)
        keys = cache.index_rows(self.index_layer, call.rows_step())  # [B, ctx, Di]
        return select(q, w, keys, step.positions, self.topk, self.scale)


def _blocks(S: int, per_row: int):
    """Query blocks [s0, s1) of S whose per-row cost is ``per_row`` elements, each within BLOCK_ELEMS."""
    n = max(1, BLOCK_ELEMS // max(1, per_row))
    return ((s0, min(S, s0 + n)) for s0 in range(0, S, n))


def select(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, topk: int,
           scale: float) -> Selection:
    """The indexer's choice: q [B, S, Hi, Di], w [B, S, Hi] fp32, the cached keys [B, ctx, Di] and each query's
    position [B, S] -> the min(topk, ctx) best positions t <= position per query (module docstring), fp32."""
    B, S, H, _ = q.shape
    ctx = keys.shape[1]
    k = min(topk, ctx)
    kt = keys.float().transpose(1, 2).unsqueeze(1)  # [B, 1, Di, ctx]
    cols = torch.arange(ctx, device=q.device)
    index = torch.empty(B, S, k, dtype=torch.int64, device=q.device)
    valid = torch.empty(B, S, k, dtype=torch.bool, device=q.device)
    for s0, s1 in _blocks(S, B * H * ctx):
        scores = torch.matmul(q[:, s0:s1].float(), kt).mul_(scale).relu_()  # [B, s, Hi, ctx]
        total = torch.matmul(w[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)  # [B, s, ctx]
        total.masked_fill_(cols > positions[:, s0:s1, None], float("-inf"))  # causal
        top = total.topk(k, dim=-1)
        index[:, s0:s1] = top.indices
        valid[:, s0:s1] = top.values > float("-inf")
    return Selection(index, valid)


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [B, ctx, D] at index [B, S, k] -> [B * S, k, D]."""
    B, ctx, D = rows.shape
    flat = index + torch.arange(B, device=index.device).view(B, 1, 1) * ctx  # [B, S, k]
    return rows.reshape(B * ctx, D)[flat.reshape(-1)].view(-1, index.shape[-1], D)


def sparse_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, pe: torch.Tensor,
                            sel: Selection, scale: float) -> torch.Tensor:
    """MLA's absorbed form over the selected positions: q_lat [B, S, h, r], q_pe [B, S, h, rope] against the cached
    latents c [B, ctx, r] and rope keys pe [B, ctx, rope] at ``sel`` -> [B, S, h, r] (in c's dtype)."""
    return selected_latent_attention(q_lat, q_pe, _gather(c, sel.index), _gather(pe, sel.index), sel.valid, scale)


def selected_latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, c_sel: torch.Tensor, pe_sel: torch.Tensor,
                              valid: torch.Tensor, scale: float) -> torch.Tensor:
    """MLA's absorbed form over the selected latents c_sel [B * S, k, r] and rope keys pe_sel [B * S, k, rope]
    (``valid`` [B, S, k]: False for padding picks) -> [B, S, h, r] (in c_sel's dtype). Scores as the dense form
    makes them: q_lat . c + q_pe . k_pe in the model dtype, softmax in fp32."""
    B, S, h, r = q_lat.shape
    k = valid.shape[-1]
    scores = (q_lat.reshape(B * S, h, r) @ c_sel.transpose(1, 2)
              + q_pe.reshape(B * S, h, -1) @ pe_sel.transpose(1, 2))  # [B * S, h, k]
    scores = scores.float() * scale
    scores.masked_fill_(~valid.view(B * S, 1, k), float("-inf"))
    probs = scores.softmax(dim=-1).to(c_sel.dtype)
    return (probs @ c_sel).view(B, S, h, r)


def sparse_kv_len(max_position: int, topk: int, max_context: int) -> int:
    """A decode step's kv_len for a sparse-attention model under CUDA graphs (engine/cuda_graph.py): at most
    ``topk`` exactly while every position is below topk (``SparseCall.dense`` then), else the next power of two
    above the largest position (at most max_context): a few graphs per batch size, and the indexer scores about
    the context in use, not max_context."""
    n = max_position + 1
    if n <= topk:
        return min(topk, max_context)
    return min(max_context, 1 << (n - 1).bit_length())


def sparse_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sel: Selection,
                            scale: float) -> torch.Tensor:
    """q [B, S, h, D] over per-head keys k [B, ctx, h, D] and values v [B, ctx, h, Dv], each query restricted to
    its selected positions -> [B, S, h, Dv]. One boolean mask [B, s, ctx] per block of queries, SDPA."""
    B, S, h, _ = q.shape
    ctx = k.shape[1]
    kt, vt = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # [B, h, ctx, D | Dv]
    out = q.new_empty(B, S, h, v.shape[-1])
    for s0, s1 in _blocks(S, B * h * ctx):
        mask = torch.zeros(B, s1 - s0, ctx, dtype=torch.bool, device=q.device)
        mask.scatter_(2, sel.index[:, s0:s1], sel.valid[:, s0:s1])  # True: attended
        o = F.scaled_dot_product_attention(q[:, s0:s1].transpose(1, 2), kt, vt, attn_mask=mask.unsqueeze(1),
                                           scale=scale)  # [B, h, s, Dv]
        out[:, s0:s1] = o.transpose(1, 2)
    return out
