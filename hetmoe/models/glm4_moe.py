"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air (model_type "glm4_moe"): GQA attention with partial RoPE (the leading
partial_rotary_factor of each head, transformers' default 0.5), q/k/v bias with attention_bias (o_proj without) and
per-head q/k RMSNorm with use_qk_norm; first_k_dense_replace dense layers (default 1), then MoE layers with shared
experts (moe_intermediate_size x n_shared_experts), routed as DeepSeek-V3 routes (hetmoe/moe/router.py kind
``sigmoid_grouped``): sigmoid scores plus e_score_correction_bias choose the top-k within the topk_group best of
n_group expert groups, weighted by the unbiased scores (renormalised with norm_topk_prob) x routed_scaling_factor.

The multi-token-prediction layers a GLM checkpoint carries after its decoder layers (num_nextn_predict_layers:
``model.layers.<num_hidden_layers>.*``) are not built: the loader reads the tensors of this model's parameters only,
so theirs are never read.

The routed experts sit behind the MoE layer ``mlp.moe`` (hetmoe/moe/), attached by whoever loads the weights; the
shared experts are an ordinary dense MLP (``mlp.shared_experts``) that the MoE layer adds.
"""

from __future__ import annotations

from hetmoe.models.common import CausalLM, PartialRopeAttention, PartialRopeModel, PreNormDecoderLayer, SwiGLUMLP
from hetmoe.models.config import ModelConfig
from hetmoe.models.deepseek_v2 import DeepseekV3MoE, DeepseekV3TopkRouter


class Glm4MoeMLP(SwiGLUMLP):
    """Dense SwiGLU MLP: the layers before first_k_dense_replace, and the shared experts."""


class Glm4MoeTopkRouter(DeepseekV3TopkRouter):
    """Router weight [E, H] (fp32 logits) and the saved e_score_correction_bias [E]: sigmoid group-limited top-k."""


class Glm4MoeMoE(DeepseekV3MoE):
    """router logits -> the MoE layer, plus the shared experts."""

    router_cls = Glm4MoeTopkRouter


class Glm4MoeAttention(PartialRopeAttention):
    """GQA with partial RoPE, q/k/v bias if attention_bias, per-head q/k RMSNorm if use_qk_norm."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        bias = cfg.get("attention_bias", False)
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx, qkv_bias=bias, o_bias=False,
                         qk_norm_eps=cfg.rms_norm_eps if cfg.get("use_qk_norm", False) else None)


class Glm4MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        if layer_idx >= cfg.first_k_dense_replace:
            mlp = Glm4MoeMoE(cfg)
        else:
            mlp = Glm4MoeMLP(cfg.hidden_size, cfg.intermediate_size)
        super().__init__(cfg, Glm4MoeAttention(cfg, layer_idx), mlp)


class Glm4MoeModel(PartialRopeModel):
    layer_cls = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(CausalLM):
    model_cls = Glm4MoeModel
