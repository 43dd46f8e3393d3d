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

Written by Transformers' own class (tests/transformers_tiny.py save_tiny: weights rounded to bf16, std 0.08, random
correction biases; fp32, 3 layers):
    glm4_moe      GLM-4.6's features: partial RoPE (half of each head), per-head q/k norm, q/k/v bias, layer 0
                  dense, layers 1 and 2 MoE with a shared expert, sigmoid routing in 2 groups (top-1 group),
                  routed_scaling_factor 2.5 (tests/models/test_glm4_minimax.py: GLM-4.5-Air's, end to end)
    minimax_m2    q/k norm over all heads, partial RoPE (rotary_dim 8 of 16), the MoE block named
                  ``block_sparse_moe`` with its own correction bias, experts ``w1|w3|w2``
"""

import pytest

transformers = pytest.importorskip("transformers")

from hetmoe.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM  # noqa: E402
from hetmoe.models.glm4_moe import Glm4MoeForCausalLM  # noqa: E402
from hetmoe.models.minimax_m2 import MiniMaxM2ForCausalLM  # noqa: E402
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
    "glm4_moe": (Glm4MoeForCausalLM, {"num_hidden_layers": 3, "use_qk_norm": True, "attention_bias": True,
                                      "routed_scaling_factor": 2.5}, 5),
    "minimax_m2": (MiniMaxM2ForCausalLM, {"num_hidden_layers": 3}, 5),
}
# The model_types hetmoe.load.random_weights has no tiny config for: their checkpoints come from hf_checkpoints.
BY_TRANSFORMERS = ("glm4_moe", "minimax_m2")

# Max rel. logit error (max |ours - hf| / max |hf|) over prefill + decode, MEASURED (batch 1 / 2).
# TorchExperts fp32, every model_type: 2.1e-7 to 6.2e-7 (the fp32 summation order of the two implementations).
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
# The checkpoints Transformers writes hold bf16-rounded weights: the row blocks then only sum in another order.
#   glm4_moe      5.0e-7 / 6.3e-7     1.9e-3 / 3.1e-3   (routed_scaling_factor 2.5, std 0.08 weights)
#   minimax_m2    4.2e-7 / 4.4e-7     1.1e-3 / 2.1e-3
# One bound per model_type for every path: ~2x the max over the paths.
BF16_TOL = {"qwen3_moe": 7e-4, "qwen2_moe": 2e-4, "mixtral": 1.2e-3, "deepseek_v2": 2.6e-4, "deepseek_v3": 2.3e-3,
            "glm4_moe": 6e-3, "minimax_m2": 4e-3}

BACKENDS = [pytest.param(None, id="torch-fp32")] + [pytest.param(p, id=f"engine-bf16-{p}") for p in PATHS.values()]


@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("path", BACKENDS)
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(request, model_type, path, batch):
    model_cls, overrides, seed = MODELS[model_type]
    if model_type in BY_TRANSFORMERS:
        checkpoint = request.getfixturevalue("hf_checkpoints")(model_type, overrides, seed=seed)
    else:
        checkpoint = request.getfixturevalue("checkpoints")(model_type, overrides, seed=seed, dtype="float32")
    backend, tol = (torch_fp32, FP32_TOL) if path is None else (engine_bf16(path), BF16_TOL[model_type])
    errors = parity_errors(transformers, checkpoint, model_cls, backend, batch)
    print(f"{model_type} {path or 'torch-fp32'} batch {batch}: max rel. error over prefill + {DECODE_STEPS} decode "
          f"steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors
