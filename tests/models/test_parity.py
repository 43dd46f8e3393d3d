"""Model parity with transformers' own implementation, every supported model_type: the same random checkpoint in
transformers' class and in ours (tests/parity.py), compared logit by logit over a prefill and DECODE_STEPS cached
greedy decode steps, batch 1 and 2. Routed experts: fp32 TorchExperts, and bf16 experts in the CPU engine on each
numerical path this machine runs (tests/paths.py: scalar / avx2 / avx512 row blocks, amx-emulated, amx).

Checkpoints (synthetic.write_checkpoint, fp32, 3 layers):
    qwen3_moe     three sparse layers
    qwen2_moe     layer 1 dense (mlp_only_layers), layers 0 and 2 sparse with the shared expert
    mixtral       the MoE block named ``block_sparse_moe``, experts ``w1|w3|w2`` (gate|up|down): the loader of
                  tests/parity.py reads both spellings
    deepseek_v2   layer 0 dense (first_k_dense_replace=1), layers 1 and 2 MoE with shared experts; prefill in the
    deepseek_v3   expanded MLA form, decode in the weight-absorbed form (tests/layers/test_mla.py: the two forms)
"""

import pytest

transformers = pytest.importorskip("transformers")

from hetmoe.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM  # noqa: E402
from hetmoe.models.mixtral import MixtralForCausalLM  # noqa: E402
from hetmoe.models.qwen2_moe import Qwen2MoeForCausalLM  # noqa: E402
from hetmoe.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from parity import DECODE_STEPS, engine_bf16, parity_errors, torch_fp32  # noqa: E402
from paths import PATHS  # noqa: E402

# model_type -> (our class, checkpoint overrides, seed)
MODELS = {
    "qwen3_moe": (Qwen3MoeForCausalLM, {"num_hidden_layers": 3}, 5),
    "qwen2_moe": (Qwen2MoeForCausalLM, {"num_hidden_layers": 3, "mlp_only_layers": [1]}, 5),
    "mixtral": (MixtralForCausalLM, {"num_hidden_layers": 3}, 5),
    "deepseek_v2": (DeepseekV2ForCausalLM, {"num_hidden_layers": 3}, 7),
    "deepseek_v3": (DeepseekV3ForCausalLM, {"num_hidden_layers": 3}, 7),
}

# Max rel. logit error (max |ours - hf| / max |hf|) over prefill + decode, MEASURED (batch 1 / 2).
# TorchExperts fp32, every model_type: 2.1e-7 to 3.8e-7 (the fp32 summation order of the two implementations).
FP32_TOL = 1e-4
# CPU engine, bf16 experts, MEASURED on every path (batch 1 / 2). The row-block paths (scalar, avx2, avx512: the
# same bits) round the weights to bf16; the AMX paths (amx-emulated; amx is the same math in the hardware's fp32
# summation order) also read bf16-rounded activations, so they land further off:
#                 row blocks          amx-emulated
#   qwen3_moe     2.5e-4 / 2.4e-4     3.6e-4 / 3.2e-4
#   qwen2_moe     7.0e-5 / 6.5e-5     9.5e-5 / 9.4e-5
#   mixtral       3.6e-4 / 4.5e-4     4.8e-4 / 5.7e-4
#   deepseek_v2   7.9e-5 / 7.8e-5     1.3e-4 / 1.2e-4
#   deepseek_v3   7.9e-4 / 6.9e-4     9.6e-4 / 1.1e-3   (routed_scaling_factor 2.5 amplifies the expert rounding)
# One bound per model_type for every path: ~2x the max over the paths.
BF16_TOL = {"qwen3_moe": 7e-4, "qwen2_moe": 2e-4, "mixtral": 1.2e-3, "deepseek_v2": 2.6e-4, "deepseek_v3": 2.3e-3}

BACKENDS = [pytest.param(None, id="torch-fp32")] + [pytest.param(p, id=f"engine-bf16-{p}") for p in PATHS.values()]


@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("path", BACKENDS)
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(checkpoints, model_type, path, batch):
    model_cls, overrides, seed = MODELS[model_type]
    checkpoint = checkpoints(model_type, overrides, seed=seed, dtype="float32")
    backend, tol = (torch_fp32, FP32_TOL) if path is None else (engine_bf16(path), BF16_TOL[model_type])
    errors = parity_errors(transformers, checkpoint, model_cls, backend, batch)
    print(f"{model_type} {path or 'torch-fp32'} batch {batch}: max rel. error over prefill + {DECODE_STEPS} decode "
          f"steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors
