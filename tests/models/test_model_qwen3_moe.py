"""Qwen3-MoE parity with transformers' own implementation: prefill, then cached decode steps, batch 1 and 2."""

import pytest

transformers = pytest.importorskip("transformers")

from hetmoe.engine.synthetic import write_checkpoint  # noqa: E402
from hetmoe.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from parity import DECODE_STEPS, engine_bf16, parity_errors, torch_fp32  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3_moe", {"num_hidden_layers": 3}, seed=5,
                            dtype="float32")


# Measured: 3.6e-7 (TorchExperts fp32) and 2.5e-4 (CPU engine, bf16 experts).
@pytest.mark.parametrize("backend, tol", [(torch_fp32, 1e-4), (engine_bf16, 2e-3)], ids=["torch-fp32", "engine-bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(checkpoint, backend, tol, batch):
    errors = parity_errors(transformers, checkpoint, Qwen3MoeForCausalLM, backend, batch)
    print(f"max rel. error over prefill + {DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors
