"""Kimi-K2.5 / K2.6 (model_type ``kimi_k25``): the DeepSeek-V3 language model of a multimodal checkpoint whose routed
experts are compressed-tensors pack-quantized int4 (tests/kimi_tiny.py: written by Transformers' DeepseekV3 classes
and compressed-tensors' compressor, or hetmoe's packer without the library), loaded by hetmoe's loader, against
Transformers' DeepseekV3ForCausalLM on the same weights dequantized (the reference checkpoint written beside it):

* logits over a prefill and DECODE_STEPS cached greedy steps (tests/parity.py's trace), batch 1 and 2: with the
  loaded engine's experts swapped for fp32 TorchExperts holding the engine's own values (what is left is the dense
  part, the loader's mapping of the wrapper and the fp32 summation order: test_parity.py's FP32_TOL), and with the
  int4 experts in the CPU engine on each class of path (the experts read int8 activations per group: the bound of
  tests/load/gguf's Q4_0 experts);
* end to end: greedy generation through ``LLM`` from the checkpoint directory (its tokenizer) equals Transformers'
  ``generate`` on the reference; the vision tower's tensors are never read;
* Kimi-K2.5's published config.json maps onto the DeepSeek-V3 model file and passes its checks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kimi_tiny import ct_available, save_kimi_k25  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.load.checkpoint import Checkpoint  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from hetmoe.moe import TorchExperts  # noqa: E402
from parity import DECODE_STEPS, hf_trace, max_rel  # noqa: E402
from paths import BEST_ROW_PATH, CLASS_PATHS, ids  # noqa: E402

PACKER = "compressed-tensors" if ct_available() else "own"
FP32_TOL = 1e-4  # tests/models/test_parity.py's: fp32 experts, the two implementations' summation order
# Int4 experts in the engine read their activations as int8 per group of 32 (both classes of path: the same bits,
# tests/paths.py). MEASURED (seed 3, batch 1 / 2): 1.5e-2 / 1.5e-2 on each class (fp32 experts: 9.9e-7 / 6.4e-7).
# Bound: tests/load/gguf's for Q4_0 experts.
INT4_TOL = 5e-2


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return save_kimi_k25(tmp_path_factory.mktemp("kimi") / "kimi-k25", seed=3, packer=PACKER)


def _load(path, **options):
    opts = EngineOptions(device="cpu", dtype="fp32", threads=1, max_batch=2, **options)
    return load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)


def _errors(model, ref, batch: int, prompt_len: int = 11) -> list:
    """Max rel. logit error of ``model`` against transformers on ``ref`` for the prefill and each decode step
    (transformers' greedy tokens fed to both)."""
    ids, fed, hf_logits = hf_trace(transformers, ref, batch, prompt_len)
    S, slots = prompt_len, torch.arange(batch)
    cache = model.make_cache(batch, S + DECODE_STEPS + 4)
    with torch.no_grad():
        logits = model.logits(model(ids, Step(positions=torch.arange(S).expand(batch, S), slots=slots), cache))
        errors = [max_rel(logits, hf_logits[0])]
        for i, nxt in enumerate(fed):
            logits = model.logits(model(nxt, Step(positions=torch.full((batch, 1), S + i), slots=slots), cache))
            errors.append(max_rel(logits, hf_logits[i + 1]))
    return errors


@pytest.mark.parametrize("batch", [1, 2])
def test_logits_match_transformers_with_fp32_experts(kimi, batch):
    path, ref, _ = kimi
    loaded = _load(path, **BEST_ROW_PATH.options)
    assert loaded.config["model_type"] == "kimi_k25" and type(loaded.model).__name__ == "DeepseekV3ForCausalLM"
    for _, layer in moe_blocks(loaded.model):
        engine = layer.engine
        mats = [engine.dequantized(e) for e in range(engine.num_experts)]
        layer.attach(TorchExperts(*(torch.stack([m[i] for m in mats]) for i in range(3)), torch.float32))
    errors = _errors(loaded.model, ref, batch)
    print(f"kimi_k25 torch-fp32 batch {batch}: max rel. error over prefill + {DECODE_STEPS} decode steps: "
          f"{max(errors):.2e}")
    assert max(errors) <= FP32_TOL, errors


@pytest.mark.parametrize("path", CLASS_PATHS, ids=ids(CLASS_PATHS))
@pytest.mark.parametrize("batch", [1, 2])
def test_logits_match_transformers_with_int4_experts(kimi, path, batch):
    ckpt, ref, _ = kimi
    loaded = _load(ckpt, **path.options)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == ("int4", 32)
    errors = _errors(loaded.model, ref, batch)
    print(f"kimi_k25 engine-int4-{path} batch {batch}: max rel. error over prefill + {DECODE_STEPS} decode steps: "
          f"{max(errors):.2e}")
    assert max(errors) <= INT4_TOL, errors


def test_generate_from_the_checkpoint_directory(kimi, monkeypatch):
    """``LLM`` on the kimi_k25 directory: the native runner, its tokenizer, greedy tokens equal to transformers'
    generate on the dequantized reference; nothing of the vision tower read."""
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.runner import Runner
    from hetmoe.engine.sampler import SamplingParams

    path, ref, _ = kimi
    read, get = set(), Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: read.add(name) or get(self, name))
    llm = LLM(path, EngineOptions(device="cpu", dtype="fp32", max_context=64, **BEST_ROW_PATH.options),
              expert_cache=None, progress=False, log=lambda m: None)
    assert isinstance(llm.runner, Runner) and llm.loaded.plan.experts_format == "int4"
    assert read and not any(n.startswith(("vision", "mm_projector")) for n in read)
    prompt = "def f(x):\n    return"
    out = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), chat=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    ids = llm.tokenizer.encode(prompt)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):]
    print(f"kimi_k25: {out.token_ids} (transformers: {want.tolist()})")
    assert out.completion_tokens == 8 and out.token_ids == want.tolist()


