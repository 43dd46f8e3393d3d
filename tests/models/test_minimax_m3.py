"""MiniMax-M3 (minimax_m3_vl, its language model): hetmoe/models/minimax_m3.py and its block-sparse attention
(hetmoe/layers/block_sparse_attention.py).

One checkpoint for the module, written by Transformers' own MiniMaxM3SparseForConditionalGeneration (save_pretrained:
the language model under language_model., a one-layer vision tower and the projectors beside it): three layers,
attention sparse / full / sparse, MLP dense / MoE / MoE (6 experts, top 2, a shared expert); 4 heads over 2 kv heads
of 16 dims, RoPE over 8 of them; an indexer of 2 heads x 16 dims keeping the top 3 blocks of 4 keys plus the block of
the query; swiglu_limit 0.3 so that the clamp changes the experts' outputs. A 30-token prompt holds 8 blocks, more
than the 3 kept (so the selection matters: checked), and the 8 cached decode steps cross the block boundaries at 32
and 36. Prompt ids stay below 300: 300 and 301 are the image and video placeholders.

Paths: fp32 dense weights on the CPU; routed experts as fp32 TorchExperts with the clamp and alpha (the CPU engine
computes silu(gate) * up only: the loader refuses the model, checked below). Tolerances (max |ours - hf| / max |hf|):
parity MEASURED <= 1e-6 (bound 1e-4, as tests/models/test_deepseek_v4.py); cached~whole MEASURED <= 1e-6 (bound
1e-5).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from decode_steps import captured_against_host
from hetmoe.config.options import EngineOptions
from hetmoe.cpu.experts import SWIGLU
from hetmoe.layers.attention import Step
from hetmoe.load.checkpoint import Checkpoint, CheckpointError
from hetmoe.models.config import ModelConfig, text_model_config
from parity import (
    DECODE_STEPS,
    assert_refused_before_weights,
    generate_like_transformers,
    load_ours,
    max_rel,
    trace_ours,
)
from paths import BEST_ROW_PATH

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "MiniMaxM3VLConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no MiniMax-M3", allow_module_level=True)

from hetmoe.models.minimax_m3 import MiniMaxM3ForCausalLM  # noqa: E402

LIMIT = 0.3
PROMPT = 30
VOCAB = 320
IMAGE, VIDEO = 300, 301
FP32_TOL = 1e-4
CACHED_TOL = 1e-5
CPU = dict(device="cpu", dtype="fp32", experts_format="bf16", **BEST_ROW_PATH.options)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
            dense_intermediate_size=48, shared_intermediate_size=24, rotary_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
            layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
            mlp_layer_types=["dense", "sparse", "sparse"], swiglu_limit=LIMIT, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
              image_size=56)


@pytest.fixture(scope="module")
def m3(tmp_path_factory) -> Path:
    """The module's checkpoint (module docstring): random weights rounded to bf16, std 0.08, norms' weights noise
    around 0 (their 1 + weight form), correction biases random."""
    return write_m3(tmp_path_factory.mktemp("minimax-m3") / "ckpt", TEXT, VISION, IMAGE, VIDEO)


def write_m3(path: Path, text: dict, vision: dict, image: int, video: int) -> Path:
    """A MiniMaxM3SparseForConditionalGeneration of these configs saved at ``path``, the weights as the module
    docstring says (seed 7)."""
    torch.manual_seed(7)
    cfg = transformers.MiniMaxM3VLConfig(text_config=text, vision_config=vision, projector_hidden_size=64,
                                         image_token_index=image, video_token_index=video)
    model = transformers.MiniMaxM3SparseForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((torch.randn_like(p) * 0.08).to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def hf(m3):
    return transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(m3, dtype=torch.float32).eval()


def load_m3(path: Path) -> MiniMaxM3ForCausalLM:
    """Our model from a checkpoint directory (parity.load_ours: language_model. dropped, the vision tower left out),
    the routed experts in fp32 TorchExperts (the layer hands them alpha and the limit)."""
    return load_ours(path, MiniMaxM3ForCausalLM)


@pytest.fixture(scope="module")
def ours(m3):
    return load_m3(m3)


def prompt_ids(batch: int, n: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, IMAGE, (batch, n), generator=torch.Generator().manual_seed(seed))


def hf_trace(hf, ids: torch.Tensor) -> tuple:
    """Transformers' logits over ``ids`` and DECODE_STEPS cached greedy steps: (the tokens it fed, logits per call)."""
    with torch.no_grad():
        out = hf(input_ids=ids, use_cache=True)
        logits, fed = [out.logits], []
        for _ in range(DECODE_STEPS):
            fed.append(out.logits[:, -1:].argmax(-1))
            out = hf(input_ids=fed[-1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
    return fed, logits


def logits_of(model, ids: torch.Tensor, calls, slots=None, cache=None) -> torch.Tensor:
    """Our logits [B, S, V] over ``ids`` [B, S] fed in ``calls`` ((start, end) spans of positions)."""
    B = ids.shape[0]
    slots = torch.arange(B) if slots is None else slots
    cache = model.make_cache(4, 64) if cache is None else cache
    out = []
    with torch.no_grad():
        for a, b in calls:
            out.append(model.logits(model(ids[:, a:b], Step(torch.arange(a, b).expand(B, b - a), slots), cache)))
    return torch.cat(out, dim=1)


# ---------------------------------------------------------------- layout


def test_layout_names_and_cache(m3, ours):
    """The config as Transformers derives it, the checkpoint's tensors under our names (the vision tower's left out),
    the layers' kinds, and a cache with the indexer's keys of the two sparse layers beside the KV cache, no states (so
    prefix reuse stays on)."""
    ckpt = Checkpoint(m3)
    assert ckpt.config["model_type"] == "minimax_m3_vl" and ckpt.skipped
    assert not any(n.startswith(("language_model.", "vision_tower.", "multi_modal")) for n in ckpt.names())
    assert "not the language model" in ckpt.notes[0]
    ckpt.close()
    layers = ours.model.layers
    assert [a.self_attn.shape.sparse for a in layers] == [True, False, True]
    assert [a.self_attn.index_layer for a in layers] == [0, 1, 1]
    assert [type(a.mlp).__name__ for a in layers] == ["ClampedMLP", "MiniMaxM3SparseMoeBlock"] * 1 + [
        "MiniMaxM3SparseMoeBlock"]
    assert "model.layers.1.mlp.gate.weight" not in dict(ours.named_parameters())  # names stay block_sparse_moe
    assert ours.model.inv_freq.shape == (4,)  # RoPE over 8 of the 16 dims
    cache = ours.make_cache(2, 40)
    assert cache.ik.shape == (2, 2, 40, 16) and cache.states is None and cache.index_layers == 2
    assert cache.elems_per_token == 3 * 2 * 32 + 2 * 16


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("batch", [1, 2])
def test_logits_and_greedy_tokens_match_transformers(hf, ours, batch):
    """Transformers' logits over a 30-token prompt and DECODE_STEPS cached greedy steps (its tokens fed to both), and
    our greedy choice at every step is its."""
    ids = prompt_ids(batch, seed=batch)
    fed, hf_logits = hf_trace(hf, ids)
    mine = trace_ours(ours, ids, fed)
    errors = [max_rel(a, b) for a, b in zip(mine, hf_logits)]
    print(f"minimax_m3 batch {batch}: " + " ".join(f"{e:.1e}" for e in errors))
    assert len(errors) == DECODE_STEPS + 1 and max(errors) < FP32_TOL, errors
    for a, b in zip(mine, hf_logits):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_every_part_matters(ours):
    """The indexer's choice (more or fewer blocks kept, another block size, no local block, its scores negated) and
    the clamp each move the logits of the 30-token prompt; with every block kept attention is the dense one (the
    selection is all that differs)."""
    ids = prompt_ids(1, seed=4)
    ref = logits_of(ours, ids, [(0, PROMPT)])
    sparse = [layer.self_attn for layer in ours.model.layers if layer.self_attn.shape.sparse]
    moes = [layer.mlp.moe for layer in ours.model.layers[1:]]

    def changed(**fields):
        for a in sparse:
            a.shape = dataclasses.replace(a.shape, **fields)
        ours.model.dense_positions = sparse[0].shape.dense_positions
        out = logits_of(ours, ids, [(0, PROMPT)])
        for a in sparse:
            a.shape = dataclasses.replace(a.shape, block=4, topk=3, local=1)
        ours.model.dense_positions = 12
        return out

    def clamp(on):
        for moe in moes:
            moe.experts.glu = moe.glu if on else SWIGLU

    everything = changed(topk=8)  # 8 blocks of 4 cover the prompt: dense
    diffs = {"top-k 4": max_rel(changed(topk=4), ref), "block 2": max_rel(changed(block=2, topk=6), ref),
             "no local block": max_rel(changed(local=0), ref), "every block": max_rel(everything, ref)}
    keys = [a.index_k_proj.weight for a in sparse]
    with torch.no_grad():  # the indexer's scores negated: other blocks chosen
        [w.neg_() for w in keys]
        diffs["indexer keys"] = max_rel(logits_of(ours, ids, [(0, PROMPT)]), ref)
        [w.neg_() for w in keys]
    clamp(False)
    diffs["clamp"] = max_rel(logits_of(ours, ids, [(0, PROMPT)]), ref)
    clamp(True)
    print(diffs)
    assert min(diffs.values()) > 1e-3, diffs
    assert max_rel(logits_of(ours, ids, [(0, PROMPT)]), ref) == 0  # every change undone
    # every block kept: the dense causal attention's logits, whatever the indexer would choose
    for a in sparse:
        a.shape = dataclasses.replace(a.shape, sparse=False)
    try:
        assert max_rel(logits_of(ours, ids, [(0, PROMPT)]), everything) < CACHED_TOL
    finally:
        for a in sparse:
            a.shape = dataclasses.replace(a.shape, sparse=True)


# ---------------------------------------------------------------- the cache: chunks, steps, batches


def test_chunks_steps_and_batches_match_one_call(ours):
    """Two sequences in slots 3 and 1: one call over all 37 tokens; the same in chunks that end inside and on blocks
    (a dense first chunk, 1-token chunks); a 9-token prompt, 13 decode steps (dense, then sparse from position 12
    on: the boundaries at 12, 16 and 20 crossed) and a last chunk; each sequence alone; a prefix kept and the rest
    written again (prefix reuse: the indexer's keys are cut back with the keys and values)."""
    ids = prompt_ids(2, 37, seed=6)
    slots = torch.tensor([3, 1])
    whole = logits_of(ours, ids, [(0, 37)], slots)
    chunked = logits_of(ours, ids, [(0, 5), (5, 12), (12, 13), (13, 21), (21, 37)], slots)
    steps = logits_of(ours, ids, [(0, 9)] + [(i, i + 1) for i in range(9, 22)] + [(22, 37)], slots)
    alone = torch.cat([logits_of(ours, ids[b:b + 1], [(0, 37)]) for b in range(2)])
    kept = ours.make_cache(4, 64)  # positions 0..19 kept, 20..36 first written with another continuation
    other = torch.cat((ids[:, :20], prompt_ids(2, 17, seed=8)), dim=1)
    logits_of(ours, other, [(0, 37)], slots, cache=kept)
    again = logits_of(ours, ids, [(20, 37)], slots, cache=kept)
    errs = [max_rel(chunked, whole), max_rel(steps, whole), max_rel(alone, whole), max_rel(again, whole[:, 20:])]
    print("cached~whole: " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < CACHED_TOL, errs


# ---------------------------------------------------------------- images, the loader, refused configs


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_captured_steps_equal_the_host_decided_ones(ours, paged):
    """Decode steps as a CUDA graph captures them (``Step.captured``: dense or block-sparse decided from kv_len
    alone, kv_len from ``sparse_kv_len`` over the 12 dense positions: 3 blocks of 4) against the same steps deciding
    on the host: prompts of 9 and 10 tokens, 12 steps of a batch of 2 across the dense positions and kv_len's powers
    of two. Blocks past a row's context score -inf either way: the same blocks are kept."""
    errs, lens = captured_against_host(ours, ours.dense_positions, (9, 10), 12, 64, paged, ids_below=IMAGE)
    print(f"{'paged' if paged else 'contiguous'}: captured~host " + " ".join(f"{e:.1e}" for e in errs)
          + f" (kv_len {lens})")
    assert ours.dense_positions == 12 and lens[:3] == [12, 12, 16] and lens[-1] == 32
    assert max(errs) < 1e-5, errs


def test_image_and_video_placeholders_are_refused(ours):
    """A prompt holding the image or video placeholder token is refused by name (text only); decode steps are not
    checked (the model's own tokens)."""
    for token, name in ((IMAGE, "image_token_index"), (VIDEO, "video_token_index")):
        ids = prompt_ids(1, 8)
        ids[0, 3] = token
        with pytest.raises(ValueError, match=f"token {token}, MiniMax-M3's .* placeholder \\({name}\\).*images and "
                                             "videos are not supported"):
            logits_of(ours, ids, [(0, 8)])


def refused(source: Path, dest: Path, monkeypatch, text_changes: dict, message: str, top: dict | None = None):
    """A copy of the checkpoint whose text_config takes ``text_changes`` (None drops the key) and whose top level
    takes ``top`` is refused by the loader with CheckpointError ``message`` (a regex after the config's path), before
    any weight is read."""
    from hetmoe.load.loader import load_model

    path = Path(shutil.copytree(source, dest))
    cfg = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in {**cfg["text_config"], **text_changes}.items() if v is not None}
    (path / "config.json").write_text(json.dumps({**cfg, **(top or {}), "text_config": text}))

    def no_weight(self, name):
        raise AssertionError(f"weight {name} was read")

    monkeypatch.setattr(Checkpoint, "get", no_weight)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(path / 'config.json'))}(: | ){message}"):
        load_model(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=lambda m: None)


def test_gpu_experts_are_refused_by_the_activation(m3, tmp_path, monkeypatch):
    """The GPU experts' kernels compute plain SwiGLU: --gpu-experts N on this model is refused naming its activation,
    before any weight is read."""
    assert_refused_before_weights(m3, tmp_path / "gpu", monkeypatch, {},
                                  "--gpu-experts 2: this model's routed experts are clamped_swiglu",
                                  {**CPU, "device": "cuda", "gpu_experts": 2})


def test_generate_through_llm(m3, hf, tmp_path, monkeypatch):
    """``LLM`` on the checkpoint directory (a tokenizer beside it): the native model, prompts prefilled in chunks of
    5 that cross the dense / sparse boundary, greedy tokens equal to Transformers' generate; two requests at once
    equal to each alone; prefix reuse on (a prompt extending a finished one reuses its cached tokens and the indexer
    keys beside them). The routed experts run on the CPU engine with the clamped SwiGLU (alpha 1.702, offset 1)."""
    from hetmoe.engine.llm import LLM
    from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

    path = Path(shutil.copytree(m3, tmp_path / "m3"))
    build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(TEXT["max_position_embeddings"])))
    llm = LLM(path, EngineOptions(max_context=96, max_batch=2, prefill_chunk=5, **CPU), expert_cache=None,
              progress=False, log=lambda m: None)
    assert isinstance(llm.runner.model, MiniMaxM3ForCausalLM) and not llm.runner.recurrent and llm.runner.sparse
    def no_placeholders(ids):
        assert IMAGE not in ids and VIDEO not in ids

    out = generate_like_transformers(llm, hf, 6, no_placeholders)
    assert out.timings.cached_tokens > 12


