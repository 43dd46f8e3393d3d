"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa): MLA with DeepSeek Sparse Attention (hetmoe/models/
deepseek_v32.py, glm_moe_dsa.py; the indexer and the restricted attention: hetmoe/layers/sparse_attention.py).

Every test runs a top-k far below its prompts (index_topk 4 or 6 against prompts of 9 to 31 tokens), so attention is
really sparse, and most cross the top-k boundary (a call that is dense, then sparse ones):

* layout: which layers run their own indexer (GLM-5's indexer_types and the entries Transformers' config class
  derives it from), the cache's indexer keys, the plan's KV bytes per token;
* contract: tiny random models placed as the loader places them (bf16 experts on the CPU engine's best row-block
  path), fp32 and bf16: prefill then cached decode of a batch of 2 against one forward over the whole sequences,
  each sequence alone, and the prompt in chunks across the top-k boundary;
* parity: checkpoints written by Transformers' own DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM (GLM: a layer that
  reuses the previous indexer's choice), prompts of 5 (dense, then decode steps past the top-k) and 20 tokens,
  batch 1 and 2: logits and greedy tokens;
* end to end: ``LLM`` on such checkpoint directories (with a tokenizer and a multi-token-prediction layer, never
  read): greedy tokens equal to transformers' ``generate``, two requests at once equal to each alone, a prompt
  sharing a cached prefix; the runner's decode steps on the eager forward;
* a DeepSeek FP8 checkpoint: the indexer's FP8 weights dequantized by the loader's path;
* the paged cache with the Triton MLA kernels (interpreter without a GPU) against the contiguous one;
* config.json entries the model files cannot run, refused naming the entry before any weight is read;
* GPU (marked): the GPU placement against transformers.

Paths: fp32 dense weights on the CPU; routed experts as fp32 TorchExperts or bf16 in the CPU engine (best row-block
path: the bf16-rounded weights Transformers wrote are held exactly). Tolerances (max |ours - hf| / max |hf| over every
step), MEASURED: parity <= 1.0e-6 on both backends (bound 1e-4, test_parity's FP32_TOL); contract fp32 cached~whole,
batch~alone, chunked~whole <= 1e-6 (bound 1e-5); bf16 see CACHED_TOL; paged~contiguous <= 1e-6 (bound 1e-4).
Transformers' indexer is what these tests follow: no Hadamard rotation and no FP8 scoring (DeepSeek's reference
code has both; the rotation keeps the dot products), weights_proj in fp32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from decode_steps import captured_against_host
from hetmoe.config.options import EngineOptions
from hetmoe.layers.attention import Step
from hetmoe.load.checkpoint import Checkpoint
from hetmoe.models.config import ModelConfig, dsa_indexer_types
from parity import (
    DECODE_STEPS,
    assert_refused_before_weights,
    engine_bf16,
    hf_trace,
    load_ours,
    max_rel,
    step_logits,
    torch_fp32,
    trace_ours,
)
from paths import BEST_ROW_PATH

transformers = pytest.importorskip("transformers")

from hetmoe.models.deepseek_v32 import DeepseekV32ForCausalLM  # noqa: E402
from hetmoe.models.glm_moe_dsa import GlmMoeDsaForCausalLM  # noqa: E402

# the checkpoints Transformers writes (tests/transformers_tiny.py: top-6 indexer of 8 heads of 16)
FAMILIES = {
    "deepseek_v32": (DeepseekV32ForCausalLM, {"num_hidden_layers": 3}),
    "glm_moe_dsa": (GlmMoeDsaForCausalLM, {"num_hidden_layers": 3, "indexer_types": ["full", "shared", "full"]}),
}
CPU = dict(device="cpu", dtype="fp32", experts_format="bf16", **BEST_ROW_PATH.options)
FP32_TOL = 1e-4
# Contract bounds (max |a - b| / max |b|). fp32, every position: MEASURED <= 5.7e-7. bf16: a whole sequence's GEMMs
# round otherwise than the one-token steps' or a chunk's (<= 1.5e-2 within the top-k, bound 2.5e-2 as
# tests/models/test_glm4_minimax.py), and past the top-k that rounding may flip the indexer's choice between
# near-equal scores (MEASURED on GLM's tiny model: 4th and 5th place 6% apart swapped, 0.31 on the logits): in bf16
# the positions past the top-k are compared for batch~alone only, bitwise.
CACHED_TOL = {"fp32": 1e-5, "bf16": 2.5e-2}


