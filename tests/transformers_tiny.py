"""Tiny random Transformers MoE checkpoints, built with Transformers' own config classes and saved with
save_pretrained (tests/engine/test_transformers_backend.py)."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=160, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False)

# family -> (config class name, entries beyond COMMON)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                         num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=5, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=24,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             num_key_value_heads=4)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=6, num_experts_per_tok=2)),
    "glm4_moe": ("Glm4MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                       num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                       n_group=2, topk_group=1, head_dim=16)),
    "qwen3_next": ("Qwen3NextConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=32, head_dim=16,
                                           linear_num_value_heads=4, linear_num_key_heads=2,
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           layer_types=["linear_attention", "full_attention"])),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                                     head_dim=16, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=32)),
}


def make_config(family: str):
    import transformers

    cls_name, extra = FAMILIES[family]
    return getattr(transformers, cls_name)(**{**COMMON, **extra})


def save_tiny(family: str, path, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.08) -> None:
    """A random ``family`` model saved to ``path``. Weights are rounded to bf16 (then stored in ``dtype``), so the
    engine's bf16 experts hold them exactly; std well above the init's 0.02 so that the routing and logits are far
    from uniform."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_((torch.randn_like(p) * std).to(torch.bfloat16).float())
            elif name.endswith("bias"):
                p.copy_((torch.randn_like(p) * std).to(torch.bfloat16).float())
    model.to(dtype).save_pretrained(path)
