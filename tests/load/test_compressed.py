"""compressed-tensors pack-quantized int4 checkpoints (hetmoe/load/compressed.py, read by hetmoe/load/checkpoint.py
and the loader) on tiny Kimi-K2.5-shaped checkpoints (tests/kimi_tiny.py: the language model written by
Transformers' DeepseekV3 classes under ``language_model.``, vision tensors beside it, the routed experts quantized by
compressed-tensors itself or by hetmoe's packer):

* the packing as compressed-tensors documents it (eight codes per int32, column 8w + j in bits 4j.., stored + 8);
  hetmoe's packer and unpacker equal the library's (skipped without it);
* every routed expert, packed into the CPU engine from its codes (int4, group 32), is bit for bit the checkpoint's
  value: a naive decoding of the stored words, and compressed-tensors' own decompression (with the scales widened to
  fp32, which is exact; its bf16 output is the same values rounded to bf16);
* --experts-format int8 takes the same codes exactly; bf16 and int4 of another group are re-quantized, and say so;
* the RAM the engine holds for the experts against their bytes in the file (int4 codes + bf16 scales), and the
  peak RSS of a load against what it keeps;
* quantized dense linears (shared experts) dequantized into the dense part, exactly;
* the checkpoint as the text model sees it: names without ``language_model.``, the vision tensors never read;
* bad input, refused by name: before any weight is read, quantization settings this reader does not handle,
  tensor headers that disagree with the config or with each other, a config.json whose text_config is unusable, a
  tiktoken.model that is not a tiktoken file; while loading, a weight_shape that disagrees with the codes and a NaN
  scale (named with its expert).

Paths: the CPU engine's best row-block path (int4 codes are held the same on every path: tests/cpu covers the kernels).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from kimi_tiny import QUANT, ct_available, ct_decompress, save_kimi_k25  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.load.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from hetmoe.load.compressed import PackQuantized, QuantizationConfigError, pack_int4, unpack_int4  # noqa: E402
from hetmoe.load.loader import check_model_dir, load_model, load_tokenizer, moe_blocks  # noqa: E402
from paths import BEST_ROW_PATH  # noqa: E402

NEEDS_CT = pytest.mark.skipif(not ct_available(), reason="compressed-tensors is not installed (pip install "
                              "compressed-tensors): hetmoe's own packer covers the format without it")
PACKERS = [pytest.param("compressed-tensors", marks=NEEDS_CT), "own"]
WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """kimi(packer, group=32) -> (checkpoint dir, reference dir, {expert module: its stored parts}), written once."""
    root, made = tmp_path_factory.mktemp("kimi"), {}

    def get(packer: str, group: int = 32):
        if (packer, group) not in made:
            made[packer, group] = save_kimi_k25(root / f"{packer}-g{group}", seed=3, packer=packer, group=group)
        return made[packer, group]

    return get


def _load(path, log=None, **options):
    opts = EngineOptions(device="cpu", dtype="fp32", threads=1, **BEST_ROW_PATH.options, **options)
    return load_model(path, opts, expert_cache=None, progress=False, log=log or (lambda m: None))


def _naive(parts: dict, group: int) -> torch.Tensor:
    """The stored words decoded one column at a time from the documented layout, times the scale (fp32)."""
    words, scale = parts["weight_packed"].to(torch.int64) & 0xFFFFFFFF, parts["weight_scale"].float()
    rows, cols = (int(v) for v in parts["weight_shape"])
    out = torch.empty(rows, cols)
    for c in range(cols):
        q = ((words[:, c // 8] >> (4 * (c % 8))) & 0xF) - 8
        out[:, c] = q.float() * scale[:, c // group]
    return out


# ---------------------------------------------------------------- the packing


def test_the_packing_is_the_documented_one():
    """Codes -8..-1 in one word are stored 0..7, column j in bits 4j..4j+3: the word 0x76543210."""
    codes = torch.arange(-8, 0, dtype=torch.int8).view(1, 8)
    word = pack_int4(codes)
    assert word.dtype == torch.int32 and word.shape == (1, 1) and int(word) == 0x76543210
    assert torch.equal(unpack_int4(word), codes)
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 5, 64), generator=gen, dtype=torch.int8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    with pytest.raises(ValueError, match=r"codes in \[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))


@NEEDS_CT
def test_our_packer_is_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized import pack_to_int32, unpack_from_int32

    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (48, 256), generator=gen, dtype=torch.int8)
    theirs = pack_to_int32(q, 4)
    assert torch.equal(pack_int4(q), theirs)
    assert torch.equal(unpack_int4(theirs), q)
    assert torch.equal(unpack_from_int32(pack_int4(q), 4, q.shape), q)


# ---------------------------------------------------------------- the experts, exactly


@pytest.mark.parametrize("packer", PACKERS)
def test_experts_are_the_checkpoint_values_bit_for_bit(kimi, packer):
    path, _, parts = kimi(packer)
    said = []
    loaded = _load(path, log=said.append)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == ("int4", 32)
    assert any("pack-quantized int4 (symmetric, bfloat16 scales per group of 32): packed as int4 group 32 from "
               "their codes, exactly" in s for s in said)
    blocks = moe_blocks(loaded.model)
    assert [n for n, _ in blocks] == ["model.layers.1.mlp", "model.layers.2.mlp"]
    for name, layer in blocks:
        for e in range(layer.engine.num_experts):
            for which, got in zip(WEIGHTS, layer.engine.dequantized(e)):
                stored = parts[f"{name}.experts.{e}.{which}"]
                assert torch.equal(got, _naive(stored, 32))
                if ct_available():  # the library's decompression: fp32 scales (exact) and its own bf16 output
                    assert torch.equal(got, ct_decompress({**stored, "weight_scale": stored["weight_scale"].float()},
                                                          32))
                    ct = ct_decompress(stored, 32)
                    assert ct.dtype == torch.bfloat16 and torch.equal(got.to(torch.bfloat16), ct)


def test_explicit_formats(kimi):
    """int8 holds the int4 codes exactly (same values); int4 group 64 and bf16 dequantize and re-quantize, said."""
    path, _, parts = kimi("own")
    want = _naive(parts["model.layers.2.mlp.experts.5.gate_proj"], 32)  # [32, 64]: two groups of 32 per row
    said = []
    loaded = _load(path, log=said.append, experts_format="int8")
    assert (loaded.plan.experts_format, loaded.plan.group_size) == ("int8", 32)
    assert any("packed as int8 group 32 as asked, exactly" in s for s in said)
    engine = dict(moe_blocks(loaded.model))["model.layers.2.mlp"].engine
    assert torch.equal(engine.dequantized(5)[0], want)
    for fmt, group in (("int4", 64), ("bf16", None)):
        said = []
        loaded = _load(path, log=said.append, experts_format=fmt, group_size=group)
        assert any(f"dequantized and re-quantized into {fmt} as asked" in s for s in said)
        got = dict(moe_blocks(loaded.model))["model.layers.2.mlp"].engine.dequantized(5)[0]
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert 0 < err < (0.1 if fmt == "int4" else 1e-2), err  # re-rounded, close


def test_ram_held_for_the_experts(kimi):
    """int4 codes as they are (half a byte per weight) and the file's own bf16 scales per 32: 4.5 bits a weight, as
    in the file (the shapes here need no padding). MEASURED: 55296 bytes held for 55296 in the file (1.000)."""
    path, _, _ = kimi("own")
    loaded = _load(path)
    file_bytes = 0
    for shard in path.glob("*.safetensors"):
        file_bytes += sum(t.numel() * t.element_size() for n, t in load_file(shard).items()
                          if ".experts." in n and n.endswith((".weight_packed", ".weight_scale")))
    ratio = loaded.info["expert_bytes"] / file_bytes
    print(f"routed experts: {loaded.info['expert_bytes']} bytes held, {file_bytes} in the file: {ratio:.4f}")
    assert ratio == pytest.approx(1.0, abs=1e-9)


def test_expert_cache_reuses_the_packed_codes(kimi, tmp_path):
    path, _, parts = kimi("own")
    first = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=str(tmp_path),
                       progress=False, log=lambda m: None)
    again = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=str(tmp_path),
                       progress=False, log=lambda m: None)
    assert (first.info["cache_misses"], again.info["cache_hits"]) == (2, 2)
    engine = dict(moe_blocks(again.model))["model.layers.1.mlp"].engine
    assert torch.equal(engine.dequantized(0)[0], _naive(parts["model.layers.1.mlp.experts.0.gate_proj"], 32))


# ---------------------------------------------------------------- the text model's view


def test_the_text_model_view_and_the_vision_tower_left_out(kimi, monkeypatch):
    path, _, parts = kimi("own")
    ckpt = Checkpoint(path)
    assert ckpt.config["model_type"] == "kimi_k25" and ckpt.config["hidden_size"] == 64
    assert ckpt.config["quantization_config"]["format"] == "pack-quantized"  # text_config's
    assert len(ckpt.skipped) == 7 and all(n.startswith(("vision_tower.", "mm_projector.")) for n in ckpt.skipped)
    names = ckpt.names()
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    assert not any(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)
    assert not any(n.endswith(("weight_packed", "weight_scale", "weight_shape")) for n in names)
    gate = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert gate in ckpt and ckpt.shape(gate) == (32, 64) and ckpt.get_fp8(gate) is None
    assert torch.equal(ckpt.get_float(gate), _naive(parts[gate[:-len(".weight")]], 32))
    assert ckpt.get_float(gate, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match="stored pack-quantized .* read it with get_float"):
        ckpt.get(gate)
    read, get = [], Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: read.append(name) or get(self, name))
    said = []
    _load(path, log=said.append)
    assert read and not any(n.startswith(("vision_tower", "mm_projector")) for n in read)
    assert any("7 tensors of mm_projector, vision_tower (not the language model) left out: text only" in s
               for s in said)


def test_quantized_dense_linears_are_dequantized(tmp_path):
    """Shared experts pack-quantized too (the config does not ignore them): dequantized into the dense part, exactly
    the checkpoint's values; the routed experts still from their codes."""
    path, _, parts = save_kimi_k25(tmp_path / "shared", seed=4, packer="own", shared_experts=True)
    said = []
    loaded = _load(path, log=said.append)
    assert any("packed as int4 group 32 from their codes, exactly" in s for s in said)
    shared = loaded.model.model.layers[2].mlp.shared_experts
    assert torch.equal(shared.down_proj.weight, _naive(parts["model.layers.2.mlp.shared_experts.down_proj"], 32))
    assert torch.equal(loaded.model.model.layers[1].mlp.shared_experts.up_proj.weight,
                       _naive(parts["model.layers.1.mlp.shared_experts.up_proj"], 32))


