"""Mixtral (model_type "mixtral"): GQA attention (no q/k norm, no bias), softmax top-k router that always
renormalises the top-k weights, routed experts only.

Checkpoint names are those of the Hub / ``save_pretrained`` (transformers 5 too): the MoE block is
``model.layers.N.block_sparse_moe`` (router ``block_sparse_moe.gate.weight``; experts
``block_sparse_moe.experts.E.w1|w3|w2.weight`` = gate|up|down). transformers renames it to ``mlp`` only in
memory, so here the module keeps the on-disk name and ``layer.mlp`` is an alias of it: the MoE layer is
``layer.mlp.moe`` like every other model's.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.attention import GQAAttention, Step
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.norm import RMSNorm
from hetmoe.models.common import CausalLM, DecoderModel, PreNormDecoderLayer, SoftmaxMoeBlock
from hetmoe.models.config import ModelConfig


class MixtralSparseMoeBlock(SoftmaxMoeBlock):
    """softmax top-k, always renormalised."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, cfg.first("num_local_experts", "num_experts"), norm_topk_prob=True)


class MixtralAttention(GQAAttention):
    """Plain GQA: no biases, no q/k norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx)


class MixtralDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MixtralAttention(cfg, layer_idx)
        self.block_sparse_moe = MixtralSparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mlp(self) -> MixtralSparseMoeBlock:
        """transformers' in-memory name of the MoE block (not a second registration: state_dict keys stay
        ``block_sparse_moe.*``)."""
        return self.block_sparse_moe

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache)
        return x + self.block_sparse_moe(self.post_attention_layernorm(x))

    forward_fused = PreNormDecoderLayer.forward_fused  # self.mlp is the block


class MixtralModel(DecoderModel):
    layer_cls = MixtralDecoderLayer

    def __init__(self, cfg: ModelConfig):
        if cfg.get("sliding_window") is not None:
            raise NotImplementedError(f"Mixtral with sliding_window={cfg['sliding_window']} is not supported")
        super().__init__(cfg)


class MixtralForCausalLM(CausalLM):
    model_cls = MixtralModel
