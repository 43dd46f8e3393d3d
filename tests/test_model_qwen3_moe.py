"""Qwen3-MoE parity with transformers' own implementation: prefill, then cached decode steps, batch 1 and 2."""

import re

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from hetmoe.engine.synthetic import write_checkpoint  # noqa: E402
from hetmoe.kernels import CPUExperts  # noqa: E402
from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.layers.moe import TorchExperts  # noqa: E402
from hetmoe.models.config import ModelConfig  # noqa: E402
from hetmoe.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402

EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
DECODE_STEPS = 8


def load_ours(path, experts_backend):
    """Non-expert tensors by name (strict); routed experts stacked per layer into the given backend."""
    cfg = ModelConfig.from_file(path / "config.json")
    model = Qwen3MoeForCausalLM(cfg)
    tensors, experts = {}, {}
    for shard in sorted(path.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            m = EXPERT_KEY.fullmatch(name)
            if m:
                experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = t.float()
            else:
                tensors[name] = t.float()
    model.load_state_dict(tensors, strict=True)
    for layer, mats in experts.items():
        gate, up, down = (torch.stack([mats[w][e] for e in sorted(mats[w])]) for w in ("gate", "up", "down"))
        model.model.layers[layer].mlp.experts = experts_backend(gate, up, down)
    return model.eval()


def torch_fp32(gate, up, down):
    return TorchExperts(gate, up, down, torch.float32)


def engine_bf16(gate, up, down):
    ex = CPUExperts(gate.shape[0], gate.shape[2], gate.shape[1], "bf16")
    ex.load(gate, up, down)
    return ex


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3_moe", {"num_hidden_layers": 3}, seed=5,
                            dtype="float32")


@pytest.mark.parametrize("backend, tol", [(torch_fp32, 1e-4), (engine_bf16, 2e-3)], ids=["torch-fp32", "engine-bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(checkpoint, backend, tol, batch):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = load_ours(checkpoint, backend)
    gen = torch.Generator().manual_seed(batch)
    S = 11
    ids = torch.randint(0, ours.config.vocab_size, (batch, S), generator=gen)
    cache = ours.make_cache(batch, 64)
    slots = torch.arange(batch)
    with torch.no_grad():
        hf_out = hf(ids, use_cache=True)
        step = Step(positions=torch.arange(S).expand(batch, S), slots=slots)
        logits = ours.logits(ours(ids, step, cache))
        errors = [max_rel(logits, hf_out.logits)]
        past, nxt = hf_out.past_key_values, hf_out.logits[:, -1:].argmax(-1)
        for i in range(DECODE_STEPS):
            hf_out = hf(nxt, cache=past, use_cache=True)
            step = Step(positions=torch.full((batch, 1), S + i), slots=slots)
            logits = ours.logits(ours(nxt, step, cache))
            errors.append(max_rel(logits, hf_out.logits))
            past, nxt = hf_out.past_key_values, hf_out.logits[:, -1:].argmax(-1)
    print(f"max rel. error over prefill + {DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors
