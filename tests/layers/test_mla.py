"""DeepSeek-V2 / V3 multi-head latent attention against transformers' own implementation beyond the parity test
(tests/models/test_parity.py): a checkpoint with YaRN RoPE (prefill + cached decode, batch 1 and 2), and the
weight-absorbed decode form against the expanded one on the same cache state. Routed experts: fp32 TorchExperts
(no engine path involved)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM  # noqa: E402
from parity import DECODE_STEPS, load_ours, max_rel, parity_errors, torch_fp32  # noqa: E402

MODELS = {"deepseek_v3": DeepseekV3ForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}

YARN = {
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 256,
}


@pytest.fixture(params=list(MODELS))
def checkpoint(request, checkpoints):
    # Layer 0 dense (first_k_dense_replace=1), layers 1 and 2 MoE with shared experts: test_parity.py's checkpoint.
    arch = request.param
    return arch, checkpoints(arch, {"num_hidden_layers": 3}, seed=7, dtype="float32")


# Measured (TorchExperts fp32, max rel. logit error over prefill + decode): 2.1e-7 to 3.1e-7.
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("arch, mscale_all_dim", [("deepseek_v3", 1.0), ("deepseek_v3", 0.707), ("deepseek_v2", 0.707)])
def test_yarn_matches_transformers(checkpoints, arch, mscale_all_dim, batch):
    # mscale == mscale_all_dim (as DeepSeek-V3 ships): cos/sin unscaled, softmax scale * mscale**2;
    # mscale != mscale_all_dim: also a YaRN attention factor != 1 on cos/sin.
    overrides = {**YARN, "rope_parameters": {**YARN["rope_parameters"], "mscale_all_dim": mscale_all_dim}}
    path = checkpoints(arch, {"num_hidden_layers": 3, **overrides}, seed=11, dtype="float32")
    errors = parity_errors(transformers, path, MODELS[arch], torch_fp32, batch)
    print(f"{arch} yarn (mscale_all_dim {mscale_all_dim}) batch {batch}: max rel. error over prefill + "
          f"{DECODE_STEPS} decode steps: {max(errors):.2e}")
    assert max(errors) <= 1e-4, errors


# Measured (fp32 logits, batch 2 at positions 5 and 9, max rel. difference absorbed vs expanded):
# V3 S=1 1.8e-7, S=3 2.0e-7; V2 S=1 1.8e-7, S=3 2.2e-7.
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
