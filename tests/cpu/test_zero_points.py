"""Zero points at their file's bytes: int4 (and int8) affine matrices with scale dtype fp16_zp, bf16_zp or fp32_zp
hold each scale in its base dtype and each min as one int8 zero point z, min = fl(scale * z) (csrc/formats/layout.h:
GPTQ's, AWQ's and compressed-tensors' w = s * (u - z)). On every path this machine runs:

    scalar, avx2, avx512   the row-block kernels (each level the ISA can run; HETMOE_MAX_ISA caps them)
    amx-emulated           the AMX GEMM's loops in plain C++ (every expert on it: amx_min_tokens=1)
    amx                    the tile unit, where there is one

the kernels widen a zero point to the very fp32 min a loader computes as scale * z, so the same codes loaded with
those fp32 scales and mins held as fp32 give the same output bits (bitwise), on one pool and on NUMA slices, for
decode and prefill token counts; the values are the naive fp32 dequantization fl(fl(s * u) - fl(s * z)), bitwise,
and the outputs are within the bound of test_code_formats.py of the float64 MoE of the dequantized weights.
"""

from __future__ import annotations

import pytest
import torch

from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import load_codes, zero_points_of
from hetmoe.cpu.layout import layout_bytes
from reference import moe_reference_emulated, rel_err

ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
AMX_PATHS = ["amx-emulated"] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
PATHS = ROW_ISAS + AMX_PATHS
EMULATED_TOL = 1e-3
SPLIT_TOL = 1e-6  # tests/cpu/test_numa.py's
TOKENS = (1, 2, 3, 7, 64, 300)
BASE = {"fp16_zp": torch.float16, "bf16_zp": torch.bfloat16, "fp32_zp": torch.float32}


def zp_codes(shape, group, sdt, gen, wide_z=False):
    """(codes u, fp32 scales, fp32 mins) of affine experts as the loaders give them: u in 0..15, scales of the base
    dtype (a few zero, negative and, fp16, subnormal), z in 0..15 (``wide_z``: the whole int8 range) and the mins
    min = fl(scale * z), one fp32 product."""
    E, H, I = shape
    out = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        u = torch.randint(0, 16, (E, rows, cols), generator=gen, dtype=torch.int8)
        G = cols // group
        s = (torch.rand(E, rows, G, generator=gen) * 0.02 + 1e-3) * torch.exp2(
            torch.randint(-3, 4, (E, rows, G), generator=gen).float())
        s[:, 0, 0], s[:, 1, 0] = 0.0, -s[:, 1, 0]
        if sdt == "fp16_zp":
            s[:, 2, 0] = 3 * 2.0**-24  # an fp16 subnormal
        s = s.to(BASE[sdt]).float()
        lo, hi = (-128, 128) if wide_z else (0, 16)
        z = torch.randint(lo, hi, (E, rows, G), generator=gen).float()
        z[:, 0, -1], z[:, -1, -1] = 0, hi - 1
        out.append((u, s, s * z))
    return tuple(zip(*out))


def values(u, s, m, group):
    """The naive fp32 dequantization fl(fl(s * u) - min), [E, rows, cols]."""
    return u.float() * s.repeat_interleave(group, dim=-1) - m.repeat_interleave(group, dim=-1)


def engine(sdt, shape, group, path, fmt="int4", pool=None):
    E, H, I = shape
    kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
    return CPUExperts(E, H, I, fmt, group, pool=pool or WorkerPool(1), scaling="affine", scale_dtype=sdt, **kw)


def routing(shape, gen, T=max(TOKENS)):
    E, H, _ = shape
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, 2), generator=gen)
    ids[1, 1] = -1
    return x, ids, torch.rand(T, 2, generator=gen)