# Kimi-K2.5's config.json as published (its text_config's sizes; the vision config cut to a few entries)
K25_TEXT = dict(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], vocab_size=163840, hidden_size=7168,
                intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
                num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
                first_k_dense_replace=1, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, topk_method="noaux_tc",
                scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.827, rms_norm_eps=1e-5,
                max_position_embeddings=262144, rope_theta=50000.0, hidden_act="silu", tie_word_embeddings=False,
                rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})


def test_the_published_config_maps_onto_deepseek_v3():
    """text_model_config of Kimi-K2.5's config.json: the DeepSeek-V3 model of its text_config (61 layers, 60 of them MoE
    with 384 experts), the wrapper's model_type kept, its checks passed, a context of 262144 positions."""
    from kimi_tiny import QUANT

    from hetmoe.load.checkpoint import check_quantization
    from hetmoe.load.loader import build_meta
    from hetmoe.models import check_config, context_limit, model_class, text_model_config
    from hetmoe.models.config import ModelConfig

    raw = ModelConfig({"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                       "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839,
                       "media_placeholder_token_id": 163605, "tie_word_embeddings": False,
                       "text_config": {**K25_TEXT, "quantization_config": QUANT},
                       "vision_config": {"patch_size": 14, "vt_hidden_size": 1152, "vt_num_hidden_layers": 27}})
    cfg = text_model_config(raw)
    assert cfg["model_type"] == "kimi_k25" and cfg["hidden_size"] == 7168 and cfg["eos_token_id"] == 163585
    assert "vision_config" not in cfg and cfg["quantization_config"] == QUANT
    check_config(cfg)
    check_quantization(cfg, "config.json")
    assert model_class(cfg).__name__ == "DeepseekV3ForCausalLM"
    assert context_limit(cfg) == (262144, "max_position_embeddings 262144")
    model = build_meta(cfg)
    assert len(moe_blocks(model)) == 60 and moe_blocks(model)[0][1].num_experts == 384
