"""The fp8 format (E4M3 codes, one byte per weight; csrc/formats/layout.h) on every path this machine runs:

    scalar, avx2, avx512   the row-block kernels (fp32 activations; HETMOE_MAX_ISA caps the levels)
    amx-emulated           the AMX GEMM's loops in plain C++ (bf16 activations; every expert on it: amx_min_tokens=1)
    amx                    the tile unit, where there is one

Experts are loaded from E4M3 codes and scales as checkpoints hold them (hetmoe/cpu/codes.py load_fp8): block FP8
(fp32 per 128 x 128: group 128, shared scales), per-channel FP8 (group 128, the row's scale in every group) and
MXFP8 (e8m0 per 32). The values the kernels multiply by are e4m3(code) * scale bit for bit (torch.float8_e4m3fn is
the naive reference of a code's value); outputs are compared with the float64 MoE on those weights: the row blocks
within fp32 summation (and the same bits as each other), the AMX paths within their bf16 activation rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch

from cases import generator, make_routing, make_weights, make_x
from hetmoe import _C
from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import block_fp8_scales, load_fp8
from hetmoe.cpu.layout import FP8_LAYOUTS, expert_bytes, packed_matrix_bytes
from paths import NATIVE_BF16_TOL
from reference import moe_reference, moe_reference_emulated, rel_err

ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
AMX_PATHS = ["amx-emulated"] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
PATHS = ROW_ISAS + AMX_PATHS

# (name, group, scale dtype, shared scales, how the checkpoint scales its codes)
CASES = {"block": (128, "fp32", True, "block"), "channel": (128, "fp32", False, "row"),
         "mxfp8": (32, "e8m0", False, "mx"), "g64": (64, "bf16", False, "group")}
# ||out - ref|| / ||ref||, ref: the float64 MoE on the engine's exact weights, MEASURED over every case, shape and run
# below on the dev machine (Zen 4). Row blocks: fp32 summation of the same products, max 2.9e-7 (bound 1e-5). AMX: x
# and h rounded to bf16, max 4.8e-3 against the exact weights, 4.8e-5 against moe_reference_emulated's bf16 rounding
# (h rounded from fp32 here, from float64 there: boundary cases; its bound, 1e-3, as tests/cpu/test_code_formats.py).
ROW_TOL = 1e-5
AMX_TOL = 1e-2
EMULATED_TOL = 1e-3
SHAPES = {"E6-H256-I128": (6, 256, 128), "E5-H200-I88": (5, 200, 88), "E5-H40-I24": (5, 40, 24)}
RUNS = ((1, 1), (3, 2), (7, 4), (40, 2))  # (T, k): one token, a few, and an AMX-sized prefill (T >= 32)


def random_codes(shape, gen) -> torch.Tensor:
    """E4M3 codes (uint8) over every exponent, NaN codes (0x7F, 0xFF) left out."""
    q = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    return torch.where((q & 0x7F) == 0x7F, q ^ 0x01, q)


def scales_for(kind: str, E: int, rows: int, cols: int, group: int, gen) -> torch.Tensor:
    """fp32 [E, rows, ceil(cols / group)] as each kind of checkpoint has them, in load_fp8's per-row form."""
    groups = -(-cols // group)
    if kind == "block":  # one per 128 x 128 block
        inv = torch.rand(E, -(-rows // 128), groups, generator=gen) * 1e-3 + 1e-5
        return torch.stack([block_fp8_scales(s, rows) for s in inv])
    if kind == "row":  # one per row, in every group
        return (torch.rand(E, rows, 1, generator=gen) * 1e-3 + 1e-5).expand(E, rows, groups).contiguous()
    if kind == "mx":  # powers of two
        return torch.ldexp(torch.ones(E, rows, groups), torch.randint(-16, -8, (E, rows, groups), generator=gen))
    return (torch.rand(E, rows, groups, generator=gen) * 1e-3 + 1e-5).bfloat16().float()


@functools.lru_cache(maxsize=None)
def checkpoint(case: str, shape) -> tuple:
    """(codes, scales, exact fp32 weights) of gate, up, down: what an FP8 checkpoint holds and what it means."""
    group, _, _, kind = CASES[case]
    E, H, I = shape
    gen = generator("fp8", case, shape)
    codes, scales, weights = [], [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        q, s = random_codes((E, rows, cols), gen), scales_for(kind, E, rows, cols, group, gen)
        codes.append(q), scales.append(s)
        weights.append(q.view(torch.float8_e4m3fn).float() * s.repeat_interleave(group, dim=2)[:, :, :cols])
    return codes, scales, weights


def engine(case: str, path: str, shape, pool=None) -> CPUExperts:
    group, sdt, shared, _ = CASES[case]
    kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
    ex = CPUExperts(*shape, "fp8", group, pool=pool or WorkerPool(1), scale_dtype=sdt, shared_scales=shared, **kw)
    codes, scales, _ = checkpoint(case, shape)
    load_fp8(ex, codes, scales)
    return ex


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("case", CASES)
def test_every_path_matches_the_exact_weights(case, shape):
    shape = SHAPES[shape]
    E, H, _ = shape
    _, _, exact = checkpoint(case, shape)
    engines = {p: engine(case, p, shape) for p in PATHS}
    for p, ex in engines.items():  # the codes and scales held as they are: e4m3(code) * scale, bit for bit
        for e in range(E):
            assert all(torch.equal(a, w[e]) for a, w in zip(ex.dequantized(e), exact)), (p, e)
    for T, k in RUNS:
        x = make_x(T, H, shape, k)
        ids, w = make_routing(T, k, E, shape, n_cold=1)
        outs = {p: ex(x, ids, w) for p, ex in engines.items()}
        ref = moe_reference(x, *exact, ids, w)
        for p, out in outs.items():
            what = f"{case} {p} T={T} k={k}"
            if p in AMX_PATHS:
                emu = moe_reference_emulated(x, *exact, ids, w, "bf16", 0)
                assert rel_err(out, emu) <= EMULATED_TOL, f"{what}: {rel_err(out, emu):.3g} vs the bf16 reference"
                assert rel_err(out, ref) <= AMX_TOL, f"{what}: {rel_err(out, ref):.3g}"
            else:
                assert rel_err(out, ref) <= ROW_TOL, f"{what}: {rel_err(out, ref):.3g}"
                assert torch.equal(out, outs[ROW_ISAS[0]]), f"{what}: differs from {ROW_ISAS[0]}"
        if len(AMX_PATHS) > 1:  # the tile unit and its emulation: the same bf16 tiles, the same epilogues
            assert rel_err(outs["amx"], outs["amx-emulated"]) <= NATIVE_BF16_TOL


def test_amx_and_row_paths_read_the_same_bytes():
    """A mixed engine (AMX for experts with many tokens, row blocks for the others) agrees with the row path within
    the bf16 bound, on one set of packed bytes."""
    shape = SHAPES["E6-H256-I128"]
    E, H, _ = shape
    rows = engine("block", ROW_ISAS[-1], shape)
    mixed = CPUExperts(*shape, "fp8", 128, pool=WorkerPool(1), isa="amx-emulated", shared_scales=True,
                       amx_min_tokens=8)
    load_fp8(mixed, *checkpoint("block", shape)[:2])
    assert [bytes(m) for m in mixed.storage()] == [bytes(m) for m in rows.storage()]
    x = make_x(48, H, "mixed")
    ids, w = make_routing(48, 2, E, "mixed", hot_share=0.5)
    assert rel_err(mixed(x, ids, w), rows(x, ids, w)) <= AMX_TOL


@pytest.mark.parametrize("case", CASES)
def test_floats_round_to_codes_times_scales(case):
    """Weights quantized here (a bf16 checkpoint loaded as fp8): each value is an E4M3 number times its stored scale,
    the largest |w| of a scale's group (shared: of its 16 rows) at most 448 times it; the error is E4M3's."""
    group, sdt, shared, _ = CASES[case]
    shape = SHAPES["E5-H200-I88"]
    src = make_weights(*shape, "fp8 floats")
    outs = {}
    for p in ROW_ISAS:
        ex = CPUExperts(*shape, "fp8", group, pool=WorkerPool(1), isa=p, scale_dtype=sdt, shared_scales=shared)
        ex.load(*src)
        outs[p] = [bytes(m) for m in ex.storage()]
    assert all(o == outs[ROW_ISAS[0]] for o in outs.values())  # packing does not depend on the ISA
    for e in range(shape[0]):
        for got, w in zip(ex.dequantized(e), src):
            w = w[e]
            assert rel_err(got, w) <= 0.04  # MEASURED 2.5e-2 .. 2.7e-2: 3 mantissa bits, round to nearest
    info = ex.info()
    assert info["kernel"].startswith("fp8/") and info["activation"] == "fp32"
    assert (info["gate_up_shared_scales"], info["down_shared_scales"]) == (shared, shared)


def test_quantized_values_are_e4m3_numbers():
    """Per (row, group): value / scale is an E4M3 number (torch.float8_e4m3fn holds it exactly) with |.| <= 448."""
    E, H, I = 2, 256, 64
    w = make_weights(E, H, I, "e4m3 numbers")
    ex = CPUExperts(E, H, I, "fp8", 32, pool=WorkerPool(1), scale_dtype="e8m0")
    ex.load(*w)
    gate = ex.dequantized(0)[0].view(I, H // 32, 32)
    scale = torch.ldexp(torch.ones(1), torch.ceil(torch.log2(w[0][0].view(I, H // 32, 32).abs().amax(-1) / 448)))
    q = gate / scale.unsqueeze(-1)
    assert q.abs().max() <= 448
    assert torch.equal(q.to(torch.float8_e4m3fn).float(), q)


@pytest.mark.parametrize("kind", ["block", "mx"])
def test_held_bytes_are_the_checkpoints(kind):
    """RAM factor: the engine's bytes over the checkpoint's (codes + its own scales) for DeepSeek-like shapes."""
    E, H, I = 2, 1024, 512
    case = {"block": "block", "mx": "mxfp8"}[kind]
    group, sdt, shared, _ = CASES[case]
    ex = CPUExperts(E, H, I, "fp8", group, pool=WorkerPool(1), scale_dtype=sdt, shared_scales=shared)
    params = 3 * I * H
    file_scales = (3 * (I // 128) * (H // 128) * 4) if kind == "block" else (3 * I * H // 32)  # fp32 / ue8m0 bytes
    factor = ex.nbytes / (E * (params + file_scales))
    assert factor <= 1.03, factor
    assert ex.nbytes == E * expert_bytes("fp8", H, I, group)
    assert FP8_LAYOUTS[group] == {"scale_dtype": sdt, "shared_scales": shared}
    want = 2 * packed_matrix_bytes("fp8", I, H, group, False, sdt, shared) + packed_matrix_bytes(
        "fp8", H, I, group, False, sdt, shared)
    assert ex.info()["bytes_per_expert"] == want


@pytest.mark.parametrize("isa", ["scalar"] + (["avx512"] if "avx512" in ROW_ISAS else []))
def test_amx_line_widening(isa):
    """fp8 lines -> the AMX GEMM's bf16 lines (line 2j: k 4j, 4j + 1; 2j + 1: k 4j + 2, 4j + 3), each code the
    bf16 of q * 2^-8: the scalar widening (the emulated GEMM's) and the AVX-512 one (the tile unit's), bit for bit."""
    lines = random_codes((5, 16, 4), generator("lines"))
    lines[0, 0] = torch.tensor([0x00, 0x80, 0x01, 0x7E], dtype=torch.uint8)  # +0, -0, the smallest subnormal, 448
    out = torch.frombuffer(bytearray(_C.fp8_to_bf16_lines(isa, lines.numpy().tobytes())), dtype=torch.bfloat16)
    want = (lines.view(torch.float8_e4m3fn).float() * 2.0 ** -8).bfloat16()  # [line, row, k]
    want = want.view(5, 16, 2, 2).permute(0, 2, 1, 3).reshape(-1)  # [line, half, row, pair]
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_numa_split_holds_the_same_weights():
    """Split over two subpools (I cut at a multiple of the group: shared scales stay whole), the same weights bit for
    bit; the output within fp32 summation (down's sum over I is added across the slices)."""
    shape = (4, 256, 256)
    one = engine("block", ROW_ISAS[-1], shape)
    split = engine("block", ROW_ISAS[-1], shape, pool=WorkerPool(2, numa=2))
    assert split.info()["numa_subpools"] == 2
    for e in range(4):
        assert all(torch.equal(a, b) for a, b in zip(one.dequantized(e), split.dequantized(e)))
    x = make_x(5, 256, "numa")
    ids, w = make_routing(5, 2, 4, "numa", n_cold=0)
    assert rel_err(split(x, ids, w), one(x, ids, w)) <= ROW_TOL


def test_bad_codes_and_scales_are_refused():
    E, H, I = 2, 128, 64
    ex = CPUExperts(E, H, I, "fp8", 128, pool=WorkerPool(1), shared_scales=True)
    gen = generator("refused")
    codes = [random_codes((E, r, c), gen) for r, c in ((I, H), (I, H), (H, I))]
    scales = [torch.full((E, r, -(-c // 128)), 2.0 ** -10) for r, c in ((I, H), (I, H), (H, I))]
    for nan in (0x7F, 0xFF):
        ex = CPUExperts(E, H, I, "fp8", 128, pool=WorkerPool(1), shared_scales=True)
        bad = codes[1].clone()
        bad[1, 3, 5] = nan
        with pytest.raises(ValueError, match=f"up of expert 1 holds the E4M3 NaN code 0x{nan:02X} at \\[3, 5\\]"):
            load_fp8(ex, [codes[0], bad, codes[2]], scales)
        assert ex.info()["experts_loaded"] == 0  # scanned before anything is packed
        with pytest.raises(ValueError, match="up of expert 1 has an E4M3 NaN code"):  # the engine's own check
            ex._ex.load_codes(0, E, codes[0].data_ptr(), scales[0].data_ptr(), bad.data_ptr(), scales[1].data_ptr(),
                              codes[2].data_ptr(), scales[2].data_ptr())
    differ = scales[2].clone()
    differ[0, 17, 0] = 2.0 ** -9  # row 17 of a block whose row 16 has 2^-10
    with pytest.raises(ValueError, match="down has shared scales .* that differ within 16 rows"):
        load_fp8(ex, codes, [scales[0], scales[1], differ])
    inf = scales[0].clone()
    inf[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="gate has scales that are NaN or Inf"):
        load_fp8(ex, [codes[0], codes[1], codes[2]], [inf, scales[1], scales[2]])
    with pytest.raises(ValueError, match="gate codes must be float8_e4m3fn"):
        load_fp8(ex, [codes[0].view(torch.int8), codes[1], codes[2]], scales)
    with pytest.raises(ValueError, match="down scales must be \\[2, 128, 1\\]"):
        load_fp8(ex, codes, [scales[0], scales[1], scales[2][:, :, :0]])
    mx = CPUExperts(E, H, I, "fp8", 32, pool=WorkerPool(1), scale_dtype="e8m0")
    with pytest.raises(ValueError, match="gate has scales that e8m0 does not hold exactly"):
        load_fp8(mx, codes, [torch.full((E, r, c // 32), 0.3) for r, c in ((I, H), (I, H), (H, I))])
    with pytest.raises(ValueError, match="E4M3 codes load into grouped fp8 experts"):
        load_fp8(CPUExperts(E, H, I, "int8", 128, pool=WorkerPool(1)), codes, scales)
    for kw, msg in [(dict(weight_format="int8", shared_scales=True), "shared scales .* grouped fp8 weights only"),
                    (dict(weight_format="fp8", group_size=0, shared_scales=True), "grouped fp8 weights only"),
                    (dict(weight_format="fp8", scaling="affine"), "fp8 weights are symmetric"),
                    (dict(weight_format="fp8", group_size=16), "group_size must be 32, 64 or 128"),
                    (dict(weight_format="fp8", scale_dtype="k8"), "fp8 weights take .* not k8"),
                    (dict(weight_format=("fp8", "int8")), "of different formats"),
                    (dict(weight_format="fp8", shared_scales="yes"), "shared_scales must be a bool")]:
        with pytest.raises(ValueError, match=msg):
            CPUExperts(E, H, I, pool=WorkerPool(1), **kw)
