"""Qwen3-MoE (model_type "qwen3_moe"): GQA attention with q/k RMSNorm, softmax top-k routed experts.

The routed experts are an *experts backend* (``hetmoe.kernels.CPUExperts`` or ``hetmoe.layers.moe.TorchExperts``)
attached to ``mlp.experts`` by whoever loads the weights; this file never sees their format.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.attention import GQAAttention, KVCache, Step
from hetmoe.layers.moe import route_softmax
from hetmoe.layers.norm import RMSNorm
from hetmoe.models.common import CausalLM, DecoderModel, SwiGLUMLP
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


class Qwen3MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen3MoeAttention(cfg, layer_idx)
        n_experts = cfg.first("num_experts", "num_local_experts")
        sparse = (
            layer_idx not in cfg.get("mlp_only_layers", [])
            and n_experts > 0
            and (layer_idx + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        self.mlp = Qwen3MoeSparseMoeBlock(cfg) if sparse else Qwen3MoeMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(DecoderModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(CausalLM):
    model_cls = Qwen3MoeModel