BAD = {  # case -> (text_config changes, the message after the file name)
    "layer-types": ({"layer_types": ["minimax_m3_sparse", "sliding_attention", "full_attention"]},
                    r"layer_types is \[.*\]; it must give each of the 3 layers"),
    "mlp-layer-types": ({"mlp_layer_types": ["dense", "sparse"]}, r"mlp_layer_types is \['dense', 'sparse'\]; it"),
    "rope-type": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                       "original_max_position_embeddings": 128}},
                  "rope_parameters has rope_type 'yarn'; hetmoe's MiniMax-M3 runs default RoPE only"),
    "rotary-dim": ({"rotary_dim": 4}, r"rotary_dim is 4, but Transformers' MiniMax-M3 turns 8 of the 16 dims"),
    "odd-rope": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3125},
                  "rotary_dim": None}, r"rope_parameters.partial_rotary_factor is 0.3125: RoPE would turn 5 of"),
    "local": ({"index_local_blocks": 4}, "index_local_blocks is 4; the blocks always kept are among"),
    "index-heads": ({"index_n_heads": 3}, "index_n_heads is 3; each indexer head chooses for a group"),
    "block": ({"index_block_size": 0}, "index_block_size is 0; it must be an integer >= 1"),
    "alpha": ({"swiglu_alpha": 0}, "swiglu_alpha is 0; it must be a number > 0"),
    "kv-heads": ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    "top-k": ({"num_experts_per_tok": 7}, r"num_experts_per_tok is 7; with 6 routed experts"),
    "scoring": ({"scoring_func": "softmax"}, "scoring_func is 'softmax'; MiniMax-M3's router scores with sigmoid"),
    "window": ({"sliding_window": 8}, "sliding_window is 8; MiniMax-M3 has no sliding-window attention"),
    "block-fp8": ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
                  r"quantization_config \(quant_method 'fp8', weight_block_size \[128, 128\]\): hetmoe reads "
                  r"MiniMax-M3 checkpoints in bf16 / fp16 / fp32 or with MXFP8 weights"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_refused_before_any_weight(m3, tmp_path, monkeypatch, case):
    changes, message = BAD[case]
    refused(m3, tmp_path / "m3", monkeypatch, changes, message)


