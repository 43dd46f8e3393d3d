"""Scales stored narrower than fp32 (fp16, bf16, e8m0, the K-quants' two-level k8; affine mins stored as the scales)
and the lut4 format (4-bit indices into a codebook of 16 int8 values: E2M1 doubled, IQ4_NL's table),
csrc/formats/layout.h, on every path this machine runs:

    scalar, avx2, avx512   the row-block kernels (each level the ISA can run; HETMOE_MAX_ISA caps them)
    amx-emulated           the AMX GEMM's loops in plain C++ (every expert on it: amx_min_tokens=1)
    amx                    the tile unit, where there is one

The row-block levels give the same bits as each other for every format (the widened scale is exact, the integer
sums are exact, the epilogue is the same); int4 and lut4 read int8 activations on both classes, so the AMX GEMM gives
those bits too (int8 weights: int16 activations on the row blocks, int8 on AMX — compared with the emulated reference
of their own rounding). Each case is checked against the float64 MoE on the engine's own dequantized weights with
its activation rounding (fp32 summation order, and activation rounding boundaries: EMULATED_TOL) and against the
fp32 reference on the source weights (quantization noise; tolerances below, measured max + ~15 %).
"""

from __future__ import annotations

import functools

import pytest
import torch

from cases import make_routing, make_weights, make_x
from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import load_codes
from hetmoe.cpu.layout import CODEBOOKS, packed_matrix_bytes
from reference import moe_reference, moe_reference_emulated, rel_err

ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
AMX_PATHS = ["amx-emulated"] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
PATHS = ROW_ISAS + AMX_PATHS

# (format, group, scale dtype, codebook): every scale dtype on int8 / int4, lut4 with each codebook, group 16 where
# the format has it
CASES = [("int8", 32, "fp16", None), ("int8", 16, "bf16", None), ("int8", 64, "e8m0", None),
         ("int4", 32, "fp16", None), ("int4", 64, "bf16", None), ("int4", 128, "e8m0", None),
         ("lut4", 32, "fp32", "iq4nl"), ("lut4", 32, "fp16", "iq4nl"), ("lut4", 128, "bf16", "iq4nl"),
         ("lut4", 32, "e8m0", "e2m1"), ("lut4", 16, "fp16", "e2m1"), ("lut4", 64, "fp32", "e2m1"),
         ("int4", 32, "k8", None), ("int4", 16, "k8", None), ("lut4", 32, "k8", "iq4nl")]
# k8 (int8 sub-scale x fp16 per 256, rounded from the fp32 group scales here): MEASURED int4 g32 0.153, int4 g16 0.158,
# lut4 iq4nl g32 0.170 (fp32 scales of the same cases: 0.159, 0.148, 0.170), + ~15 %; int8 k8 (1.55e-2 against fp32's
# 1.38e-2 at g16) is covered by the two-level tests below and tests/load/gguf/test_kquants.py
K8_TOL_INT4, K8_TOL_INT4_16, K8_TOL_LUT4 = 0.177, 0.183, 0.196
# ||out - ref|| / ||ref|| against the fp32 source, MEASURED on these cases' gaussian weights (std 0.02) over every
# shape, T and path below (the largest), + ~15 %: int8 g32 fp16 1.50e-2, g16 bf16 1.35e-2, g64 e8m0 2.23e-2; int4
# g32 fp16 0.160, g64 bf16 0.174, g128 e8m0 0.263; lut4 iq4nl g32 fp32 0.170, fp16 0.170, g128 bf16 0.187; lut4
# e2m1 g32 e8m0 0.284, g16 fp16 0.183, g64 fp32 0.203. Narrow scales cost int8 and int4 little (bf16: 2^-9
# relative; e8m0 rounds a scale up by < 2x, so the codes use as little as half their range); lut4 with IQ4_NL's
# table is about int4's, E2M1's 8 magnitudes per sign cost more.
FP32_TOL = {("int8", 32, "fp16"): 1.75e-2, ("int8", 16, "bf16"): 1.56e-2, ("int8", 64, "e8m0"): 2.6e-2,
            ("int4", 32, "fp16"): 0.185, ("int4", 64, "bf16"): 0.20, ("int4", 128, "e8m0"): 0.30,
            ("lut4", 32, "fp32"): 0.196, ("lut4", 32, "fp16"): 0.196, ("lut4", 128, "bf16"): 0.215,
            ("lut4", 32, "e8m0"): 0.33, ("lut4", 16, "fp16"): 0.21, ("lut4", 64, "fp32"): 0.235,
            ("int4", 32, "k8"): K8_TOL_INT4, ("int4", 16, "k8"): K8_TOL_INT4_16,
            ("lut4", 32, "k8"): K8_TOL_LUT4}
