"""Qwen3-Next (model_type "qwen3_next"): a hybrid of Gated DeltaNet linear attention and gated full attention, with
softmax top-k routed experts plus a sigmoid-gated shared expert.

``layer_types`` (or, in older config.json files, ``full_attention_interval``, default 4: every 4th layer) says which
layers mix tokens with what:

* ``linear_attention``: ``linear_attn``, Gated DeltaNet (hetmoe/layers/linear_attention.py: the rule, its chunked and
  recurrent forms, the convolution, the gated output norm). Qwen3-Next projects q|k|v|z with one matrix
  ``in_proj_qkvz`` and b|a with ``in_proj_ba``, both laid out per key-head group: for each of the Hk key heads, its
  q (Dk), k (Dk), then the v and z of the Hv / Hk value heads that read it (and likewise b then a).
* ``full_attention``: ``self_attn``, GQA whose q_proj yields, per head, the query and an output gate of the same size
  (interleaved per head: [q_h, gate_h]); q/k RMSNorm per head, partial RoPE (the leading ``partial_rotary_factor``
  of each head, transformers' default 0.25), attention over the KV cache, then out * sigmoid(gate) before o_proj.

Every RMSNorm outside the linear attention's gated one is zero-centred: x_normed * (1 + weight), computed in fp32
(transformers' Qwen3NextRMSNorm); the checkpoints store the offset from 1. MoE blocks: the router ``mlp.gate``,
softmax top-k (renormalised with norm_topk_prob, default true), the routed experts behind ``mlp.moe`` (attached by
whoever loads the weights), plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``; ``mlp_only_layers`` and
``decoder_sparse_step`` give dense MLP layers as in Qwen3-MoE. The multi-token-prediction weights of a checkpoint
(``mtp.*``) are not built, so never read.

The cache (``make_cache``): keys and values for the full-attention layers only (``kv_index``: a layer's rank among
them) and, for each linear-attention layer (``state_index``), a convolution state and a recurrent state per slot
(layers/kv_cache.py ``RecurrentStates``): fixed bytes per sequence, whatever its length.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.attention import Step, attend_cache
from hetmoe.layers.kv_cache import KVCache, RecurrentStates
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.linear_attention import GatedDeltaNet
from hetmoe.layers.norm import OffsetRMSNorm
from hetmoe.layers.rope import apply_rope, cos_sin
from hetmoe.models.common import CausalLM, PartialRopeModel, SoftmaxMoeBlock, SwiGLUMLP, qwen_layer_is_sparse
from hetmoe.models.config import ModelConfig

LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(cfg: ModelConfig) -> list:
    """Each layer's token mixer: config.json's layer_types, else every full_attention_interval-th layer (default 4)
    full attention and the others linear, as transformers' config classes fill it."""
    if cfg.get("layer_types") is not None:
        return list(cfg["layer_types"])
    every = cfg.get("full_attention_interval") or 4
    return [FULL if (i + 1) % every == 0 else LINEAR for i in range(cfg.num_hidden_layers)]


class Qwen3NextMLP(SwiGLUMLP):
    """Dense SwiGLU MLP: the shared expert, and the MLP of non-sparse layers."""


class Qwen3NextSparseMoeBlock(SoftmaxMoeBlock):
    """softmax top-k (renormalised if norm_topk_prob), plus the sigmoid-gated shared expert."""

    norm_topk_prob = None  # None: config.json's norm_topk_prob (default true); a subclass may fix it

    def __init__(self, cfg: ModelConfig):
        norm = cfg.get("norm_topk_prob", True) if self.norm_topk_prob is None else self.norm_topk_prob
        super().__init__(cfg, cfg.first("num_experts", "num_local_experts"), norm)
        self.shared_expert = Qwen3NextMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def shared(self, flat: torch.Tensor, fused: bool = False) -> torch.Tensor:  # [T, H]
        return torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat, fused)


