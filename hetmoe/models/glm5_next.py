"""GLM-5.3-Flash (model_type "glm5_next", its language model "glm5_next_text"), as Transformers' Glm5Next classes
define it: a hybrid of Kimi Delta Attention and NoPE MLA with a pooled DSA indexer, mHC residual streams, and
DeepSeek-V3-style MoE with clamped SwiGLU experts.

* ``layer_types`` (models/config.py ``glm5_next_config``: default every 4th layer indexed attention):
  "linear_attention" layers run KDA (hetmoe/layers/linear_attention.py ``KimiDeltaAttention``: a fixed-size state
  per sequence, the channel-wise forget gate); "indexed_attention" layers run MLA (models/deepseek_v2.py) without
  RoPE (qk_rope_head_dim 0: the latent c_kv alone is cached, keys and values are W_uk c / W_uv c) over the positions
  the indexer picks.
* The pooled indexer (``PooledIndexer``): DeepSeek-V3.2's lightning indexer (layers/sparse_attention.py) scores
  pools, not positions. The cached positions are cut into pools of ``index_kpool`` from position 0; a pool's key is
  the per-channel softmax-weighted mean of its positions' keys, the weights softmax_j(gate[j] + ape[j]) from each
  position's gate = index_kpool_compress_gate x and a learned offset per place in the pool. A query at position s
  scores the complete pools that end at or before s (sum_h w_h relu(q_h . pool_key / sqrt(Di))), keeps the best
  index_topk / index_kpool of them, all their positions, and always the incomplete last pool's positions up to s.
  So a query attends to every position while s + 1 < index_topk + index_kpool (dense MLA then); the cache keeps
  each position's key and gate beside the latents (layers/kv_cache.py ``indexer``, 2 x index_head_dim).
* ``indexer_types``: an indexed layer "shared" attends over the choice of the layer just before it (which must run
  its own: check_config), no indexer weights of its own.
* Residual (hetmoe/layers/hyper_connection.py): hc_mult streams mixed around every block (``attn_hc``, ``ffn_hc``),
  collapsed at the end by their plain mean (DeepSeek-V4's head is a learned mixing) before the final norm.
* MLP per ``mlp_layer_types``: dense (clamped SwiGLU, intermediate_size), or routed experts behind ``mlp.moe``
  (sigmoid group-limited routing as DeepSeek-V3 / GLM-4.5, their clamped SwiGLU carried as the MoE layer's
  activation: CPU engine only, as DeepSeek-V4's) plus clamped shared experts.

Checkpoints (Transformers' save_pretrained writes the same): the hyper-connections as ``hc_attn_fn`` etc., read as
``attn_hc.fn`` (``checkpoint_name``); KDA's forget gate and convolution under their stored names. The
multi-token-prediction layer (model.layers.<num_hidden_layers>.*) is not built, so never read; a multimodal
checkpoint's vision tower neither (models/config.py MULTIMODAL). Decode runs this eager forward (on a GPU for its
sparse attention, on the CPU for its recurrent states: engine/runner.py).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import Step, attend, cpu_decode
from hetmoe.layers.hyper_connection import HyperConnection, mix_streams
from hetmoe.layers.kv_cache import KVCache, RecurrentStates
from hetmoe.layers.linear_attention import KimiDeltaAttention
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.sparse_attention import Selection, SparseCall, sparse_masked_attention
from hetmoe.layers.widen import linear
from hetmoe.models.common import CausalLM
from hetmoe.models.config import ModelConfig, glm5_next_config
from hetmoe.models.deepseek_v2 import DeepseekV3Attention, DeepseekV3MoE, per_head
from hetmoe.models.deepseek_v4 import ClampedMLP, clamped_glu
from hetmoe.moe import MoELayer

LINEAR = "linear_attention"
# the checkpoint's names (GLM's release, and what Transformers' save_pretrained writes back) -> the model's
ORIGINAL_NAMES = [(re.compile(a), b) for a, b in (
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"), (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.self_attn\.forget_gate\.", ".self_attn."))]


def checkpoint_name(name: str) -> str:
    for pattern, new in ORIGINAL_NAMES:
        name = pattern.sub(new, name)
    return name


class Glm5NextMoE(DeepseekV3MoE):
    """Sigmoid group-limited routing (DeepSeek-V3's router), clamped SwiGLU routed and shared experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.moe = MoELayer(self.gate.spec, cfg.n_routed_experts, glu=clamped_glu(cfg.swiglu_limit))
        n_shared = cfg.get("n_shared_experts") or 0
        self.shared_experts = (ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, cfg.swiglu_limit)
                               if n_shared else None)


