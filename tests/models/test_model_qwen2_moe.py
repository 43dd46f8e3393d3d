"""Qwen2-MoE parity with transformers' own implementation: prefill, then cached decode steps, batch 1 and 2."""

import pytest

transformers = pytest.importorskip("transformers")

from hetmoe.engine.synthetic import write_checkpoint  # noqa: E402
from hetmoe.models.qwen2_moe import Qwen2MoeForCausalLM  # noqa: E402
from parity import DECODE_STEPS, engine_bf16, parity_errors, torch_fp32  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse with the shared expert.
    return write_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2_moe",
                            {"num_hidden_layers": 3, "mlp_only_layers": [1]}, seed=5, dtype="float32")


# Measured (batch 1 / 2): 2.6e-7 / 3.0e-7 (TorchExperts fp32) and 7.0e-5 / 6.5e-5 (CPU engine, bf16 experts).
@pytest.mark.parametrize("backend, tol", [(torch_fp32, 1e-4), (engine_bf16, 6e-4)], ids=["torch-fp32", "engine-bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(checkpoint, backend, tol, batch):
    errors = parity_errors(transformers, checkpoint, Qwen2MoeForCausalLM, backend, batch)
    print(f"max rel. error over prefill + {DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors
