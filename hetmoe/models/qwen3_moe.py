"""Qwen3-MoE (model_type "qwen3_moe"): GQA attention with q/k RMSNorm, softmax top-k routed experts.

The routed experts are an *experts backend* (``hetmoe.kernels.CPUExperts`` or ``hetmoe.layers.moe.TorchExperts``)
attached to ``mlp.experts`` by whoever loads the weights; this file never sees their format.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.attention import GQAAttention
from hetmoe.layers.moe import route_softmax
from hetmoe.models.common import (
    CausalLM,
    DecoderModel,
    PreNormDecoderLayer,
    SwiGLUMLP,
    qwen_layer_is_sparse,
)
from hetmoe.models.config import ModelConfig


class Qwen3MoeMLP(SwiGLUMLP):
    """Dense SwiGLU MLP (layers listed in mlp_only_layers)."""


class Qwen3MoeSparseMoeBlock(nn.Module):
    """route (softmax top-k) -> experts backend (dispatch, experts, combine)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.first("num_experts", "num_local_experts"), bias=False)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.get("norm_topk_prob", False)
        self.experts = None  # attached by the loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, ids = route_softmax(self.gate(flat), self.top_k, self.norm_topk_prob)  # [T, k]
        return self.experts(flat, ids, weights).view_as(x)


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