def checkpoint_of(request, family: str, tokenizer: bool = False, seed: int = 5) -> Path:
    return request.getfixturevalue("hf_checkpoints")(family, FAMILIES[family][1], seed=seed, tokenizer=tokenizer)


# ---------------------------------------------------------------- layout

TINY_BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6,
                 max_position_embeddings=128, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                 kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                 index_topk=4, index_head_dim=16, index_n_heads=4)


@pytest.mark.parametrize("entries", [{}, {"index_topk_freq": 4}, {"index_topk_freq": 3, "index_skip_topk_offset": 0},
                                     {"index_topk_pattern": "FSFFSSFS"},
                                     {"index_topk_pattern": ["full"] * 4 + ["shared"] * 4},
                                     {"indexer_types": ["full", "shared"] * 4}])
def test_glm_indexer_layers_are_transformers(entries):
    """Which layers run their own indexer, as GlmMoeDsaConfig derives it from config.json; those layers have an
    indexer (weights) and rows of indexer keys in the cache, the others none."""
    from hetmoe.load.loader import build_meta

    raw = {**TINY_BASE, "model_type": "glm_moe_dsa", "num_hidden_layers": 8, **entries}
    hf = transformers.GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    kinds = dsa_indexer_types(ModelConfig(raw))
    assert kinds == hf.indexer_types
    model = build_meta(ModelConfig(raw))
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    assert [("shared" if i is None else "full") for i in indexers] == kinds
    assert [i.index_layer for i in indexers if i is not None] == list(range(kinds.count("full")))
    cache = model.make_cache(2, 32)
    assert cache.index_layers == kinds.count("full") and cache.ik.shape[-1] == 16