def test_legacy_entries_read_as_transformers_reads_them():
    """sparse_attention_config's legacy names, its sparse_attention_freq and moe_layer_freq give the indexer's sizes
    and the layers' kinds as MiniMaxM3VLTextConfig derives them (compared with it)."""
    text = {k: v for k, v in TEXT.items() if k not in ("layer_types", "mlp_layer_types") and not k.startswith("index")}
    legacy = dict(sparse_attention_config={"sparse_num_index_heads": 4, "sparse_index_dim": 16,
                                           "sparse_block_size": 8, "sparse_topk_blocks": 2, "sparse_local_block": 0,
                                           "sparse_attention_freq": [0, 1, 1]}, moe_layer_freq=[1, 0, 1])
    theirs = transformers.MiniMaxM3VLTextConfig(**text, **legacy)
    cfg = text_model_config(ModelConfig({"model_type": "minimax_m3_vl", "text_config": {**text, **legacy}}))
    model = MiniMaxM3ForCausalLM(cfg)
    mine = model.config
    for name in ("layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim", "index_block_size",
                 "index_topk_blocks", "index_local_blocks"):
        assert mine[name] == getattr(theirs, name), name
    assert [a.self_attn.shape.sparse for a in model.model.layers] == [False, True, True]
    assert hasattr(model.model.layers[1], "mlp") and not hasattr(model.model.layers[1], "block_sparse_moe")


