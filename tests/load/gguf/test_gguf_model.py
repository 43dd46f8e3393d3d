"""Running a GGUF file (hetmoe/load/gguf/checkpoint.py through hetmoe/load/loader.py): tiny models written as llama.cpp
writes them (tests/gguf_files.py), dense tensors in F32, routed experts quantized by the gguf package.

* Q8_0 / Q4_0 experts load as int8 / int4 with groups of 32 by default, packed from their codes: every expert's
  values are bitwise what gguf's dequantization gives. So do the K-quants (Q4_K, Q5_K, Q6_K, and unsloth's Q4_K_M
  mix of Q4_K gate/up with Q6_K down), written here as random blocks since the gguf package cannot quantize them
  (tests/gguf_files.py random_blocks; no binary fixture), and files whose layers have different exact types.
* The GGUF model's logits match the same model's reference on the dequantized weights (fp32 dense and experts,
  tests/parity.py), within the engine's activation rounding: measured max rel. error below.
* The i-quants (IQ2_XXS .. IQ1_M) load as grid at their file's bytes (random blocks: every byte pattern is valid),
  alone and beside K-quants, and their logits match the dequantized checkpoint's as the other exact types' do.
* Experts no layout holds (gate and up of different types here) are dequantized and re-quantized into the nearest
  engine format, said on the log.
* ``LLM`` generates from the file with the tokenizer and chat template the file carries; a broken file is named.
"""

from __future__ import annotations

import json
import re
from typing import Optional

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_files import (  # noqa: E402
    GGUF_ARCH,
    add_tokenizer,
    hetmoe_state,
    hf_config,
    random_blocks,
    to_gguf_tensors,
    write_metadata,
)

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.cpu.codes import GRID_TYPES, layout_of  # noqa: E402
from hetmoe.load.gguf import GGUFError  # noqa: E402
from hetmoe.load.gguf.kquants import KQUANTS  # noqa: E402
from hetmoe.load.gguf.lut4_blocks import LUT4_BLOCKS  # noqa: E402
from hetmoe.load.gguf.random_file import random_tensor  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from hetmoe.load.random_weights import build_tokenizer, tokenizer_config  # noqa: E402
from paths import CLASS_PATHS, ids  # noqa: E402

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"]


def quantized_gguf(tmp_path, arch: str, qtype: str, tokenizer: bool = False, pad_tokens: bool = True,
                   split_max_tensors: int = 0, layer_types: Optional[dict] = None, **overrides):
    """(GGUF path, config, the HF state, the experts' dequantized values by GGUF name): experts stacked and quantized
    to ``qtype`` ("GATE_UP+DOWN" for two types; ``layer_types``: block id -> such a type, else ``qtype``) by the gguf
    package, or for K-quants and the 4-bit codebook types, which it cannot quantize, random centred blocks
    (tests/gguf_files.py random_blocks), for the i-quants random blocks (hetmoe/load/gguf/random_file.py);
    everything else F32. ``overrides``: config entries (K-quant rows need sizes that are multiples of 256)."""
    cfg = hf_config(arch, **overrides)
    # a well-conditioned model: weights of std 0.1 (norm weights about 1), not hetmoe_state's N(0, 1)
    state = {n: (1 + 0.1 * v if "norm" in n else 0.1 * v) for n, v in hetmoe_state(arch, cfg, seed=3).items()}
    tensors = to_gguf_tensors(arch, cfg, state)
    deq, qts, rng = {}, {}, np.random.default_rng(4)
    for name, t in list(tensors.items()):
        if "_exps." in name:
            gate_up, down = ((layer_types or {}).get(int(name.split(".")[1]), qtype) + "+").split("+")[:2]
            gate, up = (gate_up + "," + gate_up).split(",")[:2]  # "GATE,UP": gate and up of different types
            kind = (down or gate) if "_down_" in name else gate if "_gate_" in name else up
            qts[name] = qt = getattr(gguf.GGMLQuantizationType, kind)
            if kind in KQUANTS or kind in LUT4_BLOCKS:
                raw = np.stack([random_blocks(kind, *t.shape[1:], rng, centered=True) for _ in range(t.shape[0])])
            elif kind in GRID_TYPES:  # random grid and sign indices, sub-scales, an fp16 d per 256 (weights ~0.02)
                raw = random_tensor(kind, t.shape, rng)
            else:
                raw = gguf.quants.quantize(t, qt)
            deq[name] = gguf.quants.dequantize(raw, qt)
            tensors[name] = raw
    tok = None
    if tokenizer:
        backend = build_tokenizer(cfg["vocab_size"])
        tok = (backend, tokenizer_config(cfg["max_position_embeddings"]), "qwen2", cfg["vocab_size"] * pad_tokens)
    w = gguf.GGUFWriter(str(tmp_path / f"{arch}-{qtype}.gguf"), GGUF_ARCH[arch], split_max_tensors=split_max_tensors)
    write_metadata(w, arch, cfg)
    if tok is not None:
        add_tokenizer(w, *tok)
    for name, t in tensors.items():
        w.add_tensor(name, t, raw_dtype=qts.get(name))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    if split_max_tensors:  # llama.cpp's gguf-split names: NAME-00001-of-0000N.gguf
        return sorted(tmp_path.glob(f"{arch}-{qtype}-0*.gguf"))[0], cfg, state, deq
    return tmp_path / f"{arch}-{qtype}.gguf", cfg, state, deq


