"""Mixtral parity with transformers' own implementation: prefill, then cached decode steps, batch 1 and 2.

Mixtral checkpoints name the MoE block ``block_sparse_moe`` and its experts ``w1|w3|w2`` (gate|up|down);
tests/parity.py's loader reads both spellings.
"""

import pytest

transformers = pytest.importorskip("transformers")

from hetmoe.engine.synthetic import write_checkpoint  # noqa: E402
from hetmoe.models.mixtral import MixtralForCausalLM  # noqa: E402
from parity import DECODE_STEPS, engine_bf16, parity_errors, torch_fp32  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("mixtral"), "mixtral", {"num_hidden_layers": 3}, seed=5,
                            dtype="float32")


# Measured (batch 1 / 2): 3.3e-7 / 3.5e-7 (TorchExperts fp32) and 3.6e-4 / 4.5e-4 (CPU engine, bf16 experts).
@pytest.mark.parametrize("backend, tol", [(torch_fp32, 1e-4), (engine_bf16, 4e-3)], ids=["torch-fp32", "engine-bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(checkpoint, backend, tol, batch):
    errors = parity_errors(transformers, checkpoint, MixtralForCausalLM, backend, batch)
    print(f"max rel. error over prefill + {DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors
