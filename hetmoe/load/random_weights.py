"""Synthetic Hugging Face checkpoints for tests and benchmarks.

``write_checkpoint(path, "qwen3_moe")`` writes a complete checkpoint directory of any supported architecture —
``config.json``, sharded ``*.safetensors`` with their index, and a byte-level BPE tokenizer trained offline with
the ``tokenizers`` library (``tokenizer.json`` + ``tokenizer_config.json`` with a chat template) — with random
weights, exactly as the architecture's own ``save_pretrained`` lays them out (per-expert tensors, HF names).

The architecture's config and modeling classes come from ``transformers`` (needed here only, never by the
engine), so a checkpoint is by construction one that transformers itself loads.

``build_random_model("qwen3-30b-a3b")`` builds a model of a real, published shape (``SHAPES``) in memory with
random weights — no checkpoint, no tokenizer — placed exactly as the loader places it: what benchmarks of full-size
models run on.
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from torch import nn

from hetmoe.config.options import EngineOptions
from hetmoe.layers.norm import RMSNorm
from hetmoe.load.calibration import keep_gpu_experts
from hetmoe.load.dense import on_host, pack_dense
from hetmoe.load.loader import LoadedModel, build_meta, moe_blocks, new_experts, plan_model
from hetmoe.load.rules import defer_layers, layerwise_layers
from hetmoe.models.config import ModelConfig
from hetmoe.moe import HostStaging
from hetmoe.moe.streamed import choice as prefill_choice

# Small but complete configurations: every feature of the architecture is present (dense first layers,
# shared experts, groups, GQA, q/k norm, MLA), with sizes that load in well under a second.
TINY = {
    "qwen3_moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    "deepseek_v3": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    "deepseek_v2": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
        n_group=2, topk_group=1, topk_method="group_limited_greedy", q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=1.0,
    ),
}

ARCHITECTURES = tuple(TINY)

# A little English and Python for the tokenizer to learn merges from (it only has to cover bytes sensibly).
_CORPUS = """\
Mixture-of-Experts models route every token to a few experts out of many.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
def forward(self, x):
    return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
for i in range(10):
    print(i, i * i)
class Expert:
    pass
Hello, world! How are you today? I am fine, thank you.
"""

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _config(arch: str, overrides: Optional[dict], vocab_size: int):
    import transformers

    if arch not in TINY:
        raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    kwargs = {**TINY[arch], **(overrides or {})}
    kwargs.setdefault("vocab_size", vocab_size)
    kwargs.update(bos_token_id=None, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return transformers.AutoConfig.for_model(arch, **kwargs)


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers.Tokenizer``) trained on the strings ``texts``, with the special
    tokens <|endoftext|> (id 0), <|im_start|>, <|im_end|> that ``tokenizer_config`` and the chat template use."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a small built-in corpus (no download)."""
    return train_bpe(_CORPUS.splitlines(), vocab_size)


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json of a ``train_bpe`` tokenizer: eos <|im_end|>, pad <|endoftext|>, no bos, the
    ChatML-style chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": model_max_length,
        "chat_template": _CHAT_TEMPLATE,
    }


