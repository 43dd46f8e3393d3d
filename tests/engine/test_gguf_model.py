"""Running a GGUF file (hetmoe/gguf/checkpoint.py through hetmoe/engine/loader.py): tiny models written as llama.cpp
writes them (tests/gguf_files.py), dense tensors in F32, routed experts quantized by the gguf package.

* Q8_0 / Q4_0 experts load as int8 / int4 with groups of 32 by default, packed from their codes: every expert's
  values are bitwise what gguf's dequantization gives.
* The GGUF model's logits match the same model's reference on the dequantized weights (fp32 dense and experts,
  tests/parity.py), within the engine's activation rounding: measured max rel. error below.
* Another type (Q5_0 here) is dequantized and re-quantized into the nearest engine format, said on the log.
* ``LLM`` generates from the file with the tokenizer and chat template the file carries; a broken file is named.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf_files import GGUF_ARCH, add_tokenizer, hetmoe_state, hf_config, to_gguf_tensors, write_metadata  # noqa: E402

from hetmoe.engine.loader import load_model, moe_blocks  # noqa: E402
from hetmoe.engine.placement import EngineOptions  # noqa: E402
from hetmoe.gguf import GGUFError  # noqa: E402
from hetmoe.testing.synthetic import build_tokenizer, tokenizer_config  # noqa: E402

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"]


def quantized_gguf(tmp_path, arch: str, qtype: str, tokenizer: bool = False, pad_tokens: bool = True,
                   split_max_tensors: int = 0):
    """(GGUF path, config, the HF state with the experts' dequantized values): experts stacked and quantized to
    ``qtype`` by the gguf package, everything else F32."""
    cfg = hf_config(arch)
    # a well-conditioned model: weights of std 0.1 (norm weights about 1), not hetmoe_state's N(0, 1)
    state = {n: (1 + 0.1 * v if "norm" in n else 0.1 * v) for n, v in hetmoe_state(arch, cfg, seed=3).items()}
    tensors = to_gguf_tensors(arch, cfg, state)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    deq = {}
    for name, t in list(tensors.items()):
        if "_exps." in name:
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
        w.add_tensor(name, t, raw_dtype=qt if name in deq else None)
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
    assert any(f"are {qtype}: packed as {fmt} group 32, exactly" in s for s in said)
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


# measured (max rel. logit error over prefill + 4 decode steps, fp32 reference on the dequantized weights):
# Q8_0 9.5e-6..6.7e-5, Q4_0 3.0e-3..1.9e-2 (the engine's activation rounding: int16 / int8 per group of 32)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype, bound", [("Q8_0", 5e-4), ("Q4_0", 5e-2)])
def test_gguf_logits_match_the_dequantized_checkpoint(tmp_path, arch, qtype, bound):
    from safetensors.torch import save_file

    from hetmoe.engine.runner import Runner
    from hetmoe.models import model_class
    from parity import load_ours, max_rel, torch_fp32

    path, cfg, state, deq = quantized_gguf(tmp_path, arch, qtype)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    weights = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in state.items() if ".experts." not in n}
    loaded = _load(path)
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
    err = max(max_rel(g, w) for g, w in zip(got, want))
    print(f"{arch} {qtype}: max rel. logit error {err:.2e}")
    assert err < bound


def test_other_types_are_requantized_into_the_nearest_format(tmp_path):
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q5_0")
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert loaded.plan.experts_format == "int4" and loaded.plan.group_size == 32
    assert any("Q5_0, which no engine format holds exactly: dequantized and re-quantized into int4" in s for s in said)


def test_generate_from_a_gguf_file_with_its_own_tokenizer(tmp_path):
    from hetmoe.engine.generation import SamplingParams
    from hetmoe.engine.llm import LLM

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
    m = peak_rss("import torch, tqdm, hetmoe.models.qwen3_moe, gguf\nfrom hetmoe.engine.loader import load_model\n"
                 "from hetmoe.engine.placement import EngineOptions",
                 'loaded = load_model(sys.argv[1], EngineOptions(device="cpu", threads=1), expert_cache=None, '
                 "progress=False, log=lambda m: None)", 'loaded.info["expert_bytes"]', tmp_path / "big.gguf")
    # Measured (dev machine): ratio 1.12 (final +97 MiB over the baseline); 1.83 with the mapped pages kept.
    assert m["final"] - m["baseline"] >= m["expert_bytes"] * 0.95  # the experts really are resident
    assert m["ratio"] <= 1.3


def test_the_commands_take_a_gguf_file(tmp_path, capsys):
    """generate (its text from the file's tokenizer) and eval (the GGUF's exact int4 against re-quantized int8)."""
    from hetmoe.cli import main as cli_main

    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_0", tokenizer=True)
    common = ["--device", "cpu", "--threads", "1", "--expert-cache", "off"]
    assert cli_main(["generate", "--model", str(path), "--prompt", "Hello", "--max-new-tokens", "4", "--json",
                     *common]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completion_tokens"] == 4 and out["prompt_tokens"] > 0
    text = tmp_path / "t.txt"
    text.write_text("hello world, this is a test of the GGUF path with a few more words to fill windows")
    report = tmp_path / "eval.json"
    assert cli_main(["eval", "--model", str(path), "--text", str(text), "--window", "8", "--json", str(report),
                     "--experts-format", "int8", *common]) == 0
    captured = capsys.readouterr()
    assert "re-quantized into int8 as asked" in captured.err and "int8 g32" in captured.out
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
