"""GGUF's 4-bit codebook types (IQ4_NL, IQ4_XS, MXFP4, NVFP4) and Q4_0 / Q8_0 at the file's own bytes
(hetmoe/load/gguf/lut4_blocks.py and checkpoint.py -> hetmoe/cpu/codes.py -> the lut4 format and the fp16 / e8m0 scale
types of csrc/formats/layout.h).

Fixtures: random valid blocks (tests/gguf_files.py: every nibble pattern is valid once the scale fields hold finite
values; MXFP4 exponents over a wide range, and its edge bytes 0, 1, 255 here) and ``gguf.quants.dequantize`` of those
bytes as the reference; Q4_0 / Q8_0 quantized by the gguf package. No binary fixture is committed.

Paths covered: the row-block kernels at the best ISA the tests may use (scalar, AVX2, AVX-512: HETMOE_MAX_ISA / the
CPU), the AMX GEMM through its emulation and, on a CPU with AMX, natively; one pool and two NUMA subpools; the GPU
prefill's PyTorch unpack (hetmoe/moe/streamed/packed.py) and its Triton kernel (interpreted here, on the GPU there);
the GPU-resident experts' copy of the engine's codes (hetmoe/moe/gpu_resident/format.py). Tolerances are written next
to each comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interp import assert_unpack_equals_engine

from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import EXACT_TYPES, exact_layout, load_codes
from hetmoe.load.gguf.checkpoint import block_codes
from hetmoe.load.gguf.lut4_blocks import LUT4_BLOCKS, lut4_codes
from reference import ACTIVATION_QMAX, _moe, fake_quantize, rel_err

gguf = pytest.importorskip("gguf")
from gguf_files import assert_torch_unpack_equals_engine, random_blocks  # noqa: E402

E, H, I = 3, 256, 512
HAS_AMX = "amx" in cpu_info()["supported_isas"]
PATHS = ["rows", "amx-emulated"] + (["amx"] if HAS_AMX else [])
ROWS_ONLY = 10**6  # amx_min_tokens that keeps every expert on the row-block kernels
TYPES = ["IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4", "Q4_0", "Q8_0"]
# (gate/up type, down type): one type per layer, and mixes of a codebook type with an int8 one (down, as the
# dynamic quantizers keep it wider)
LAYERS = [(t, t) for t in TYPES] + [("MXFP4", "Q8_0"), ("IQ4_XS", "Q6_K"), ("IQ4_NL", "Q4_0"), ("NVFP4", "Q8_0")]


def codes_of(kind: str, raw: np.ndarray, shape: tuple) -> tuple:
    if kind in LUT4_BLOCKS:
        return (*lut4_codes(raw, kind, shape), None)
    if kind in ("Q8_0", "Q4_0"):
        return block_codes(raw, kind, shape)
    from hetmoe.load.gguf.kquants import kquant_codes

    return kquant_codes(raw, kind, shape)


def gguf_experts(kinds: tuple, seed: int, pool: WorkerPool, centered: bool = False, **kw):
    """(experts loaded from random blocks, gguf's dequantization of gate, up, down [E, rows, cols], the blocks'
    bytes per matrix)."""
    rng = np.random.default_rng(seed)
    experts = CPUExperts(E, H, I, pool=pool, **exact_layout(*kinds), **kw)
    codes, scales, mins, refs, nbytes = [], [], [], [], []
    for kind, (rows, cols) in zip((kinds[0], kinds[0], kinds[1]), ((I, H), (I, H), (H, I))):
        raws = np.stack([random_blocks(kind, rows, cols, rng, centered) for _ in range(E)])
        qt = getattr(gguf.GGMLQuantizationType, kind)
        refs.append(torch.from_numpy(gguf.quants.dequantize(raws, qt).astype(np.float32)))
        q, s, m = codes_of(kind, raws, (E, rows, cols))
        codes.append(q), scales.append(s), mins.append(m), nbytes.append(raws.nbytes)
    load_codes(experts, codes, scales, mins=mins)
    return experts, refs, nbytes


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's own, on 12 * 2^127 (inf)
@pytest.mark.parametrize("kind", ["IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"])
def test_decoded_codes_times_codebook_are_gguf_values(kind):
    """lut4_codes of random blocks: codebook[index] * scale is gguf.quants.dequantize, bit for bit; MXFP4's exponent
    bytes 0 and 1 (fp32 subnormal scales) and 255 (2^127) included; NVFP4's UE4M3 bytes 0 and 0x7F (zero), 1 (the
    smallest subnormal), 0x80 (bit 7, not read) and 0x7E (the largest), its scales exact in fp16."""
    from hetmoe.cpu.layout import CODEBOOKS

    rng = np.random.default_rng(1)
    raw = random_blocks(kind, 8, 512, rng)
    if kind == "MXFP4":
        raw.reshape(8, 16, 17)[:3, 0, 0] = (0, 1, 255)
    if kind == "NVFP4":
        raw.reshape(8, 8, 36)[0, 0, :4] = (0, 0x7F, 1, 0x80)
        raw.reshape(8, 8, 36)[1, 0, 0] = 0x7E
    q, s = lut4_codes(raw, kind, (8, 512))
    assert q.dtype == torch.int8 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert s.shape == (8, 512 // EXACT_TYPES[kind][2])
    if kind == "NVFP4":
        assert torch.equal(s, s.half().float())
    book = torch.tensor(CODEBOOKS[EXACT_TYPES[kind][4]], dtype=torch.float32)
    got = book[q.long()] * s.repeat_interleave(EXACT_TYPES[kind][2], dim=1)
    want = torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).astype(np.float32))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("split", [False, True], ids=["one-pool", "numa2"])
@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
def test_packed_experts_dequantize_bitwise_as_gguf(kinds, split):
    experts, refs, _ = gguf_experts(kinds, 2, WorkerPool(2, numa=2) if split else WorkerPool(1))
    for e in range(E):
        for got, want in zip(experts.dequantized(e), refs):
            assert torch.equal(got.view(torch.int32), want[e].view(torch.int32))  # bit for bit, -0.0 included


# RAM held per expert / the file's bytes for it. MXFP4, IQ4_NL, Q4_0, Q8_0: the file's bytes (their scales held at
# their own width); IQ4_XS: an fp32 scale per 32 (d * (ls - 32) has 17 significant bits) against the file's fp16 d
# per 256 and 6-bit ls per 32: 5 / 4.25 bits per weight = 1.176 (its nibbles are the file's).
# IQ4_XS: k8 scales (an int8 sub-scale per 32 and the file's fp16 d per 256) against the file's 6-bit ls per 32
# NVFP4: an fp16 scale per 16 against the file's UE4M3 byte: 5 / 4.5 bits per weight
RAM_RATIO = {"MXFP4": 1.0, "IQ4_NL": 1.0, "Q4_0": 1.0, "Q8_0": 1.0, "IQ4_XS": (4 + 8 / 32 + 16 / 256) / 4.25,
             "NVFP4": 5 / 4.5}


@pytest.mark.parametrize("kind", TYPES)
def test_ram_is_the_files_bytes(kind):
    experts, _, nbytes = gguf_experts((kind, kind), 3, WorkerPool(1))
    held = experts.info()["bytes_per_expert"] * E
    assert held == pytest.approx(sum(nbytes) * RAM_RATIO[kind], rel=1e-12), (held, sum(nbytes))
    layout = exact_layout(kind, kind)
    assert (experts.info()["gate_up_scale_dtype"], experts.info()["gate_up_codebook"]) == (layout["scale_dtype"][0],
                                                                                           layout["codebook"][0])


def test_nvfp4_e4m3_held_is_the_files_bytes(monkeypatch):
    """With hetmoe/cpu/codes.py E4M3_HELD: NVFP4's UE4M3 bytes held as they are (e4m3 scales, factor 1), the values
    gguf's dequantization bit for bit, the RAM the file's bytes and 4 bytes per 16 rows of a matrix (its factor)."""
    from hetmoe.cpu import codes as cpu_codes

    monkeypatch.setattr(cpu_codes, "E4M3_HELD", True)
    experts, refs, nbytes = gguf_experts(("NVFP4", "NVFP4"), 5, WorkerPool(1))
    assert experts.info()["gate_up_scale_dtype"] == experts.info()["down_scale_dtype"] == "e4m3"
    for e in range(E):
        for got, want in zip(experts.dequantized(e), refs):
            assert torch.equal(got, want[e])
    held = experts.info()["bytes_per_expert"] * E
    assert held == sum(nbytes) + E * 4 * (2 * -(-I // 16) + -(-H // 16))


def reference(experts, x, ids, w, refs, amx: bool) -> torch.Tensor:
    """The float64 MoE on gguf's values with the engine's activation rounding (as tests/load/gguf/test_kquants.py)."""
    info = experts.info()
    qmax_x, qmax_h = (ACTIVATION_QMAX["int8" if amx else info[a]] for a in ("activation", "down_activation"))
    qx = lambda v: fake_quantize(v, info["group_size"], qmax_x).double()  # noqa: E731
    qh = lambda v: fake_quantize(v, info["down_group_size"], qmax_h).double()  # noqa: E731
    return _moe(x.double(), lambda e: tuple(r[e].double() for r in refs), E, ids, w, None, qx, qh)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
@pytest.mark.parametrize("T", [1, 3, 37])
def test_a_moe_call_matches_the_reference_on_gguf_values(kinds, T, path):
    """Each path against the reference on gguf's values with the engine's activation rounding (tight: fp32
    summation order and activation rounding boundaries; measured max 2.2e-6) and against the plain fp64 MoE on gguf's
    values (the activation rounding: measured max 1.6e-2 with int8 activations, 8.3e-5 with int16)."""
    amx = path != "rows"
    kw = dict(isa=path, amx_min_tokens=1) if amx else dict(amx_min_tokens=ROWS_ONLY)
    experts, refs, _ = gguf_experts(kinds, 4, WorkerPool(1), centered=True, **kw)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, 2), generator=gen)
    ids[0, 1] = -1  # a skipped slot
    w = torch.rand(T, 2, generator=gen)
    got = experts.forward(x, ids, w)
    assert rel_err(got, reference(experts, x, ids, w, refs, amx)) < 1e-4
    plain = _moe(x.double(), lambda e: tuple(r[e].double() for r in refs), E, ids, w, None, lambda v: v.double(),
                 lambda v: v.double())
    int8_act = amx or {"int4", "lut4"} & {experts.info()["weight_format"], experts.info()["down_weight_format"]}
    assert rel_err(got, plain) < (3e-2 if int8_act else 3e-4)


@pytest.mark.parametrize("kinds", LAYERS, ids=lambda k: "+".join(k))
def test_the_gpu_prefill_unpack_equals_the_engine(kinds):
    """hetmoe/moe/streamed/packed.py's torch twin reads lut4 and the narrow scale types bitwise (fp32) like the
    engine."""
    experts, _, _ = gguf_experts(kinds, 5, WorkerPool(1))
    assert_torch_unpack_equals_engine(experts, E)


def test_the_gpu_resident_copy_keeps_codes_and_widens_scales():
    """GPU-resident experts of such engines: lut4 codes kept with their codebook, int4 / int8 codes as they are,
    scales widened to fp32 -- the engine's values exactly (hetmoe/moe/gpu_resident/format.py cpu_storage /
    cpu_codes; the kernels that read them: tests/moe/gpu_resident/test_gpu_experts_int.py)."""
    from hetmoe.moe.gpu_resident import format as rf

    for kinds in (("MXFP4", "Q8_0"), ("IQ4_XS", "IQ4_XS"), ("Q4_0", "Q4_0")):
        experts, _, _ = gguf_experts(kinds, 6, WorkerPool(1))
        st = rf.cpu_storage(experts)
        assert (st.gate_up, st.down) == tuple(EXACT_TYPES[t][0] for t in kinds)
        for e in (0, E - 1):
            (gu_q, gu_s), (d_q, d_s) = rf.cpu_codes(experts, e, st)
            assert gu_s.dtype == d_s.dtype == torch.float32
            g, u, d = experts.dequantized(e)
            got_gu = rf.dequantize(gu_q, gu_s, st.gate_up, st.group, H, codebook=st.gate_up_codebook)
            assert torch.equal(got_gu, torch.cat([g, u]))
            assert torch.equal(rf.dequantize(d_q, d_s, st.down, st.down_group, I, codebook=st.down_codebook), d)


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        lut4_codes(np.zeros(136, np.uint8), "IQ4_XS", (1, 128))
    with pytest.raises(ValueError, match=r"MXFP4 \[2, 64\] needs 68 bytes, got 67"):
        lut4_codes(np.zeros(67, np.uint8), "MXFP4", (2, 64))
    rng = np.random.default_rng(7)
    experts = CPUExperts(E, H, I, pool=WorkerPool(1), **exact_layout("IQ4_NL", "IQ4_NL"))
    parts = [lut4_codes(random_blocks("IQ4_NL", r, c, rng).reshape(1, -1).repeat(E, 0), "IQ4_NL", (E, r, c))
             for r, c in ((I, H), (I, H), (H, I))]
    scales = [p[1] for p in parts]
    nan = scales[1].clone()
    nan[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="up has scales that are NaN or Inf"):
        load_codes(experts, [p[0] for p in parts], [scales[0], nan, scales[2]])
    assert experts.info()["experts_loaded"] == 0


# MXFP4 / IQ4_NL / IQ4_XS / Q4_0 / Q8_0's layouts, and bf16 scales
TRITON_LAYOUTS = [("lut4", 32, "e8m0", "e2m1"), ("lut4", 32, "fp16", "iq4nl"), ("lut4", 32, "fp32", "iq4nl"),
                  ("int4", 32, "fp16", None), ("int8", 32, "fp16", None), ("int8", 16, "bf16", None),
                  ("lut4", 16, "fp16", "e2m1")]


def test_the_triton_unpack_reads_lut4_and_narrow_scales():
    """The layerwise prefill's one-pass kernel on lut4 and the narrow scale types (@gpu run: the same test), K
    padded to the group in down."""
    assert_unpack_equals_engine((2, 64, 40), [dict(weight_format=fmt, group_size=group, scale_dtype=scale_dtype,
                                                   codebook=codebook)
                                              for fmt, group, scale_dtype, codebook in TRITON_LAYOUTS])


@pytest.mark.parametrize("mix", ["MXFP4", "IQ4_XS", "NVFP4"])
def test_a_random_file_of_codebook_experts_loads_at_its_bytes(tmp_path, mix):
    """hetmoe/load/gguf/random_file.py's qwen3moe file (what the benchmarks write) with MXFP4 / IQ4_XS / NVFP4 experts,
    loaded by the loader: every expert's values are gguf's dequantization of the file's tensors, and the experts' RAM
    is the file's expert bytes (IQ4_XS: times 1.015, its k8 scales; NVFP4: 1.11, its fp16 scales)."""
    import copy

    from hetmoe.config.options import EngineOptions
    from hetmoe.load.gguf.random_file import qwen3moe_plan, write_random_gguf
    from hetmoe.load.loader import load_model, moe_blocks
    from hetmoe.load.random_weights import SHAPES
    from hetmoe.models.config import ModelConfig

    cfg = ModelConfig({**copy.deepcopy(SHAPES["qwen3-30b-a3b"]), "hidden_size": 256, "moe_intermediate_size": 256,
                       "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                       "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2, "vocab_size": 600,
                       "bos_token_id": 597, "eos_token_id": 598})
    dense = dict.fromkeys(("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "output"), "F32")
    path = tmp_path / f"random-{mix}.gguf"
    info = write_random_gguf(path, cfg, qwen3moe_plan(cfg, mix, dense), "random", 7, seed=1)
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=lambda m: None)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    held = file_bytes = 0
    for block, layer in moe_blocks(loaded.model):
        bid = int(block.split(".")[2])
        want = [gguf.quants.dequantize(tensors[f"blk.{bid}.ffn_{w}_exps.weight"].data, getattr(
            gguf.GGMLQuantizationType, mix)) for w in ("gate", "up", "down")]
        for e in range(layer.engine.num_experts):
            for got, w in zip(layer.engine.dequantized(e), want):
                assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(w[e], dtype=np.float32)))
        held += layer.engine.nbytes
        file_bytes += sum(info["tensor_bytes"][f"blk.{bid}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
    assert held == pytest.approx(file_bytes * RAM_RATIO[mix], rel=1e-12)
