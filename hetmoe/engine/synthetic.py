"""Synthetic Hugging Face checkpoints for tests and benchmarks.

``write_checkpoint(path, "qwen3_moe")`` writes a complete checkpoint directory of any supported architecture —
``config.json``, sharded ``*.safetensors`` with their index, and a byte-level BPE tokenizer trained offline with
the ``tokenizers`` library (``tokenizer.json`` + ``tokenizer_config.json`` with a chat template) — with random
weights, exactly as the architecture's own ``save_pretrained`` lays them out (per-expert tensors, HF names).

The architecture's config and modeling classes come from ``transformers`` (needed here only, never by the
engine), so a checkpoint is by construction one that transformers itself loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

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


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a small built-in corpus (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return tok


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
    import torch
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
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": _CHAT_TEMPLATE,
    }, indent=1))
    return path