@pytest.mark.parametrize("model_type", ["kimi_k25", "kimi_k2"])
def test_the_language_model_alone_loads(kimi, tmp_path, model_type):
    """The language model alone (no text_config, no prefix, quantization_config at the top): under kimi_k25, and as
    Kimi-K2-Thinking ships its int4 experts, under kimi_k2."""
    src, _, parts = kimi("own")
    path = Path(shutil.copytree(src, tmp_path / "flat"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg["text_config"], "model_type": model_type}))
    for shard in path.glob("*.safetensors"):
        tensors = {n.removeprefix("language_model."): t for n, t in load_file(shard).items()
                   if not n.startswith(("vision_tower", "mm_projector"))}
        save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n.removeprefix("language_model."): f for n, f in index["weight_map"].items()
                           if not n.startswith(("vision_tower", "mm_projector"))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    engine = dict(moe_blocks(_load(path).model))["model.layers.2.mlp"].engine
    assert torch.equal(engine.dequantized(1)[1], _naive(parts["model.layers.2.mlp.experts.1.up_proj"], 32))


# ---------------------------------------------------------------- bad input

QC = "text_config.quantization_config"
BAD_QUANT = {  # case -> (the change to text_config.quantization_config, what the error says after the file name)
    "eight-bits": ("config_groups.group_0.weights.num_bits", 8, r"weights.num_bits is 8; hetmoe reads"),
    "group-16": ("config_groups.group_0.weights.group_size", 16, r"weights.group_size is 16; the CPU engine's int4"),
    "symmetric": ("config_groups.group_0.weights.symmetric", "yes", r"weights.symmetric is 'yes'; it must be true"),
    "per-channel": ("config_groups.group_0.weights.strategy", "channel", r"weights.strategy is 'channel'"),
    "float": ("config_groups.group_0.weights.type", "float", r"weights.type is 'float'"),
    "actorder": ("config_groups.group_0.weights.actorder", "group", r"weights.actorder is 'group'; activation-order"),
    "dynamic": ("config_groups.group_0.weights.dynamic", True, r"weights.dynamic is True"),
    "w4a8": ("config_groups.group_0.input_activations", {"num_bits": 8, "type": "int"},
             r"group_0.input_activations is \{.*\}; activation quantization is not run"),
    "format": ("format", "int-quantized", r"quantization_config.format is 'int-quantized'"),
    "kv-cache": ("kv_cache_scheme", {"num_bits": 8, "type": "float"}, r"kv_cache_scheme is \{.*\}; hetmoe runs none"),
    "bnb": ("quant_method", "bitsandbytes", r"quantization_config.quant_method is 'bitsandbytes', which hetmoe does "
                                             r"not read"),
    "no-groups": ("config_groups", {}, r"config_groups is \{\}; it must map group names"),
    "bad-regex": ("ignore", ["re:(unclosed"], r"quantization_config.ignore is 're:\(unclosed'; its pattern does"),
}


