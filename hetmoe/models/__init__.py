"""One file per Hugging Face ``model_type``; pure nn.Modules with Hugging Face class and parameter names.

``model_class(cfg)`` maps a checkpoint's ``config.json`` to the causal-LM class that runs it; ``check_config``
(models/config_checks.py) refuses entries those classes cannot run, and ``context_limit(cfg)`` is how many positions
the model attends over. A multimodal checkpoint whose language model is one of these (``MULTIMODAL``) is read through
``text_model_config``: its text_config, the vision tower left out.
"""

from __future__ import annotations

import importlib

from hetmoe.models.config import MULTIMODAL, ConfigError, ModelConfig, Multimodal, text_model_config
from hetmoe.models.config import context_limit as _limit
from hetmoe.models.config_checks import check_config

__all__ = ["ConfigError", "ModelConfig", "check_config", "checkpoint_names", "context_limit", "model_class",
           "MODEL_TYPES", "MULTIMODAL", "Multimodal", "text_model_config"]

# model_type -> (module, class). Kimi-K2 ships model_type "kimi_k2" with the DeepSeek-V3 architecture; Kimi-K2.5 and
# K2.6 ship "kimi_k25", the same language model inside a multimodal wrapper (MULTIMODAL: its text_config is run).
MODEL_TYPES = {
    "deepseek_v3": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "kimi_k25": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM"),
    # Qwen3.5-MoE: its language model alone ("qwen3_5_moe_text"), or inside the multimodal wrapper (MULTIMODAL)
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    # MLA with DeepSeek Sparse Attention (a lightning indexer's top-k positions per query)
    "deepseek_v32": ("deepseek_v32", "DeepseekV32ForCausalLM"),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    # one shared KV head: sliding window with sinks + compressed (CSA / HCA) attention, hyper-connections, hash routing
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM"),
    # the language model of MiniMax-M3 (MULTIMODAL): GQA with block-sparse attention, clamped SwiGLU experts
    "minimax_m3_vl": ("minimax_m3", "MiniMaxM3ForCausalLM"),
    # attention sinks, sliding windows, experts with biases and a clamped SwiGLU
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM"),
    # GLM-5.3-Flash: KDA linear attention + NoPE MLA with a pooled DSA indexer, hyper-connections; its language model
    # alone ("glm5_next_text") or inside the multimodal wrapper (MULTIMODAL)
    "glm5_next": ("glm5_next", "Glm5NextForCausalLM"),
    "glm5_next_text": ("glm5_next", "Glm5NextForCausalLM"),
}
# The model types whose file builds its RoPE from config.json's rope_scaling / rope_parameters (YaRN); the others
# run default RoPE whatever the config says, so a scaling factor there extends nothing.
APPLIES_ROPE_SCALING = frozenset({"deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v2", "deepseek_v32", "glm_moe_dsa",
                                  "deepseek_v4", "gpt_oss"})


def checkpoint_names(model_type):
    """name -> the model's name, for a model type whose checkpoints may name tensors otherwise than its model file
    (DeepSeek-V4's and GLM-5.3-Flash's own naming, which Transformers' save_pretrained writes too), else None."""
    if model_type == "deepseek_v4":
        from hetmoe.models.deepseek_v4 import checkpoint_name

        return checkpoint_name
    if model_type in ("glm5_next", "glm5_next_text"):
        from hetmoe.models.glm5_next import checkpoint_name as glm5_next_name

        return glm5_next_name
    return None


def model_class(cfg: ModelConfig) -> type:
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json has model_type {model_type!r}, which hetmoe does not support "
            f"(supported: {', '.join(sorted(MODEL_TYPES))})"
        )
    module, name = MODEL_TYPES[model_type]
    return getattr(importlib.import_module(f"hetmoe.models.{module}"), name)


def context_limit(cfg: ModelConfig) -> tuple:
    """(positions the model attends over or None, where that number comes from): max_position_embeddings, or
    original x factor where the config scales RoPE and the model file applies it."""
    return _limit(cfg, cfg.get("model_type") in APPLIES_ROPE_SCALING)
