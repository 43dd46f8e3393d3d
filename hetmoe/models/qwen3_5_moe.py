"""Qwen3.5-MoE (model_type "qwen3_5_moe", its language model "qwen3_5_moe_text"): Qwen3-Next's hybrid of Gated DeltaNet
linear attention and gated full attention (hetmoe/models/qwen3_next.py, whose modules this file reuses), with:

* the linear attention's input projections as four plain matrices, ``in_proj_qkv`` (q|k|v of all heads, in that
  order: the convolution's channels as they are), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, instead of
  Qwen3-Next's per-group in_proj_qkvz / in_proj_ba;
* every layer a MoE layer, top-k weights always renormalised (transformers' Qwen3VLMoeTextTopKRouter).

The published checkpoints are multimodal (Qwen3_5MoeForConditionalGeneration: ``model.language_model.*``,
``model.visual.*``, ``lm_head``): hetmoe runs their language model, text only (hetmoe.models.MULTIMODAL: config.json's
text_config; the vision tower is never read). Text positions are the same on the three axes of its multimodal RoPE
(mrope_section), which then turns each head's leading dims exactly as the one-axis partial RoPE here.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.linear_attention import GatedDeltaNet
from hetmoe.models.config import ModelConfig
from hetmoe.models.qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextForCausalLM,
    Qwen3NextModel,
    Qwen3NextSparseMoeBlock,
)


class Qwen3_5MoeSparseMoeBlock(Qwen3NextSparseMoeBlock):
    """softmax top-k, always renormalised, plus the sigmoid-gated shared expert."""

    norm_topk_prob = True


class Qwen3_5MoeGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3.5's separate projections in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""

    def __init__(self, cfg: ModelConfig, state_index: int):
        super().__init__(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                         cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                         cfg.rms_norm_eps, state_index)
        H = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(H, self.n_v, bias=False)
        self.in_proj = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.in_proj is None:
            self.in_proj = FusedLinears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def project(self, x: torch.Tensor) -> tuple:
        B, S, _ = x.shape
        if self.in_proj is not None:
            mixed, z, b, a = self.in_proj.parts(x)
        else:
            mixed, z, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        return mixed, z.reshape(B, S, self.n_v, self.v_dim), b, a


class Qwen3_5MoeDecoderLayer(Qwen3NextDecoderLayer):
    linear_cls = Qwen3_5MoeGatedDeltaNet
    moe_cls = Qwen3_5MoeSparseMoeBlock

    @staticmethod
    def sparse(cfg: ModelConfig, layer_idx: int) -> bool:
        return True


class Qwen3_5MoeTextModel(Qwen3NextModel):
    layer_cls = Qwen3_5MoeDecoderLayer


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    model_cls = Qwen3_5MoeTextModel
