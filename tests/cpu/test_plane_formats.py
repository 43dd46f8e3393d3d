"""The bit-plane formats (int6, int5, int3, int2: b-bit codes at b bits each, csrc/formats/layout.h), which hold the
K-quants Q6_K, Q5_K, Q3_K and Q2_K at their file's bytes, on every path this machine runs:

    scalar, avx2, avx512   the row-block kernels (each level the CPU can run)
    amx-emulated           the AMX GEMM's loops in plain C++ (every expert on it: amx_min_tokens=1)
    amx                    the tile unit, where there is one

Codes are random and loaded as they are (load_codes), symmetric and affine, fp32 / fp16 / k8 / k4 scales, over shapes
whose K ends in half a unit (int5 / int3 store 32 of K per unit). Each case is checked three ways: the packed values are
exactly code x scale (- min); the output matches the float64 MoE on those values with the engine's activation
rounding (EMULATED_TOL, the bound of tests/cpu/test_kernels.py); and it is bit for bit the output of the same codes
held in the format they widen to (int6, int5 -> int8; int3, int2 -> int4) on the same path: the same integer sums
and the same epilogue.
"""

from __future__ import annotations

import pytest
import torch

from cases import make_routing, make_x, seed_of
from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import CODE_RANGE, load_codes
from hetmoe.cpu.layout import PLANES, min_set_bytes, packed_matrix_bytes, set_bytes
from reference import moe_reference_emulated, rel_err

ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
AMX_PATHS = ["amx-emulated"] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
PATHS = ROW_ISAS + AMX_PATHS
WIDENED = {"int6": "int8", "int5": "int8", "int3": "int4", "int2": "int4"}
EMULATED_TOL = 1e-3

# (format, scaling, group, scale dtype): the K-quants' own (Q6_K, Q5_K, Q3_K with k8, Q2_K with k4), and each format
# in the other scaling, other groups and scale dtypes
CASES = [("int6", "symmetric", 16, "k8"), ("int5", "affine", 32, "k8"), ("int3", "symmetric", 16, "k8"),
         ("int2", "affine", 16, "k4"), ("int2", "affine", 16, "k8"), ("int6", "affine", 16, "k4"),
         ("int6", "affine", 32, "fp16"), ("int5", "symmetric", 16, "fp32"), ("int3", "affine", 64, "fp16"),
         ("int2", "symmetric", 128, "fp32")]
# (E, H, I) per group: 3 and 5 groups of K (group 16: an odd number of quads, half a unit of int5 / int3), or whole
# super-blocks of 256
SHAPES = {"E5-H3g-I5g": lambda g: (5, 3 * g, 5 * g), "E6-H256-I128": lambda g: (6, 256, 128)}
RUNS = ((1, 1), (2, 2), (7, 4), (40, 2))  # (T, k)


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def case_id(case) -> str:
    return "-".join(str(v) for v in case)


