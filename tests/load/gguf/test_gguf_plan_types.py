"""``hetmoe plan --model FILE.gguf``'s bytes per GGML type (hetmoe/load/gguf/type_bytes.py) against what a real
load allocates, read from the tensor headers alone; and files refused before any weight is read (a type hetmoe
cannot run, a tensor whose rows are not whole blocks, data past the end of the file)."""

from __future__ import annotations

import dataclasses
import struct

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from test_gguf_model import KSIZES, _load, quantized_gguf  # noqa: E402

from hetmoe.cli import main  # noqa: E402
from hetmoe.load.gguf import GGUFError  # noqa: E402
from hetmoe.load.gguf import checkpoint as gguf_checkpoint  # noqa: E402
from hetmoe.load.loader import moe_blocks  # noqa: E402


def _type_rows(path, **options):
    from hetmoe.config.options import EngineOptions
    from hetmoe.load.gguf.type_bytes import type_rows
    from hetmoe.load.loader import build_meta, moe_blocks, open_checkpoint, plan_model
    from hetmoe.load.materialize import expert_keys
    from hetmoe.plan.placement import normalize_options

    opts = normalize_options(EngineOptions(device="cpu", dtype="fp32", threads=1, **options))
    ckpt = open_checkpoint(path)
    try:
        model = build_meta(ckpt.config)
        blocks = moe_blocks(model)
        names = expert_keys(ckpt, blocks[0][0])
        opts = ckpt.experts_options([f"{blocks[0][0]}.experts.0.{n}.weight" for n in names], opts, lambda m: None)
        types = ckpt.expert_layouts([n for n, _ in blocks], names)
        inter = ckpt.shape(f"{blocks[0][0]}.experts.0.{names[0]}.weight")[0]
        plan = plan_model(model, ckpt.config, blocks, opts, inter, expert_layouts=types)
        return plan, type_rows(ckpt, model, blocks, names, plan)
    finally:
        ckpt.close()


@pytest.mark.parametrize("qtype, layer_types", [
    ("Q8_0", None), ("Q4_K", None), ("Q6_K", None), ("MXFP4", None), ("IQ4_XS", None),
    ("Q5_0", None), ("Q2_K", None), ("Q4_1", None), ("TQ2_0", None), ("TQ1_0", None),
    ("Q4_K+Q6_K", None),  # Q4_K_M's experts
    ("Q4_K", {0: "Q4_K+Q6_K", 1: "Q5_K+Q8_0"}),  # a mix per layer, one int8 plan
    ("Q4_K", {1: "Q6_K+Q6_K"}),  # a Q6_K layer (int8 class, group 16) beside Q4_K: each in its own layout
    ("Q4_K", {1: "F16"}),  # a type no layout holds: that layer re-quantized
    ("MXFP4", {1: "Q8_0"}),
])
def test_bytes_per_type_are_what_the_load_allocates(tmp_path, qtype, layer_types):
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", qtype, layer_types=layer_types, **KSIZES["qwen3_moe"])
    plan, rows = _type_rows(path, dense_format="bf16")
    loaded = _load(path, dense_format="bf16")
    experts = [r for r in rows if r.part == "experts"]
    assert sum(r.held_bytes for r in experts) == loaded.info["expert_bytes"] == plan.ram["routed experts"]
    engine = [block.experts.nbytes for _, block in moe_blocks(loaded.model)]
    if layer_types is None and "+" not in qtype:  # one type: its row is every engine's bytes
        assert [(r.ggml_type, r.held_bytes) for r in experts] == [(qtype, sum(engine))]
    # the file's bytes per type: the stacked tensors' own sizes in the file
    reader = gguf.GGUFReader(str(path))
    for r in experts:
        mine = [t for t in reader.tensors if "_exps." in t.name and t.tensor_type.name == r.ggml_type]
        assert (r.tensors, r.file_bytes) == (len(mine), sum(int(t.n_bytes) for t in mine))
    dense = [r for r in rows if r.part == "dense"]
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    assert sum(r.held_bytes for r in dense) == plan.ram["dense weights"] == held
    assert all(r.ggml_type == "F32" for r in dense)  # the test files' dense tensors (tests/gguf_files.py)


# held / file bytes of the routed experts per type (csrc/formats/layout.h: codes + scale sets), what `hetmoe plan`
# prints; <= 1.05 where the engine holds the file's bits per weight (4-bit codes with their own scales)
RAM_FACTORS = {"Q4_K": (1.0278, "int4 g32 k8 affine"), "Q4_1": (1.0, "int4 g32 fp16 affine"),
               "IQ4_XS": (1.0147, "lut4 iq4nl g32 k8"), "Q4_0": (1.0, "int4 g32 fp16"),
               "Q3_K": (1.0364, "int3 g16 k8"), "Q2_K": (1.0, "int2 g16 k4 affine"),
               "Q5_K": (1.0227, "int5 g32 k8 affine"), "Q6_K": (1.0, "int6 g16 k8"),
               "Q5_0": (1.0, "int5 g32 fp16"), "Q5_1": (1.0, "int5 g32 fp16 affine"),
               # int2 codes with the file's fp16 d per 256 once per 128: 2.125 bits per weight against TQ2_0's 2.0625
               # and TQ1_0's 1.6875 (its trits packed at 1.6 bits)
               "TQ2_0": (2.125 / 2.0625, "int2 g128 fp16"), "TQ1_0": (2.125 / 1.6875, "int2 g128 fp16")}
