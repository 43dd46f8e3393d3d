"""One file per Hugging Face ``model_type``; pure nn.Modules with Hugging Face class and parameter names.

``model_class(cfg)`` maps a checkpoint's ``config.json`` to the causal-LM class that runs it; ``check_config``
(models/config.py) refuses entries those classes cannot run, and ``context_limit(cfg)`` is how many positions the
model attends over.
"""

from __future__ import annotations

import importlib

from hetmoe.models.config import ConfigError, ModelConfig, check_config
from hetmoe.models.config import context_limit as _limit

__all__ = ["ConfigError", "ModelConfig", "check_config", "context_limit", "model_class", "MODEL_TYPES"]

# model_type -> (module, class). Kimi-K2 ships model_type "kimi_k2" with the DeepSeek-V3 architecture.
MODEL_TYPES = {
    "deepseek_v3": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "kimi_k2": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "mixtral": ("mixtral", "MixtralForCausalLM"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2ForCausalLM"),
}
# The model types whose file builds its RoPE from config.json's rope_scaling / rope_parameters (YaRN); the others
# run default RoPE whatever the config says, so a scaling factor there extends nothing.
APPLIES_ROPE_SCALING = frozenset({"deepseek_v3", "kimi_k2", "deepseek_v2"})


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