def _load(path, **kw):
    opts = EngineOptions(device="cpu", dtype="fp32", threads=1, **kw)
    return load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype, fmt", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_q8_0_and_q4_0_experts_load_exactly(tmp_path, arch, qtype, fmt):
    path, cfg, _, deq = quantized_gguf(tmp_path, arch, qtype)
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert loaded.plan.experts_format == fmt and loaded.plan.group_size == 32
    assert any(f"are {qtype}: packed as " in s and f"(planned as {fmt} group 32), exactly" in s for s in said)
    blocks = moe_blocks(loaded.model)
    assert blocks
    exps = {k: v for k, v in deq.items()}
    for (name, layer), bid in zip(blocks, [int(n.split(".")[2]) for n, _ in blocks]):
        engine = layer.engine
        gate, up, down = (exps[f"blk.{bid}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
        for e in (0, engine.num_experts - 1):
            g, u, d = engine.dequantized(e)
            assert torch.equal(g, torch.from_numpy(np.ascontiguousarray(gate[e])))
            assert torch.equal(u, torch.from_numpy(np.ascontiguousarray(up[e])))
            assert torch.equal(d, torch.from_numpy(np.ascontiguousarray(down[e])))


# Max rel. logit error over prefill + 4 decode steps against the fp32 reference on the dequantized weights, per
# class of engine path (tests/paths.py): what bounds it is how the experts round their activations. MEASURED: the
# row class reads int16 activations for Q8_0 (int8 codes): 9.5e-6..6.7e-5; int8 per group of 32 for Q4_0:
# 3.0e-3..1.9e-2. The AMX class reads int8 per group of 32 for both: Q8_0 3.4e-3..1.4e-2 (amx-emulated, whose int8
# bits are the tile unit's; 1.8e-3..1.0e-2 were seen under isa=auto on the GPU machine's Xeon), Q4_0 as the row class.
LOGIT_BOUND = {(False, "Q8_0"): 5e-4, (False, "Q4_0"): 5e-2, (True, "Q8_0"): 5e-2, (True, "Q4_0"): 5e-2}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("path", CLASS_PATHS, ids=ids(CLASS_PATHS))
def test_gguf_logits_match_the_dequantized_checkpoint(tmp_path, arch, qtype, path):
    """Paths: the best row-block path and the AMX class (the tile unit where there is one, else its emulation)."""
    err = logit_error(tmp_path, arch, *quantized_gguf(tmp_path, arch, qtype), **path.options)
    print(f"{arch} {qtype} {path}: max rel. logit error {err:.2e}")
    assert err < LOGIT_BOUND[path.amx, qtype]


def logit_error(tmp_path, arch: str, path, cfg: dict, state: dict, deq: dict, **options) -> float:
    """Max rel. logit error of the GGUF model (loaded with ``options``) against the fp32 reference on its dequantized
    weights, over a prefill of 11 tokens and 4 decode steps."""
    from safetensors.torch import save_file

    from hetmoe.engine.runner import Runner
    from hetmoe.models import model_class
    from parity import load_ours, max_rel, torch_fp32

    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    weights = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in state.items() if ".experts." not in n}
    loaded = _load(path, **options)
    for block, layer in moe_blocks(loaded.model):
        bid = int(block.split(".")[2])
        for which, w in zip(names, ("gate", "up", "down")):
            stacked = deq[f"blk.{bid}.ffn_{w}_exps.weight"]
            for e in range(stacked.shape[0]):
                weights[f"{block}.experts.{e}.{which}.weight"] = torch.from_numpy(np.ascontiguousarray(stacked[e]))
    save_file(weights, str(ref_dir / "model.safetensors"))
    ref = load_ours(ref_dir, model_class(cfg), torch_fp32)
    runner = Runner(loaded)
    ids = [(7 * i + 3) % cfg["vocab_size"] for i in range(11)]
    got = [runner.prefill(ids)]
    from hetmoe.layers.attention import Step

    cache = ref.make_cache(1, 64)
    with torch.no_grad():
        want = [ref.logits(ref(torch.tensor([ids]), Step(torch.arange(11)[None], torch.tensor([0])), cache))[0, -1]]
        for step in range(4):
            tok = (5 * step + 1) % cfg["vocab_size"]
            got.append(runner.decode(tok))
            pos = torch.tensor([[11 + step]])
            want.append(ref.logits(ref(torch.tensor([[tok]]), Step(pos, torch.tensor([0])), cache))[0, -1])
    return max(max_rel(g, w) for g, w in zip(got, want))


# K-quant rows are whole super-blocks of 256 values: hidden and expert intermediate sizes of 256
KSIZES = {"qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256),
          "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=256),
          "mixtral": dict(hidden_size=256, intermediate_size=256)}
# (types, plan format and group, engine layout: formats, group, down group, scalings): one type, and unsloth's Q4_K_M
# (Q4_K gate/up, Q6_K down: int4 beside the 6-bit planes, planned as int8)
KLAYOUTS = [("Q4_K", ("int4", 32), ("int4", 32, 32, ("affine", "affine"))),
            ("Q5_K", ("int8", 32), ("int5", 32, 32, ("affine", "affine"))),
            ("Q6_K", ("int8", 16), ("int6", 16, 16, ("symmetric", "symmetric"))),
            ("Q4_K+Q6_K", ("int8", 32), (("int4", "int6"), 32, 16, ("affine", "symmetric")))]


def _layout(engine) -> tuple:
    """(formats, group, down group, scalings) of an engine's code layout."""
    return tuple(layout_of(engine).values())[:4]


def _assert_exact(loaded, deq: dict) -> None:
    """Every expert's values are gguf's dequantization, bit for bit."""
    for name, layer in moe_blocks(loaded.model):
        bid = int(name.split(".")[2])
        want = [deq[f"blk.{bid}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down")]
        for e in range(layer.engine.num_experts):
            for got, w in zip(layer.engine.dequantized(e), want):
                assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(w[e])))


@pytest.mark.parametrize("arch", list(KSIZES))
@pytest.mark.parametrize("qtype, plan, layout", KLAYOUTS, ids=[k for k, _, _ in KLAYOUTS])
def test_kquant_experts_load_exactly(tmp_path, arch, qtype, plan, layout):
    path, _, _, deq = quantized_gguf(tmp_path, arch, qtype, **KSIZES[arch])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == plan
    held = "/".join(sorted(set(layout[0] if isinstance(layout[0], tuple) else (layout[0],))))
    assert any(f"are {'/'.join(sorted(set(qtype.split('+'))))}: packed as {held} (planned as {plan[0]} group "
               f"{plan[1]}), exactly" in s for s in said), said
    assert all(_layout(layer.engine) == layout for _, layer in moe_blocks(loaded.model))
    _assert_exact(loaded, deq)


# the types held exactly since the two-level scales (one architecture: the loading path is the same): Q3_K, a Q2_K
# file's mix (Q2_K gate/up, Q3_K down), Q4_1, Q5_0 + Q5_1; (types, plan, layout, scale dtypes)
NEW_LAYOUTS = [("Q3_K", ("int4", 16), ("int3", 16, 16, ("symmetric", "symmetric")), ("k8", "k8")),
               ("Q2_K+Q3_K", ("int4", 16), (("int2", "int3"), 16, 16, ("affine", "symmetric")), ("k4", "k8")),
               ("Q4_1", ("int4", 32), ("int4", 32, 32, ("affine", "affine")), ("fp16", "fp16")),
               ("Q5_0+Q5_1", ("int8", 32), ("int5", 32, 32, ("symmetric", "affine")), ("fp16", "fp16"))]