class Qwen3NextAttention(nn.Module):
    """Gated GQA: q_proj [heads * 2D] (query and output gate per head), per-head zero-centred q/k norms, partial RoPE
    (the table's width), attention over the cache rows of layer ``kv_index``, out * sigmoid(gate), o_proj."""

    def __init__(self, cfg: ModelConfig, kv_index: int):
        super().__init__()
        H, K, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default
        hidden, bias = cfg.hidden_size, cfg.get("attention_bias", False)
        self.kv_index, self.n_heads, self.n_kv, self.head_dim = kv_index, H, K, D
        self.q_proj = nn.Linear(hidden, H * D * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, K * D, bias=bias)
        self.v_proj = nn.Linear(hidden, K * D, bias=bias)
        self.o_proj = nn.Linear(H * D, hidden, bias=bias)
        self.q_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(D, cfg.rms_norm_eps)
        self.qkv = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.qkv is None:  # once: the loader may have fused (and packed) this layer already
            self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        qg, k, v = self.qkv.parts(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q, gate = qg.reshape(B, S, H, 2 * D).split(D, dim=-1)  # [B, S, H, D] each
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(k.reshape(B, S, K, D)), *rope)
        cache.write(self.kv_index, step, k, v.reshape(B, S, K, D))
        out = attend_cache(q, cache, self.kv_index, step, D**-0.5)  # [B, S, H, D]
        out = out.reshape(B, S, H * D) * torch.sigmoid(gate.reshape(B, S, H * D))
        return self.o_proj(out)


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3-Next's grouped projections in_proj_qkvz and in_proj_ba (module docstring)."""

    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                         cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                         cfg.rms_norm_eps, state_index)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.n_v, bias=False)
        self.in_proj = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.in_proj is None:
            self.in_proj = FusedLinears(self.in_proj_qkvz, self.in_proj_ba)

    def project(self, x: torch.Tensor) -> tuple:
        B, S, _ = x.shape
        Hk, Dk, Dv, r = self.n_k, self.k_dim, self.v_dim, self.n_v // self.n_k
        qkvz, ba = self.in_proj.parts(x) if self.in_proj is not None else (self.in_proj_qkvz(x), self.in_proj_ba(x))
        q, k, v, z = qkvz.reshape(B, S, Hk, 2 * Dk + 2 * r * Dv).split((Dk, Dk, r * Dv, r * Dv), dim=-1)
        b, a = ba.reshape(B, S, Hk, 2 * r).split((r, r), dim=-1)
        mixed = torch.cat((q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)), dim=-1)
        return mixed, z.reshape(B, S, self.n_v, Dv), b.reshape(B, S, self.n_v), a.reshape(B, S, self.n_v)


class Qwen3NextDecoderLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)); the mixer is ``linear_attn`` or
    ``self_attn`` as layer_types says."""

    linear_cls = Qwen3NextGatedDeltaNet
    moe_cls = Qwen3NextSparseMoeBlock

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        kinds = layer_types(cfg)
        rank = kinds[:layer_idx].count(kinds[layer_idx])  # among the layers of its kind: its cache row
        if kinds[layer_idx] == LINEAR:
            self.linear_attn = self.linear_cls(cfg, rank)
        else:
            self.self_attn = Qwen3NextAttention(cfg, rank)
        self.mlp = self.moe_cls(cfg) if self.sparse(cfg, layer_idx) else Qwen3NextMLP(cfg.hidden_size,
                                                                                     cfg.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @staticmethod
    def sparse(cfg: ModelConfig, layer_idx: int) -> bool:
        return qwen_layer_is_sparse(cfg, layer_idx)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, step, cache)
        else:
            x = x + self.self_attn(h, rope, step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(PartialRopeModel):
    """embed_tokens -> layers -> norm (Qwen3-Next's 1 + weight form); one partial-RoPE table per call (the leading
    cfg.rope_dim dims of each head). A fused decode step (``Step.fused``, the CUDA graph's) runs the same unfused
    ops."""

    layer_cls = Qwen3NextDecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        rope = cos_sin(step.positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, step, cache)
        return self.norm(x)


class Qwen3NextForCausalLM(CausalLM):
    model_cls = Qwen3NextModel

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", **layout) -> KVCache:
        """Keys and values of the full-attention layers, and the RecurrentStates of the linear-attention ones."""
        cfg = self.config
        kinds = layer_types(cfg)
        n_linear = kinds.count(LINEAR)
        states = None
        if n_linear:
            width = cfg.linear_conv_kernel_dim - 1
            conv = (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                    + cfg.linear_num_value_heads * cfg.linear_value_head_dim)  # q|k|v channels
            states = RecurrentStates(n_linear, max_batch, conv, width, cfg.linear_num_value_heads,
                                     cfg.linear_key_head_dim, cfg.linear_value_head_dim, dtype, device)
        return KVCache(len(kinds) - n_linear, max_batch, max_context, cfg.num_key_value_heads,
                       cfg.head_dim_or_default, dtype, device, states=states, **layout)