def _edit(path: Path, dotted: str, value) -> None:
    cfg = json.loads((path / "config.json").read_text())
    node = cfg
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture
def damaged(kimi, tmp_path):
    """A private copy of the own-packer checkpoint, to damage."""
    return Path(shutil.copytree(kimi("own")[0], tmp_path / "kimi"))


@pytest.mark.parametrize("case", list(BAD_QUANT))
def test_an_unsupported_quantization_config_is_named_before_any_weight(damaged, no_weights, case):
    setting, value, message = BAD_QUANT[case]
    _edit(damaged, f"{QC}.{setting}", value)
    where = re.escape(str(damaged / "config.json"))
    with pytest.raises(CheckpointError, match=f"^{where}: .*{message}"):
        _load(damaged)
    with pytest.raises(CheckpointError, match=f"^{where}: .*{message}"):
        check_model_dir(damaged)


def test_every_documented_setting_of_kimi_parses():
    scheme = PackQuantized.parse(QUANT)
    assert [g.group_size for g in scheme.groups] == [32]
    assert scheme.group_of("model.layers.1.mlp.experts.0.gate_proj") is not None
    for name in ("model.layers.1.self_attn.q_a_proj", "model.layers.1.mlp.shared_experts.up_proj",
                 "model.layers.0.mlp.down_proj", "lm_head"):
        assert scheme.group_of(name) is None, name
    with pytest.raises(QuantizationConfigError, match=r"quantization_config is None; it must describe them"):
        PackQuantized.parse(None)