def random_codes(case, shape, seed: int):
    """(codes, scales, mins or None) for gate, up, down: codes uniform over the format's range, scales (and mins) that
    the scale dtype holds exactly (k8: an int8 sub-scale times an fp16 per 256 values of a row; k4: a 4-bit unsigned
    one, zero included)."""
    fmt, scaling, group, sdt = case
    E, H, I = shape
    gen = torch.Generator().manual_seed(seed)
    lo, hi = CODE_RANGE[fmt, scaling]

    def scale_set(rows, cols, base):
        G = cols // group
        if sdt in ("k8", "k4"):
            sub = torch.randint(*((1, 64) if sdt == "k8" else (0, 16)), (E, rows, G), generator=gen).float()
            sup = (torch.rand(E, rows, -(-cols // 256), generator=gen) * base + base / 4).half().float()
            return sub * sup.repeat_interleave(256 // group, dim=2)[:, :, :G]
        s = torch.rand(E, rows, G, generator=gen) * base + base / 4
        return s.half().float() if sdt == "fp16" else s

    out = ([], [], [])
    for rows, cols in ((I, H), (I, H), (H, I)):
        out[0].append(torch.randint(lo, hi + 1, (E, rows, cols), generator=gen, dtype=torch.int8))
        out[1].append(scale_set(rows, cols, 2e-4 if sdt in ("k8", "k4") else 0.01))
        out[2].append(scale_set(rows, cols, 1e-3 if sdt in ("k8", "k4") else 0.05) if scaling == "affine" else None)
    return out


def engine(fmt: str, case, path: str, shape, codes) -> CPUExperts:
    _, scaling, group, sdt = case
    kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
    ex = CPUExperts(*shape, fmt, group, pool=WorkerPool(1), scaling=scaling, scale_dtype=sdt, **kw)
    load_codes(ex, codes[0], codes[1], mins=codes[2])
    return ex


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_path_matches_the_references_and_the_widened_format(case, shape):
    fmt, scaling, group, sdt = case
    shape = SHAPES[shape](group)
    E, H, I = shape
    codes = random_codes(case, shape, seed_of(case) % 1000)  # (hash() of a str changes from run to run)
    engines = {p: engine(fmt, case, p, shape, codes) for p in PATHS}
    wide = {p: engine(WIDENED[fmt], case, p, shape, codes) for p in PATHS}
    base = engines[ROW_ISAS[0]]
    for e in range(E):  # the values are code x scale (- min), as the widened format holds them
        for m, (got, want) in enumerate(zip(base.dequantized(e), wide[ROW_ISAS[0]].dequantized(e))):
            q, s = codes[0][m][e].float(), codes[1][m][e].repeat_interleave(group, dim=1)
            value = q * s if scaling == "symmetric" else q * s - codes[2][m][e].repeat_interleave(group, dim=1)
            assert torch.equal(got, value) and torch.equal(got, want), (fmt, e, m)
    dq = list(zip(*(base.dequantized(e) for e in range(E))))
    for T, k in RUNS:
        x = make_x(T, H, shape, k)
        ids, w = make_routing(T, k, E, shape, n_cold=1)
        for p, ex in engines.items():
            out = ex(x, ids, w)
            act = ex.info()["amx_activation"] if p in AMX_PATHS else ex.info()["activation"]
            assert act == ("int16" if fmt in ("int6", "int5") and p not in AMX_PATHS else "int8")
            emu = moe_reference_emulated(x, *dq, ids, w, act, group)
            what = f"{case_id(case)} {p} T={T} k={k}"
            assert rel_err(out, emu) <= EMULATED_TOL, f"{what}: {rel_err(out, emu):.3g} vs the emulated reference"
            assert torch.equal(out, wide[p](x, ids, w)), f"{what}: differs from {WIDENED[fmt]} of the same codes"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bytes_are_the_codes_bits(case):
    """b bits per weight: the data of a matrix is exactly b/8 of its padded values (whole units), and the engine
    allocates what hetmoe/cpu/layout.py counts."""
    fmt, scaling, group, sdt = case
    E, H, I = SHAPES["E6-H256-I128"](group)
    ex = CPUExperts(E, H, I, fmt, group, pool=WorkerPool(1), scaling=scaling, scale_dtype=sdt)
    affine = scaling == "affine"
    want = 2 * packed_matrix_bytes(fmt, I, H, group, affine, sdt) + packed_matrix_bytes(fmt, H, I, group, affine, sdt)
    assert ex.info()["bytes_per_expert"] == want == ex.nbytes // E
    unit_k, lines, bits = PLANES[fmt]
    assert lines * 64 * 8 == unit_k * 16 * bits
    def scales(kp, g):
        return set_bytes(2, kp, g, sdt) + (min_set_bytes(2, kp, g, sdt) if affine else 0)

    assert packed_matrix_bytes(fmt, 32, 256, group, affine, sdt) - scales(256, group) == 32 * 256 * bits // 8
    assert packed_matrix_bytes(fmt, 32, 48, 16, affine, sdt) - scales(48, 16) == (
        32 * round_up(48, unit_k) * bits // 8)  # a K that ends in half a unit stores the unit whole
    if sdt == "k4":  # a byte per group for a 4-bit sub-scale and sub-min, an fp16 d and dmin per 256: Q2_K's 84 bytes
        assert packed_matrix_bytes("int2", 32, 256, 16, True, "k4") == 32 * 84
    assert ex.info()["kernel"].startswith(fmt + "/")


@pytest.mark.parametrize("fmt", list(PLANES))
@pytest.mark.parametrize("scaling", ["symmetric", "affine"])
def test_floats_quantize_into_the_formats(fmt, scaling):
    """Floats loaded into a bit-plane engine are quantized per group (absmax, or min/max when affine): every value a
    code in range times its scale, every path the same bits, and the output near the fp32 MoE."""
    from cases import make_weights
    from reference import moe_reference

    E, H, I = 4, 64, 48
    weights = make_weights(E, H, I, "planes", fmt)
    outs = []
    x = make_x(3, H, fmt)
    ids, w = make_routing(3, 2, E, fmt, n_cold=0)
    for p in ROW_ISAS:
        ex = CPUExperts(E, H, I, fmt, 16, pool=WorkerPool(1), scaling=scaling, isa=p)
        ex.load(*weights)
        outs.append(ex(x, ids, w))
    assert all(torch.equal(o, outs[0]) for o in outs)
    # MEASURED on these weights + ~15 %: int6 0.035 / 0.036 (symmetric / affine), int5 0.064 / 0.046, int3 0.30 / 0.22,
    # int2 1.27 / 0.62 (symmetric int2 from floats is codes -1, 0, 1 of an absmax scale: worse than nothing; the format
    # is there for Q2_K's affine codes)
    tol = {"int6": (0.041, 0.041), "int5": (0.074, 0.053), "int3": (0.35, 0.25), "int2": (1.46, 0.72)}[fmt]
    tol = tol[scaling == "affine"]
    assert rel_err(outs[0], moe_reference(x, *weights, ids, w)) <= tol


def test_what_the_formats_cannot_hold_is_refused():
    pool = WorkerPool(1)
    with pytest.raises(ValueError, match="int6 weights need a group size"):
        CPUExperts(2, 64, 32, "int6", 0, pool=pool)
    ex = CPUExperts(2, 64, 32, "int3", 16, pool=pool)
    codes = [torch.full((2, 32, 64), 4, dtype=torch.int8), torch.zeros(2, 32, 64, dtype=torch.int8),
             torch.zeros(2, 64, 32, dtype=torch.int8)]
    scales = [torch.full((2, 32, 4), 0.5), torch.full((2, 32, 4), 0.5), torch.full((2, 64, 2), 0.5)]
    with pytest.raises(ValueError, match=r"gate has codes in \[4, 4\]; int3 holds \[-4, 3\]"):
        load_codes(ex, codes, scales)


def test_what_k4_cannot_hold_is_refused():
    """k4 (4-bit unsigned sub-scales and sub-mins, an fp16 d and dmin per 256 values) takes affine integer weights
    only, and values whose super-block has no such split are refused, naming the matrix."""
    pool = WorkerPool(1)
    with pytest.raises(ValueError, match="k4 scales need affine weights"):
        CPUExperts(2, 256, 32, "int2", 16, pool=pool, scale_dtype="k4")
    with pytest.raises(ValueError, match="fp8 weights take .* not k4"):
        CPUExperts(2, 256, 32, "fp8", 32, pool=pool, scale_dtype="k4")
    E, H, I = 2, 256, 32
    ex = CPUExperts(E, H, I, "int2", 16, pool=pool, scaling="affine", scale_dtype="k4")
    q = [torch.zeros(E, r, c, dtype=torch.int8) for r, c in ((I, H), (I, H), (H, I))]
    s = [torch.full((E, r, c // 16), 0.5) for r, c in ((I, H), (I, H), (H, I))]
    m = [t.clone() * 3 for t in s]
    load_codes(ex, q, s, mins=m)  # 0.5 = 1 x fp16 0.5, 1.5 = 1 x fp16 1.5
    bad = s[1].clone()
    bad[1, 3, 0] = 0.5 * 16  # 16 x the others' scale: no 4-bit sub-scale
    with pytest.raises(ValueError, match="up has scales that k4 does not hold exactly"):
        load_codes(ex, q, [s[0], bad, s[2]], mins=m)
    mixed = m[2].clone()
    mixed[0, 0, 1] = -1.5  # one sign per super-block (the fp16 dmin's)
    with pytest.raises(ValueError, match="down has mins that k4 does not hold exactly"):
        load_codes(ex, q, s, mins=[m[0], m[1], mixed])
    negative = [-t for t in m]  # all <= 0: a negative dmin
    load_codes(ex, q, s, mins=negative)
    assert torch.equal(ex.dequantized(1)[0], torch.full((I, H), 1.5))


@pytest.mark.parametrize("fmt", ["int2", "int4", "int8"])
def test_floats_quantize_into_k4(fmt):
    """Floats loaded into affine k4 experts: each group's scale and min rounded to a 4-bit multiple of an fp16 per 256
    values (RowBlock::value's exact products), every row path the same bits, near the fp32-scaled engine's error."""
    from cases import make_weights
    from reference import moe_reference

    E, H, I = 4, 512, 96
    weights = make_weights(E, H, I, "k4 floats", fmt)
    x = make_x(3, H, fmt)
    ids, w = make_routing(3, 2, E, fmt, n_cold=0)
    ref = moe_reference(x, *weights, ids, w)
    errs = {}
    for sdt in ("k4", "fp32"):
        outs = []
        for p in ROW_ISAS:
            ex = CPUExperts(E, H, I, fmt, 16, pool=WorkerPool(1), scaling="affine", scale_dtype=sdt, isa=p)
            ex.load(*weights)
            outs.append(ex(x, ids, w))
        assert all(torch.equal(o, outs[0]) for o in outs), sdt
        errs[sdt] = rel_err(outs[0], ref)
    # MEASURED k4 / fp32 on these weights: int2 0.637 / 0.625, int4 0.119 / 0.105, int8 0.0367 / 0.0123 (a min rounded
    # to a 4-bit multiple of its super-block's dmin costs int8 codes most: Q2_K is the format's reason), + ~15 %
    assert errs["k4"] <= {"int2": 0.733, "int4": 0.137, "int8": 0.042}[fmt]
    assert errs["fp32"] <= errs["k4"]