@pytest.mark.parametrize("qtype, plan, layout, scales", NEW_LAYOUTS, ids=[k[0] for k in NEW_LAYOUTS])
def test_more_types_load_exactly(tmp_path, qtype, plan, layout, scales):
    path, _, _, deq = quantized_gguf(tmp_path, "qwen3_moe", qtype, **KSIZES["qwen3_moe"])
    loaded = _load(path)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == plan
    for _, layer in moe_blocks(loaded.model):
        assert _layout(layer.engine) == layout and layout_of(layer.engine)["scale_dtype"] == scales
    _assert_exact(loaded, deq)


# measured (max rel. logit error, as above): Q4_K_M 1.4e-2..1.7e-2, Q4_K 2.0e-2..3.7e-2 (int4 gate/up: x rounded to
# int8 per group of 32; Q4_K_M's int8 down keeps h in int16)
@pytest.mark.parametrize("arch", list(KSIZES))
@pytest.mark.parametrize("qtype, bound", [("Q4_K+Q6_K", 6e-2), ("Q4_K", 6e-2)])
def test_kquant_logits_match_the_dequantized_checkpoint(tmp_path, arch, qtype, bound):
    err = logit_error(tmp_path, arch, *quantized_gguf(tmp_path, arch, qtype, **KSIZES[arch]))
    print(f"{arch} {qtype}: max rel. logit error {err:.2e}")
    assert err < bound


def test_mixed_types_per_layer(tmp_path):
    """A "UD" file: each layer its own exact types, all held exactly in one plan (int8 group 32 here), each layer
    with its own formats, down group and scalings."""
    types = {0: "Q4_K+Q6_K", 1: "Q5_K+Q8_0"}
    path, _, _, deq = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", layer_types=types, **KSIZES["qwen3_moe"])
    loaded = _load(path)
    layouts = [_layout(layer.engine) for _, layer in moe_blocks(loaded.model)]
    assert layouts == [(("int4", "int6"), 32, 16, ("affine", "symmetric")), (("int5", "int8"), 32, 32,
                                                                             ("affine", "symmetric"))]
    _assert_exact(loaded, deq)


def test_an_explicit_int8_holds_int4_types_exactly(tmp_path):
    path, _, _, deq = quantized_gguf(tmp_path, "qwen3_moe", "Q4_0")
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1, experts_format="int8"),
                        expert_cache=None, progress=False, log=said.append)
    assert any("packed as int8 group 32 as asked, exactly" in s for s in said), said
    assert all(_layout(layer.engine)[0] == "int8" for _, layer in moe_blocks(loaded.model))
    _assert_exact(loaded, deq)


def test_each_layer_takes_its_own_layout(tmp_path):
    """A Q4_K layer beside a Q6_K layer (an int8 type of group 16): each held exactly in its own layout."""
    path, _, _, deq = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", layer_types={1: "Q6_K"}, **KSIZES["qwen3_moe"])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None, progress=False,
                        log=said.append)
    said = [s for s in said if "packed as" in s]
    assert any("packed as int4/int6 (planned per layer: int4 group 32, int8 group 16), exactly" in s for s in said)
    assert [_layout(layer.engine) for _, layer in moe_blocks(loaded.model)] == [
        ("int4", 32, 32, ("affine", "affine")), ("int6", 16, 16, ("symmetric", "symmetric"))]
    _assert_exact(loaded, deq)


