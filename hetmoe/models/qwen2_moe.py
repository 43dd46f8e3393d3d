"""Qwen2-MoE (model_type "qwen2_moe"): GQA attention with q/k/v bias (o_proj without), softmax top-k routed
experts plus a shared expert gated by ``sigmoid(shared_expert_gate(x))``.

The routed experts are an *experts backend* attached to ``mlp.experts`` by whoever loads the weights; the shared
expert is an ordinary dense MLP of this module (``mlp.shared_expert``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import GQAAttention, KVCache, Step
from hetmoe.layers.moe import route_softmax
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.rope import cos_sin, inv_frequencies
from hetmoe.models.config import ModelConfig


class Qwen2MoeMLP(nn.Module):
    """Dense SwiGLU MLP: the shared expert, and the MLP of non-sparse layers."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeSparseMoeBlock(nn.Module):
    """route (softmax top-k) -> experts backend, plus sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.first("num_experts", "num_local_experts"), bias=False)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.get("norm_topk_prob", False)
        self.experts = None  # attached by the loader
        self.shared_expert = Qwen2MoeMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, ids = route_softmax(self.gate(flat), self.top_k, self.norm_topk_prob)  # [T, k]
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (self.experts(flat, ids, weights) + shared).view_as(x)


class Qwen2MoeAttention(GQAAttention):
    """GQA with bias on q/k/v (config qkv_bias, default True), none on o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx, qkv_bias=cfg.get("qkv_bias", True), o_bias=False)


class Qwen2MoeDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Qwen2MoeAttention(cfg, layer_idx)
        n_experts = cfg.first("num_experts", "num_local_experts")
        sparse = (
            layer_idx not in cfg.get("mlp_only_layers", [])
            and n_experts > 0
            and (layer_idx + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        self.mlp = Qwen2MoeSparseMoeBlock(cfg) if sparse else Qwen2MoeMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise NotImplementedError("Qwen2-MoE with sliding-window attention is not supported")
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inv_frequencies(cfg.head_dim_or_default, cfg.rope_theta), persistent=False)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        rope = cos_sin(step.positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, step, cache)
        return self.norm(x)


class Qwen2MoeForCausalLM(nn.Module):
    """forward(ids, step, cache) -> hidden states [B, S, H]; logits(hidden) -> [B, S, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen2MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        return self.model(input_ids, step, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu") -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, max_batch, max_context, cfg.num_key_value_heads,
                       cfg.head_dim_or_default, dtype, device)
