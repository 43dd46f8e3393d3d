"""Qwen2-MoE (model_type "qwen2_moe"): GQA attention with q/k/v bias (o_proj without), softmax top-k routed
experts plus a shared expert gated by ``sigmoid(shared_expert_gate(x))``.

The routed experts sit behind the MoE layer ``mlp.moe`` (hetmoe/moe/), attached by whoever loads the weights; the
shared expert is an ordinary dense MLP of this module (``mlp.shared_expert``) that the layer adds.
"""

from __future__ import annotations

import torch
from torch import nn

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


class Qwen2MoeMLP(SwiGLUMLP):
    """Dense SwiGLU MLP: the shared expert, and the MLP of non-sparse layers."""


class Qwen2MoeSparseMoeBlock(SoftmaxMoeBlock):
    """softmax top-k, plus the sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.first("num_experts", "num_local_experts"), cfg.get("norm_topk_prob", False))
        self.shared_expert = Qwen2MoeMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared(self, flat: torch.Tensor, fused: bool = False) -> torch.Tensor:  # [T, H]
        return torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat, fused)


class Qwen2MoeAttention(GQAAttention):
    """GQA with bias on q/k/v (config qkv_bias, default True), none on o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx, qkv_bias=cfg.get("qkv_bias", True), o_bias=False)


class Qwen2MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        sparse = qwen_layer_is_sparse(cfg, layer_idx)
        mlp = Qwen2MoeSparseMoeBlock(cfg) if sparse else Qwen2MoeMLP(cfg.hidden_size, cfg.intermediate_size)
        super().__init__(cfg, Qwen2MoeAttention(cfg, layer_idx), mlp)


class Qwen2MoeModel(DecoderModel):
    layer_cls = Qwen2MoeDecoderLayer

    def __init__(self, cfg: ModelConfig):
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise NotImplementedError("Qwen2-MoE with sliding-window attention is not supported")
        super().__init__(cfg)


class Qwen2MoeForCausalLM(CausalLM):
    model_cls = Qwen2MoeModel
