"""DeepSeek-V4 (deepseek_v4): hetmoe/models/deepseek_v4.py, its attention and cache (hetmoe/layers/
compressed_attention.py) and hyper-connections (hetmoe/layers/hyper_connection.py).

The checkpoints are Transformers' own DeepseekV4ForCausalLM's (tests/transformers_tiny.py: three layers, HCA
compressed 8x, CSA compressed 4x with an indexer keeping the top 3, sliding window only; a window of 8, 2
hyper-connection streams; layer 0 hash-routed, layers 1-2 sqrtsoftplus with a correction bias), with swiglu_limit 0.3
so that the clamp of the SwiGLU inputs changes the experts' and the shared expert's outputs. Prompts of 30 tokens are
longer than the window, the HCA rate and the CSA rate x the indexer's top-k (12): the window, every compressed entry
kind and the indexer's choice all matter (checked: each changed alone moves the logits), and the cached decode steps
cross compression boundaries (CSA entries close at positions 31 and 35, an HCA entry at 31).

Paths: fp32 dense weights on the CPU; routed experts as fp32 TorchExperts with the clamp (the CPU engine's clamp is
not wired yet: its end-to-end test below runs a checkpoint whose limit the activations never reach, and the loader
refuses a model whose experts must clamp while the engine cannot). Tolerances (max |ours - hf| / max |hf|):
parity MEASURED <= 1.2e-6 (bound 1e-4, as tests/models/test_deepseek_v32.py); cached~whole, chunked~whole,
batch~alone MEASURED <= 7e-7 (bound 1e-5).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.cpu.experts import SWIGLU, Glu
from hetmoe.layers.attention import Step
from hetmoe.load.checkpoint import Checkpoint
from hetmoe.models.config import ModelConfig
from hetmoe.moe import TorchExperts
from parity import (
    DECODE_STEPS,
    assert_refused_before_weights,
    generate_like_transformers,
    hf_trace,
    max_rel,
    trace_ours,
)
from paths import BEST_ROW_PATH

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4", allow_module_level=True)

from hetmoe.models.deepseek_v4 import DeepseekV4ForCausalLM, checkpoint_name  # noqa: E402

LIMIT = 0.3
PROMPT = 30
FP32_TOL = 1e-4
CACHED_TOL = 1e-5
CPU = dict(device="cpu", dtype="fp32", experts_format="bf16", **BEST_ROW_PATH.options)
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w3|w2)\.weight")


def checkpoint_of(request, **overrides) -> Path:
    return request.getfixturevalue("hf_checkpoints")("deepseek_v4", {"swiglu_limit": LIMIT, **overrides}, seed=3)


def load_v4(path: Path) -> DeepseekV4ForCausalLM:
    """Our model from a checkpoint directory through hetmoe's Checkpoint (its tensor names mapped to the model's),
    every tensor but the routed experts by name (strict), those stacked per layer into fp32 TorchExperts (the
    layer hands them the swiglu_limit)."""
    ckpt = Checkpoint(path)
    model = DeepseekV4ForCausalLM(ModelConfig.from_file(path / "config.json"))
    tensors, experts = {}, {}
    for name in ckpt.names():
        m = EXPERT.fullmatch(name)
        if m:
            experts.setdefault(int(m[1]), {}).setdefault(m[3], {})[int(m[2])] = ckpt.get(name).float()
        elif not name.startswith("mtp."):
            t = ckpt.get(name)
            tensors[name] = t.float() if t.is_floating_point() else t.clone()
    model.load_state_dict(tensors, strict=True)
    model.fuse_projections()
    for layer, mats in experts.items():
        gate, up, down = (torch.stack([mats[w][e] for e in sorted(mats[w])]) for w in ("w1", "w3", "w2"))
        moe = model.model.layers[layer].mlp.moe
        moe.attach(TorchExperts(gate, up, down, glu=moe.glu))
    ckpt.close()
    return model.eval()


def logits_of(model, ids: torch.Tensor, calls, slots=None, lengths=None, cache=None) -> torch.Tensor:
    """Our logits [B, S, V] over ``ids`` [B, S] fed in ``calls`` ((start, end) spans of positions)."""
    B = ids.shape[0]
    slots = torch.arange(B) if slots is None else slots
    cache = model.make_cache(4, 64) if cache is None else cache
    out = []
    with torch.no_grad():
        for a, b in calls:
            step = Step(torch.arange(a, b).expand(B, b - a), slots, lengths=lengths)
            out.append(model.logits(model(ids[:, a:b], step, cache)))
    return torch.cat(out, dim=1)


# ---------------------------------------------------------------- layout


def test_layout_names_and_cache(request):
    """Each layer's attention and routing kind as Transformers' config derives them, every tensor of our model under a
    name the checkpoint mapping leaves as it is, fp32 buffers for what Transformers keeps in fp32; the cache: a window
    ring per layer, compressed entries of the compressed layers (and the indexer's), the slots' states fixed-size."""
    model = load_v4(checkpoint_of(request))
    layers = model.model.layers
    assert [type(a.self_attn.compressor).__name__ for a in layers] == ["Compressor", "Compressor", "NoneType"]
    assert hasattr(layers[1].self_attn.compressor, "indexer") and not hasattr(layers[0].self_attn.compressor,
                                                                               "indexer")
    assert [type(a.mlp.gate).__name__ for a in layers] == ["DeepseekV4HashRouter"] + ["DeepseekV4TopKRouter"] * 2
    assert [a.rope_kind for a in layers] == ["compress", "compress", "main"]
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()
                                                        if not n.endswith("inv_freq")]
    assert all(checkpoint_name(n) == n for n in names)
    for name in ("self_attn.sinks", "attn_hc.fn", "input_layernorm.weight", "self_attn.compressor.position_bias"):
        assert layers[1].get_buffer(name).dtype == torch.float32
    cache = model.make_cache(2, 40)
    assert [tuple(s.window.shape) for s in cache.layers] == [(2, 8, 32)] * 3
    assert cache.layers[0].compressor.entries.shape == (2, 40 // 8 + 1, 32) and cache.layers[0].indexer is None
    assert cache.layers[1].indexer.entries.shape == (2, 40 // 4 + 1, 16) and cache.layers[2].compressor is None
    assert cache.elems_per_token == 32 / 8 + 32 / 4 + 16 / 4 and cache.states is not None and not cache.paged


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("batch", [1, 2])
def test_logits_and_greedy_tokens_match_transformers(request, batch):
    """Transformers' logits over a 30-token prompt and DECODE_STEPS cached greedy steps (its tokens fed to both), and
    our greedy choice at every step is its."""
    path = checkpoint_of(request)
    ids, fed, hf_logits = hf_trace(transformers, path, batch, PROMPT)
    ours = trace_ours(load_v4(path), ids, fed)
    errors = [max_rel(a, b) for a, b in zip(ours, hf_logits)]
    print(f"deepseek_v4 batch {batch}: " + " ".join(f"{e:.1e}" for e in errors))
    assert len(errors) == DECODE_STEPS + 1 and max(errors) < FP32_TOL, errors
    for a, b in zip(ours, hf_logits):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("kind", ["compress", "main"])
def test_yarn_rope_matches_transformers(request, kind):
    """YaRN (factor 4 over 16 original positions, so the 30-token prompt and its decode steps run past them) on the
    compressed layers' RoPE or the main one: logits and greedy tokens as Transformers'."""
    rope = transformers.DeepseekV4Config().rope_parameters
    rope[kind] = {**rope[kind], "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                  "beta_fast": 32.0, "beta_slow": 1.0}
    path = checkpoint_of(request, rope_parameters=rope)
    ids, fed, hf_logits = hf_trace(transformers, path, 1, PROMPT)
    ours = trace_ours(load_v4(path), ids, fed)
    plain = trace_ours(load_v4(checkpoint_of(request)), ids, fed)
    assert max(max_rel(a, b) for a, b in zip(ours, hf_logits)) < FP32_TOL
    assert max(max_rel(a, b) for a, b in zip(plain, hf_logits)) > 1e-3  # the scaling matters here
    for a, b in zip(ours, hf_logits):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_every_part_matters(request):
    """The window, the HCA entries, the indexer's choice and the clamp each move the logits of the 30-token prompt: a
    model with any of them changed is not the one compared with Transformers above."""
    model = load_v4(checkpoint_of(request))
    ids = torch.randint(0, 320, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    ref = logits_of(model, ids, [(0, PROMPT)])
    layers = model.model.layers

    def changed(fn, undo):
        fn()
        out = logits_of(model, ids, [(0, PROMPT)])
        undo()
        return max_rel(out, ref)

    window = [layer.self_attn for layer in layers]

    def set_window(w):
        for a in window:
            a.shape = dataclasses.replace(a.shape, window=w)

    indexer = layers[1].self_attn.compressor.indexer
    hca = layers[0].self_attn.compressor
    diffs = {
        "window": changed(lambda: set_window(16), lambda: set_window(8)),
        "indexer top-k": changed(lambda: setattr(indexer, "topk", 64), lambda: setattr(indexer, "topk", 3)),
        "HCA entries": changed(lambda: hca.kv_norm.weight.mul_(2), lambda: hca.kv_norm.weight.div_(2)),
        "clamp": changed(lambda: [setattr(layer.mlp.moe.experts, "glu", SWIGLU) for layer in layers],
                         lambda: [setattr(layer.mlp.moe.experts, "glu", layer.mlp.moe.glu) for layer in layers]),
    }
    print(diffs)
    assert min(diffs.values()) > 1e-3, diffs
    assert max_rel(logits_of(model, ids, [(0, PROMPT)]), ref) == 0  # every change undone


# ---------------------------------------------------------------- the cache: chunks, steps, batches


def test_chunks_steps_and_batches_match_one_call(request):
    """Two sequences in slots 3 and 1: one call over all 37 tokens; the same in chunks that end inside and on
    compression windows (1-token chunks included); a 9-token prompt then 28 decode steps; each sequence alone; a
    right-padded batch (the second row 5 tokens shorter: ``Step.lengths``) whose padding changes no state, then both
    rows continued; a slot reused from position 0 after a longer sequence."""
    model = load_v4(checkpoint_of(request))
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(6))
    slots = torch.tensor([3, 1])
    whole = logits_of(model, ids, [(0, 37)], slots)
    chunked = logits_of(model, ids, [(0, 5), (5, 6), (6, 19), (19, 20), (20, 21), (21, 37)], slots)
    steps = logits_of(model, ids, [(0, 9)] + [(i, i + 1) for i in range(9, 37)], slots)
    alone = torch.cat([logits_of(model, ids[b:b + 1], [(0, 37)]) for b in range(2)])
    errs = [max_rel(chunked, whole), max_rel(steps, whole), max_rel(alone, whole)]
    # right padding: row 1 holds 20 real tokens of the 25-token call; its tokens 20.. come in the next calls
    cache = model.make_cache(4, 64)
    padded = logits_of(model, ids, [(0, 25)], slots, lengths=torch.tensor([25, 20]), cache=cache)
    rest0 = logits_of(model, ids[:1], [(25, 37)], slots[:1], cache=cache)[0]
    rest1 = logits_of(model, ids[1:], [(20, 37)], slots[1:], cache=cache)[0]
    errs += [max_rel(padded[0], whole[0, :25]), max_rel(padded[1, :20], whole[1, :20]),
             max_rel(rest0, whole[0, 25:]), max_rel(rest1, whole[1, 20:])]
    # slot 3 written again from position 0 with the other sequence: nothing of the first one is left
    again = logits_of(model, ids[1:], [(0, 11), (11, 37)], slots[:1], cache=cache)
    errs.append(max_rel(again[0], whole[1]))
    print("cached~whole: " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < CACHED_TOL, errs


# ---------------------------------------------------------------- checkpoint names


def test_release_naming_loads_as_save_pretrained(request, tmp_path):
    """The checkpoint renamed as DeepSeek releases it (no model. prefix: embed.weight, head.weight, norm.weight,
    hc_head_fn, layers.N.attn.*, per-expert w1/w2/w3; an mtp.0.* layer, never read) loads the same tensors as the
    names Transformers' save_pretrained wrote (model.norm.weight: the final norm, not an attention's kv_norm)."""
    source = checkpoint_of(request)
    dest = Path(shutil.copytree(source, tmp_path / "release"))
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    weight_map = {}
    release = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, t in load_file(dest / shard).items():
            new = release.get(name, name[len("model."):] if name.startswith("model.") else name)
            tensors[new] = t
            weight_map[new] = shard
        save_file(tensors, dest / shard, metadata={"format": "pt"})
    mtp = {"mtp.0.attn.wq_a.weight": torch.randn(24, 64), "mtp.0.norm.weight": torch.randn(64)}
    save_file(mtp, dest / "mtp.safetensors", metadata={"format": "pt"})
    weight_map.update({k: "mtp.safetensors" for k in mtp})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "norm.weight" in weight_map and "layers.0.attn.norm.weight" in weight_map
    ours, theirs = Checkpoint(dest), Checkpoint(source)
    assert sorted(n for n in ours.names() if not n.startswith("mtp.")) == sorted(theirs.names())
    for name in theirs.names():
        assert torch.equal(ours.get(name), theirs.get(name)), name
    ids = torch.randint(0, 320, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    assert torch.equal(logits_of(load_v4(dest), ids, [(0, PROMPT)]), logits_of(load_v4(source), ids, [(0, PROMPT)]))


# ---------------------------------------------------------------- end to end


def test_gpu_experts_are_refused_by_the_activation(request, tmp_path, monkeypatch):
    """The GPU experts' kernels compute plain SwiGLU: --gpu-experts N on this model is refused naming its activation,
    before any weight is read (auto keeps every expert on the CPU engine)."""
    assert_refused_before_weights(checkpoint_of(request), tmp_path / "v4", monkeypatch, {},
                                  "--gpu-experts 2: this model's routed experts are clamped_swiglu",
                                  {**CPU, "device": "cuda", "gpu_experts": 2})


def test_generate_through_llm(request, tmp_path, monkeypatch):
    """``LLM`` on a checkpoint directory Transformers wrote (with a tokenizer), the native model, prompts prefilled in
    chunks of 5: greedy tokens equal to Transformers' generate; two requests at once equal to each alone; prefix
    reuse off (said), so a prompt that extends a finished one is computed again, its tokens still Transformers'.
    The CPU engine's experts clamp at the checkpoints' limit (0.3: the clamp changes their outputs)."""
    from hetmoe.engine.llm import LLM

    path = request.getfixturevalue("hf_checkpoints")("deepseek_v4", {"swiglu_limit": LIMIT}, seed=4, tokenizer=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    said = []
    llm = LLM(path, EngineOptions(max_context=64, max_batch=2, prefill_chunk=5, **CPU), expert_cache=None,
              progress=False, log=said.append)
    assert isinstance(llm.runner.model, DeepseekV4ForCausalLM) and llm.runner.recurrent
    moe = llm.runner.model.model.layers[0].mlp.moe
    assert isinstance(moe.experts, CPUExperts) and moe.experts.glu == Glu("clamped_swiglu", 1.0, LIMIT, 0.0)
    out = generate_like_transformers(llm, hf, 8)
    assert out.timings.cached_tokens == 0
    assert any("prefix reuse is off: the model's compressed-attention layers keep" in m for m in said)


# ---------------------------------------------------------------- refused configs

BAD = {  # case -> (config.json changes, the message after the file name)
    "scoring": ({"scoring_func": "softmax"}, "scoring_func is 'softmax'; DeepSeek-V4's router scores with"),
    "layer-types": ({"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                    r"layer_types is \['sliding_attention', 'full_attention', 'sliding_attention'\]; it must give"),
    "mlp-layer-types": ({"mlp_layer_types": ["hash_moe", "dense", "moe"]}, r"mlp_layer_types is .*'hash_moe' or"),
    "kv-heads": ({"num_key_value_heads": 2}, "num_key_value_heads is 2; DeepSeek-V4 has one key/value head"),
    "o-groups": ({"o_groups": 3}, r"o_groups is 3; it must divide num_attention_heads x head_dim \(128\)"),
    "rate": ({"compress_rates": {"compressed_sparse_attention": 0, "heavily_compressed_attention": 8}},
             r"compress_rates\['compressed_sparse_attention'\] is 0; it must be an integer >= 1"),
    "shared": ({"n_shared_experts": 2}, "n_shared_experts is 2; DeepSeek-V4 runs one shared expert"),
    "norm-topk": ({"norm_topk_prob": False}, "norm_topk_prob is False; DeepSeek-V4 runs a router that always"),
    "limit": ({"swiglu_limit": 0}, "swiglu_limit is 0; it must be a number > 0"),
    "activation": ({"hidden_act": "gelu"}, "hidden_act is 'gelu'; DeepSeek-V4 runs SwiGLU experts"),
    "rope": ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
             r"rope_parameters\['compress'\] has rope_type 'llama3'; DeepSeek-V4 runs default or yarn RoPE"),
    "expert-dtype": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                              "expert_dtype": "int4"}},
                     "quantization_config.expert_dtype is 'int4': hetmoe reads DeepSeek-V4's routed experts in FP8"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_refused_before_any_weight(request, tmp_path, monkeypatch, case):
    changes, message = BAD[case]
    assert_refused_before_weights(checkpoint_of(request), tmp_path / "v4", monkeypatch, changes, message, CPU)