def test_deepseek_v32_layout_and_plan():
    """Every layer an indexer; MLA's RoPE interleaved and the indexer's half-split; dense and MoE layers from
    mlp_layer_types; the plan's KV elements per token: latent + rope key per layer, and the indexer's key."""
    from hetmoe.load.loader import build_meta
    from hetmoe.load.shapes import model_shapes
    from hetmoe.models.deepseek_v2 import DeepseekV2MLP, DeepseekV3MoE
    from hetmoe.models.deepseek_v32 import ROPE_BY_FORM

    cfg = ModelConfig({**TINY_BASE, "model_type": "deepseek_v32", "num_hidden_layers": 4,
                       "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})
    model = build_meta(cfg)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [DeepseekV2MLP, DeepseekV3MoE] * 2
    attn = layers[3].self_attn
    assert attn.rope_fn is ROPE_BY_FORM["interleave"] and attn.indexer.rope_fn is ROPE_BY_FORM["half"]
    assert attn.indexer.index_layer == 3
    assert sorted(n for n, _ in attn.indexer.named_parameters()) == [
        "k_norm.bias", "k_norm.weight", "weights_proj.weight", "wk.weight", "wq_b.weight"]
    shapes = model_shapes(model, cfg.with_defaults(), 32)
    assert shapes.kv_elems_per_token == 4 * (16 + 8) + 4 * 16


# ---------------------------------------------------------------- contract

TINY = {
    "deepseek_v32": dict(TINY_BASE, model_type="deepseek_v32", num_hidden_layers=3),
    "glm_moe_dsa": dict(TINY_BASE, model_type="glm_moe_dsa", num_hidden_layers=4,
                        indexer_types=["full", "shared", "full", "shared"]),
}


def _random_model(name: str, dtype: str = "fp32", **entries):
    from hetmoe.load.random_weights import build_random_model

    opts = EngineOptions(device="cpu", dtype=dtype, experts_format="bf16", max_context=96, max_batch=4,
                         **BEST_ROW_PATH.options)
    return build_random_model({**TINY[name], **entries}, None, opts, std=0.08, log=lambda m: None)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(TINY))
def test_prefill_then_cached_decode(name, dtype):
    """A 9-token prompt (top-4: sparse) and 3 cached steps of a batch of 2 against the whole sequences in one call and
    each sequence alone; the same tokens in chunks 0-3 (dense), 3-5 and 5-12 (sparse over a cached prefix)."""
    loaded = _random_model(name, dtype)
    model, torch_dtype = loaded.model, loaded.plan.dtype
    assert all(b.moe.experts is not None for b in model.modules() if hasattr(b, "moe"))
    gen = torch.Generator().manual_seed(11)
    prompt, steps = 9, 3
    ids = torch.randint(0, 256, (2, prompt + steps), generator=gen)
    slots = torch.tensor([3, 1])  # not the first rows, not in order
    with torch.inference_mode():
        cache = model.make_cache(4, 32, torch_dtype)
        cached = [step_logits(model, ids[:, :prompt], 0, slots, cache)]
        for i in range(prompt, prompt + steps):
            cached.append(step_logits(model, ids[:, i:i + 1], i, slots, cache))
        cached = torch.cat(cached, dim=1)  # [2, prompt + steps, vocab]
        whole = step_logits(model, ids, 0, slots, model.make_cache(4, 32, torch_dtype))
        chunked = model.make_cache(4, 32, torch_dtype)
        parts = [step_logits(model, ids[:, a:b], a, slots, chunked) for a, b in ((0, 3), (3, 5), (5, prompt + steps))]
        alone = []
        for b in range(2):
            one = model.make_cache(1, 32, torch_dtype)
            rows = [step_logits(model, ids[b:b + 1, :prompt], 0, slots[:1] * 0, one)]
            rows += [step_logits(model, ids[b:b + 1, i:i + 1], i, slots[:1] * 0, one)
                     for i in range(prompt, prompt + steps)]
            alone.append(torch.cat(rows, dim=1))
        # the same model with a top-k above every context: dense MLA, which the sparse runs must differ from
        for layer in model.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.topk = 64
        model.model.index_topk = 64
        dense = step_logits(model, ids, 0, slots, model.make_cache(4, 32, torch_dtype))
    chunked = torch.cat(parts, dim=1)
    upto = None if dtype == "fp32" else 4  # (bf16: CACHED_TOL's comment)
    errs = (max_rel(cached[:, :upto], whole[:, :upto]), max_rel(cached, torch.cat(alone)),
            max_rel(chunked[:, :upto], whole[:, :upto]))
    print(f"{name} {dtype}: cached~whole {errs[0]:.1e}, batch~alone {errs[1]:.1e}, chunked~whole {errs[2]:.1e} "
          f"(every position: {max_rel(cached, whole):.1e}, {max_rel(chunked, whole):.1e}), "
          f"sparse~dense {max_rel(whole, dense):.1e}")
    assert torch.isfinite(cached).all() and max(errs) <= CACHED_TOL[dtype], errs
    assert dtype == "fp32" or errs[1] == 0  # bf16: the rows of a batch are computed as each alone, bit for bit
    assert max_rel(whole[:, :4], dense[:, :4]) <= CACHED_TOL[dtype]  # within the top-k: every position, dense
    assert max_rel(whole[:, 4:], dense[:, 4:]) > 0.1  # past the top-k the selection matters


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("name", list(TINY))
def test_captured_steps_equal_the_host_decided_ones(name, paged):
    """Decode steps as a CUDA graph captures them (``Step.captured``: dense or sparse decided from kv_len alone,
    kv_len from ``sparse_kv_len``, the selected latents read at their positions: ``KVCache.rows_at``) against the
    same steps deciding on the host from the positions: prompts of 2 and 3 tokens (top-4), then 9 steps of a batch of
    2 across the top-k and across kv_len's powers of two. Where every position is below the top-k
    the two are the same computation; past it, at a kv_len > the context, the selection is the same. (16 indexer
    heads: with 4, positions whose every head's score the relu cuts to 0 tie often, and top-k may keep either of
    two tied positions, differently over a longer row.)"""
    model = _random_model(name, index_n_heads=16).model
    errs, lens = captured_against_host(model, 4, (2, 3), 9, 32, paged)
    print(f"{name} {'paged' if paged else 'contiguous'}: captured~host " + " ".join(f"{e:.1e}" for e in errs)
          + f" (kv_len {lens})")
    assert lens[:3] == [4, 8, 8] and lens[-1] == 16  # a dense step, then sparse ones
    assert max(errs) < 1e-5, errs


def test_sparse_kv_len():
    from hetmoe.layers.sparse_attention import sparse_kv_len

    assert [sparse_kv_len(p, 4, 32) for p in (0, 3, 4, 7, 8, 15, 16, 31)] == [4, 4, 8, 8, 16, 16, 32, 32]
    assert sparse_kv_len(100, 2048, 4096) == 2048 and sparse_kv_len(2048, 2048, 4096) == 4096
    assert sparse_kv_len(5000, 2048, 6000) == 6000 and sparse_kv_len(10, 64, 32) == 32  # never past max_context


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_rows_at_reads_the_gathered_rows(paged):
    """KVCache.rows_at (the selected positions alone) against rows() then a gather, with positions past a row's
    own in the index (they read a stale or zero entry there and in the gather alike)."""
    from hetmoe.layers.kv_cache import KVCache
    from hetmoe.layers.sparse_attention import _gather

    cache = KVCache(2, 3, 40, 1, 6, torch.float32, "cpu", v_head_dim=4,
                    **(dict(page_size=8, initial_tokens=8) if paged else {}))
    for s, n in ((0, 17), (2, 33), (1, 5)):
        cache.reserve(s, n)
        pos = torch.arange(n)[None]
        cache.write(1, Step(pos, torch.tensor([s])), torch.randn(1, n, 1, 6), torch.randn(1, n, 1, 4))
    step = Step(torch.tensor([[16], [32]]), torch.tensor([0, 2]), kv_len=40)
    index = torch.randint(0, 33, (2, 1, 5), generator=torch.Generator().manual_seed(1))
    k, v = cache.rows_at(1, step, index)
    k_all, v_all = cache.rows(1, step)
    assert torch.equal(k.view(2, 5, 6), _gather(k_all.view(2, -1, 6), index))
    assert torch.equal(v.view(2, 5, 4), _gather(v_all.view(2, -1, 4), index))


# ---------------------------------------------------------------- parity with transformers

BACKENDS = [pytest.param(torch_fp32, id="torch-fp32"), pytest.param(engine_bf16(BEST_ROW_PATH), id="engine-bf16")]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("prompt_len", [5, 20])
def test_logits_and_greedy_tokens_match_transformers(request, family, backend, batch, prompt_len):
    """Transformers' logits over a prompt and DECODE_STEPS cached greedy steps (its greedy tokens fed to both); our
    greedy choice at every step is its. A 5-token prompt is dense and its decode steps cross the top-6 boundary."""
    checkpoint = checkpoint_of(request, family)
    ids, fed, hf_logits = hf_trace(transformers, checkpoint, batch, prompt_len)
    ours = trace_ours(load_ours(checkpoint, FAMILIES[family][0], backend), ids, fed)
    errors = [max_rel(a, b) for a, b in zip(ours, hf_logits)]
    print(f"{family} batch {batch} prompt {prompt_len}: " + " ".join(f"{e:.1e}" for e in errors))
    assert len(errors) == DECODE_STEPS + 1 and max(errors) < FP32_TOL, errors
    for a, b in zip(ours, hf_logits):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


# ---------------------------------------------------------------- YaRN

# DeepSeek-V3.2's published RoPE settings (factor 40 over 4096 positions), with mscale_all_dim 0.707: an attention
# factor != 1 scales the cos/sin table, which the indexer's rotation reads too, and mscale**2 the softmax scale
YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                            "mscale_all_dim": 0.707}, "max_position_embeddings": 163840}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_yarn_matches_transformers(request, family):
    """The YaRN cos/sin table these models hand their layers (DeepSeek-V3's: models/deepseek_v2.py) against
    Transformers' rotary embedding of the same class, past 32K positions (bound 1e-6, as
    tests/layers/test_long_positions.py); then the logits of a 20-token prompt (sparse) and its cached greedy steps
    (bound FP32_TOL)."""
    from hetmoe.models import context_limit

    path = request.getfixturevalue("hf_checkpoints")(family, {**FAMILIES[family][1], **YARN}, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_ours(path, FAMILIES[family][0], torch_fp32)
    assert context_limit(ours.config) == (163840, "max_position_embeddings 163840")
    positions = torch.tensor([[0, 5, 4095, 32_768, 40_000, 131_071]])
    cos, sin = ours.model.rope_table(positions, torch.float32)
    with torch.no_grad():
        hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1), positions)
    assert (torch.cat((cos, cos), -1) - hf_cos).abs().max() < 1e-6
    assert (torch.cat((sin, sin), -1) - hf_sin).abs().max() < 1e-6
    ids, fed, hf_logits = hf_trace(transformers, path, 1, 20)
    errors = [max_rel(a, b) for a, b in zip(trace_ours(ours, ids, fed), hf_logits)]
    print(f"{family} yarn: " + " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) < FP32_TOL, errors


# ---------------------------------------------------------------- end to end


def _add_mtp_layer(path: Path, cfg: dict) -> list:
    """A multi-token-prediction layer as these checkpoints carry it (model.layers.<num_hidden_layers>.*, random
    tensors of its real names), added to the index. Returns their names."""
    from safetensors.torch import save_file

    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    shapes = {"eh_proj.weight": (H, 2 * H), "enorm.weight": (H,), "hnorm.weight": (H,),
              "shared_head.norm.weight": (H,), "shared_head.head.weight": (cfg["vocab_size"], H),
              "self_attn.indexer.wk.weight": (cfg["index_head_dim"], H),
              "mlp.gate.weight": (cfg["n_routed_experts"], H)}
    tensors = {f"model.layers.{L}.{k}": torch.randn(s) for k, s in shapes.items()}
    save_file(tensors, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return list(tensors)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_through_llm(request, tmp_path, monkeypatch, family):
    """``LLM`` on a checkpoint directory Transformers wrote (a tokenizer, an MTP layer added: never read), prompts of
    12 to 20 tokens prefilled in chunks of 5 (the first chunk dense, the others sparse over the cached prefix):
    greedy tokens equal to transformers' generate; two requests at once (batched prefill of right-padded chunks,
    batched decode) equal to each alone; a prompt that extends a finished one reuses its cached prefix."""
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.runner import Runner
    from hetmoe.engine.sampler import SamplingParams

    source = checkpoint_of(request, family, tokenizer=True, seed=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    path = Path(shutil.copytree(source, tmp_path / family))
    mtp = _add_mtp_layer(path, json.loads((path / "config.json").read_text()))
    read = set()
    get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: read.add(name) or get(self, name))
    llm = LLM(path, EngineOptions(max_context=64, max_batch=2, prefill_chunk=5, **CPU), expert_cache=None,
              progress=False, log=lambda m: None)
    assert isinstance(llm.runner, Runner) and llm.runner.sparse and llm.runner.lean is None
    assert read and not read & set(mtp)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = ["def f(x):\n    return x * 2 + 1", "Hello there, how are you today?"]
    alone = [llm.generate(p, params, chat=False) for p in prompts]
    for prompt, out in zip(prompts, alone):
        ids = llm.tokenizer.encode(prompt)
        assert len(ids) > 6  # past the top-k
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):]
        print(f"{family}: {out.token_ids} (transformers: {ref.tolist()})")
        assert out.completion_tokens == 8 and out.token_ids == ref.tolist()
    both = llm.generate(prompts, params, chat=False)
    assert [r.token_ids for r in both] == [r.token_ids for r in alone]
    longer = prompts[0] + " if x else 3"
    out = llm.generate(longer, params, chat=False)
    ids = llm.tokenizer.encode(longer)
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):]
    assert out.timings.cached_tokens > 6 and out.token_ids == ref.tolist()