def test_a_layer_of_a_type_no_layout_holds_is_requantized(tmp_path):
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", layer_types={1: "F16"}, **KSIZES["qwen3_moe"])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert any("(planned as int4 group 32), exactly except 1 layer(s) of other types (re-quantized)" in s
               for s in said), said
    assert [_layout(layer.engine) for _, layer in moe_blocks(loaded.model)] == [
        ("int4", 32, 32, ("affine", "affine")), ("int4", 32, 32, ("symmetric", "symmetric"))]


def test_a_bad_kquant_block_is_named(tmp_path):
    """A Q4_K super-block whose fp16 d is NaN: the loader names the file, the expert and the matrix."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", **KSIZES["qwen3_moe"])
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    data = bytearray(path.read_bytes())
    data[t.data_offset:t.data_offset + 2] = np.array([np.nan], np.float16).tobytes()  # expert 0, row 0, block 0
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"Q4_K.gguf: model.layers.1.mlp.experts.0: down has scales that are NaN"):
        _load(path)


def test_other_types_are_requantized_into_the_nearest_format(tmp_path):
    """Gate Q4_0 beside up Q4_1 (no layout holds gate and up of different types): re-quantized into int4."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_0,Q4_1+Q4_0", **KSIZES["qwen3_moe"])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert loaded.plan.experts_format == "int4" and loaded.plan.group_size == 32
    assert any("Q4_0/Q4_1, which no engine format holds exactly: dequantized and re-quantized into int4" in s
               for s in said), said