@pytest.mark.gpu
def test_graph_decode_equals_eager(m3):
    """Decode steps of a batch of 2 replayed from CUDA graphs against the same steps run eagerly (fp32, experts on
    the CPU engine): prompts of 9 and 11 tokens (12 dense positions), 12 steps, so the graphs cover dense steps and
    block-sparse ones at kv_len 16 and 32 (``sparse_kv_len``: one graph per batch size and kv_len)."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    loaded = load_model(m3, EngineOptions(**{**CPU, "device": "cuda"}, max_context=64, max_batch=2),
                        expert_cache=None, progress=False, log=lambda m: None)
    out, keys = {}, None
    for graph in (True, False):
        runner = Runner(loaded, cuda_graph=graph)
        assert runner.decoder.cuda_graph is graph and runner.sparse_topk == 12
        for s, n in enumerate((9, 11)):
            runner.prefill(prompt_ids(1, n, seed=s)[0].tolist(), slot=s)
        out[graph] = torch.stack([runner.decode_batch([(13 * i + 29 * s) % 250 + 3 for s in (0, 1)], [0, 1]).cpu()
                                  for i in range(12)])
        keys = sorted(runner.decoder.graphs) if graph else keys
        runner.decoder.close()
    errs = [max_rel(a, b) for a, b in zip(out[True], out[False])]
    print("minimax_m3 graph~eager: " + " ".join(f"{e:.1e}" for e in errs) + f" (graphs {keys})")
    assert {k[1] for k in keys} == {12, 16, 32}
    assert max(errs) < 1e-5, errs