class Glm5NextLinearAttention(KimiDeltaAttention):
    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__(cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                         cfg.rms_norm_eps, cfg.linear_lower_bound, state_index)


def pooled_select(q: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor, topk: int,
                  pool: int, ape: torch.Tensor, scale: float) -> Selection:
    """The pooled indexer's choice (module docstring): q [B, S, Hi, Di], w [B, S, Hi] fp32, the cached keys and gates
    packed [B, ctx, 2 Di], positions [B, S], ape [pool, Di] -> per query the positions of its best topk / pool
    complete visible pools and of its incomplete last pool: index [B, S, topk + pool - 1], valid. Every query has a
    real pick (its own position, or a pool ending there); a padding pick repeats the query's first real one."""
    B, S, H, Di = q.shape
    keys, gates = packed.split(Di, dim=-1)
    P = keys.shape[1] // pool
    grouped = keys[:, :P * pool].view(B, P, pool, Di)
    weights = (gates[:, :P * pool].view(B, P, pool, Di).float() + ape.float()).softmax(dim=2).to(keys.dtype)
    pool_keys = (weights * grouped).sum(dim=2).float().transpose(1, 2).unsqueeze(1)  # [B, 1, Di, P]
    ends = torch.arange(1, P + 1, device=q.device) * pool - 1  # each pool's last position
    k = min(topk // pool, P)
    chosen = torch.empty(B, S, k, dtype=torch.int64, device=q.device)
    real = torch.empty(B, S, k, dtype=torch.bool, device=q.device)
    n = max(1, (1 << 24) // max(1, B * H * P))  # queries per block: its [B, s, Hi, P] scores within 64 MiB
    for s0 in range(0, S, n):
        s1 = min(S, s0 + n)
        scores = torch.matmul(q[:, s0:s1].float(), pool_keys).mul_(scale).relu_()  # [B, s, Hi, P]
        total = torch.matmul(w[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)  # [B, s, P]
        total.masked_fill_(ends > positions[:, s0:s1, None], float("-inf"))  # pools not yet complete at s
        top = total.topk(k, dim=-1)
        chosen[:, s0:s1], real[:, s0:s1] = top.indices, top.values > float("-inf")
    offsets = torch.arange(pool, device=q.device)
    index = (chosen.unsqueeze(-1) * pool + offsets).flatten(2)  # [B, S, k * pool]
    valid = real.unsqueeze(-1).expand(B, S, k, pool).flatten(2)
    seen = positions + 1  # [B, S]
    tail_start = seen - seen % pool
    tail = tail_start.unsqueeze(-1) + offsets[:-1]  # [B, S, pool - 1]
    index, valid = torch.cat((index, tail), dim=-1), torch.cat((valid, tail <= positions.unsqueeze(-1)), dim=-1)
    first = index.gather(-1, valid.int().argmax(-1, keepdim=True))
    return Selection(torch.where(valid, index, first), valid)


class PooledIndexer(nn.Module):
    """The pooled DSA indexer of one MLA layer (module docstring), Transformers' names: wq_b [Hi Di, q_lora_rank],
    wk [Di, hidden], k_norm (LayerNorm Di), weights_proj [Hi, hidden], index_kpool_compress_ape [pool, Di],
    index_kpool_compress_gate [Di, hidden]. ``index_layer``: its rows in the cache's indexer entries."""

    def __init__(self, cfg: ModelConfig, index_layer: int):
        super().__init__()
        H, Di = cfg.index_n_heads, cfg.index_head_dim
        self.n_heads, self.head_dim, self.topk, self.pool = H, Di, cfg.index_topk, cfg.index_kpool
        self.index_layer = index_layer
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * Di, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, Di, bias=False)
        self.k_norm = nn.LayerNorm(Di, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, H, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.pool, Di))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(Di, cfg.hidden_size))
        self.scale = Di**-0.5

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, step: Step, cache: KVCache,
                call: SparseCall) -> Selection | None:
        """Write this call's keys and gates to the cache; the selection of its queries, or None when dense."""
        B, S, _ = x.shape
        gates = F.linear(x, self.index_kpool_compress_gate)
        cache.write_index(self.index_layer, step, torch.cat((self.k_norm(self.wk(x)), gates), dim=-1))
        if call.dense:
            return None
        q = self.wq_b(q_resid).view(B, S, self.n_heads, self.head_dim)
        w = self.weights_proj(x).float() * self.n_heads**-0.5  # (in the model dtype, as Transformers)
        packed = cache.index_rows(self.index_layer, call.rows_step())  # [B, ctx, 2 Di]
        return pooled_select(q, w, packed, step.positions, self.topk, self.pool, self.index_kpool_compress_ape,
                             self.scale)