@NEEDS_CT
def test_compressed_tensors_reads_the_same_config():
    from compressed_tensors.quantization import QuantizationConfig

    qc = QuantizationConfig.model_validate({k: v for k, v in QUANT.items() if k != "quant_method"})
    assert qc.format == "pack-quantized" and qc.config_groups["group_0"].weights.group_size == 32


def _rewrite(path: Path, change) -> None:
    """change(tensors) on the shard holding layer 2's tensors (written back with the index updated)."""
    shard = next(f for f in path.glob("*.safetensors")
                 if "language_model.model.layers.2.mlp.experts.0.gate_proj.weight_packed" in load_file(f))
    tensors = load_file(shard)
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in tensors or f != shard.name}
    index["weight_map"].update({n: shard.name for n in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


EXPERT = "language_model.model.layers.2.mlp.experts.4.up_proj"
BAD_TENSORS = {  # case -> (change to the shard, the error after the shard's name)
    "no-scale": (lambda t: t.pop(f"{EXPERT}.weight_scale"),
                 r"model.layers.2.mlp.experts.4.up_proj.weight_packed has no .*\.weight_scale beside it"),
    "scale-shape": (lambda t: t.update({f"{EXPERT}.weight_scale": t[f"{EXPERT}.weight_scale"][:, :1].contiguous()}),
                    r"up_proj.weight_scale has shape \[32, 1\]; .* holds \[32, 64\], which in groups of 32 "
                    r"\(quantization_config.config_groups.group_0\) needs \[32, 2\]"),
    "packed-dtype": (lambda t: t.update({f"{EXPERT}.weight_packed": t[f"{EXPERT}.weight_packed"].view(torch.uint8)}),
                     r"up_proj.weight_packed is torch.uint8 \[32, 32\]; int4 codes are packed eight to an int32"),
    "scale-dtype": (lambda t: t.update({f"{EXPERT}.weight_scale": t[f"{EXPERT}.weight_scale"].view(torch.int16)}),
                    r"up_proj.weight_scale has dtype torch.int16; scales are read from bf16, fp16 or fp32"),
}


@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_inconsistent_tensors_are_named_before_any_weight(damaged, no_weights, case):
    change, message = BAD_TENSORS[case]
    _rewrite(damaged, change)
    with pytest.raises(CheckpointError, match=f"model-0000[12]-of-00002.safetensors: .*{message}"):
        _load(damaged)


def test_a_packed_module_the_config_leaves_out_is_named(damaged, no_weights):
    _edit(damaged, f"{QC}.ignore", QUANT["ignore"] + ["re:.*experts\\.4\\..*"])
    with pytest.raises(CheckpointError, match=r"language_model.model.layers.[12].mlp.experts.4.(gate|up|down)_proj."
                                              r"weight_packed is pack-quantized, but .*config.json's "
                                              r"quantization_config does not quantize model.layers"):
        _load(damaged)


def test_a_wrong_weight_shape_is_named_at_load(damaged):
    _rewrite(damaged, lambda t: t.update({f"{EXPERT}.weight_shape": torch.tensor([64, 32])}))
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.experts.4.up_proj.weight_shape says \[64, 32\]; "
                                              r"its codes and scales hold \[32, 64\]"):
        _load(damaged)


def test_a_nan_scale_is_named_with_its_expert(damaged):
    def nan(t):
        s = t[f"{EXPERT}.weight_scale"].clone()
        s[3, 1] = float("nan")
        t[f"{EXPERT}.weight_scale"] = s

    _rewrite(damaged, nan)
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.experts.4: up has scales that are NaN or Inf"):
        _load(damaged)


TEXT_CONFIGS = {
    "not-an-object": ("[1, 2]", r"text_config is \[1, 2\]; a kimi_k25 config.json holds its language model's"),
    "other-model": ('{"model_type": "qwen3_moe"}', r"text_config.model_type is 'qwen3_moe'; hetmoe runs the language "
                                                   r"model of kimi_k25 as kimi_k2 / deepseek_v3 only"),
}


@pytest.mark.parametrize("case", list(TEXT_CONFIGS))
def test_an_unusable_text_config_is_named(damaged, no_weights, case):
    value, message = TEXT_CONFIGS[case]
    _edit(damaged, "text_config", json.loads(value))
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(damaged / 'config.json'))}: {message}"):
        check_model_dir(damaged)