def test_runner_decode_steps_cross_the_top_k(request):
    """The runner on the CPU: a 4-token prompt (dense: MLA's decode on the CPU engine's threads) and 6 decode steps
    past the top-6 (sparse), against one forward over the whole sequence."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    loaded = load_model(checkpoint_of(request, "deepseek_v32"), EngineOptions(max_context=64, **CPU),
                        expert_cache=None, progress=False, log=lambda m: None)
    runner = Runner(loaded)
    prompt, fed = [5, 17, 300, 42], [7, 11, 250, 3, 99, 13, 64]
    steps = [runner.prefill(prompt)] + [runner.decode(t) for t in fed[:-1]]
    model = loaded.model
    with torch.inference_mode():
        ids = torch.tensor([prompt + fed[:-1]])
        whole = model.logits(model(ids, Step(torch.arange(10)[None], torch.tensor([0])), model.make_cache(1, 16)))
    assert max_rel(torch.stack(steps), whole[0, 3:]) < 1e-5


# ---------------------------------------------------------------- FP8 checkpoints


def test_fp8_indexer_weights_load_dequantized(request, tmp_path):
    """A DeepSeek-V3.2 checkpoint as DeepSeek ships it: e4m3 weights with a weight_scale_inv per 128x128 block for
    every linear of the layers (the indexer's wq_b and wk too) but the router and the indexer's weights_proj
    (bf16-exact), quantization_config fp8. The loader dequantizes the indexer's weights through the same path as
    MLA's: the loaded wq_b / wk equal the stored blocks times their scales, and the logits equal those of the same
    checkpoint written with the dequantized weights."""
    from safetensors.torch import load_file, save_file

    from hetmoe.engine.runner import Runner
    from hetmoe.layers.gpu_linear import quantize_fp8
    from hetmoe.load.checkpoint import dequantize_fp8
    from hetmoe.load.loader import load_model

    source = checkpoint_of(request, "deepseek_v32")
    fp8, plain = (Path(shutil.copytree(source, tmp_path / n)) for n in ("fp8", "plain"))
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())
    stored = {}
    for shard in sorted(set(index["weight_map"].values())):
        q_tensors, d_tensors = {}, {}
        for name, t in load_file(fp8 / shard).items():
            quantize = (t.dim() == 2 and name.startswith("model.layers.") and "norm" not in name
                        and not name.endswith((".mlp.gate.weight", "weights_proj.weight")) and ".experts." not in name)
            if quantize:
                q, scale = quantize_fp8(t * 4)
                q = q[:, :t.shape[1]].contiguous()
                q_tensors[name], q_tensors[name + "_scale_inv"] = q, scale
                index["weight_map"][name + "_scale_inv"] = shard
                d_tensors[name] = dequantize_fp8(q, scale)
                stored[name] = d_tensors[name]
            else:
                q_tensors[name] = d_tensors[name] = t
        save_file(q_tensors, fp8 / shard, metadata={"format": "pt"})
        save_file(d_tensors, plain / shard, metadata={"format": "pt"})
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    assert any("indexer.wq_b" in n for n in stored) and any("indexer.wk" in n for n in stored)
    loaded = {n: load_model(p, EngineOptions(max_context=64, **CPU), expert_cache=None, progress=False,
                            log=lambda m: None) for n, p in (("fp8", fp8), ("plain", plain))}
    params = dict(loaded["fp8"].model.named_parameters())
    for name in (n for n in stored if "indexer" in n):
        assert torch.equal(params[name], stored[name]), name
    ids = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11, 19]
    logits = {n: Runner(lm).prefill(ids) for n, lm in loaded.items()}
    assert torch.equal(logits["fp8"], logits["plain"])


# ---------------------------------------------------------------- the paged cache (Triton kernels)


# (positions, slots) of each call: a prompt in two chunks (dense, then sparse over its cached prefix), a second prompt,
# decode steps of one row then of both at different lengths; or (sparse) every call past the top-6
CALLS = {
    "dense-then-sparse": [(torch.arange(0, 5)[None], [0]), (torch.arange(5, 21)[None], [0]),
                          (torch.arange(0, 3)[None], [1])] + [(torch.tensor([[3 + i]]), [1]) for i in range(4)]
                         + [(torch.tensor([[21], [7]]), [0, 1]), (torch.tensor([[22], [8]]), [0, 1]),
                            (torch.arange(9, 12)[None], [1])],
    "sparse": [(torch.arange(0, 10)[None], [0]), (torch.arange(10, 21)[None], [0]), (torch.arange(0, 8)[None], [1]),
               (torch.tensor([[21], [8]]), [0, 1]), (torch.tensor([[22], [9]]), [0, 1]),
               (torch.arange(10, 13)[None], [1])],
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("calls", list(CALLS))
def test_paged_cache_matches_contiguous(request, family, calls):
    """The same calls over a paged cache and over the contiguous one: the indexer's keys and the sparse path's rows
    read through the page table (torch, any device), and while a call is dense, the Triton MLA kernels on the paged
    cache ("dense-then-sparse": on a GPU, or in Triton's interpreter; skipped without triton) against SDPA on the
    contiguous one. Every kernel access inside its arguments (the interpreter's check)."""
    import contextlib

    from hetmoe.moe import TorchExperts

    checked = contextlib.nullcontext
    if calls != "sparse":
        from triton_interp import checked_accesses, triton_module

        triton_module("hetmoe.ops.triton.attention")
        checked = checked_accesses
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_ours(checkpoint_of(request, family), FAMILIES[family][0],
                      lambda *w: TorchExperts(*(t.to(device) for t in w))).to(device)
    caches = [model.make_cache(2, 96, device=device, page_size=16, initial_tokens=16),
              model.make_cache(2, 96, device=device)]
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad(), checked():
        for positions, slots in CALLS[calls]:
            ids = torch.randint(0, model.config.vocab_size, positions.shape, generator=gen).to(device)
            outs = []
            for cache in caches:
                for b, slot in enumerate(slots):
                    cache.reserve(slot, int(positions[b, -1]) + 1)
                step = Step(positions.to(device), torch.tensor(slots, device=device), kv_len=96,
                            start=int(positions[0, 0]) if len(slots) == 1 else None)
                outs.append(model.logits(model(ids, step, cache)))
            assert max_rel(outs[0], outs[1]) < 1e-4, positions.tolist()
    assert caches[0].paged and caches[0].version > 1  # the pool grew: the indexer's keys moved with the latents


# ---------------------------------------------------------------- refused configs

BAD = {  # case -> (family, config.json changes (None drops the entry), the message after the file name)
    "no-q-lora": ("deepseek_v32", {"q_lora_rank": 0}, "q_lora_rank is 0; it must be an integer >= 1"),
    "topk": ("deepseek_v32", {"index_topk": 0}, "index_topk is 0; it must be an integer >= 1"),
    "index-heads": ("glm_moe_dsa", {"index_n_heads": "many"}, "index_n_heads is 'many'; it must be an integer >= 1"),
    "index-head-dim": ("deepseek_v32", {"index_head_dim": 4}, "index_head_dim is 4; the indexer turns the first 8"),
    "mla-rope": ("deepseek_v32", {"rope_interleave": False},
                 "rope_interleave is False; deepseek_v32's MLA rotates interleaved pairs only"),
    "indexer-rope-v32": ("deepseek_v32", {"indexer_rope_interleave": True},
                         "indexer_rope_interleave is True; deepseek_v32's indexer turns its rope dims half-split"),
    "indexer-rope-glm": ("glm_moe_dsa", {"indexer_rope_interleave": False},
                         "indexer_rope_interleave is False; glm_moe_dsa's indexer turns its rope dims as interleaved"),
    "layer-types": ("deepseek_v32", {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
                    r"layer_types is \['indexed_attention', 'full_attention', 'indexed_attention'\]; deepseek_v32 "
                    "runs 'indexed_attention'"),
    "mlp-layer-types": ("deepseek_v32", {"mlp_layer_types": ["dense", "moe", "sparse"]},
                        r"mlp_layer_types is \['dense', 'moe', 'sparse'\]; it must list 'dense' or 'sparse'"),
    "v32-shared": ("deepseek_v32", {"indexer_types": ["full", "shared", "full"]},
                   r"indexer_types is \['full', 'shared', 'full'\]; deepseek_v32 runs its indexer in every layer"),
    "v32-freq": ("deepseek_v32", {"index_topk_freq": 4}, "index_topk_freq is 4; deepseek_v32 runs its indexer in"),
    "glm-first-shared": ("glm_moe_dsa", {"indexer_types": ["shared", "full", "full"]},
                         "indexer_types makes layer 0 'shared'; a shared layer reuses the previous layer's indexer"),
    "glm-pattern": ("glm_moe_dsa", {"indexer_types": None, "index_topk_pattern": "FXF"},
                    "index_topk_pattern is 'FXF'; it must give each of the 3 layers"),
    "glm-pattern-short": ("glm_moe_dsa", {"indexer_types": None, "index_topk_pattern": "FS"},
                          "index_topk_pattern is 'FS'; it must give each of the 3 layers"),
    "glm-freq": ("glm_moe_dsa", {"indexer_types": None, "index_topk_freq": "4"},
                 "index_topk_freq is '4'; it must be an integer"),
    "glm-pattern-first": ("glm_moe_dsa", {"indexer_types": None, "index_topk_pattern": "SFF"},
                          "index_topk_pattern makes layer 0 'shared'"),
    "glm-offset": ("glm_moe_dsa", {"indexer_types": None, "index_skip_topk_offset": -1, "index_topk_freq": 3},
                   "index_topk_freq / index_skip_topk_offset makes layer 0 'shared'"),
    "activation": ("glm_moe_dsa", {"hidden_act": "gelu"}, "hidden_act is 'gelu'; glm_moe_dsa runs SwiGLU"),
    "groups": ("deepseek_v32", {"n_group": 3}, r"n_group is 3; it must divide the 8 routed experts"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_is_refused_before_any_weight(request, tmp_path, monkeypatch, case):
    family, changes, message = BAD[case]
    assert_refused_before_weights(checkpoint_of(request, family), tmp_path / family, monkeypatch, changes, message, CPU)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_placement_matches_transformers(request, family):
    """The checkpoint loaded by hetmoe onto the GPU in fp32 (dense part and the paged cache there, bf16 experts on the
    CPU engine's row-block path; decode steps through CUDA graphs) against transformers in fp32 on the CPU: prompts of
    4 and 11 tokens in two slots (chunks of 5: the first chunks dense, on the Triton MLA kernels; the rest sparse,
    the indexer's keys and the latents read through the page table), then 6 greedy steps of batch 2. Bound 1e-3
    (fp32 GPU kernels in another order). Not bf16 against fp32: bf16 rounding flips the indexer's and the router's
    choices between near-equal scores on these tiny models (measured on the CPU, bf16 against fp32: 0.66 to 0.76 on
    single steps, with a top-k of 6 and of 64); the bf16 sparse kernels are checked on the GPU in
    tests/layers/test_sparse_attention.py."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    path = checkpoint_of(request, family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = load_model(path, EngineOptions(**{**CPU, "device": "cuda"}, max_context=64, max_batch=2, prefill_chunk=5),
                        expert_cache=None, progress=False, log=lambda m: None)
    runner = Runner(loaded)
    assert runner.sparse and runner.cache.paged
    assert runner.decoder is not None and runner.decoder.cuda_graph and not runner.decoder.fused
    prompts = [[5, 17, 300, 42], [7, 7, 250, 1, 99, 13, 2, 140, 31, 8, 200]]
    errs, caches, last = [], [], []
    with torch.inference_mode():
        for b, ids in enumerate(prompts):
            out = hf(torch.tensor([ids]), use_cache=True)
            errs.append(max_rel(runner.prefill(ids, slot=b).view(-1), out.logits[0, -1]))
            caches.append(out.past_key_values)
            last.append(out.logits[0, -1])
        for _ in range(6):
            nxt = [int(x.argmax()) for x in last]
            outs = [hf(torch.tensor([[t]]), past_key_values=c, use_cache=True) for t, c in zip(nxt, caches)]
            last = [o.logits[0, -1] for o in outs]
            errs.append(max_rel(runner.decode_batch(nxt, [0, 1]), torch.stack(last)))
    print(f"{family} GPU~transformers: " + " ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 1e-3, errs


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_graph_decode_equals_eager(request, family):
    """Decode steps of a batch of 2 replayed from CUDA graphs against the same steps run eagerly (fp32, the paged
    cache): prompts of 2 and 5 tokens (top-6), 10 steps, so the graphs cover a dense step and sparse ones at kv_len
    8 and 16 (``sparse_kv_len``: one graph per batch size and kv_len)."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    loaded = load_model(checkpoint_of(request, family), EngineOptions(**{**CPU, "device": "cuda"}, max_context=64,
                                                                      max_batch=2),
                        expert_cache=None, progress=False, log=lambda m: None)
    out, keys = {}, None
    for graph in (True, False):
        runner = Runner(loaded, cuda_graph=graph)
        assert runner.decoder.cuda_graph is graph and runner.sparse_topk == 6
        for s, ids in enumerate(([5, 17], [7, 250, 1, 99, 13])):
            runner.prefill(ids, slot=s)
        out[graph] = torch.stack([runner.decode_batch([(13 * i + 29 * s) % 250 + 3 for s in (0, 1)], [0, 1]).cpu()
                                  for i in range(10)])
        keys = sorted(runner.decoder.graphs) if graph else keys
        runner.decoder.close()
    errs = [max_rel(a, b) for a, b in zip(out[True], out[False])]
    print(f"{family} graph~eager: " + " ".join(f"{e:.1e}" for e in errs) + f" (graphs {keys})")
    assert {k[1] for k in keys} == {6, 8, 16}
    assert max(errs) < 1e-5, errs
