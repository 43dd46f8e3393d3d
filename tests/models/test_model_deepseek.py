"""DeepSeek-V2 / V3 (MLA, dense-then-MoE layers, shared experts) parity with transformers' own implementation:
prefill (expanded MLA form), then cached decode steps (weight-absorbed MLA form), batch 1 and 2; plus a
DeepSeek-V3 checkpoint with YaRN RoPE; plus the absorbed vs the expanded form on the same cache state."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hetmoe.engine.synthetic import write_checkpoint  # noqa: E402
from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM  # noqa: E402
from parity import DECODE_STEPS, engine_bf16, load_ours, max_rel, parity_errors, torch_fp32  # noqa: E402

MODELS = {"deepseek_v3": DeepseekV3ForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}

YARN = {
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 256,
}


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoint(request, tmp_path_factory):
    # Layer 0 dense (first_k_dense_replace=1), layers 1 and 2 MoE with shared experts.
    arch = request.param
    path = write_checkpoint(tmp_path_factory.mktemp(arch), arch, {"num_hidden_layers": 3}, seed=7, dtype="float32")
    return arch, path


# Measured (batch 1 / 2), TorchExperts fp32: V3 2.4e-7 / 2.4e-7, V2 2.6e-7 / 2.8e-7; CPU engine, bf16 experts:
# V3 7.9e-4 / 6.9e-4 (routed_scaling_factor 2.5 amplifies the expert rounding), V2 7.9e-5 / 7.8e-5.
BF16_TOL = {"deepseek_v3": 6e-3, "deepseek_v2": 6e-4}


@pytest.mark.parametrize("backend", [torch_fp32, engine_bf16], ids=["torch-fp32", "engine-bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_and_decode_match_transformers(checkpoint, backend, batch):
    arch, path = checkpoint
    tol = 1e-4 if backend is torch_fp32 else BF16_TOL[arch]
    errors = parity_errors(transformers, path, MODELS[arch], backend, batch)
    print(f"{arch} batch {batch}: max rel. error over prefill + {DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= tol, errors


# Measured (TorchExperts fp32): 1.9e-7 to 2.7e-7.
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("arch, mscale_all_dim", [("deepseek_v3", 1.0), ("deepseek_v3", 0.707), ("deepseek_v2", 0.707)])
def test_yarn_matches_transformers(tmp_path_factory, arch, mscale_all_dim, batch):
    # mscale == mscale_all_dim (as DeepSeek-V3 ships): cos/sin unscaled, softmax scale * mscale**2;
    # mscale != mscale_all_dim: also a YaRN attention factor != 1 on cos/sin.
    overrides = {**YARN, "rope_parameters": {**YARN["rope_parameters"], "mscale_all_dim": mscale_all_dim}}
    path = write_checkpoint(tmp_path_factory.mktemp(f"{arch}_yarn"), arch, {"num_hidden_layers": 3, **overrides},
                            seed=11, dtype="float32")
    errors = parity_errors(transformers, path, MODELS[arch], torch_fp32, batch)
    print(f"{arch} yarn (mscale_all_dim {mscale_all_dim}) batch {batch}: max rel. error over prefill + "
          f"{DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= 1e-4, errors


# Measured (fp32 logits, batch 2 at positions 5 and 9, max rel. difference absorbed vs expanded):
# V3 S=1 1.8e-7, S=3 2.0e-7; V2 S=1 1.8e-7, S=3 2.0e-7.
@pytest.mark.parametrize("S", [1, 3])
def test_absorbed_decode_matches_expanded(checkpoint, S):
    arch, path = checkpoint
    model = load_ours(path, MODELS[arch], torch_fp32)
    attns = [layer.self_attn for layer in model.model.layers]
    assert S <= min(a.absorb_max_tokens for a in attns)
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(3)
    cache = model.make_cache(2, 16)
    lengths = [5, 9]  # different positions per sequence
    with torch.no_grad():
        for slot, n in enumerate(lengths):  # prefill (expanded form), one sequence per call
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            model(ids, Step(positions=torch.arange(n).unsqueeze(0), slots=torch.tensor([slot])), cache)
        ids = torch.randint(0, vocab, (2, S), generator=gen)
        step = Step(positions=torch.stack([torch.arange(n, n + S) for n in lengths]), slots=torch.arange(2))
        absorbed = model.logits(model(ids, step, copy.deepcopy(cache)))
        for a in attns:
            a.absorb_max_tokens = 0
        expanded = model.logits(model(ids, step, copy.deepcopy(cache)))
    err = max_rel(absorbed, expanded)
    print(f"{arch} S={S}: absorbed vs expanded max rel. difference {err:.2e}")
    assert err <= 1e-5, err