# against the emulated reference, MEASURED max 2.6e-7, except 1.7e-4 where AMX rounds h to int8 (T=64): an element at
# a rounding boundary in fp32 (the engine) and not in float64 (the reference). The bound of test_kernels.py.
EMULATED_TOL = 1e-3

SHAPES = {"E12-H160-I96": (12, 160, 96), "E10-H200-I88": (10, 200, 88), "E5-H40-I24": (5, 40, 24)}
RUNS = ((1, 1), (3, 2), (7, 4), (64, 2))  # (T, k)


def case_id(case) -> str:
    fmt, group, sdt, book = case
    return f"{fmt}{'-' + book if book else ''}-g{group}-{sdt}"


@functools.lru_cache(maxsize=None)
def weights(shape):
    return make_weights(*shape, "code formats")


def engine(case, path: str, shape, pool=None) -> CPUExperts:
    fmt, group, sdt, book = case
    E, H, I = shape
    kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
    ex = CPUExperts(E, H, I, fmt, group, pool=pool or WorkerPool(1), scale_dtype=sdt, codebook=book, **kw)
    ex.load(*weights(shape))
    return ex


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_path_matches_the_references(case, shape):
    shape = SHAPES[shape]
    E, H, _ = shape
    engines = {p: engine(case, p, shape) for p in PATHS}
    base = engines[ROW_ISAS[0]]
    dq = list(zip(*(base.dequantized(e) for e in range(E))))
    for p, ex in engines.items():  # packing is the same on every path
        assert all(torch.equal(a, b) for e in (0, E - 1) for a, b in zip(ex.dequantized(e), base.dequantized(e))), p
    for T, k in RUNS:
        x = make_x(T, H, shape, k)
        ids, w = make_routing(T, k, E, shape, n_cold=1)
        outs = {p: ex(x, ids, w) for p, ex in engines.items()}
        ref = moe_reference(x, *weights(shape), ids, w)
        for p, out in outs.items():
            amx = p in AMX_PATHS
            act = "int16" if case[0] == "int8" and not amx else "int8"
            emu = moe_reference_emulated(x, *dq, ids, w, act, case[1])
            what = f"{case_id(case)} {p} T={T} k={k}"
            assert rel_err(out, emu) <= EMULATED_TOL, f"{what}: {rel_err(out, emu):.3g} vs the emulated reference"
            assert rel_err(out, ref) <= FP32_TOL[case[:3]], f"{what}: {rel_err(out, ref):.4g} vs the fp32 reference"
            if not amx or case[0] != "int8":  # one class of activations: the same bits as the first row path
                assert torch.equal(out, outs[ROW_ISAS[0]]), f"{what}: differs from {ROW_ISAS[0]}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bytes_per_expert_follow_the_scale_width(case):
    fmt, group, sdt, book = case
    E, H, I = SHAPES["E10-H200-I88"]
    ex = CPUExperts(E, H, I, fmt, group, pool=WorkerPool(1), scale_dtype=sdt, codebook=book)
    want = 2 * packed_matrix_bytes(fmt, I, H, group, False, sdt) + packed_matrix_bytes(fmt, H, I, group, False, sdt)
    assert ex.info()["bytes_per_expert"] == want == ex.nbytes // E
    info = ex.info()
    assert (info["gate_up_scale_dtype"], info["down_scale_dtype"]) == (sdt, sdt)
    assert (info["gate_up_codebook"], info["down_codebook"]) == (book, book)
    assert info["kernel"].startswith(fmt + "/")


