"""MiniMax-M2 / M2.1 / M2.5 (model_type "minimax_m2"): GQA attention whose q/k RMSNorm runs over all heads at once
(q_norm [heads * head_dim], k_norm [kv_heads * head_dim], not per head), then partial RoPE (rotary_dim of each
head_dim); every layer MoE, routed experts only: sigmoid scores plus e_score_correction_bias choose the top-k,
weighted by the unbiased scores renormalised (hetmoe/moe/router.py kind ``sigmoid_grouped`` with one group, no
scaling).

Checkpoint names are those of the Hub / ``save_pretrained``: the MoE block is ``model.layers.N.block_sparse_moe``
(router ``gate.weight``, the block's own ``e_score_correction_bias``, experts ``experts.E.w1|w3|w2.weight`` =
gate|up|down), as Mixtral's; transformers renames it to ``mlp`` only in memory, so here the module keeps the on-disk
name and ``layer.mlp`` is an alias of it: the MoE layer is ``layer.mlp.moe`` like every other model's. The
multi-token-prediction modules of the checkpoint are not built, so the loader never reads them.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from hetmoe.layers.norm import RMSNorm
from hetmoe.models.common import CausalLM, PartialRopeAttention, PartialRopeModel, PreNormDecoderLayer
from hetmoe.models.config import ModelConfig
from hetmoe.models.mixtral import MixtralDecoderLayer
from hetmoe.moe import MoELayer, RouterLogits, RouterSpec


class MiniMaxM2SparseMoeBlock(nn.Module):
    """The linear router ``gate`` (logits in the model dtype, sigmoid in fp32), the score correction the block
    keeps (zeros, not loaded, when use_routing_bias is false), the routed experts behind ``moe``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n_experts = cfg.first("num_local_experts", "num_experts")
        self.gate = nn.Linear(cfg.hidden_size, n_experts, bias=False)
        if cfg.get("use_routing_bias", True):
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts), persistent=True)
        else:  # (on the CPU even while the model is built on the meta device: it is not loaded)
            self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, device="cpu"), persistent=False)
        self.moe = MoELayer(RouterSpec("sigmoid_grouped", cfg.num_experts_per_tok, norm_topk_prob=True), n_experts)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        gate = self.gate
        logits = RouterLogits(flat, gate.weight, flat.dtype, partial(gate, flat)) if fused else gate(flat)
        return self.moe(flat, logits, correction_bias=self.e_score_correction_bias).view_as(x)


class MiniMaxM2Attention(PartialRopeAttention):
    """GQA without biases, q/k RMSNorm over all heads' dims, partial RoPE."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx, qk_norm_eps=cfg.rms_norm_eps, qk_norm_all_heads=True)


class MiniMaxM2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MiniMaxM2Attention(cfg, layer_idx)
        self.block_sparse_moe = MiniMaxM2SparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mlp(self) -> MiniMaxM2SparseMoeBlock:
        """transformers' in-memory name of the MoE block (not a second registration: state_dict keys stay
        ``block_sparse_moe.*``)."""
        return self.block_sparse_moe

    forward = MixtralDecoderLayer.forward  # x + attn(norm(x)), then x + block_sparse_moe(norm(x))
    forward_fused = PreNormDecoderLayer.forward_fused  # self.mlp is the block


class MiniMaxM2Model(PartialRopeModel):
    layer_cls = MiniMaxM2DecoderLayer


class MiniMaxM2ForCausalLM(CausalLM):
    model_cls = MiniMaxM2Model
