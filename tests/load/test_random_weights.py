"""Synthetic checkpoints (hetmoe/load/random_weights.py): complete, sharded, loadable by transformers itself."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hetmoe.load.random_weights import ARCHITECTURES, write_checkpoint  # noqa: E402


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_loads_in_transformers(arch, tmp_path):
    path = write_checkpoint(tmp_path / arch, arch, seed=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((path / s).exists() for s in shards)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch

    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    # Every tensor on disk is one the model expects, and none it expects is missing (nothing re-initialised).
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok("def forward(self, x): return x", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "def forward(self, x): return x"
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_seed_reproducible_and_overrides(tmp_path):
    a = write_checkpoint(tmp_path / "a", "qwen3_moe", {"num_hidden_layers": 3, "num_experts": 12}, seed=1)
    b = write_checkpoint(tmp_path / "b", "qwen3_moe", {"num_hidden_layers": 3, "num_experts": 12}, seed=1)
    from safetensors.torch import load_file

    def tensors(p):
        index = json.loads((p / "model.safetensors.index.json").read_text())
        out = {}
        for shard in set(index["weight_map"].values()):
            out.update(load_file(p / shard))
        return out

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert "model.layers.2.mlp.experts.11.down_proj.weight" in ta
    assert ta["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16


def test_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="unknown architecture 'llama'"):
        write_checkpoint(tmp_path, "llama")


def test_persistent_buffers_get_values_of_their_role():
    """A random build of a model whose weights include persistent buffers (DeepSeek-V4: fp32 norm weights,
    hyper-connection mixers, hash-routing tables) gives them values of their role, not zeros: norm weights 1,
    mixers and biases random, each token's hash-routed experts distinct and within the layer; the logits then
    depend on the prompt (all zeros before: a zero norm weight)."""
    pytest.importorskip("transformers")
    from transformers_tiny import make_config

    from hetmoe.config.options import EngineOptions
    from hetmoe.engine.runner import Runner
    from hetmoe.load.random_weights import build_random_model

    cfg = make_config("deepseek_v4").to_dict()
    loaded = build_random_model(cfg, None, EngineOptions(device="cpu", dtype="fp32", experts_format="bf16",
                                                         max_context=64, max_batch=2), log=lambda m: None)
    seen = set()
    for name, module in loaded.model.named_modules():
        for leaf, b in module.named_buffers(recurse=False):
            if leaf in module._non_persistent_buffers_set:
                continue
            seen.add(leaf)
            if leaf == "weight" and type(module).__name__.endswith("Norm"):
                assert torch.equal(b, torch.ones_like(b)), name
            elif leaf in ("fn", "hc_fn", "position_bias", "sinks"):
                assert b.abs().max() > 0, f"{name}.{leaf}"
            elif leaf == "tid2eid":
                assert 0 <= int(b.min()) and int(b.max()) < module.n_experts
                assert all(len(set(row)) == b.shape[1] for row in b[:50].tolist())
                assert len({tuple(row) for row in b[:50].tolist()}) >= min(10, module.n_experts)  # spread
    assert {"weight", "fn", "hc_fn", "tid2eid"} <= seen
    runner = Runner(loaded)
    a, b = runner.prefill([5, 17, 30, 42], slot=0), runner.prefill([7, 7, 250, 1], slot=1)
    assert a.abs().max() > 0 and not torch.allclose(a, b)
