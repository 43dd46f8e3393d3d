"""The per-token row work of a MoE job (csrc/kernels/row_ops.h): activation quantization and bf16 conversions at
every ISA level this CPU runs must give the scalar reference's bytes exactly, on inputs that hit rounding ties,
group edges, all-zero groups, denormals, NaN and Inf."""

import numpy as np
import pytest

from hetmoe import _C

ISAS = [i for i in _C.cpu_features()["supported_isas"] if i in ("avx2", "avx512")]
pytestmark = pytest.mark.skipif(not ISAS, reason="no SIMD level besides scalar on this CPU")


def tricky_rows(k: int, seed: int):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(k).astype(np.float32)
    yield "normal", base
    yield "large range", (base * np.float32(10.0) ** rng.integers(-20, 20, k)).astype(np.float32)
    # exact ties after scaling: amax 127 -> inv 1, values k + 0.5 round to even
    ties = (rng.integers(-126, 126, k) + 0.5).astype(np.float32)
    ties[::97] = 127.0
    yield "ties", ties
    zeros = base.copy()
    zeros[: min(k, 128)] = 0.0
    yield "zero group", zeros
    den = base.copy()
    den[1::3] = np.float32(1e-40)
    yield "denormals", den
    for bad in (np.nan, np.inf, -np.inf):
        v = base.copy()
        v[min(k - 1, 70)] = bad
        yield f"{bad}", v


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,group", [("int8", 32), ("int8", 128), ("int8", 0), ("int4", 32), ("int4", 64),
                                       ("int4", 128), ("bf16", 0)])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("k", [64, 200, 768, 2048])
def test_quantize_matches_scalar(isa, fmt, group, amx, k):
    for name, x in tricky_rows(k, k + group):
        ref = _C.row_quantize("scalar", fmt, amx, group, x)
        got = _C.row_quantize(isa, fmt, amx, group, x)
        assert got == ref, f"{isa} {fmt} g{group} amx={amx} k={k}: rows differ on '{name}' input"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", [64, 200, 2048, 7168])
def test_one_group_row_matches_scalar(isa, k):
    """x of per-row int8 experts on AMX: one int8 group (one scale, one sum) over the whole row."""
    for name, x in tricky_rows(k, k + 128):
        ref = _C.row_quantize("scalar", "int8", True, 0, x, one_group=True)
        got = _C.row_quantize(isa, "int8", True, 0, x, one_group=True)
        assert got == ref, f"{isa} k={k}: rows differ on '{name}' input"
    x = np.linspace(-3, 5, k, dtype=np.float32)
    row = _C.row_quantize("scalar", "int8", True, 0, x, one_group=True)
    kp = -(-k // 128) * 128
    q = np.frombuffer(row[:kp], np.int8)
    scale = np.frombuffer(row, np.float32, count=1, offset=-(-kp // 64) * 64)[0]
    assert q.max() == 127 and scale == np.float32(5) / np.float32(127)  # the whole row's amax sets the one scale


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_conversions_match_scalar(isa):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(1000).astype(np.float32)
    # round-to-even ties (low half exactly 0x8000 with even and odd bf16), the largest finite, denormals, NaN, Inf
    bits = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00000001, 0x807FFFFF, 0x7FC00001, 0xFF800000, 0x7F800000,
                     0x7F800001, 0xFFFFFFFF], dtype=np.uint32)
    x[: len(bits)] = bits.view(np.float32)
    ref_bits, ref_back = _C.row_bf16("scalar", x)
    got_bits, got_back = _C.row_bf16(isa, x)
    assert got_bits == ref_bits
    got_u32, ref_u32 = (np.array(v, np.float32).view(np.uint32) for v in (got_back, ref_back))
    assert np.array_equal(got_u32, ref_u32)
    assert ref_bits[0] == 0x3F80 and ref_bits[1] == 0x3F82  # ties to even, up and down


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="float32"):
        _C.row_quantize("scalar", "int8", False, 32, np.zeros(64, np.float64))
    with pytest.raises(ValueError, match="unknown weight format 'int7'"):
        _C.row_quantize("scalar", "int7", False, 32, np.zeros(64, np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n", [1, 16, 37, 2048])
def test_swiglu_matches_scalar(isa, n):
    """The experts' SwiGLU (silu(gate) * up with the engine's own exp) as a vector row op: the scalar bits at every
    level, including the exp's clamps (|gate| past 87/88), NaN, Inf, zeros and denormals."""
    rng = np.random.default_rng(n)
    gate = (rng.standard_normal(n) * 6).astype(np.float32)
    up = rng.standard_normal(n).astype(np.float32)
    special = np.array([0.0, -0.0, 1e-40, -1e-40, 87.5, -87.5, 88.5, -90.0, 200.0, -200.0, np.inf, -np.inf, np.nan,
                        3.4e38, -3.4e38, 0.6931472], np.float32)
    m = min(n, special.size)
    gate[:m] = special[:m]
    ref = np.array(_C.row_swiglu("scalar", gate, up), np.float32)
    got = np.array(_C.row_swiglu(isa, gate, up), np.float32)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)), f"{isa} n={n}: SwiGLU bits differ"
    # and it is the SwiGLU: against float64 math where the fast exp is accurate
    ok = np.isfinite(gate) & (np.abs(gate) < 80)
    g64 = gate[ok].astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up[ok]
    assert np.allclose(got[ok], want, rtol=1e-5, atol=1e-30)
    assert np.isnan(got[np.isnan(gate)]).all()


@pytest.mark.parametrize("isa", ["scalar"] + ISAS)
@pytest.mark.parametrize("n,offset", [(64, 0), (100, 0), (100, 3), (16, 16), (7, 0)])
def test_copy_stream_copies(isa, n, offset):
    """The cache-bypassing copy of the down outputs: every element copied, aligned or not, nothing before it."""
    x = np.arange(n, dtype=np.float32) + 0.5
    got = np.array(_C.row_copy_stream(isa, x, offset), np.float32)
    assert np.array_equal(got[offset:], x[offset:])
    assert (got[:offset] == -1).all()
