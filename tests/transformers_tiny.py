"""Tiny random Transformers MoE checkpoints, built with Transformers' own config classes and saved with
save_pretrained (tests/transformers/test_transformers_backend.py; tests/models for the native model files of the
families Transformers writes them for: ``FAMILIES`` and ``NATIVE_FAMILIES``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
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

# Families whose checkpoints only hetmoe's own model files read in the tests (tests/models), beyond FAMILIES (the
# Transformers backend's list). MiniMax-M2's config class defaults bos/eos ids beyond this vocabulary: none here.
NATIVE_FAMILIES = {
    "minimax_m2": ("MiniMaxM2Config", dict(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
                                           head_dim=16, rotary_dim=8, bos_token_id=None, eos_token_id=None)),
    # MLA + DeepSeek Sparse Attention with a top-6 indexer of 8 heads: a 20-token prompt is sparse
    **{family: (cls, dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                          n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=16,
                          q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                          num_key_value_heads=4, index_topk=6, index_head_dim=16, index_n_heads=8))
       for family, cls in (("deepseek_v32", "DeepseekV32Config"), ("glm_moe_dsa", "GlmMoeDsaConfig"))},
}

# Families only the Transformers backend's own tests read, beyond FAMILIES: DeepSeek-V4 (its experts' clamped SwiGLU
# keeps Transformers' implementation). Three layers, one of each attention kind: HCA (compressed 8x here), CSA
# (compressed 4x, an indexer keeping the top 3), sliding window only; a window of 8 and 2 hyper-connection streams;
# the first layer hash-routed (tid2eid); no MTP layer.
BACKEND_FAMILIES = {
    "deepseek_v4": ("DeepseekV4Config", dict(num_hidden_layers=3, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
                                             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                             n_shared_experts=1, sliding_window=8, o_groups=2, o_lora_rank=16,
                                             index_n_heads=4, index_head_dim=16, index_topk=3,
                                             num_nextn_predict_layers=0, hc_mult=2,
                                             compress_rates={"compressed_sparse_attention": 4,
                                                             "heavily_compressed_attention": 8},
                                             layer_types=["heavily_compressed_attention",
                                                          "compressed_sparse_attention", "sliding_attention"],
                                             mlp_layer_types=["hash_moe", "moe", "moe"])),
}


def make_config(family: str, overrides: dict | None = None):
    import transformers

    cls_name, extra = {**FAMILIES, **NATIVE_FAMILIES, **BACKEND_FAMILIES}[family]
    return getattr(transformers, cls_name)(**{**COMMON, **extra, **(overrides or {})})


def save_tiny(family: str, path, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.08,
              max_shard_size: str = "100KB", tokenizer: bool = False, overrides: dict | None = None) -> Path:
    """A random ``family`` model (its config entries changed by ``overrides``) saved to ``path`` in shards of
    ``max_shard_size`` (with ``tokenizer``: a byte-level BPE tokenizer and its config beside it). Weights are
    rounded to bf16 (then stored in ``dtype``), so the engine's bf16 experts hold them exactly; std well above the
    init's 0.02 so that the routing and logits are far from uniform; norm weights 1 + noise, DeepSeek-style
    correction biases random, hash-routing tables random."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, overrides), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = (torch.randn_like(p) * std).to(torch.bfloat16).float()
            p.copy_(1 + noise if "norm" in name and p.dim() == 1 else noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
            elif name.endswith("tid2eid"):  # hash routing: k distinct experts per token id
                n_experts = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n_experts)[:b.shape[1]] for _ in range(b.shape[0])]))
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

        tok = build_tokenizer(COMMON["vocab_size"])
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(COMMON["max_position_embeddings"])))
    return path