CASES = {"g32-fp16": (32, "fp16_zp", (4, 96, 160)), "g64-bf16": (64, "bf16_zp", (3, 128, 192)),
         "g128-fp16": (128, "fp16_zp", (4, 256, 128)), "g128-fp32": (128, "fp32_zp", (3, 128, 256)),
         "g32-fp32": (32, "fp32_zp", (3, 64, 96))}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_points_give_the_bits_of_fp32_scales_and_mins(case):
    """The same codes loaded with zero-point scale dtypes and with fp32 scales and mins: the same values (bitwise
    the naive dequantization), scale + 1 byte per group of the base dtype, and on every path the same output bits
    as the fp32 form and as the first row-block path, T in TOKENS."""
    group, sdt, shape = CASES[case]
    E, H, I = shape
    gen = torch.Generator().manual_seed(group + H + I)
    codes, scales, mins = zp_codes(shape, group, sdt, gen)
    x, ids, w = routing(shape, gen)
    want = [values(u, s, m, group) for u, s, m in zip(codes, scales, mins)]
    layout = {"weight_format": "int4", "group_size": group, "scaling": ("affine", "affine"), "scale_dtype": sdt}
    first = {}
    for path in PATHS:
        narrow, f32 = engine(sdt, shape, group, path), engine("fp32", shape, group, path)
        load_codes(narrow, codes, scales, mins=mins)
        load_codes(f32, codes, scales, mins=mins)
        assert narrow.nbytes == E * layout_bytes(layout, H, I)
        width = 4 if sdt == "fp32_zp" else 2
        groups = 2 * -(-I // 16) * 16 * (H // group) + -(-H // 16) * 16 * (I // group)  # (row, group)s, padded rows
        assert f32.nbytes - narrow.nbytes == E * groups * (4 + 4 - width - 1)
        if path == PATHS[0]:
            for e in range(E):
                for got, ref in zip(narrow.dequantized(e), want):
                    assert torch.equal(got.view(torch.int32), ref[e].view(torch.int32))
        for T in TOKENS:
            a, b = narrow(x[:T], ids[:T], w[:T]), f32(x[:T], ids[:T], w[:T])
            assert torch.equal(a, b), f"{sdt} {path} T={T}: differs from fp32 scales and mins"
            first.setdefault(T, a)
            if path not in AMX_PATHS or T > 1:
                assert torch.equal(a, first[T]), f"{sdt} {path} T={T}: differs from {PATHS[0]}"
            act = "int8"
            emu = moe_reference_emulated(x[:T], *want, ids[:T], w[:T], act, group)
            assert rel_err(a, emu) <= EMULATED_TOL, f"{sdt} {path} T={T}: {rel_err(a, emu):.3g}"


@pytest.mark.parametrize("path", PATHS)
def test_int8_zero_points_of_the_whole_byte_range(path):
    """Affine int8 (an int8 plan of a GPTQ checkpoint holds its codes so) with zero points over all of int8, signed
    byte widened with its sign: the bits of fp32 scales and mins on every path."""
    shape, group = (3, 64, 96), 32
    gen = torch.Generator().manual_seed(8)
    codes, scales, mins = zp_codes(shape, group, "fp16_zp", gen, wide_z=True)
    x, ids, w = routing(shape, gen, 64)
    narrow, f32 = engine("fp16_zp", shape, group, path, "int8"), engine("fp32", shape, group, path, "int8")
    load_codes(narrow, codes, scales, mins=mins)
    load_codes(f32, codes, scales, mins=mins)
    for e in range(shape[0]):
        for got, u, s, m in zip(narrow.dequantized(e), codes, scales, mins):
            assert torch.equal(got, values(u[e], s[e], m[e], group))
    for T in (1, 7, 64):
        assert torch.equal(narrow(x[:T], ids[:T], w[:T]), f32(x[:T], ids[:T], w[:T])), f"{path} T={T}"


@pytest.mark.parametrize("sdt", ["fp16_zp", "fp32_zp"])
def test_numa_slices_give_the_bits_of_one_pool(sdt):
    """A layer split over two NUMA subpools (each slice its own part of down's K): the values of the unsplit
    engine, the bits of fp32 scales and mins on the same split, every T, and within SPLIT_TOL of the unsplit engine
    (the slices' partial sums add in another order: tests/cpu/test_numa.py)."""
    shape, group = (4, 96, 256), 32
    gen = torch.Generator().manual_seed(11)
    codes, scales, mins = zp_codes(shape, group, sdt, gen)
    x, ids, w = routing(shape, gen)
    path = ROW_ISAS[-1]
    one = engine(sdt, shape, group, path)
    two = engine(sdt, shape, group, path, pool=WorkerPool(2, numa=2))
    ref = engine("fp32", shape, group, path, pool=WorkerPool(2, numa=2))
    for ex in (one, two, ref):
        load_codes(ex, codes, scales, mins=mins)
    assert two.info()["numa_subpools"] == 2
    for e in range(shape[0]):
        for got, want in zip(two.dequantized(e), one.dequantized(e)):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for T in TOKENS:
        a = two(x[:T], ids[:T], w[:T])
        assert torch.equal(a, ref(x[:T], ids[:T], w[:T])), f"T={T}: differs from fp32 scales and mins"
        assert rel_err(a, one(x[:T], ids[:T], w[:T])) <= SPLIT_TOL, f"T={T}: the slices against one pool"


@pytest.mark.parametrize("path", [PATHS[0], AMX_PATHS[0]])
def test_quantized_here(path):
    """Weights quantized here into int4 affine fp16_zp (each min rounded to a multiple of its fp16 scale): the values
    are held as they read back, and the outputs are those of the same values loaded as fp32 scales and mins."""
    shape, group = (3, 128, 96), 32
    E, H, I = shape
    gen = torch.Generator().manual_seed(5)
    src = [torch.randn(E, I, H, generator=gen) * 0.02, torch.randn(E, I, H, generator=gen) * 0.02,
           torch.randn(E, H, I, generator=gen) * 0.02]
    ex = engine("fp16_zp", shape, group, path)
    ex.load(*src)
    dq = [torch.stack(m) for m in zip(*(ex.dequantized(e) for e in range(E)))]
    assert max(rel_err(a, b) for a, b in zip(dq, src)) < 0.15
    x, ids, w = routing(shape, gen, 16)
    emu = moe_reference_emulated(x, *dq, ids, w, "int8", group)
    assert rel_err(ex(x, ids, w), emu) <= EMULATED_TOL


def test_what_zero_points_cannot_hold_is_refused():
    pool = WorkerPool(1)
    with pytest.raises(ValueError, match="fp16_zp scales need affine weights"):
        CPUExperts(2, 64, 32, "int4", 32, pool=pool, scale_dtype="fp16_zp")
    shape, group = (2, 64, 32), 32
    gen = torch.Generator().manual_seed(4)
    codes, scales, mins = zp_codes(shape, group, "fp16_zp", gen)
    ex = engine("fp16_zp", shape, group, "scalar", pool=pool)
    with pytest.raises(ValueError, match="up has mins that fp16_zp does not hold exactly"):
        load_codes(ex, codes, scales, mins=(mins[0], mins[1] + scales[1] * 0.5, mins[2]))
    with pytest.raises(ValueError, match="down has mins that fp16_zp does not hold exactly"):
        load_codes(ex, codes, scales, mins=(mins[0], mins[1], mins[2] + scales[2].abs() * 300))  # z past 127
    with pytest.raises(ValueError, match="gate has scales that fp16_zp does not hold exactly"):
        load_codes(ex, codes, (scales[0] * 1.0001 + 1e-7,) + scales[1:], mins=mins)
    z, held = zero_points_of(scales[0], mins[0])
    assert held.all() and torch.equal(scales[0] * z.float(), mins[0])
