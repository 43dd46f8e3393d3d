"""GLM-4.5 family (glm4_moe) and MiniMax-M2 (minimax_m2) beyond their logit parity with transformers
(tests/models/test_parity.py):

* partial RoPE: the RoPE table and its rotation bitwise as transformers' own, and how much of a head turns read
  from config.json as transformers' config classes read it;
* contract: tiny random models (hetmoe.load.random_weights.build_random_model: placed as the loader places a
  checkpoint, bf16 experts on the CPU engine's best row-block path), fp32 and bf16: shapes and dtypes,
  prefill then cached decode of a batch of 2 against one forward over the whole sequence and against each sequence
  alone;
* config.json entries the model files cannot run, refused naming the entry before any weight is read;
* the CPU decode step (engine/cpu_decode.py) leaves these models to the eager forward, and why;
* end to end: greedy generation through ``LLM`` from a checkpoint directory written by transformers' own class
  equals transformers' ``generate``; a GLM checkpoint's multi-token-prediction layer is never read;
* GPU (marked): the CUDA graph decode with the fused path on against off and against the eager step, and the
  GPU placement (dense on the GPU, experts on the CPU engine) against transformers on the CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from decode_steps import graph_decode
from hetmoe.config.options import EngineOptions
from hetmoe.layers.attention import Step
from hetmoe.layers.rope import apply_rope, cos_sin
from hetmoe.load.checkpoint import Checkpoint
from hetmoe.models.config import ModelConfig
from hetmoe.moe.router import RouterSpec
from parity import assert_refused_before_weights, max_rel
from paths import BEST_ROW_PATH

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False)
# Tiny configs of each feature set (contract): GLM-4.6 (q/k norm, q/k/v bias, scaled routing in groups), GLM-4.5-Air
# without q/k norm (and here without bias; first_k_dense_replace and the RoPE share left to transformers' defaults:
# 1 and 0.5), MiniMax-M2.
TINY = {
    "glm4_moe": dict(COMMON, model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=32,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                     partial_rotary_factor=0.5),
    "glm4_moe-air": dict(COMMON, model_type="glm4_moe", intermediate_size=96, moe_intermediate_size=32,
                         n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1),
    "minimax_m2": dict(COMMON, model_type="minimax_m2", intermediate_size=32, num_local_experts=6,
                       num_experts_per_tok=2, rotary_dim=8, rope_theta=5e6, use_qk_norm=True,
                       qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True),
}
CPU = dict(device="cpu", dtype="fp32", experts_format="bf16", **BEST_ROW_PATH.options)


def _random_model(name: str, dtype: str = "fp32", device: str = "cpu", **options):
    from hetmoe.load.random_weights import build_random_model

    opts = EngineOptions(device=device, dtype=dtype, experts_format="bf16", max_context=96, max_batch=8,
                         **({} if device == "cuda" else BEST_ROW_PATH.options), **options)
    return build_random_model(TINY[name], None, opts, std=0.08, log=lambda m: None)


# ---------------------------------------------------------------- partial RoPE


# (raw config.json entries, the dims of each 16-wide head transformers turns)
ROPE_CONFIGS = [
    ("glm4_moe", {}, 8),  # Glm4MoeConfig's default partial_rotary_factor 0.5
    ("glm4_moe", {"partial_rotary_factor": 0.25}, 4),
    ("glm4_moe", {"partial_rotary_factor": 0.25,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}, 16),
    ("minimax_m2", {"rotary_dim": 8}, 8),
    ("minimax_m2", {"rotary_dim": 8, "partial_rotary_factor": 0.25}, 4),
    ("minimax_m2", {"rotary_dim": 8, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, 12),
    ("minimax_m2", {}, 16),
]


@pytest.mark.parametrize("model_type,raw,dims", ROPE_CONFIGS)
def test_rope_share_and_table_are_transformers(model_type, raw, dims):
    """How much of each head RoPE turns (ModelConfig.rope_dim, with the config class's defaults) and the inverse
    frequencies (theta included: MiniMax's default 5e6) equal what transformers' config and rotary classes make
    of the same config.json entries; the cos/sin tables equal theirs bitwise, past 32K positions too."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding

    from hetmoe.models import model_class

    base = {k: v for k, v in TINY[model_type].items() if k not in ("partial_rotary_factor", "rotary_dim",
                                                                    "rope_theta")}
    cfg = ModelConfig({**base, **raw})
    hf_cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items() if k != "model_type"})
    rotary = {"glm4_moe": Glm4MoeRotaryEmbedding, "minimax_m2": MiniMaxM2RotaryEmbedding}[model_type](hf_cfg)
    assert cfg.with_defaults().rope_dim == dims == 2 * rotary.inv_freq.numel()
    with torch.device("meta"):
        ours = model_class(cfg)(cfg).model
    assert torch.equal(ours.inv_freq, rotary.inv_freq)
    positions = torch.tensor([[0, 1, 5, 77, 1000, 32_768, 40_000, 131_071]])
    for dtype in (torch.float32, torch.bfloat16):
        hf_cos, hf_sin = rotary(torch.zeros(1, dtype=dtype), positions)
        cos, signed_sin = cos_sin(positions, ours.inv_freq, dtype)
        assert torch.equal(cos[:, :, 0], hf_cos)
        assert torch.equal(signed_sin[:, :, 0, dims // 2:], hf_sin[..., dims // 2:])
        assert torch.equal(signed_sin[:, :, 0, :dims // 2], -hf_sin[..., :dims // 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rope_rotation_is_transformers(dtype):
    """apply_rope with a table narrower than the head turns the leading dims and passes the rest, bitwise as
    transformers' apply_rotary_pos_emb (GLM-4.5's and MiniMax-M2's are the same function)."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    B, S, H, K, D, R = 2, 5, 4, 2, 16, 8
    q, k = (torch.randn(B, S, n, D, generator=gen).to(dtype) for n in (H, K))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, R, 2, dtype=torch.float32) / R))
    positions = torch.randint(0, 500, (B, S), generator=gen)
    cos, signed_sin = cos_sin(positions, inv_freq, dtype)  # [B, S, 1, R]
    sin = torch.cat((-signed_sin[..., :R // 2], signed_sin[..., R // 2:]), dim=-1)
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[:, :, 0], sin[:, :, 0])
    assert torch.equal(apply_rope(q, cos, signed_sin), hf_q.transpose(1, 2))
    assert torch.equal(apply_rope(k, cos, signed_sin), hf_k.transpose(1, 2))
    assert torch.equal(apply_rope(q, cos, signed_sin)[..., R:], q[..., R:])


# ---------------------------------------------------------------- contract


# max |cached - whole| / max |whole| over every position, and batch 2 against each sequence alone. MEASURED (the
# three configs; experts on the best row-block path): fp32 cached~whole <= 5.2e-7, batch~alone <= 3.9e-7 (the dense
# GEMMs' fp32 order); bf16 cached~whole <= 1.3e-2 (the whole sequence's SDPA rounds its probabilities to bf16, the
# one-token steps' CPU decode attention keeps them in fp32), batch~alone 0. Bounds about 2-3x: fp32 1e-5 (the fp32
# bound of the engine tests), bf16 2.5e-2.
# That bf16 rounding may also flip a router's top-k between near-equal scores (MEASURED on the AVX-512 dev machine
# over 60 prompts per config: 4-7 prompts flip a token, 3.3e-2 to 0.30 on the logits from that token on; which
# prompts flip changes with the bf16 GEMMs torch's SDPA runs on the CPU: on an AMX Xeon prompt 11 flips, 0.42 on
# glm4_moe's logits and 0.099 on minimax_m2's). So cached~whole is compared up to each sequence's first token routed
# otherwise, and at that token the router logits of the two runs must agree within the bound (a near-tie, not a
# wrong input); batch~alone is compared at every position.
CACHED_TOL = {"fp32": 1e-5, "bf16": 2.5e-2}
# 23 (minimax_m2) and 25 (glm4_moe, glm4_moe-air): prompts whose cached and whole runs route a token otherwise on the
# AVX-512 dev machine
PROMPT_SEEDS = (11, 23, 25)


def _forward(model, ids: torch.Tensor, start: int, slots: torch.Tensor, cache) -> torch.Tensor:
    B, S = ids.shape
    step = Step(positions=torch.arange(start, start + S).expand(B, S), slots=slots)
    hidden = model(ids, step, cache)
    assert hidden.shape == (B, S, model.config.hidden_size) and hidden.dtype == model.model.embed_tokens.weight.dtype
    logits = model.logits(hidden)
    assert logits.shape == (B, S, model.config.vocab_size) and logits.dtype == hidden.dtype
    return logits


def _spy_routing(monkeypatch) -> list:
    """Every routing from now on, in call order: (router logits [T, E] fp32, top-k ids [T, k] sorted)."""
    calls, route = [], RouterSpec.route

    def spy(self, logits, correction_bias=None):
        weights, ids = route(self, logits, correction_bias)
        calls.append((logits.detach().float().clone(), ids.sort(dim=-1).values))
        return weights, ids

    monkeypatch.setattr(RouterSpec, "route", spy)
    return calls


def _by_layer(calls: list, n_layers: int, B: int) -> tuple:
    """The routings of consecutive forwards of B sequences (one per MoE layer each, in layer order) -> router logits
    [L, B, S, E] and ids [L, B, S, k] over the positions of all the forwards."""
    def stack(i):
        return torch.stack([torch.cat([c[i].view(B, -1, c[i].shape[-1]) for c in calls[layer::n_layers]], dim=1)
                            for layer in range(n_layers)])

    return stack(0), stack(1)


def _cached_whole_err(cached, whole, routed_cached: tuple, routed_whole: tuple, tol: float) -> tuple:
    """max |cached - whole| / max |whole| over the positions of each sequence before its first token that a router
    sends to other experts in the two runs; at that token the router logits must agree within ``tol``.
    Returns (the error, the number of sequences with such a token)."""
    (c_logits, c_ids), (w_logits, w_ids) = routed_cached, routed_whole
    assert c_ids.shape == w_ids.shape and c_ids.shape[1:3] == cached.shape[:2]
    differ = (c_ids != w_ids).any(dim=-1)  # [L, B, S]
    compared = torch.ones(cached.shape[:2], dtype=torch.bool)  # [B, S]
    for b in range(cached.shape[0]):
        layer_pos = differ[:, b].nonzero()  # (layer, position) of each differing routing
        if len(layer_pos):
            pos = int(layer_pos[:, 1].min())
            layer = int(layer_pos[layer_pos[:, 1] == pos, 0].min())  # the first layer routing it otherwise
            err = max_rel(c_logits[layer, b, pos], w_logits[layer, b, pos])
            assert err <= tol, f"sequence {b}, position {pos}, MoE layer {layer}: router logits differ by {err:.1e}"
            compared[b, pos:] = False
    diff = (cached.float() - whole.float()).abs()[compared]
    return (diff.max() / whole.float().abs().max()).item(), int((~compared).any(dim=1).sum())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(TINY))
def test_prefill_then_cached_decode(monkeypatch, name, dtype):
    loaded = _random_model(name, dtype)
    model, torch_dtype = loaded.model, loaded.plan.dtype
    assert model.config.rope_dim == 8 and model.model.inv_freq.shape == (4,)
    assert all(b.moe.experts is not None for b in model.modules() if hasattr(b, "moe"))
    calls = _spy_routing(monkeypatch)
    n_moe = sum(hasattr(b, "moe") for b in model.modules())
    prompt, steps = 7, 3
    slots = torch.arange(2)
    for seed in PROMPT_SEEDS:
        ids = torch.randint(0, 256, (2, prompt + steps), generator=torch.Generator().manual_seed(seed))
        calls.clear()
        with torch.inference_mode():
            cache = model.make_cache(2, 32, torch_dtype)
            cached = [_forward(model, ids[:, :prompt], 0, slots, cache)]
            for i in range(prompt, prompt + steps):  # one token per sequence over the cache
                cached.append(_forward(model, ids[:, i:i + 1], i, slots, cache))
            cached = torch.cat(cached, dim=1)  # [2, prompt + steps, vocab]
            assert len(calls) == n_moe * (1 + steps)  # each MoE layer routes once per forward
            routed_cached = _by_layer(calls[:], n_moe, 2)
            calls.clear()
            whole = _forward(model, ids, 0, slots, model.make_cache(2, 32, torch_dtype))
            assert len(calls) == n_moe
            routed_whole = _by_layer(calls[:], n_moe, 2)
            alone = []
            for b in range(2):  # each sequence alone, in slot 0 of a fresh cache
                one = model.make_cache(1, 32, torch_dtype)
                rows = [_forward(model, ids[b:b + 1, :prompt], 0, slots[:1], one)]
                rows += [_forward(model, ids[b:b + 1, i:i + 1], i, slots[:1], one)
                         for i in range(prompt, prompt + steps)]
                alone.append(torch.cat(rows, dim=1))
        err, flipped = _cached_whole_err(cached, whole, routed_cached, routed_whole, CACHED_TOL[dtype])
        alone_err = max_rel(cached, torch.cat(alone))
        print(f"{name} {dtype} prompt {seed}: cached~whole {err:.1e} ({flipped} sequences compared up to a token "
              f"routed otherwise), batch~alone {alone_err:.1e}")
        assert torch.isfinite(cached).all() and max(err, alone_err) <= CACHED_TOL[dtype], (err, alone_err)


def test_minimax_without_routing_bias():
    """use_routing_bias false: no correction bias in the checkpoint (nothing to load), zeros in the router."""
    from hetmoe.load.loader import build_meta

    cfg = ModelConfig(TINY["minimax_m2"], use_routing_bias=False)
    model = build_meta(cfg)
    assert not any(k.endswith("e_score_correction_bias") for k in model.state_dict())
    bias = model.model.layers[0].mlp.e_score_correction_bias
    assert bias.device.type == "cpu" and torch.equal(bias, torch.zeros(6))
    with_bias = build_meta(ModelConfig(TINY["minimax_m2"])).state_dict()
    assert with_bias["model.layers.0.block_sparse_moe.e_score_correction_bias"].shape == (6,)


# ---------------------------------------------------------------- refused configs

BAD = {  # case -> (family, config.json changes (None drops the entry), the message after the file name)
    "glm-odd-rope-dims": ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                           "partial_rotary_factor": 0.1875}},
                          r"rope_parameters.partial_rotary_factor is 0.1875: RoPE would turn 3 of the 16 dims of "
                          r"each head; it needs an even number between 2 and 16"),
    "glm-rope-beyond-head": ("glm4_moe", {"rope_parameters": None, "partial_rotary_factor": 2},
                             "partial_rotary_factor is 2: RoPE would turn 32 of the 16 dims"),
    "glm-rope-not-a-number": ("glm4_moe", {"rope_parameters": {"partial_rotary_factor": "half"}},
                              "rope_parameters.partial_rotary_factor is 'half'; it must be a number > 0"),
    "glm-groups": ("glm4_moe", {"n_group": 3}, r"n_group is 3; it must divide the 8 routed experts \(n_routed_"),
    "glm-no-experts": ("glm4_moe", {"n_routed_experts": 0}, "n_routed_experts is 0; it must be an integer >= 1"),
    "glm-dense-layers": ("glm4_moe", {"first_k_dense_replace": -1},
                         "first_k_dense_replace is -1; it must be an integer >= 0"),
    "glm-default-dense-layer": ("glm4_moe", {"first_k_dense_replace": None, "intermediate_size": None},
                                "does not describe a glm4_moe model: it has no intermediate_size"),
    "glm-expert-size": ("glm4_moe", {"moe_intermediate_size": None},
                        "does not describe a glm4_moe model: it has no moe_intermediate_size"),
    "glm-activation": ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act is 'gelu'; glm4_moe runs SwiGLU"),
    "glm-scaling": ("glm4_moe", {"routed_scaling_factor": 0}, "routed_scaling_factor is 0; it must be a number > 0"),
    "minimax-odd-rotary-dim": ("minimax_m2", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6},
                                              "rotary_dim": 7},
                               "rotary_dim is 7: RoPE would turn 7 of the 16 dims of each head"),
    "minimax-one-expert": ("minimax_m2", {"num_local_experts": 1, "num_experts_per_tok": 1},
                           "num_local_experts is 1; MiniMax-M2's router needs at least 2 routed experts"),
    "minimax-shared-expert": ("minimax_m2", {"shared_intermediate_size": 64},
                              "shared_intermediate_size is 64; hetmoe's minimax_m2 has no shared expert"),
    "minimax-lightning": ("minimax_m2", {"attn_type_list": [0, 1, 1]}, "attn_type_list lists layers other than"),
    "minimax-no-qk-norm": ("minimax_m2", {"use_qk_norm": False}, "use_qk_norm is False; hetmoe's minimax_m2 runs"),
    "minimax-per-head-norm": ("minimax_m2", {"qk_norm_type": "per_head"}, "qk_norm_type is 'per_head'"),
    "minimax-softmax": ("minimax_m2", {"scoring_func": "softmax"}, "scoring_func is 'softmax'"),
    "minimax-scaled": ("minimax_m2", {"routed_scaling_factor": 2.0}, "routed_scaling_factor is 2.0; hetmoe's"),
    "minimax-groups": ("minimax_m2", {"use_grouped_topk": True, "num_expert_group": 2},
                       r"num_expert_group is 2 \(use_grouped_topk\); hetmoe's minimax_m2 routes without expert"),
    "minimax-window": ("minimax_m2", {"attn_window_size": [0, 64, 0]},
                       r"attn_window_size is \[0, 64, 0\]; hetmoe's minimax_m2 attends over the whole context"),
    "minimax-expert-size": ("minimax_m2", {"intermediate_size": None},
                            "does not describe a minimax_m2 model: it has no intermediate_size"),
    "minimax-top-k": ("minimax_m2", {"num_experts_per_tok": 7},
                      r"num_experts_per_tok is 7; with 6 routed experts \(num_local_experts\) it must be between"),
}
PARITY = {"glm4_moe": {"num_hidden_layers": 3, "use_qk_norm": True, "attention_bias": True,
                       "routed_scaling_factor": 2.5}, "minimax_m2": {"num_hidden_layers": 3}}  # test_parity's


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_refused_before_any_weight(hf_checkpoints, tmp_path, monkeypatch, case):
    family, changes, message = BAD[case]
    source = hf_checkpoints(family, PARITY[family], seed=5)
    assert_refused_before_weights(source, tmp_path / family, monkeypatch, changes, message, CPU)


# ---------------------------------------------------------------- the CPU decode step


@pytest.mark.parametrize("name", ["glm4_moe", "minimax_m2"])
def test_cpu_decode_step_stays_eager(name):
    """The lean CPU decode step's attention block turns and normalises whole heads: it refuses these models (the
    reason said), and the runner's one-token steps take the eager forward, equal to the forward called directly."""
    from hetmoe.engine.cpu_decode import why_not
    from hetmoe.engine.runner import Runner

    loaded = _random_model(name)
    runner = Runner(loaded)
    assert runner.lean is None
    assert why_not(loaded.model, runner.cache) == "layer 0's attention is not the GQA attention"
    prompt = [5, 17, 200, 42, 9]
    runner.prefill(prompt)
    steps = [runner.decode(t).float() for t in (7, 11)]
    model = loaded.model
    with torch.inference_mode():
        cache = model.make_cache(1, 16, torch.float32)
        ids = torch.tensor([prompt + [7, 11]])
        whole = model.logits(model(ids, Step(torch.arange(7).view(1, 7), torch.tensor([0])), cache))[0, -2:]
    assert max_rel(torch.stack(steps).view(2, -1), whole) < 1e-5


# ---------------------------------------------------------------- end to end


def _add_mtp_layer(path: Path, cfg: dict) -> list:
    """GLM checkpoints carry their multi-token-prediction layer as model.layers.<num_hidden_layers>.*: a shard of
    such tensors (random, of the real names and shapes) added to the index. Returns their names."""
    from safetensors.torch import save_file

    L, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    I, E, D = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["head_dim"]
    p = f"model.layers.{L}."
    shapes = {"eh_proj.weight": (H, 2 * H), "enorm.weight": (H,), "hnorm.weight": (H,),
              "shared_head.norm.weight": (H,), "shared_head.head.weight": (V, H), "input_layernorm.weight": (H,),
              "self_attn.q_proj.weight": (cfg["num_attention_heads"] * D, H), "mlp.gate.weight": (E, H),
              "mlp.gate.e_score_correction_bias": (E,), "mlp.shared_experts.gate_proj.weight": (I, H)}
    shapes.update({f"mlp.experts.{e}.{w}.weight": (H, I) if w == "down_proj" else (I, H)
                   for e in range(E) for w in ("gate_proj", "up_proj", "down_proj")})
    tensors = {p + k: torch.randn(s) for k, s in shapes.items()}
    save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return list(tensors)


E2E = {  # GLM-4.5-Air's features (no q/k norm, q/k/v bias); MiniMax-M2 as test_parity's
    "glm4_moe": {"num_hidden_layers": 3, "attention_bias": True, "use_qk_norm": False, "n_group": 1,
                 "topk_group": 1, "num_nextn_predict_layers": 1},
    "minimax_m2": {"num_hidden_layers": 3},
}


@pytest.mark.parametrize("family", list(E2E))
def test_generate_from_a_transformers_checkpoint(hf_checkpoints, tmp_path, monkeypatch, family):
    """``LLM`` on a checkpoint directory Transformers wrote (sharded, with a tokenizer): the native runner, greedy
    tokens equal to transformers' generate (fp32 dense, bf16 experts holding the bf16-rounded weights exactly on the
    row-block path). GLM: an MTP layer added to the checkpoint, never read."""
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.runner import Runner
    from hetmoe.engine.sampler import SamplingParams

    source = hf_checkpoints(family, E2E[family], seed=4, tokenizer=True)  # (seed 4: no greedy loop of one token)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    path = Path(shutil.copytree(source, tmp_path / family))
    cfg = json.loads((path / "config.json").read_text())
    mtp = _add_mtp_layer(path, cfg) if family == "glm4_moe" else []
    read = set()
    get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: read.add(name) or get(self, name))
    llm = LLM(path, EngineOptions(max_context=64, **CPU), expert_cache=None, progress=False, log=lambda m: None)
    assert isinstance(llm.runner, Runner) and llm.loaded.config["model_type"] == family
    assert read and not read & set(mtp)  # the model's tensors were read, the MTP layer's never
    prompt = "def f(x):\n    return"
    out = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), chat=False)
    ids = llm.tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):]
    print(f"{family}: {out.token_ids} (transformers: {ref.tolist()})")
    assert out.completion_tokens == 8 and out.token_ids == ref.tolist()


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_graph_decode_on_gpu(name, attention):
    """Dense part on the GPU (bf16), experts on the CPU engine through the stream-ordered jobs: the CUDA graph decode
    with the fused path on against off and against the same steps eager, batch 1, 3 and 8, over the paged cache
    (Triton attention) and the contiguous one (SDPA). Paths: GPU + the CPU engine. Bound 5e-2 relative max logit
    error, the bf16 graph tests' (tests/ops/test_fused_decode.py)."""
    pytest.importorskip("triton")
    loaded = _random_model(name, "bf16", "cuda", attention=attention)
    for batch in (1, 3, 8):
        on, off = graph_decode(loaded, batch, True), graph_decode(loaded, batch, False)
        eager = graph_decode(loaded, batch, True, graph=False)
        errs = {"fused~unfused": max_rel(on, off), "graph~eager": max_rel(on, eager)}
        print(f"{name} {attention} batch {batch}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert torch.isfinite(on).all() and all(v < 5e-2 for v in errs.values()), errs


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["glm4_moe", "minimax_m2"])
def test_gpu_placement_matches_transformers(hf_checkpoints, family):
    """The parity checkpoint loaded by hetmoe onto the GPU (fp32 dense, bf16 experts on the CPU engine's row-block
    path, decode through the CUDA graph with the fused path) against transformers on the CPU: prefill and 6 greedy
    steps. Bound 1e-3 relative max logit error (fp32 GPU kernels in another order; measured values printed)."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    path = hf_checkpoints(family, PARITY[family], seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(path, EngineOptions(**{**CPU, "device": "cuda"}, max_context=64), expert_cache=None,
                        progress=False, log=lambda m: None)
    runner = Runner(loaded)
    ids = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]
    errs = []
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True)
        errs.append(max_rel(runner.prefill(ids).view(-1), out.logits[0, -1]))
        for _ in range(6):
            nxt = int(out.logits[0, -1].argmax())
            out = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
            errs.append(max_rel(runner.decode(nxt).view(-1), out.logits[0, -1]))
    print(f"{family} GPU~transformers: " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 1e-3, errs