AT_FILE_SIZE = tuple(t for t in RAM_FACTORS if t != "TQ1_0")  # codes as narrow as the file's (TQ1_0's are narrower)


@pytest.mark.parametrize("qtype", list(RAM_FACTORS))
def test_ram_factor_per_type(tmp_path, qtype):
    """Each exactly held type's row of the plan (held / file bytes, from the real layout), and what a load
    allocates for it."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", qtype, **KSIZES["qwen3_moe"])
    plan, rows = _type_rows(path, dense_format="bf16")
    (row,) = [r for r in rows if r.part == "experts"]
    factor, how = RAM_FACTORS[qtype]
    assert row.ggml_type == qtype and row.held_as == {f"{how} (exact)"}
    assert row.ratio == pytest.approx(factor, abs=1e-4)
    assert row.held_bytes == plan.ram["routed experts"]
    if qtype in AT_FILE_SIZE:
        assert row.ratio <= 1.05


def test_a_single_type_per_layer_matches_each_engine(tmp_path):
    """Layer 0 all Q8_0, layer 1 all Q4_K (each in its own layout): each type's row is that layer's engine bytes."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0", layer_types={1: "Q4_K"}, **KSIZES["qwen3_moe"])
    _, rows = _type_rows(path)
    loaded = _load(path)
    engine = [block.experts.nbytes for _, block in moe_blocks(loaded.model)]
    held = {r.ggml_type: r.held_bytes for r in rows if r.part == "experts"}
    assert held == {"Q8_0": engine[0], "Q4_K": engine[1]}


def test_q4_k_m_like_file_holds_each_layer_in_its_own_layout(tmp_path):
    """Layer 0 Q4_K gate/up beside Q6_K down (Q4_K_M's), layer 1 all Q4_K: the pure Q4_K layer is held as int4 at its
    file's bytes (not as int8 codes because another layer needs wide codes), and the plan's bytes per layer, CPU and
    GPU-resident (affine mins included), are what the load allocates."""
    from hetmoe.cpu.codes import exact_layout
    from hetmoe.cpu.layout import layout_bytes
    from hetmoe.moe.gpu_resident.format import expert_bytes as resident_bytes
    from hetmoe.moe.gpu_resident.format import storage_for

    path, cfg, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", layer_types={0: "Q4_K+Q6_K"},
                                     **KSIZES["qwen3_moe"])
    plan, _ = _type_rows(path)
    loaded = _load(path)
    engines = [block.experts for _, block in moe_blocks(loaded.model)]
    assert [(e.info()["weight_format"], e.info()["down_weight_format"]) for e in engines] == [
        ("int4", "int6"), ("int4", "int4")]
    assert [(lp.experts_format, lp.group_size) for lp in plan.layers] == [("int8", 32), ("int4", 32)]
    assert [lp.ram for lp in plan.layers] == [e.nbytes for e in engines]
    assert plan.ram["routed experts"] == loaded.info["expert_bytes"] == sum(e.nbytes for e in engines)
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], engines[1].num_experts
    as_int8 = E * layout_bytes(exact_layout("Q4_K", "Q4_K", "int8"), H, I)  # the layer in int8 codes
    # per 256 weights: int4 codes 128 + k8 scales and mins 20 bytes, against int8 codes 256 + 20 (4.6 bits, not 8.6)
    assert engines[1].nbytes / as_int8 == pytest.approx(148 / 276, abs=1e-4)
    # GPU-resident experts as the plan counts them: the engines' own codes, mins (fp32, per group) beside the scales
    for lp, e in zip(plan.layers, engines):
        st = storage_for(e)
        assert st.gate_up_affine and lp.gpu_format == st.name
        assert lp.gpu_expert_bytes == resident_bytes(st, H, I, plan.dtype.itemsize)