def shape_tokenizer(vocab_size: int):
    """A tokenizer for a model built in memory (``build_random_model``), which has no tokenizer of its own but
    must turn any of its ``vocab_size`` ids into text: the 256 byte-level symbols, the specials, then one
    ASCII word per remaining id (" aa", " ab", ...), so every generated token decodes to readable text.
    Encoding uses bytes only (no merges). Returns a ``hetmoe.tokenizer.Tokenizer`` with the ChatML
    template; eos is <|im_end|>."""
    import string

    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from hetmoe.tokenizer import Tokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    n_words = vocab_size - len(vocab) - len(_SPECIALS)
    if n_words < 0:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer")
    letters, width = string.ascii_lowercase, 1
    while 26**width < n_words:
        width += 1
    for i in range(n_words):
        word = "".join(letters[(i // 26**j) % 26] for j in reversed(range(width)))
        vocab["\u0120" + word] = len(vocab)  # \u0120 is the byte-level symbol of a space
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(_SPECIALS)
    return Tokenizer(backend, tokenizer_config(4096), chat_template=_CHAT_TEMPLATE)


def write_checkpoint(
    path: Union[str, Path],
    arch: str,
    config: Optional[dict] = None,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    max_shard_size: str = "100KB",
    vocab_size: int = 512,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` (a Hugging Face ``model_type``) into ``path``.

    ``config`` overrides entries of the tiny default configuration (any size works: e.g. more layers or
    experts). Weights are ``dtype`` and split into shards of ``max_shard_size`` with an index, so loaders are
    exercised on multi-shard checkpoints. Returns the directory.
    """
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    cfg = _config(arch, config, vocab_size)
    if cfg.vocab_size < tokenizer.get_vocab_size():
        raise ValueError(f"vocab_size {cfg.vocab_size} is smaller than the tokenizer's {tokenizer.get_vocab_size()}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    with torch.no_grad():  # a visible spread: the default init leaves norms at 1 and router biases at 0
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(cfg.max_position_embeddings), indent=1))
    return path


# ---------------------------------------------------------------------------------------------- real shapes

# The published config.json of each model (the entries that describe its shape and numerics; training-only and
# quantization entries left out). build_random_model builds them with random weights.
SHAPES = {
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 40960, "max_window_layers": 48,
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (and R1): MLA, 3 dense layers, 256 routed + 1 shared, sigmoid routing
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_attention_heads": 128,
        "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "attention_bias": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {  # deepseek-ai/DeepSeek-V2-Lite: MLA without q LoRA, 1 dense layer, 64 routed + 2 shared
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "n_group": 1, "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax",
        "norm_topk_prob": False, "routed_scaling_factor": 1.0, "attention_bias": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 163840, "tie_word_embeddings": False, "bos_token_id": 100000,
        "eos_token_id": 100001, "torch_dtype": "bfloat16",
    },
    "deepseek-v4-flash": {  # deepseek-ai/DeepSeek-V4-Flash, as Transformers' DeepseekV4Config describes it (its
        # defaults): one 512-wide KV head, 128-token window, CSA (4x, top-512 indexer) / HCA (128x) layers, 4 mHC
        # streams, 3 hash-routed layers, 256 routed + 1 shared expert, sqrtsoftplus routing, clamped SwiGLU
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128, "num_hash_layers": 3,
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "minimax-m3": {  # MiniMaxAI/MiniMax-M3's language model, as Transformers' MiniMaxM3VLTextConfig describes it (its
        # defaults): GQA 64 / 4 heads of 128 (RoPE over 64 dims), 128 routed experts top-4 + 1 shared, clamped SwiGLU;
        # the attention schedule is not among those defaults: every layer block-sparse here (16 blocks of 128, an
        # indexer of 4 x 128 whose key per position every layer keeps: the larger cache)
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
        "vocab_size": 200064, "hidden_size": 6144, "intermediate_size": 3072, "num_hidden_layers": 60,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "rotary_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
        "num_local_experts": 128, "num_experts_per_tok": 4, "shared_intermediate_size": 3072,
        "dense_intermediate_size": 12288, "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "layer_types": ["minimax_m3_sparse"] * 60, "mlp_layer_types": ["sparse"] * 60, "index_n_heads": 4,
        "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16, "index_local_blocks": 1,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 524288, "tie_word_embeddings": False,
        "bos_token_id": 200034, "eos_token_id": 200020, "torch_dtype": "bfloat16",
    },
    "glm-5.3-flash": {  # zai-org/GLM-5.3-Flash's language model, as Transformers' Glm5NextTextConfig describes it (its
        # defaults): 34 KDA layers (64 heads of 128: a 4 MiB fp32 state + a 3-wide conv window of 3 x 8192 per layer
        # and sequence, ~141 MiB per sequence in bf16) and 11 NoPE MLA layers (every 4th) caching a 512 latent plus
        # the pooled indexer's key and gate (2 x 128) per position: 11 x 768 elements, 16.5 KiB per token in bf16;
        # 288 routed experts top-8 + 1 shared, 3 dense layers, 4 mHC streams, clamped SwiGLU
        "architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
        "vocab_size": 154880, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 45, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256,
        "n_routed_experts": 288, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "swiglu_limit": 10.0, "index_topk": 2048,
        "index_head_dim": 128, "index_n_heads": 32, "index_kpool": 16, "index_kpool_always_select_tail": True,
        "linear_head_dim": 128, "linear_num_heads": 64, "linear_conv_kernel_dim": 4, "linear_lower_bound": -5.0,
        "hc_mult": 4, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "attention_bias": False, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3.2": {  # deepseek-ai/DeepSeek-V3.2: DeepSeek-V3's sizes and routing, plus DeepSeek Sparse Attention's
        # lightning indexer (64 heads of 128, top-2048) in every layer, its key cached per position beside the latent
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64, "attention_bias": False, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "glm-5": {  # zai-org/GLM-5, as Transformers' GlmMoeDsaConfig describes it (its defaults): MLA (64 heads, nope 192,
        # v 256) with DeepSeek Sparse Attention (32 indexer heads of 128, top-2048) in all 78 layers, 3 dense layers,
        # 256 routed experts top-8 + 1 shared
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
        "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048,
        "num_hidden_layers": 78, "first_k_dense_replace": 3, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "index_topk": 2048, "index_head_dim": 128,
        "index_n_heads": 32, "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "max_position_embeddings": 202752,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "qwen3.5-397b-a17b": {  # Qwen/Qwen3.5-397B-A17B's language model: 60 layers of 4096 (3 Gated DeltaNet : 1 gated
        # full attention, 32 query / 2 KV heads of 256, RoPE on a quarter), 512 routed experts top-10 + 1 shared, as
        # published; the expert width (1024) is what 397 B parameters leave, and the linear attention's heads (16 key /
        # 64 value heads of 128) twice Transformers' Qwen3_5MoeTextConfig defaults (the 35B-A3B's) with the width
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 64, "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 15,
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "qwen3-next-80b-a3b": {  # Qwen/Qwen3-Next-80B-A3B, as Transformers' Qwen3NextConfig describes it (its defaults): 48
        # layers of 2048, 3 Gated DeltaNet : 1 gated full attention, 512 routed experts top-10 + 1 shared
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "gpt-oss-120b": {  # openai/gpt-oss-120b, as Transformers' GptOssConfig describes it (its defaults): 36 layers of
        # 2880, alternating 128-token sliding and full attention with sinks, 128 experts top-4 with biases and clamped
        # SwiGLU
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 18, "num_local_experts": 128,
        "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": True,
        "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "glm-4.5-air": {  # zai-org/GLM-4.5-Air: Transformers' Glm4MoeConfig defaults (its sizes: 46 layers of 4096, 1 dense
        # layer, 128 routed experts top-8 + 1 shared) with the checkpoint's 96 / 8 heads of 128 (RoPE on half) and
        # q/k/v biases
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "use_qk_norm": False,
        "attention_bias": True, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
    "minimax-m2.5": {  # MiniMaxAI/MiniMax-M2.5 (MiniMax-M2's architecture), as Transformers' MiniMaxM2Config
        # describes it (its defaults): 62 layers of 3072, 48 / 8 heads of 128, 256 experts top-8, sigmoid routing
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 256,
        "num_experts_per_tok": 8, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 5000000.0, "rope_type": "default"}, "max_position_embeddings": 196608,
        "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020, "torch_dtype": "bfloat16",
    },
}

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


def shape_config(shape: Union[str, dict], num_layers: Optional[int] = None) -> ModelConfig:
    """The config of a named shape (a key of ``SHAPES``) or of a config.json-like dict, with ``num_layers``
    decoder layers instead of the shape's own number when given."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if not isinstance(shape, dict) or "model_type" not in shape:
        raise ValueError("a shape is a name in SHAPES or a config.json-like dict with a model_type")
    cfg = ModelConfig(copy.deepcopy(shape))
    if num_layers is not None:
        if int(num_layers) < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        cfg["num_hidden_layers"] = int(num_layers)
    return cfg


_CHUNK = 1 << 24  # elements generated per task (on the CPU, tasks run on all cores)


def _walk(module: nn.Module, prefix: str = ""):
    """(name, module) of ``module`` and every module under it, in ``named_modules`` order, keeping no reference to a
    module whose subtree is done: ``named_modules`` remembers every module it visited until it ends, which would keep
    alive each weight that ``_fill_random``'s ``each_layer`` packed and replaced (a whole model's bf16
    weights on the GPU at once)."""
    seen = set()  # ids, not modules: a module reached twice is visited once, as named_modules does

    def walk(m: nn.Module, name: str):
        if id(m) in seen:
            return
        seen.add(id(m))
        yield name, m
        for leaf, child in list(m._modules.items()):
            if child is not None:
                yield from walk(child, f"{name}.{leaf}" if name else leaf)

    yield from walk(module, prefix)


def _fill_random(model: nn.Module, device: torch.device, dtype: torch.dtype, seed: int, std: float,
                 each_layer: Optional[Callable[[nn.Module], None]] = None,
                 host: Optional[Callable[[str, nn.Module], bool]] = None) -> None:
    """Give every meta parameter and buffer of ``model`` storage on ``device``, one tensor at a time: parameters
    N(0, std) in ``dtype`` (RMSNorm weights 1), persistent buffers in their own dtype by their role
    (``_buffer_role``: ones, N(0, std), a hash-routing table, else zeros as e_score_correction_bias), non-persistent
    buffers (RoPE tables, computed at build time) moved — as the loader does. Each
    chunk of ``_CHUNK`` elements has its own seeded generator, so the values do not depend on the thread count.
    ``each_layer(layer)`` runs as soon as a decoder layer is filled (the loader packs each layer's dense weights
    then, so that the dtype copies of one layer at most are alive). ``host(name, module)``: the module's parameters
    are kept in host memory (made on ``device`` a chunk at a time, the same values), as the loader reads the
    linears a GPU packs in a format other than bf16 (load/dense.py ``on_host``)."""
    workers = len(os.sched_getaffinity(0)) if device.type == "cpu" else 1
    decoder_layers = {id(m) for m in getattr(getattr(model, "model", None), "layers", [])} if each_layer else set()
    current, inside = None, set()

    def normal(t: torch.Tensor, index: int, chunk: int) -> None:
        gen = torch.Generator(device=device).manual_seed((seed * 1_000_003 + index) * 4099 + chunk)
        part = t.view(-1)[chunk * _CHUNK:(chunk + 1) * _CHUNK]
        if part.device.type == device.type:
            part.normal_(0.0, std, generator=gen)
        else:  # made on the device, with its generator, and copied to host memory
            part.copy_(torch.empty(part.shape, dtype=part.dtype, device=device).normal_(0.0, std, generator=gen))

    index = 0
    with ThreadPoolExecutor(workers) as pool:
        for name, module in _walk(model):
            if current is not None and id(module) not in inside:
                each_layer(current)
                current = None
            if id(module) in decoder_layers:
                current, inside = module, {id(m) for m in module.modules()}
            where = torch.device("cpu") if host is not None and host(name, module) else device
            for leaf, p in list(module._parameters.items()):
                if p is None:
                    continue
                t = torch.empty(p.shape, dtype=dtype, device=where)
                if isinstance(module, RMSNorm):
                    t.fill_(1.0)
                else:
                    list(pool.map(lambda c: normal(t, index, c), range(-(-t.numel() // _CHUNK))))
                module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
                index += 1
                t = None  # (no reference here to a weight each_layer packs and frees)
            for leaf, b in list(module._buffers.items()):
                if b is None:
                    continue
                if leaf in module._non_persistent_buffers_set:
                    module._buffers[leaf] = b.to(device)
                    continue
                t = torch.zeros(b.shape, dtype=b.dtype, device=device)
                role = _buffer_role(module, leaf)
                if role == "ones":
                    t.fill_(1.0)
                elif role == "normal":
                    list(pool.map(lambda c: normal(t, index, c), range(-(-t.numel() // _CHUNK))))
                elif role == "experts":  # hash routing: each token's k distinct experts, spread over the layer's
                    rows, k = t.shape
                    first = (torch.arange(rows, device=device) * 2654435761 + index) % module.n_experts
                    t.copy_((first[:, None] + torch.arange(k, device=device)) % module.n_experts)
                module._buffers[leaf] = t
                index += 1
        if current is not None:
            each_layer(current)


# Persistent buffers hold weights of some models (fp32 norm weights, hyper-connection mixers, the short convolution's
# taps, hash-routing tables): random builds give them values of their role, not zeros (a zero norm weight would make
# every logit 0 and every router choose the same experts). Named by buffer; anything else stays zero (score biases).
_ONES = ("scale", "hc_scale")  # multiplicative scales
_NORMAL = ("fn", "base", "hc_fn", "hc_base", "position_bias", "sinks", "dt_bias", "A_log")


def _buffer_role(module: nn.Module, leaf: str) -> Optional[str]:
    """How a random build fills persistent buffer ``leaf`` of ``module``: "ones", "normal" (N(0, std)), "experts"
    (a hash-routing table) or None (zeros)."""
    if leaf == "tid2eid":
        return "experts"
    if leaf == "weight":  # a norm's weight (ones) or a convolution's taps (normal)
        return "ones" if type(module).__name__.endswith("Norm") else "normal"
    return "ones" if leaf in _ONES else "normal" if leaf in _NORMAL else None


def build_random_model(
    shape: Union[str, dict],
    num_layers: Optional[int] = None,
    options: Optional[EngineOptions] = None,
    *,
    seed: int = 0,
    std: float = 0.02,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> LoadedModel:
    """A model of ``shape`` (a key of ``SHAPES`` or a config dict) with random weights, built in memory and placed
    as ``load_model`` places a checkpoint under ``options``: dense weights N(0, std) on the plan's device in its
    dtype (generated there, one tensor at a time; the linears a GPU packs in fp8/int8/int4 are copied to host memory
    and packed from there, each layer as soon as it is filled, as the loader does), routed experts packed in the
    plan's format on the CPU (``CPUExperts.fill_random(seed + layer)``), attached (and deferred) like the loader
    attaches them; placement rules (``options.rules``) apply as in the loader.

    The memory plan is made from the real shapes first: MemoryError, before anything large is allocated, when the
    model does not fit. ``LoadedModel.path`` is None (there is no tokenizer: feed token ids).
    """
    t0 = time.perf_counter()
    options = options or EngineOptions()
    cfg = shape_config(shape, num_layers)
    model = build_meta(cfg)
    blocks = moe_blocks(model)
    inter = (cfg.get("moe_intermediate_size") or cfg.intermediate_size) if blocks else 0
    plan = plan_model(model, cfg, blocks, options, inter)
    name = shape if isinstance(shape, str) else cfg.model_type
    mixed = len({(lp.experts_format, lp.group_size) for lp in plan.layers}) > 1
    log(f"hetmoe: random {name} ({cfg.model_type}): {cfg.num_hidden_layers} layers, {len(blocks)} MoE; "
        f"{plan.device.type}, {plan.dtype}, experts {plan.experts_format}"
        f"{f' group {plan.group_size}' if plan.experts_format != 'bf16' else ''}"
        f"{f' and others (rules {options.rules})' if mixed else ''}"
        f"{f', {options.defer_experts} deferred per token' if options.defer_experts else ''}; {plan.describe()}")
    def pack(root):  # as the loader does: each decoder layer as soon as it is filled, then what is left (lm_head)
        pack_dense(root, plan.dense_format, plan.device, options, plan.dtype)

    host = lambda name, module: on_host(module, name, plan.dense_format, plan.device)  # noqa: E731
    _fill_random(model, plan.device, plan.dtype, seed, std, each_layer=pack, host=host)
    model.fuse_projections()
    pack(model)
    staging = (HostStaging(cfg.hidden_size, cfg.num_experts_per_tok, plan.dtype)
               if plan.device.type == "cuda" and blocks else None)
    expert_bytes = 0
    for (block_name, block), lp in zip(blocks, plan.layers):
        layer = int(_LAYER_INDEX.search(f".{block_name}.").group(1))
        experts = new_experts(block, cfg, inter, plan, options, lp)
        experts.fill_random(seed + layer, std)
        expert_bytes += experts.nbytes
        block.attach(experts, staging)
    defer_layers(blocks, plan)
    gpu_experts = keep_gpu_experts(model.eval(), blocks, plan, options, None, log)  # no tokenizer: the first N
    lw, gpu_prefill = prefill_choice.setup(layerwise_layers(blocks, plan), plan, options, log)
    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)
    info = {"load_s": time.perf_counter() - t0, "expert_bytes": expert_bytes, "shape": name, "seed": seed,
            "gpu_experts": gpu_experts, "gpu_prefill": gpu_prefill}
    log(f"hetmoe: built in {info['load_s']:.1f} s (routed experts {expert_bytes / 2**30:.2f} GiB)")
    return LoadedModel(model.eval(), cfg, plan, options, None, info, lw)
