"""DeepSeek-V3.2 (model_type "deepseek_v32"): DeepSeek-V3 (models/deepseek_v2.py: MLA, sigmoid group-limited
routing, shared experts) with DeepSeek Sparse Attention in every layer: a lightning indexer (``self_attn.indexer``,
hetmoe/layers/sparse_attention.py) picks the ``index_topk`` cached positions each query attends to.

As Transformers' DeepseekV32 classes have it:

* MLA always rotates interleaved pairs (``rope_interleave`` is not a V3.2 entry: config.json saying false is
  refused); the indexer turns the first qk_rope_head_dim dims of its heads half-split (``rotate_half``), with the
  same cos/sin table (YaRN attention factor included);
* the indexer reads q_resid = q_a_layernorm(q_a_proj(x)), so q_lora_rank is required;
* dense or MoE per layer from ``mlp_layer_types`` ("dense" / "sparse"), else first_k_dense_replace (default 3);
* the multi-token-prediction layer of a checkpoint (model.layers.<num_hidden_layers>.*) is not built, so never read.

The cache (``make_cache``) holds MLA's latents as DeepSeek-V3's does, and the indexer's key of every position of
every indexer layer beside them (layers/kv_cache.py ``indexer``). The forward threads one ``SparseCall`` through the
layers: a call whose every query sees at most index_topk positions runs dense MLA (the indexer writes its keys only);
past that each layer attends over its indexer's selection. The decode step runs this eager forward on every
placement: no CUDA graph or fused kernels yet, nor the lean CPU step (said at load, engine/runner.py).
"""

from __future__ import annotations

import torch

from hetmoe.layers.attention import Step
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.sparse_attention import (
    LightningIndexer,
    SparseCall,
    selected_latent_attention,
    sparse_masked_attention,
)
from hetmoe.layers.widen import linear
from hetmoe.models.config import ModelConfig, dsa_indexer_types
from hetmoe.models.deepseek_v2 import (
    ROPE_FORMS,
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3Model,
    per_head,
)

ROPE_BY_FORM = {form: fn for fn, form in ROPE_FORMS.items()}  # "half", "interleave", "complex" -> rotation


class DeepseekV32Attention(DeepseekV3Attention):
    """MLA plus its lightning indexer (``indexer``; None in a layer that reuses the previous indexer's choice,
    GLM-5's "shared" layers). Dense while the call is (``SparseCall.dense``): DeepSeek-V3's forms and kernels as
    they are; past that, the same projections and cache writes, then attention over the selected positions."""

    indexer_rope = staticmethod(ROPE_BY_FORM["half"])  # the indexer's rotation of its rope dims

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)  # MLA's rope_fn: interleaved (config.json cannot say otherwise: check_config)
        kinds = dsa_indexer_types(cfg)
        self.indexer = None
        if kinds[layer_idx] == "full":
            self.indexer = LightningIndexer(cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim,
                                            cfg.qk_rope_head_dim, cfg.index_topk,
                                            kinds[:layer_idx].count("full"), self.indexer_rope)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache, call: SparseCall) -> torch.Tensor:
        B, S, _ = x.shape
        q_a, kv_a = self.q_kv_a.parts(x) if self.q_kv_a is not None else (self.q_a_proj(x), self.kv_a_proj_with_mqa(x))
        q_resid = self.q_a_layernorm(q_a)
        q_nope, q_pe = self._epilogue(self.q_b_proj(q_resid), kv_a, rope, step, cache)
        if self.indexer is not None:
            call.selection = self.indexer(x, q_resid, rope, step, cache, call)
        if call.selection is None:  # (config checks: a layer without an indexer follows one that has)
            dense = self._attend_absorbed if S <= self.absorb_max_tokens else self._attend_expanded
            out = dense(q_nope, q_pe, cache, step)
        else:
            out = self._attend_selected(q_nope, q_pe, cache, call)
        return self.o_proj(out.reshape(B, S, -1))  # out: [B, S, h, v_dim]

    def _attend_selected(self, q_nope, q_pe, cache: KVCache, call: SparseCall) -> torch.Tensor:
        """Attention over ``call.selection`` only -> [B, S, h, v_dim]: absorbed over the gathered latents for a few
        query tokens per sequence, else expanded with a mask of the selected positions."""
        B, S, h, _ = q_nope.shape
        sel = call.selection
        if S <= self.absorb_max_tokens:  # the selected positions' latents alone read from the cache
            c_sel, pe_sel = (t.to(q_nope.dtype).view(B * S, t.shape[2], -1)
                             for t in cache.rows_at(self.layer_idx, call.step, sel.index))  # [B * S, k, r | rope]
            w_uk, w_vu = self._latent_weights()
            q_lat = per_head(q_nope, w_uk, call.step)  # [B, S, h, r]
            out_lat = selected_latent_attention(q_lat, q_pe, c_sel, pe_sel, sel.valid, self.scale)
            return per_head(out_lat, w_vu, call.step)
        c_all, pe_all = (t.to(q_nope.dtype) for t in cache.rows(self.layer_idx, call.rows_step()))  # [B, ctx, 1, ..]
        ctx = c_all.shape[1]
        kv = linear(c_all, self.kv_b_proj.weight).view(B, ctx, h, self.nope + self.v_dim)
        k, v = self._split_expanded(kv, pe_all)
        return sparse_masked_attention(torch.cat((q_nope, q_pe), dim=-1), k, v, call.selection, self.scale)


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    attn_cls = DeepseekV32Attention

    @staticmethod
    def sparse(cfg: ModelConfig, layer_idx: int) -> bool:
        kinds = cfg.get("mlp_layer_types")
        if kinds is not None:
            return kinds[layer_idx] == "sparse"
        return DeepseekV3DecoderLayer.sparse(cfg, layer_idx)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache, call: SparseCall) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache, call)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, *args):
        raise NotImplementedError("sparse-attention layers have no fused decode step (their model's forward runs "
                                  "them eagerly)")


class DeepseekV32Model(DeepseekV3Model):
    """embed_tokens -> layers -> norm, with one ``SparseCall`` per forward shared by the layers. A fused step
    (``Step.fused``) runs the same eager layers."""

    layer_cls = DeepseekV32DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.index_topk = cfg.index_topk

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        rope = self.rope_table(step.positions, x.dtype)
        call = SparseCall(step, self.index_topk)
        for layer in self.layers:
            x = layer(x, rope, step, cache, call)
        return self.norm(x)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    model_cls = DeepseekV32Model
    # its decode steps read no device value on the host when the step says it is captured (SparseCall), so the
    # runner decodes it through CUDA graphs (kv_len from sparse_attention.sparse_kv_len)
    sparse_steps_captured = True

    @property
    def dense_positions(self) -> int:
        """Contexts up to this many positions attend to every position: dense MLA (SparseCall's topk)."""
        return self.model.index_topk

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", **layout) -> KVCache:
        """DeepSeek-V3's latent cache, plus the indexer keys [.., index_head_dim] of every layer with an indexer."""
        cfg = self.config
        n_index = sum(layer.self_attn.indexer is not None for layer in self.model.layers)
        return KVCache(cfg.num_hidden_layers, max_batch, max_context, 1, cfg.kv_lora_rank, dtype, device,
                       v_head_dim=cfg.qk_rope_head_dim, indexer=(n_index, cfg.index_head_dim), **layout)