def test_a_shorter_context_keeps_each_layers_layout(tmp_path):
    """Most layers all Q4_K (int4), one Q4_K_M layer (int8 class): a RAM budget that --max-context auto shortens the
    context for re-plans every layer in its own layout, as the load builds it."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", layer_types={0: "Q4_K+Q6_K"}, num_hidden_layers=3,
                                   **KSIZES["qwen3_moe"])
    full, _ = _type_rows(path)
    own = [(lp.experts_format, lp.group_size) for lp in full.layers]
    assert own == [("int8", 32), ("int4", 32), ("int4", 32)] and full.experts_format == "int4"
    budget = full.ram_bytes - full.ram["KV cache"] // 2
    short, _ = _type_rows(path, cpu_memory=budget)
    assert short.max_context < full.max_context and short.ram_bytes <= budget
    assert [(lp.experts_format, lp.group_size) for lp in short.layers] == own
    assert short.ram["routed experts"] == full.ram["routed experts"]


def test_plan_prints_the_types_without_reading_tensor_data(tmp_path, capsys, monkeypatch):
    """Every tensor's data replaced by an object that fails when used: the plan still prints, the same bytes."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K+Q6_K", **KSIZES["qwen3_moe"])
    assert main(["plan", "--model", str(path), "--device", "cpu", "--dtype", "fp32"]) == 0
    before = capsys.readouterr().out

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"tensor data read ({name})")

        def __array__(self, *a, **k):
            raise AssertionError("tensor data read")

        def __getitem__(self, key):
            raise AssertionError("tensor data read")

    real = gguf_checkpoint.open_gguf

    def header_only(p):
        f = real(p)
        f.tensors = {n: dataclasses.replace(t, data=Untouchable()) for n, t in f.tensors.items()}
        return f

    monkeypatch.setattr(gguf_checkpoint, "open_gguf", header_only)
    assert main(["plan", "--model", str(path), "--device", "cpu", "--dtype", "fp32"]) == 0
    after = capsys.readouterr().out

    def steady(out: str) -> list:  # the lines that do not read the machine's free memory, which moves between runs
        return [line for line in out.splitlines() if "available" not in line and " budget (" not in line]

    assert steady(after) == steady(before)
    lines = after.splitlines()
    q4k = next(line for line in lines if line.startswith("experts  Q4_K "))
    q6k = next(line for line in lines if line.startswith("experts  Q6_K "))
    assert "int4 g32 k8 affine (exact)" in q4k and "int6 g16 k8 (exact)" in q6k, (q4k, q6k)
    assert " 1.03x " in q4k and " 1.00x " in q6k, (q4k, q6k)
    assert any(line.startswith("dense    F32 ") for line in lines)
    with pytest.raises(AssertionError, match="tensor data read"):  # the guard works: a load reads data
        _load(path)


def _retype(path, tensor: str, new_type: int, ne0: int = 0) -> None:
    """Rewrite ``tensor``'s type id (and its first dimension ``ne0`` when given) in the header of ``path``."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    i = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, i)[0]
    if ne0:
        struct.pack_into("<Q", data, i + 4, ne0)
    struct.pack_into("<I", data, i + 4 + 8 * n_dims, new_type)
    path.write_bytes(bytes(data))


def test_a_type_hetmoe_cannot_run_is_named_before_any_weight(tmp_path, monkeypatch, capsys):
    """A norm of integers (F32 -> I32 in the header: 4 bytes a value either way): one error naming the tensor, its
    type and the supported list; the loader never decodes a weight."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0", **KSIZES["qwen3_moe"])
    _retype(path, "blk.1.attn_norm.weight", int(gguf.GGMLQuantizationType.I32))

    def no_read(*a, **k):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(gguf_checkpoint.GGUFCheckpoint, "get_float", no_read)
    with pytest.raises(GGUFError) as err:
        _load(path)
    msg = str(err.value)
    assert "blk.1.attn_norm.weight" in msg and " is I32, which hetmoe cannot run" in msg and "IQ2_XXS" in msg, msg
    assert main(["plan", "--model", str(path), "--device", "cpu"]) != 0  # the plan refuses it the same way
    assert "is I32, which hetmoe cannot run" in capsys.readouterr().err


def test_experts_of_a_type_gguf_cannot_decode_are_named(tmp_path):
    """The last layer's down experts (the file's last expert tensor) retyped Q8_K, which neither the engine nor gguf
    decodes; the file is padded so that its larger blocks fit."""
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0", **KSIZES["qwen3_moe"])
    _retype(path, "blk.1.ffn_down_exps.weight", int(gguf.GGMLQuantizationType.Q8_K))
    path.write_bytes(path.read_bytes() + bytes(1 << 20))
    with pytest.raises(GGUFError, match=r"tensor blk.1.ffn_down_exps.weight \(model.layers.1.mlp.experts.0.down_proj"
                                        r".weight\) is Q8_K, which hetmoe cannot run; supported types: F32, "):
        _load(path)


def test_rows_that_are_not_whole_blocks_name_the_file_and_tensor(tmp_path):
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q4_K", **KSIZES["qwen3_moe"])
    _retype(path, "blk.0.ffn_up_exps.weight", int(gguf.GGMLQuantizationType.Q4_K), ne0=200)
    with pytest.raises(GGUFError, match=r"Q4_K.gguf: tensor blk.0.ffn_up_exps.weight: Q4_K rows of 200 values "
                                        r"are not whole blocks of 256"):
        _load(path)


def test_a_file_cut_inside_a_tensor_names_the_tensor(tmp_path):
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "Q8_0")
    reader = gguf.GGUFReader(str(path))
    last = max(reader.tensors, key=lambda t: t.data_offset)
    path.write_bytes(path.read_bytes()[:int(last.data_offset) + 3])
    with pytest.raises(GGUFError, match=rf"is truncated: tensor {last.name}'s data ends at byte \d+, the file has"):
        _load(path)