def test_generate_from_a_gguf_file_with_its_own_tokenizer(tmp_path):
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.sampler import SamplingParams

    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0", tokenizer=True)
    llm = LLM(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None, progress=False)
    result = llm.generate("Hello there", SamplingParams(max_tokens=5, ignore_eos=True))
    assert result.completion_tokens == 5 and result.prompt_tokens > 0
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert chat.completion_tokens == 3


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    """A token list shorter than the embedding (the config's vocab_size comes from it): the embedding is refused."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0", tokenizer=True, pad_tokens=False)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \[512, 64\] in .*Q8_0.gguf"):
        _load(path)


def test_broken_gguf_files_are_named(tmp_path):
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError, match="cut.gguf"):
        _load(cut)
    with pytest.raises(ValueError, match="GGUF models"):  # a directory with two models: which one?
        (tmp_path / "two").mkdir()
        for name in ("a.gguf", "b.gguf"):
            (tmp_path / "two" / name).write_bytes(path.read_bytes())
        _load(tmp_path / "two")


def test_peak_rss_while_loading_a_gguf(tmp_path):
    """Q8_0 experts of a 6-layer model (~80 MB of file), packed from their codes layer by layer: the process never
    holds two copies (the mapped pages are dropped after each layer, as for safetensors)."""
    from rss import peak_rss

    big = dict(hidden_size=512, num_experts=32, moe_intermediate_size=256, num_hidden_layers=6)
    cfg = hf_config("qwen3_moe", **big)
    state = {n: 0.1 * v for n, v in hetmoe_state("qwen3_moe", cfg, seed=1).items()}
    tensors = to_gguf_tensors("qwen3_moe", cfg, state)
    del state
    qt = gguf.GGMLQuantizationType.Q8_0
    w = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "qwen3moe")
    write_metadata(w, "qwen3_moe", cfg)
    for name, t in tensors.items():
        if "_exps." in name:
            w.add_tensor(name, gguf.quants.quantize(t, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    del tensors
    m = peak_rss("import torch, tqdm, hetmoe.models.qwen3_moe, gguf\nfrom hetmoe.load.loader import load_model\n"
                 "from hetmoe.config.options import EngineOptions",
                 'loaded = load_model(sys.argv[1], EngineOptions(device="cpu", threads=1), expert_cache=None, '
                 "progress=False, log=lambda m: None)", 'loaded.info["expert_bytes"]', tmp_path / "big.gguf")
    # Measured (dev machine): ratio 1.12 (final +97 MiB over the baseline); 1.83 with the mapped pages kept.
    assert m["final"] - m["baseline"] >= m["expert_bytes"] * 0.95  # the experts really are resident
    assert m["ratio"] <= 1.3


def test_the_commands_take_a_gguf_file(tmp_path, capsys):
    """generate (its text from the file's tokenizer) and eval (the GGUF's exact int4 g32 against re-quantized
    int4 g64)."""
    from hetmoe.cli import main as cli_main

    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_0", tokenizer=True)
    common = ["--device", "cpu", "--threads", "1", "--expert-cache", "off"]
    assert cli_main(["generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "4", "--json",
                     *common]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completion_tokens"] == 4 and out["prompt_tokens"] > 0
    text = tmp_path / "t.txt"
    text.write_text("hello world, this is a test of the GGUF path with a few more words to fill windows")
    report = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(path), "--text", str(text), "--window", "8", "--json", str(report),
                     "--experts-format", "int4", "--group-size", "64", *common]) == 0
    captured = capsys.readouterr()
    assert "re-quantized into int4 as asked" in captured.err and "int4 g64" in captured.out
    assert report.is_file() and json.loads(report.read_text())


def test_a_split_gguf_loads_as_the_single_file_does(tmp_path):
    from hetmoe.engine.runner import Runner

    (tmp_path / "one").mkdir()
    (tmp_path / "parts").mkdir()
    whole, _, _, _ = quantized_gguf(tmp_path / "one", "deepseek_v3", "Q8_0")
    first, _, _, _ = quantized_gguf(tmp_path / "parts", "deepseek_v3", "Q8_0", split_max_tensors=7)
    assert "-00001-of-" in first.name and len(list((tmp_path / "parts").glob("*.gguf"))) > 2
    ids = [3, 14, 15, 92, 65, 35]
    logits = [Runner(_load(p)).prefill(ids) for p in (whole, first)]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("qtype, layer_types", [
    ("Q8_0", None), ("Q4_0", None), ("Q4_K", None), ("Q5_K", None), ("Q6_K", None), ("Q4_K+Q6_K", None),
    ("Q4_K", {0: "Q4_K+Q6_K", 1: "Q5_K+Q8_0"}),  # layers of different exact layouts
    ("Q4_K", {1: "Q6_K+Q6_K"}),  # gate and up of different types: that layer re-quantized into the plan's format
    ("MXFP4", None), ("IQ4_XS", None), ("IQ4_NL", None), ("MXFP4+Q8_0", None),  # lut4 at its scales' own width
    ("MXFP4", {1: "Q8_0"}),  # an int8 plan: the MXFP4 layer's codebook values as int8 codes, e8m0 scales
    ("IQ2_XXS+IQ3_XXS", None), ("IQ1_M", {1: "IQ2_XS+Q6_K"}),  # grid at the file's bytes, beside a K-quant
])
def test_the_plan_counts_what_the_engine_allocates(tmp_path, qtype, layer_types, capsys):
    """For every GGUF type mix the plan's routed-expert bytes, per layer and in all, are the bytes the engine
    allocated (affine layouts' fp32 mins and group-16 scales included), and ``hetmoe plan`` prints them."""
    from hetmoe.cli import main
    from hetmoe.config.units import gib

    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", qtype, layer_types=layer_types, **KSIZES["qwen3_moe"])
    loaded = _load(path)
    engine = [block.experts.nbytes for _, block in moe_blocks(loaded.model)]
    assert [lp.ram for lp in loaded.plan.layers] == engine
    assert loaded.plan.ram["routed experts"] == loaded.info["expert_bytes"] == sum(engine)
    assert main(["plan", "--model", str(path), "--device", "cpu", "--dtype", "fp32"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("routed experts"))
    assert f" {gib(sum(engine))} " in row, row


# The 4-bit codebook types (hetmoe/load/gguf/lut4_blocks.py): (types, plan format and group, engine layout: formats,
# group, down group, scale dtypes, codebooks). A codebook type beside an int8 one plans as int8 and keeps its lut4.
LUT_LAYOUTS = [("MXFP4", ("int4", 32), ("lut4", 32, 32, ("e8m0", "e8m0"), ("e2m1", "e2m1"))),
               ("IQ4_XS", ("int4", 32), ("lut4", 32, 32, ("k8", "k8"), ("iq4nl", "iq4nl"))),
               ("IQ4_NL", ("int4", 32), ("lut4", 32, 32, ("fp16", "fp16"), ("iq4nl", "iq4nl"))),
               ("MXFP4+Q8_0", ("int8", 32), (("lut4", "int8"), 32, 32, ("e8m0", "fp16"), ("e2m1", None)))]


def _lut_layout(engine) -> tuple:
    lay = layout_of(engine)
    return lay["weight_format"], lay["group_size"], lay["down_group_size"], lay["scale_dtype"], lay["codebook"]


@pytest.mark.parametrize("arch", list(KSIZES))
@pytest.mark.parametrize("qtype, plan, layout", LUT_LAYOUTS, ids=[k for k, _, _ in LUT_LAYOUTS])
def test_codebook_experts_load_exactly(tmp_path, arch, qtype, plan, layout):
    """MXFP4 / IQ4_XS / IQ4_NL experts held at their own bytes (lut4, their scales at their own width): every expert's
    values are gguf's dequantization, bit for bit."""
    path, _, _, deq = quantized_gguf(tmp_path, arch, qtype, **KSIZES[arch])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == plan
    assert any(f"(planned as {plan[0]} group {plan[1]}), exactly" in s for s in said), said
    assert all(_lut_layout(layer.engine) == layout for _, layer in moe_blocks(loaded.model))
    _assert_exact(loaded, deq)


def test_codebook_types_beside_an_int8_layer(tmp_path):
    """A layer of MXFP4 beside a layer of Q8_0: by default each layer in its own layout (lut4 beside int8); under
    --experts-format int8 the MXFP4 layer's indices become int8 codes of their codebook values. The same weights, bit
    for bit, either way."""
    path, _, _, deq = quantized_gguf(tmp_path, "qwen3_moe", "MXFP4", layer_types={1: "Q8_0"}, **KSIZES["qwen3_moe"])
    int8 = ("int8", 32, 32, ("fp16", "fp16"), (None, None))
    for kw, first in (({}, ("lut4", 32, 32, ("e8m0", "e8m0"), ("e2m1", "e2m1"))),
                      ({"experts_format": "int8"}, ("int8", 32, 32, ("e8m0", "e8m0"), (None, None)))):
        loaded = _load(path, **kw)
        assert [_lut_layout(layer.engine) for _, layer in moe_blocks(loaded.model)] == [first, int8]
        _assert_exact(loaded, deq)


# measured (max rel. logit error against the fp32 reference on the dequantized weights, as above): MXFP4
# 1.6e-2..2.5e-2, IQ4_XS 1.8e-2..2.4e-2 on both classes (x rounded to int8 per group of 32 for the 4-bit experts)
@pytest.mark.parametrize("arch", list(KSIZES))
@pytest.mark.parametrize("qtype", ["MXFP4", "IQ4_XS"])
@pytest.mark.parametrize("path", CLASS_PATHS, ids=ids(CLASS_PATHS))
def test_codebook_logits_match_the_dequantized_checkpoint(tmp_path, arch, qtype, path):
    """Paths: the best row-block path and the AMX class (the tile unit where there is one, else its emulation)."""
    err = logit_error(tmp_path, arch, *quantized_gguf(tmp_path, arch, qtype, **KSIZES[arch]), **path.options)
    print(f"{arch} {qtype} {path}: max rel. logit error {err:.2e}")
    assert err < 6e-2


# The i-quants (csrc/formats/layout.h grid): (types, engine layout: formats, group, down group, codebooks). A type
# beside a K-quant keeps both layouts.
GRID_LAYOUTS = [("IQ2_XXS", ("grid", 32, 32, ("iq2_xxs", "iq2_xxs"))),
                ("IQ2_XXS+IQ3_XXS", ("grid", 32, 32, ("iq2_xxs", "iq3_xxs"))),
                ("IQ3_S+IQ2_S", ("grid", 32, 16, ("iq3_s", "iq2_s"))),
                ("IQ1_S+IQ1_M", ("grid", 32, 16, ("iq1_s", "iq1_m"))),
                ("IQ2_XS+Q4_K", (("grid", "int4"), 16, 32, ("iq2_xs", None)))]


def _grid_layout(engine) -> tuple:
    lay = layout_of(engine)
    return lay["weight_format"], lay["group_size"], lay["down_group_size"], lay["codebook"]


@pytest.mark.parametrize("qtype, layout", GRID_LAYOUTS, ids=[k for k, _ in GRID_LAYOUTS])
def test_grid_experts_load_at_the_files_bytes(tmp_path, qtype, layout):
    """i-quant experts held as grid: every expert's values are gguf's dequantization, bit for bit, and the experts'
    RAM is the file's expert bytes (a K-quant down beside: its own layout's)."""
    path, _, _, deq = quantized_gguf(tmp_path, "qwen3_moe", qtype, **KSIZES["qwen3_moe"])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert any("packed as grid" in s and "exactly" in s for s in said), said
    assert all(_grid_layout(layer.engine) == layout for _, layer in moe_blocks(loaded.model))
    _assert_exact(loaded, deq)
    reader = gguf.GGUFReader(str(path))
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors if "_exps." in t.name}
    for block, layer in moe_blocks(loaded.model):
        bid = int(block.split(".")[2])
        want = sum(file_bytes[f"blk.{bid}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
        if "Q4_K" not in qtype:
            assert layer.engine.nbytes == want
        assert layer.engine.nbytes <= 1.05 * want


# MEASURED max rel. logit error (prefill of 11 tokens, 4 decode steps, against the fp32 model on the dequantized
# weights): 4.9e-4 (IQ2_XXS+IQ3_XXS), 3.7e-4 (IQ1_M+IQ3_S) on the AVX2 row blocks and the emulated AMX GEMM alike (the
# same bits: int8 activations on both), + ~2x
GRID_LOGIT_BOUND = 1e-3


@pytest.mark.parametrize("qtype", ["IQ2_XXS+IQ3_XXS", "IQ1_M+IQ3_S"])
@pytest.mark.parametrize("path", CLASS_PATHS, ids=ids(CLASS_PATHS))
def test_grid_logits_match_the_dequantized_checkpoint(tmp_path, qtype, path):
    err = logit_error(tmp_path, "qwen3_moe", *quantized_gguf(tmp_path, "qwen3_moe", qtype, **KSIZES["qwen3_moe"]),
                      **path.options)
    print(f"{qtype} {path}: max rel. logit error {err:.2e}")
    assert err < GRID_LOGIT_BOUND


def test_a_bad_grid_block_is_named(tmp_path):
    """An IQ3_XXS super-block whose fp16 d is Inf, and a file cut inside an expert tensor: the loader names the file,
    the tensor (the expert and matrix for a bad block)."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "IQ2_XXS+IQ3_XXS", **KSIZES["qwen3_moe"])
    good = path.read_bytes()
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    data = bytearray(good)
    data[t.data_offset + 98:t.data_offset + 100] = np.array([np.inf], np.float16).tobytes()  # expert 0, row 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"IQ3_XXS.gguf: model.layers.1.mlp.experts.0: down of expert 0 .*d that is "
                                         r"not finite"):
        _load(path)
    path.write_bytes(good[:t.data_offset + 1000])  # the file ends inside blk.1's down experts
    with pytest.raises(GGUFError, match=re.escape(path.name) + r" is truncated: tensor blk.1.ffn_down_exps.weight"):
        _load(path)