def test_a_tiktoken_tokenizer_is_read_before_any_weight(damaged, no_weights):
    """Kimi's checkpoints ship tiktoken.model, no tokenizer.json: hetmoe reads it (tests/test_tokenizer_tiktoken.py),
    and one that is not a tiktoken file is refused naming it and the line."""
    (damaged / "tokenizer.json").rename(damaged / "tiktoken.model")
    with pytest.raises(ValueError, match=r"tiktoken.model line 1: expected 'base64-token rank'"):
        load_tokenizer(damaged)


def test_peak_rss_while_loading(tmp_path):
    """Pack-quantized experts of a 6-layer model (34 MB of them in the file, 37.5 MiB held), unpacked and packed a
    chunk of experts at a time: the process never holds two copies (the mapped pages are dropped after each layer)."""
    from rss import peak_rss

    big = dict(hidden_size=512, moe_intermediate_size=256, intermediate_size=256, n_routed_experts=32,
               num_hidden_layers=6)
    path, _, _ = save_kimi_k25(tmp_path / "big", seed=1, packer="own", overrides=big, tokenizer=False)
    m = peak_rss("import torch, tqdm, hetmoe.models.deepseek_v2\nfrom hetmoe.load.loader import load_model\n"
                 "from hetmoe.config.options import EngineOptions",
                 'loaded = load_model(sys.argv[1], EngineOptions(device="cpu", threads=1), expert_cache=None, '
                 "progress=False, log=lambda m: None)", 'loaded.info["expert_bytes"]', path)
    # MEASURED (this machine): peak / final over the baseline 1.16 (final +61 MiB: experts, dense part, buffers)
    assert m["final"] - m["baseline"] >= m["expert_bytes"] * 0.95  # the experts really are resident
    assert m["ratio"] <= 1.3
