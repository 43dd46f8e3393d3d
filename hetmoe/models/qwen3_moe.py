"""Qwen3-MoE (model_type "qwen3_moe"): GQA attention with q/k RMSNorm, softmax top-k routed experts.

The routed experts sit behind the MoE layer ``mlp.moe`` (hetmoe/moe/), attached by whoever loads the weights; this
file never sees where they run or in what format.
"""

from __future__ import annotations

from hetmoe.layers.attention import GQAAttention
from hetmoe.models.common import (
    CausalLM,
    DecoderModel,
    PreNormDecoderLayer,
    SoftmaxMoeBlock,
    SwiGLUMLP,
    qwen_layer_is_sparse,
)
from hetmoe.models.config import ModelConfig


class Qwen3MoeMLP(SwiGLUMLP):
    """Dense SwiGLU MLP (layers listed in mlp_only_layers)."""


class Qwen3MoeSparseMoeBlock(SoftmaxMoeBlock):
    """softmax top-k, renormalised if norm_topk_prob."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.first("num_experts", "num_local_experts"), cfg.get("norm_topk_prob", False))


class Qwen3MoeAttention(GQAAttention):
    """GQA with per-head q/k RMSNorm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        bias = cfg.get("attention_bias", False)
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx, qkv_bias=bias, o_bias=bias, qk_norm_eps=cfg.rms_norm_eps)


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        sparse = qwen_layer_is_sparse(cfg, layer_idx)
        mlp = Qwen3MoeSparseMoeBlock(cfg) if sparse else Qwen3MoeMLP(cfg.hidden_size, cfg.intermediate_size)
        super().__init__(cfg, Qwen3MoeAttention(cfg, layer_idx), mlp)


class Qwen3MoeModel(DecoderModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    model_cls = Qwen3MoeModel