def test_fp32_scales_keep_the_default_bytes():
    """scale_dtype="fp32" is the layout as it was: the same storage, byte for byte, as an engine not asked."""
    shape = SHAPES["E10-H200-I88"]
    for fmt, group in (("int8", 32), ("int4", 64), ("int4", 0), ("int8", 0)):
        a = CPUExperts(*shape, fmt, group, pool=WorkerPool(1))
        b = CPUExperts(*shape, fmt, group, pool=WorkerPool(1), scale_dtype="fp32")
        a.load(*weights(shape)), b.load(*weights(shape))
        assert [bytes(m) for m in a.storage()] == [bytes(m) for m in b.storage()]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_values_are_codes_times_stored_scales(case):
    """Weights quantized here: every value is a code (int8 / int4: an integer in range; lut4: a codebook entry) times
    its group's stored scale, read from the packed bytes and widened as the GPU paths widen them
    (hetmoe/moe/streamed/packed.py); e8m0 scales are powers of two."""
    from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, widen_set

    fmt, group, sdt, book = case
    shape = SHAPES["E10-H200-I88"]
    ex = engine(case, ROW_ISAS[0], shape)
    lay = ExpertLayout.of(ex)
    gu, I, H = lay.gate_up, lay.intermediate, lay.hidden
    per_expert = lay.range_bytes()[1]
    sets = expert_ranges(ex)[1][:per_expert].view(gu.n_blocks * 2, gu.set_bytes)  # gate and up blocks alternate
    scales = widen_set(sets, gu).view(gu.n_blocks, 2, gu.kp // group, 16)
    gate_scales = scales[:, 0].permute(0, 2, 1).reshape(-1, gu.kp // group)[:I]  # [I, G]
    per_value = gate_scales.repeat_interleave(group, dim=1)[:, :H]  # [I, H]
    assert (per_value > 0).all()
    gate = ex.dequantized(0)[0]
    if fmt == "lut4":  # the nearest codebook entry times the scale is the value, bit for bit
        cb = torch.tensor(CODEBOOKS[book], dtype=torch.float32)
        q = cb[(gate / per_value).unsqueeze(-1).sub(cb).abs().argmin(-1)]
    else:
        lo, hi = (-127, 127) if fmt == "int8" else (-8, 7)
        q = (gate / per_value).round()
        assert q.min() >= lo and q.max() <= hi
    assert torch.equal(q * per_value, gate)
    if sdt == "e8m0":
        assert (torch.frexp(gate_scales)[0] == 0.5).all()
    if sdt == "k8":  # an int8 sub-scale times an fp16 per 256 values of a row
        G = gu.kp // group
        sub = sets[:, :G * 16].contiguous().view(torch.int8).view(gu.n_blocks, 2, G, 16)
        sup = sets[:, G * 16:].contiguous().view(torch.float16).view(gu.n_blocks, 2, -1, 16)
        assert sub.min() >= -127 and sub.max() <= 127 and sup.shape[2] == -(-gu.kp // 256)
        assert torch.equal(scales, sub.float() * sup.float()[:, :, torch.arange(G) * group // 256])


@pytest.mark.parametrize("split", [False, True], ids=["one-pool", "numa2"])
@pytest.mark.parametrize("sdt, book", [("fp16", "iq4nl"), ("fp32", "iq4nl"), ("e8m0", "e2m1"), ("bf16", "e2m1")])
def test_lut4_codes_load_bitwise(sdt, book, split):
    """load_codes with lut4 indices and scales the type holds: the values are codebook[q] * scale, bit for bit."""
    E, H, I, G = 3, 64, 96, 32
    gen = torch.Generator().manual_seed(7)
    pool = WorkerPool(2, numa=2) if split else WorkerPool(1)
    ex = CPUExperts(E, H, I, "lut4", G, pool=pool, scale_dtype=sdt, codebook=book)
    codes, scales, want = [], [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        q = torch.randint(0, 16, (E, rows, cols), generator=gen, dtype=torch.int8)
        if sdt == "e8m0":
            s = torch.ldexp(torch.ones(E, rows, cols // G), torch.randint(-12, -4, (E, rows, cols // G), generator=gen))
        else:
            s = (torch.rand(E, rows, cols // G, generator=gen) * 0.01 + 1e-4)
            s = s.to(torch.float16 if sdt == "fp16" else torch.bfloat16 if sdt == "bf16" else torch.float32).float()
        codes.append(q), scales.append(s)
        want.append(torch.tensor(CODEBOOKS[book], dtype=torch.float32)[q.long()] * s.repeat_interleave(G, dim=2))
    load_codes(ex, codes, scales)
    for e in range(E):
        for got, w in zip(ex.dequantized(e), want):
            assert torch.equal(got.view(torch.int32), w[e].view(torch.int32))


def test_what_the_formats_cannot_hold_is_refused():
    E, H, I = 2, 64, 32
    pool = WorkerPool(1)
    bad = [(dict(weight_format="lut4", group_size=32), "lut4 weights need a codebook"),
           (dict(weight_format="int4", group_size=32, codebook="e2m1"), "a codebook goes with lut4 weights only"),
           (dict(weight_format="lut4", group_size=32, codebook="e2m1", scaling="affine"), "lut4 weights are symmetric"),
           (dict(weight_format="lut4", group_size=0, codebook="e2m1"), "lut4 group_size must be 16, 32, 64 or 128"),
           (dict(weight_format="int4", group_size=0, scale_dtype="fp16"), "fp16 scales need grouped weights"),
           (dict(weight_format="int8", group_size=0, scale_dtype="k8"), "k8 scales need grouped weights"),
           (dict(weight_format="int4", group_size=32, scale_dtype="e8m0", scaling="affine"),
            "e8m0 scales need symmetric weights"),
           (dict(weight_format="bf16", scale_dtype="fp16"), "bf16 weights have no scales"),
           (dict(weight_format="int8", scale_dtype="fp8"), "scale_dtype must be one of fp32, fp16, bf16, e8m0, k8"),
           (dict(weight_format="lut4", codebook="nf4"), "codebook must be one of e2m1, iq4nl"),
           (dict(weight_format="lut8", codebook="e2m1"), "unknown weight_format 'lut8'")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            CPUExperts(E, H, I, pool=pool, **kw)
    ex = CPUExperts(E, H, I, "lut4", 32, pool=pool, scale_dtype="fp16", codebook="iq4nl")
    q = [torch.zeros(E, r, c, dtype=torch.int8) for r, c in ((I, H), (I, H), (H, I))]
    s = [torch.full((E, r, c // 32), 0.5) for r, c in ((I, H), (I, H), (H, I))]
    out_of_range = q[0].clone()
    out_of_range[1, 2, 3] = 16
    with pytest.raises(ValueError, match=r"gate has codes in \[0, 16\]; lut4 holds \[0, 15\]"):
        load_codes(ex, [out_of_range, q[1], q[2]], s)
    inexact = s[2].clone()
    inexact[0, 1, 0] = 0.1  # not an fp16 value
    with pytest.raises(ValueError, match="down has scales that fp16 does not hold exactly"):
        load_codes(ex, q, [s[0], s[1], inexact])
    ex8 = CPUExperts(E, H, I, "int8", 32, pool=pool, scale_dtype="e8m0")
    with pytest.raises(ValueError, match="up has scales that e8m0 does not hold exactly"):
        load_codes(ex8, q, [s[0], s[1] * 3, s[2]])
    assert ex.info()["experts_loaded"] == ex8.info()["experts_loaded"] == 0


def two_level_codes(fmt: str, scaling: str, group: int, shape: tuple, gen: torch.Generator, k4: bool = False) -> tuple:
    """(codes, fp32 scales, fp32 mins or None) for gate, up, down of random K-quant-like matrices: every scale (and
    min) d * sc with d an fp16 value per (row, 256 values of K) and sc an integer (int8 for scales, 6 bits for mins;
    ``k4``: 4 bits for both, Q2_K's), one exact fp32 product (what gguf's dequantization computes), codes anywhere in
    the layout's range."""
    E, H, I = shape
    lo, hi = {("int8", "symmetric"): (-127, 127), ("int4", "symmetric"): (-8, 7), ("int8", "affine"): (0, 127),
              ("int4", "affine"): (0, 15), ("lut4", "symmetric"): (0, 15), ("int2", "affine"): (0, 3)}[fmt, scaling]
    out = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        q = torch.randint(lo, hi + 1, (E, rows, cols), generator=gen, dtype=torch.int8)
        per = 256 // group
        n_super = -(-cols // 256)

        def level2(lo_sc: int, hi_sc: int) -> torch.Tensor:
            d = (torch.rand(E, rows, n_super, generator=gen) * 0.01 + 1e-3).half().float()
            if scaling == "symmetric":
                d = d * (torch.randint(0, 2, d.shape, generator=gen) * 2 - 1)  # Q6_K's d may be negative
            sc = torch.randint(lo_sc, hi_sc + 1, (E, rows, cols // group), generator=gen).float()
            return d.repeat_interleave(per, dim=2)[..., :cols // group] * sc

        scales = level2(-128, 127) if scaling == "symmetric" else level2(0, 15 if k4 else 63)
        mins = level2(0, 15 if k4 else 63) if scaling == "affine" else None
        out.append((q, scales, mins))
    return tuple(zip(*out))


TWO_LEVEL = [("int8", "symmetric", 16), ("int4", "symmetric", 16), ("int4", "affine", 32), ("int8", "affine", 32),
             ("int4", "affine", 16), ("lut4", "symmetric", 32)]


@pytest.mark.parametrize("shape", [(4, 512, 256), (3, 96, 160)], ids=["whole-supers", "part-super"])
@pytest.mark.parametrize("fmt, scaling, group", TWO_LEVEL, ids=lambda v: str(v))
def test_two_level_scales_give_the_bits_of_fp32_scales(fmt, scaling, group, shape):
    """The same codes, scales and mins loaded as k8 (int8 sub-scale x fp16 per 256) and as fp32: the same values
    (dequantized bitwise; the PyTorch unpack of the GPU prefill reads the k8 bytes to the same bits) and, on every
    path (each row-block ISA, the emulated AMX GEMM, native AMX where there is one), decode (T = 1) and prefill
    (T = 37, 64) calls give the same output bits: the kernels widen sub x super to the very fp32 scale."""
    from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts

    E, H, I = shape
    gen = torch.Generator().manual_seed(H + group)
    codes, scales, mins = two_level_codes(fmt, scaling, group, shape, gen)
    book = "iq4nl" if fmt == "lut4" else None
    x = torch.randn(64, H, generator=gen)
    ids = torch.randint(0, E, (64, 2), generator=gen)
    ids[5, 1] = -1
    w = torch.rand(64, 2, generator=gen)
    for path in PATHS:
        kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
        pair = [CPUExperts(E, H, I, fmt, group, pool=WorkerPool(1), scaling=scaling, scale_dtype=sdt, codebook=book,
                           **kw) for sdt in ("k8", "fp32")]
        for ex in pair:
            load_codes(ex, codes, scales, mins=None if scaling == "symmetric" else mins)
        k8, f32 = pair
        assert k8.nbytes < f32.nbytes
        if path == PATHS[0]:
            for e in range(E):
                assert all(torch.equal(a, b) for a, b in zip(k8.dequantized(e), f32.dequantized(e)))
            gu, dn = unpack_experts(ExpertLayout.of(k8), expert_ranges(k8), E, torch.float32)
            for e in range(E):
                g, u, d = k8.dequantized(e)
                assert torch.equal(gu[e], torch.cat([g, u])) and torch.equal(dn[e], d)
        for T in (1, 37, 64):
            a, b = k8(x[:T], ids[:T], w[:T]), f32(x[:T], ids[:T], w[:T])
            assert torch.equal(a, b), f"{fmt} {scaling} g{group} {path} T={T}"


@pytest.mark.parametrize("shape", [(4, 512, 256), (3, 96, 160)], ids=["whole-supers", "part-super"])
@pytest.mark.parametrize("fmt, group", [("int4", 16), ("int8", 32), ("int2", 16)], ids=lambda v: str(v))
def test_k4_scales_give_the_bits_of_fp32_scales(fmt, group, shape):
    """The same affine codes, scales and mins loaded as k4 (Q2_K's 4-bit sub-scale and sub-min per group in one byte,
    an fp16 d and dmin per 256 values) and as fp32: the same values (dequantized bitwise), fewer bytes than k8, and on
    every path (each row-block ISA, the emulated AMX GEMM, native AMX where there is one) decode (T = 1) and prefill
    (T = 37, 64) give the same output bits."""
    E, H, I = shape
    gen = torch.Generator().manual_seed(H + group + 1)
    codes, scales, mins = two_level_codes(fmt, "affine", group, shape, gen, k4=True)
    x = torch.randn(64, H, generator=gen)
    ids = torch.randint(0, E, (64, 2), generator=gen)
    ids[5, 1] = -1
    w = torch.rand(64, 2, generator=gen)
    for path in PATHS:
        kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
        trio = [CPUExperts(E, H, I, fmt, group, pool=WorkerPool(1), scaling="affine", scale_dtype=sdt, **kw)
                for sdt in ("k4", "k8", "fp32")]
        for ex in trio:
            load_codes(ex, codes, scales, mins=mins)
        k4, k8, f32 = trio
        assert k4.nbytes < k8.nbytes < f32.nbytes
        assert k4.info()["gate_up_scale_dtype"] == k4.info()["down_scale_dtype"] == "k4"
        if path == PATHS[0]:
            for e in range(E):
                assert all(torch.equal(a, b) for a, b in zip(k4.dequantized(e), f32.dequantized(e)))
        for T in (1, 37, 64):
            a, b = k4(x[:T], ids[:T], w[:T]), f32(x[:T], ids[:T], w[:T])
            assert torch.equal(a, b), f"{fmt} g{group} {path} T={T}"


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fp16_affine_mins_give_the_bits_of_fp32(fmt):
    """Q4_1 / Q5_1's form (fp16 d and fp16 min per 32): affine with fp16 scales stores its mins as fp16 too, half
    the bytes of fp16 scales beside fp32 mins, and gives fp32's bits on every path; the PyTorch unpack reads them."""
    from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts

    E, H, I, G = 3, 96, 64, 32
    gen = torch.Generator().manual_seed(9)
    codes, scales, mins = [], [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        codes.append(torch.randint(0, 16 if fmt == "int4" else 32, (E, rows, cols), generator=gen, dtype=torch.int8))
        scales.append((torch.rand(E, rows, cols // G, generator=gen) * 0.01).half().float())
        mins.append((torch.randn(E, rows, cols // G, generator=gen) * 0.05).half().float())
    x = torch.randn(40, H, generator=gen)
    ids = torch.randint(0, E, (40, 2), generator=gen)
    w = torch.rand(40, 2, generator=gen)
    for path in PATHS:
        kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
        pair = [CPUExperts(E, H, I, fmt, G, pool=WorkerPool(1), scaling="affine", scale_dtype=sdt, **kw)
                for sdt in ("fp16", "fp32")]
        for ex in pair:
            load_codes(ex, codes, scales, mins=mins)
        assert pair[0].info()["bytes_per_expert"] == (
            2 * packed_matrix_bytes(fmt, I, H, G, True, "fp16") + packed_matrix_bytes(fmt, H, I, G, True, "fp16"))
        for T in (1, 40):
            assert torch.equal(pair[0](x[:T], ids[:T], w[:T]), pair[1](x[:T], ids[:T], w[:T])), f"{path} T={T}"
    gu, dn = unpack_experts(ExpertLayout.of(pair[0]), expert_ranges(pair[0]), E, torch.float32)
    for e in range(E):
        g, u, d = pair[0].dequantized(e)
        assert torch.equal(gu[e], torch.cat([g, u])) and torch.equal(dn[e], d)


def test_what_k8_cannot_hold_is_refused():
    """Scales whose super-block does not split into int8 sub-scales times one fp16 value are refused, naming the
    matrix; nothing of the call is loaded."""
    E, H, I = 2, 256, 256
    ex = CPUExperts(E, H, I, "int8", 16, pool=WorkerPool(1), scale_dtype="k8")
    q = [torch.zeros(E, r, c, dtype=torch.int8) for r, c in ((I, H), (I, H), (H, I))]
    s = [torch.full((E, r, c // 16), 0.5) for r, c in ((I, H), (I, H), (H, I))]
    load_codes(ex, q, s)  # 0.5 = 1 x fp16 0.5
    bad = s[1].clone()
    bad[1, 3, 0] = 0.5 * 1000  # 1000 x the others' scale: no int8 sub-scale
    with pytest.raises(ValueError, match="up has scales that k8 does not hold exactly"):
        load_codes(ex, q, [s[0], bad, s[2]], first_expert=0)
    third = s[2].clone()
    third[0, 0, 2] = 0.1  # beside 0.5: no fp16 d with int8 multiples giving both
    with pytest.raises(ValueError, match="down has scales that k8 does not hold exactly"):
        load_codes(ex, q, [s[0], s[1], third])