class Glm5NextAttention(DeepseekV3Attention):
    """MLA without RoPE (the cache's "k" holds c_kv, its "v" nothing) and the pooled indexer (None in a "shared"
    layer). Dense while the call is (every query within index_topk + index_kpool - 1 positions): the absorbed form
    for a few tokens per sequence, else the expanded one; past that, the same two forms over the selection."""

    def __init__(self, cfg: ModelConfig, kv_index: int, index_layer):
        super().__init__(cfg, kv_index)
        self.q_a_layernorm.variance_epsilon = self.kv_a_layernorm.variance_epsilon = cfg.rms_norm_eps
        self.indexer = PooledIndexer(cfg, index_layer) if index_layer is not None else None

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache, call: SparseCall) -> torch.Tensor:
        B, S, _ = x.shape
        q_a, kv_a = self.q_kv_a.parts(x) if self.q_kv_a is not None else (self.q_a_proj(x), self.kv_a_proj_with_mqa(x))
        q_resid = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_resid).view(B, S, self.n_heads, self.nope)
        c_kv = self.kv_a_layernorm(kv_a).view(B, S, 1, self.kv_lora_rank)
        cache.write(self.layer_idx, step, c_kv, c_kv.new_empty(B, S, 1, 0))
        if self.indexer is not None:
            call.selection = self.indexer(x, q_resid, step, cache, call)
        sel = call.selection  # (a shared layer follows the full layer whose choice it reads: check_config)
        rows = step if sel is None else call.rows_step()
        if S <= self.absorb_max_tokens:
            out = self._latent(q, cache, step, rows, sel)
        else:
            out = self._expanded(q, cache, step, rows, sel)
        return self.o_proj(out.reshape(B, S, -1))  # out: [B, S, h, v_dim]

    def _latent(self, q, cache: KVCache, step: Step, rows: Step, sel) -> torch.Tensor:
        """Attention in the latent space, W_uk folded into the query and W_uv applied after -> [B, S, h, v_dim]."""
        B, S, h, _ = q.shape
        w_uk, w_vu = self._latent_weights()
        q_lat = per_head(q, w_uk, step)  # [B, S, h, r]
        decode = cpu_decode(q_lat, cache) if sel is None else None
        if decode:
            out = decode(q_lat[:, 0], cache.k[self.layer_idx], None, step.slots, step.positions[:, 0] + 1,
                         self.scale, v_is_k1=True).unsqueeze(1)
            return per_head(out, w_vu, step)
        if sel is None and cache.paged:
            from hetmoe.ops.triton import attention as triton_attention

            c, _ = cache.pages(self.layer_idx)
            slots = step.slots.unsqueeze(1).expand(B, S).reshape(-1)
            out = triton_attention.decode(q_lat.reshape(B * S, h, -1), c, None, cache.table, slots,
                                          step.positions.reshape(-1), self.scale, v_is_k1=True)
            return per_head(out.view(B, S, h, -1), w_vu, step)
        c = cache.rows(self.layer_idx, rows)[0].to(q.dtype).squeeze(2)  # [B, ctx, r]
        ctx, r = c.shape[1:]
        if sel is None:  # every position up to the query's
            scores = (q_lat.reshape(B, S * h, r) @ c.transpose(1, 2)).view(B, S, h, ctx).float() * self.scale
            scores = scores + step.attn_mask(ctx, scores.dtype).view(B, S, 1, ctx)
            out = (scores.softmax(dim=-1).to(c.dtype).view(B, S * h, ctx) @ c).view(B, S, h, r)
            return per_head(out, w_vu, step)
        k = sel.index.shape[-1]
        flat = sel.index + torch.arange(B, device=c.device).view(B, 1, 1) * ctx  # [B, S, k]
        c_sel = c.reshape(B * ctx, r)[flat.reshape(-1)].view(B * S, k, r)
        scores = (q_lat.reshape(B * S, h, r) @ c_sel.transpose(1, 2)).float() * self.scale  # [B S, h, k]
        scores.masked_fill_(~sel.valid.view(B * S, 1, k), float("-inf"))
        out = (scores.softmax(dim=-1).to(c_sel.dtype) @ c_sel).view(B, S, h, r)
        return per_head(out, w_vu, step)

    def _expanded(self, q, cache: KVCache, step: Step, rows: Step, sel) -> torch.Tensor:
        """Every attended latent expanded into per-head keys W_uk c and values W_uv c -> [B, S, h, v_dim]."""
        c = cache.rows(self.layer_idx, rows)[0].to(q.dtype)  # [B, ctx, 1, r]
        B, ctx = c.shape[:2]
        kv = linear(c, self.kv_b_proj.weight).view(B, ctx, self.n_heads, self.nope + self.v_dim)  # widened on the CPU
        k, v = kv.split([self.nope, self.v_dim], dim=-1)
        if sel is not None:  # (padding picks repeat a real one: the mask is the same)
            return sparse_masked_attention(q, k, v, Selection(sel.index, torch.ones_like(sel.valid)), self.scale)
        if cache.paged:  # the expanded rows as pages of an identity table
            from hetmoe.ops.triton import attention as triton_attention

            n, P = B * ctx // cache.page_size, cache.page_size
            table = torch.arange(n, dtype=torch.int32, device=c.device).view(B, ctx // P)
            return triton_attention.prefill(q, k.reshape(n, P, self.n_heads, -1), v.reshape(n, P, self.n_heads, -1),
                                            table, torch.arange(B, device=c.device), step.positions, self.scale)
        return attend(q, k, v, step, self.scale)


class Glm5NextDecoderLayer(nn.Module):
    """streams [B, S, n, H] -> attn_hc collapses them, self_attn (KDA or MLA) on input_layernorm(.), mixed back; the
    same with ffn_hc around mlp(post_attention_layernorm(.))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        kinds = cfg.layer_types
        rank = kinds[:layer_idx].count(kinds[layer_idx])  # among the layers of its kind: its cache row
        self.linear = kinds[layer_idx] == LINEAR
        if self.linear:
            self.self_attn = Glm5NextLinearAttention(cfg, rank)
        else:
            full = [i for i, k in enumerate(kinds) if k != LINEAR and cfg.indexer_types[i] == "full"]
            index_layer = full.index(layer_idx) if layer_idx in full else None
            self.self_attn = Glm5NextAttention(cfg, rank, index_layer)
        if cfg.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = Glm5NextMoE(cfg)
        else:
            self.mlp = ClampedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.swiglu_limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, step: Step, cache: KVCache, call: SparseCall) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        x = self.input_layernorm(x)
        out = self.self_attn(x, step, cache) if self.linear else self.self_attn(x, step, cache, call)
        streams = mix_streams(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        return mix_streams(streams, self.mlp(self.post_attention_layernorm(x)), post, comb)


class Glm5NextModel(nn.Module):
    """embed_tokens -> hc_mult copies -> layers -> the streams' mean -> norm, one SparseCall per forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.dense_limit = cfg.index_topk + cfg.index_kpool - 1  # positions a query sees before the choice bites
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        streams = x.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()  # [B, S, n, H]
        call = SparseCall(step, self.dense_limit)
        for layer in self.layers:
            streams = layer(streams, step, cache, call)
        return self.norm(streams.mean(dim=2))


class Glm5NextForCausalLM(CausalLM):
    model_cls = Glm5NextModel

    def __init__(self, cfg: ModelConfig):
        super().__init__(glm5_next_config(cfg))

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", **layout) -> KVCache:
        """The MLA layers' latents [.., 1, kv_lora_rank] (nothing for RoPE keys), the indexer's key and gate
        [.., 2 index_head_dim] of each layer with an indexer, and the KDA layers' RecurrentStates (a convolution
        window of W - 1 over q|k|v, a [Dk, Dv] state per head)."""
        cfg = self.config
        n_linear = cfg.layer_types.count(LINEAR)
        n_index = sum(getattr(layer.self_attn, "indexer", None) is not None for layer in self.model.layers)
        dim = cfg.linear_num_heads * cfg.linear_head_dim
        states = RecurrentStates(n_linear, max_batch, 3 * dim, cfg.linear_conv_kernel_dim - 1, cfg.linear_num_heads,
                                 cfg.linear_head_dim, cfg.linear_head_dim, dtype, device) if n_linear else None
        return KVCache(len(cfg.layer_types) - n_linear, max_batch, max_context, 1, cfg.kv_lora_rank, dtype, device,
                       v_head_dim=0, states=states, indexer=(n_index, 2 * cfg.index_head_dim), **layout)
