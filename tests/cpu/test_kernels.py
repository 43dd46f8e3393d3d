"""Correctness of the CPU expert engine (issue "CPU expert engine: fused MoE kernels").

Every case is checked twice:
  * against ``moe_reference`` (exact math, float64): the error is the quantization noise of the format;
  * against ``moe_reference_emulated`` (the engine's own dequantized weights and activation rounding): only
    fp32 summation order differs, so the bound is tight for every format and ISA.

Error vs the exact reference, ||out - ref|| / ||ref||, MEASURED on this suite's inputs (gaussian weights with
std 0.02, x ~ N(0, 1), fixed seeds; the kernels are bitwise identical on every ISA, so every machine sees these
exact numbers). They are quantization-noise floors; tolerances add ~15 %. Cases with few outputs (one token,
one expert, H=40) fluctuate more than large ones, hence two columns: "all" = every case of this file,
"large" = H >= 1536 with T = 64.

    format      measured: all (max)   large (range)        tolerance: all / large
    bf16        4.43e-3               2.91e-3              5.0e-3 / 3.4e-3
    int8 g32    1.31e-2               0.940e-2..0.945e-2   1.5e-2 / 1.0e-2  (the issue's target; ~6 % margin)
    int8 g64    1.10e-2               1.04e-2              1.3e-2 / 1.2e-2
    int8 g128   1.21e-2               1.13e-2..1.14e-2     1.4e-2 / 1.3e-2
    int8 row    1.54e-2               1.40e-2..1.45e-2     1.75e-2 / 1.65e-2
    int4 g32    0.238                 0.152..0.153         0.27 / 0.175
    int4 g64    0.198                 0.167                0.23 / 0.19
    int4 g128   0.216                 0.177                0.25 / 0.205
    int4 row    0.203                 0.191                0.235 / 0.22

The issue asked int8 <= 1e-2 and int4 <= 0.10. int8 weights rounded per group (step amax/127) add ~0.6 % noise
to each of gate, up and down, which compounds through SwiGLU to ~1.1e-2 at group 128; only group 32 gets below
1e-2, and only on large shapes. int4 (16 levels) gives 0.15-0.18; int4 with one scale per row 0.19 (its scale
search clips a row's tails as a group's; gaussian rows have no outliers, so on trained weights the gap to g64 is
wider). Against the emulated reference every format
measured <= 3.1e-4 (int4; int8 <= 7.9e-6, bf16 <= 1.6e-6); the bound asserted is 1e-3.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from cases import FORMATS, make_routing, make_weights, make_x
from hetmoe.cpu import CPUExperts, Slots, WorkerPool, cpu_info, shared_pool
from reference import moe_reference, moe_reference_emulated, rel_err

# The row-block kernels of every ISA give the same bits; the AMX level (AMX experts read bf16 / int8
# activations) has its own file, tests/cpu/test_amx.py.
ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
BEST_ISA = ISAS[-1]

# Measured quantization-noise floors + ~15 % (table in the module docstring): any case / large shapes.
FP32_TOL = {
    "bf16": 5.0e-3,
    "int8-g32": 1.5e-2,
    "int8-g64": 1.3e-2,
    "int8-g128": 1.4e-2,
    "int8-row": 1.75e-2,
    "int4-g32": 0.27,
    "int4-g64": 0.23,
    "int4-g128": 0.25,
    "int4-row": 0.235,
}
FP32_TOL_LARGE = {
    "bf16": 3.4e-3,
    "int8-g32": 1.0e-2,
    "int8-g64": 1.2e-2,
    "int8-g128": 1.3e-2,
    "int8-row": 1.65e-2,
    "int4-g32": 0.175,
    "int4-g64": 0.19,
    "int4-g128": 0.205,
    "int4-row": 0.22,
}
EMULATED_TOL = 1e-3

SMALL = (12, 160, 96)  # E, H, I: not powers of two
ODD = (10, 200, 88)  # H, I not multiples of 16 nor of any group size
TINY = (5, 40, 24)  # H, I below one group of 128
TS = (1, 2, 3, 7, 64, 300)
KS = (1, 2, 6, 8)


# ---------------------------------------------------------------- cached engines and references


@functools.lru_cache(maxsize=None)
def weights(shape):
    return make_weights(*shape)


def build(fmt: str, isa: str, shape, pool=None) -> CPUExperts:
    E, H, I = shape
    weight_format, group = FORMATS[fmt]
    ex = CPUExperts(E, H, I, weight_format, group, isa=isa, pool=pool or shared_pool())
    ex.load(*weights(shape))
    return ex


@functools.lru_cache(maxsize=None)
def small_engine(fmt: str, isa: str, shape) -> CPUExperts:
    return build(fmt, isa, shape)


@functools.lru_cache(maxsize=None)
def inputs(shape, T: int, k: int, hot_share: float = 0.0):
    E, H, _ = shape
    x = make_x(T, H, shape, k, hot_share)
    ids, w = make_routing(T, k, E, shape, hot_share=hot_share, n_cold=max(0, min(2, E - k - 1)))
    return x, ids, w


@functools.lru_cache(maxsize=None)
def reference(shape, T: int, k: int, hot_share: float = 0.0):
    x, ids, w = inputs(shape, T, k, hot_share)
    return moe_reference(x, *weights(shape), ids, w)


def dequantized_all(ex: CPUExperts):
    g, u, d = zip(*(ex.dequantized(e) for e in range(ex.num_experts)))
    return g, u, d


def emulated(ex: CPUExperts, x, ids, w, skip_mask=None):
    info = ex.info()
    return moe_reference_emulated(x, *dequantized_all(ex), ids, w, info["activation"], info["group_size"], skip_mask)


@functools.lru_cache(maxsize=None)
def small_emulated(fmt: str, shape, T: int, k: int, hot_share: float = 0.0):
    # Packing does not depend on the ISA (test_isas_bitwise_identical checks it), so one ISA serves all.
    return emulated(small_engine(fmt, ISAS[0], shape), *inputs(shape, T, k, hot_share))


def check(out, ref, emu, fp32_tol, what: str):
    err, err_emu = rel_err(out, ref), rel_err(out, emu)
    assert err <= fp32_tol, f"{what}: error vs fp32 reference {err:.4g} > {fp32_tol:.4g}"
    assert err_emu <= EMULATED_TOL, f"{what}: error vs emulated reference {err_emu:.3g} > {EMULATED_TOL}"


def run_small(fmt: str, isa: str, shape, T: int, k: int, hot_share: float = 0.0):
    """(engine output, fp32 reference, emulated reference) of one cached small case."""
    x, ids, w = inputs(shape, T, k, hot_share)
    out = small_engine(fmt, isa, shape)(x, ids, w)
    return out, reference(shape, T, k, hot_share), small_emulated(fmt, shape, T, k, hot_share)


# ---------------------------------------------------------------- accuracy matrix


def test_routing_covers_skips_and_idle_experts():
    """The generated routing exercises -1 slots and experts that receive no token."""
    _, ids, _ = inputs(SMALL, 300, 6)
    assert (ids == -1).any()
    assert torch.bincount(ids[ids >= 0], minlength=SMALL[0]).eq(0).sum() == 2
    assert all(len(set(row) - {-1}) == len([e for e in row if e != -1]) for row in ids.tolist()), "repeated id"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matrix(fmt, T, k, isa):
    out, ref, emu = run_small(fmt, isa, SMALL, T, k)
    assert out.shape == (T, SMALL[1]) and out.dtype == torch.float32
    check(out, ref, emu, FP32_TOL[fmt], f"{fmt} {isa} T={T} k={k}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [ODD, TINY], ids=["H200-I88", "H40-I24"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_shapes(fmt, shape, isa):
    for T, k in ((1, 1), (7, 2), (64, 3)):
        out, ref, emu = run_small(fmt, isa, shape, T, k)
        check(out, ref, emu, FP32_TOL[fmt], f"{fmt} {isa} {shape} T={T} k={k}")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_skewed_routing(fmt, isa):
    """T=300 with ~85 % of the tokens sending their first slot to one expert."""
    x, ids, _ = inputs(SMALL, 300, 6, 0.85)
    counts = torch.bincount(ids[ids >= 0], minlength=SMALL[0])
    assert counts.max() >= 0.8 * 300, "the routing is not skewed"
    out, ref, emu = run_small(fmt, isa, SMALL, 300, 6, 0.85)
    check(out, ref, emu, FP32_TOL[fmt], f"{fmt} {isa} skewed")


LARGE_SHAPES = {"H1536-I704": (9, 1536, 704), "H2880-I704": (6, 2880, 704)}


@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=list(LARGE_SHAPES))
@pytest.mark.parametrize("fmt", FORMATS)
def test_large_shapes(fmt, shape):
    shape = LARGE_SHAPES[shape]
    engines = {isa: build(fmt, isa, shape) for isa in ISAS}
    for T, k in ((3, 2), (64, 4)):
        x, ids, w = inputs(shape, T, k)
        ref = reference(shape, T, k)
        emu = emulated(engines[ISAS[0]], x, ids, w)
        tol = FP32_TOL_LARGE[fmt] if T >= 64 else FP32_TOL[fmt]
        outs = {isa: ex(x, ids, w) for isa, ex in engines.items()}
        for isa, out in outs.items():
            check(out, ref, emu, tol, f"{fmt} {isa} {shape} T={T} k={k}")
            assert torch.equal(out, outs[ISAS[0]]), f"{isa} and {ISAS[0]} differ"


# The per-commit tier keeps one format per kind at this shape (the small-shape tests cover every format); the slow
# tier runs the rest.
@pytest.mark.parametrize("fmt", ["bf16", "int8-g128", "int4-g64", *(pytest.param(f, marks=pytest.mark.slow)
                                                                  for f in ("int8-row", "int4-g32", "int4-g128",
                                                                            "int4-row"))])
def test_deepseek_v3_shape(fmt):
    """H=7168, I=2048 (DeepSeek-V3 routed experts), 4 experts, T=3, k=2, best ISA."""
    shape = (4, 7168, 2048)
    ex = build(fmt, BEST_ISA, shape)
    x, ids, w = inputs(shape, 3, 2)
    out = ex(x, ids, w)
    ref = reference(shape, 3, 2)
    used = ids[ids >= 0].unique().tolist()
    dq = [ex.dequantized(e) if e in used else (None,) * 3 for e in range(shape[0])]
    info = ex.info()
    emu = moe_reference_emulated(x, *zip(*dq), ids, w, info["activation"], info["group_size"])
    check(out, ref, emu, FP32_TOL[fmt], f"{fmt} DeepSeek-V3 shape")


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("fmt", FORMATS)
def test_isas_bitwise_identical(fmt):
    if len(ISAS) < 2:
        pytest.skip("only one ISA on this CPU")
    for shape in (SMALL, ODD, TINY):
        base = small_engine(fmt, ISAS[0], shape)
        for isa in ISAS[1:]:
            other = small_engine(fmt, isa, shape)
            for e in range(shape[0]):
                for a, b in zip(base.dequantized(e), other.dequantized(e)):
                    assert torch.equal(a, b), f"packing differs between {ISAS[0]} and {isa}"
            for T, k in ((1, 1), (7, 6), (300, 8)):
                if k > shape[0] - 1:
                    continue
                x, ids, w = inputs(shape, T, k)
                assert torch.equal(base(x, ids, w), other(x, ids, w)), f"{isa} vs {ISAS[0]}: {shape} T={T} k={k}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_deterministic_across_runs_and_threads(fmt, isa):
    one = build(fmt, isa, SMALL, pool=WorkerPool(1))
    two = build(fmt, isa, SMALL, pool=WorkerPool(2))
    for T, k, hot in ((1, 2, 0.0), (12, 8, 0.0), (64, 8, 0.0), (300, 6, 0.85)):
        x, ids, w = inputs(SMALL, T, k, hot)
        first = two(x, ids, w)
        assert torch.equal(first, two(x, ids, w)), f"T={T}: two runs differ"
        assert torch.equal(first, one(x, ids, w)), f"T={T}: 1 thread and 2 threads differ"


# ---------------------------------------------------------------- dtypes and call options


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_input_and_output(fmt):
    ex = small_engine(fmt, BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 64, 6)
    x16 = x.bfloat16()
    out32 = ex(x16.float(), ids, w)
    assert torch.equal(ex(x16, ids, w, torch.empty(64, SMALL[1])), out32), "bf16 x must act as its exact fp32 value"
    out16 = ex(x16, ids, w)  # out defaults to x's dtype
    assert out16.dtype == torch.bfloat16
    assert torch.equal(out16, out32.bfloat16()), "bf16 out must be the fp32 result rounded to nearest even"
    assert torch.equal(ex(x, ids, w, torch.empty(64, SMALL[1], dtype=torch.bfloat16)), ex(x, ids, w).bfloat16())
    ref = moe_reference(x16, *weights(SMALL), ids, w)
    assert rel_err(out16, ref) <= FP32_TOL[fmt] + 4e-3  # + bf16 rounding of x and out


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["bf16", "int8-g128", "int4-g32"])
def test_accumulate(fmt, out_dtype):
    ex = small_engine(fmt, BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 7, 2)
    y = ex(x, ids, w)
    out0 = (torch.randn(7, SMALL[1]) * y.std()).to(out_dtype)  # same scale as the result
    out = out0.clone()
    assert ex(x, ids, w, out, accumulate=True) is out
    if out_dtype == torch.float32:
        assert rel_err(out, out0.double() + y.double()) <= 1e-6
        check(out - out0, reference(SMALL, 7, 2), small_emulated(fmt, SMALL, 7, 2), FP32_TOL[fmt], "accumulate")
    else:  # one bf16 rounding of the sum
        assert rel_err(out, out0.double() + y.double()) <= 4e-3


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["bf16", "int8-g32", "int4-g64"])
def test_combine_in_the_down_phase_matches_the_combine_after_it(fmt, out_dtype):
    """Up to 16 tokens the down phase's tasks combine the output columns they complete; above, the combine runs after
    the phase. A token's row is the same bits either way, with accumulate and an odd hidden size too."""
    for shape in (SMALL, ODD):
        ex = small_engine(fmt, BEST_ISA, shape)
        x, ids, w = inputs(shape, 17, 3)
        base = (torch.randn(17, shape[1]) * 0.05).to(out_dtype)
        for accumulate in (False, True):
            few, many = base[:16].clone(), base.clone()
            ex(x[:16], ids[:16], w[:16], few, accumulate=accumulate)
            ex(x, ids, w, many, accumulate=accumulate)
            assert torch.equal(few, many[:16]), f"{shape} accumulate={accumulate}"
            assert not torch.equal(few, base[:16])


@pytest.mark.parametrize("fmt", ["bf16", "int8-row", "int4-g64"])
def test_int32_ids_match_int64(fmt):
    ex = small_engine(fmt, BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 64, 8)
    assert torch.equal(ex(x, ids.int(), w), ex(x, ids, w))


@pytest.mark.parametrize("fmt", ["bf16", "int8-g128", "int4-g32"])
def test_skip_mask(fmt):
    ex = small_engine(fmt, BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 64, 6)
    busiest = torch.bincount(ids[ids >= 0], minlength=SMALL[0]).topk(3).indices
    mask = torch.zeros(SMALL[0], dtype=torch.bool)
    mask[busiest] = True
    out = ex(x, ids, w, skip_mask=mask)
    ref = moe_reference(x, *weights(SMALL), ids, w, skip_mask=mask)
    check(out, ref, emulated(ex, x, ids, w, skip_mask=mask), FP32_TOL[fmt], f"{fmt} skip_mask")
    # Skipping an expert is the same as routing its slots to -1.
    assert torch.equal(out, ex(x, torch.where(mask[ids.clamp(min=0)], -1, ids), w))
    # uint8 masks work too, and an all-false mask changes nothing.
    assert torch.equal(out, ex(x, ids, w, skip_mask=mask.to(torch.uint8)))
    assert torch.equal(ex(x, ids, w, skip_mask=torch.zeros_like(mask)), ex(x, ids, w))


@pytest.mark.parametrize("fmt", ["bf16", "int8-g128", "int4-g32"])
def test_no_routed_token(fmt):
    ex = small_engine(fmt, BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 7, 2)
    none = torch.full_like(ids, -1)
    out = torch.full((7, SMALL[1]), 3.0)
    assert torch.equal(ex(x, none, w, out), torch.zeros(7, SMALL[1]))
    out0 = torch.randn(7, SMALL[1])
    out = out0.clone()
    assert torch.equal(ex(x, none, w, out, accumulate=True), out0)
    everything = torch.ones(SMALL[0], dtype=torch.bool)
    assert torch.equal(ex(x, ids, w, skip_mask=everything), torch.zeros(7, SMALL[1]))


@pytest.mark.parametrize("fmt", ["bf16", "int8-g128", "int4-g32"])
def test_zero_tokens(fmt):
    ex = small_engine(fmt, BEST_ISA, SMALL)
    out = ex(torch.empty(0, SMALL[1]), torch.empty(0, 4, dtype=torch.long), torch.empty(0, 4))
    assert out.shape == (0, SMALL[1])


def test_duplicate_expert_in_one_token():
    """The engine does not require distinct ids per token: a repeated expert counts once per slot."""
    ex = small_engine("int8-g128", BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 7, 2)
    dup = torch.stack([ids[:, 0], ids[:, 0]], dim=1)
    ref = moe_reference(x, *weights(SMALL), dup, w)
    check(ex(x, dup, w), ref, emulated(ex, x, dup, w), FP32_TOL["int8-g128"], "duplicate ids")


@pytest.mark.parametrize("fmt", ["bf16", "int8-g128"])
def test_long_prompt_in_chunks(fmt):
    """T > 1024 runs in chunks of 1024 tokens."""
    x, ids, w = inputs(SMALL, 2500, 2)
    ex = small_engine(fmt, BEST_ISA, SMALL)
    out, ref, emu = run_small(fmt, BEST_ISA, SMALL, 2500, 2)
    check(out, ref, emu, FP32_TOL[fmt], f"{fmt} T=2500")
    assert torch.equal(out[1024:2048], ex(x[1024:2048], ids[1024:2048], w[1024:2048]))
    bad = ids.clone()
    bad[1500, 1] = 99
    with pytest.raises(ValueError, match=r"topk_ids\[1500, 1\] = 99"):
        ex(x, bad, w)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_reaches_output(fmt, bad):
    """A NaN or Inf in x must show in that token's output (csrc/formats/activation.h promises it), not vanish."""
    ex = small_engine(fmt, BEST_ISA, SMALL)
    x, ids, w = inputs(SMALL, 7, 2)
    x = x.clone()
    x[0, 17] = bad  # token 0 always has an expert (make_routing)
    out = ex(x, ids, w)
    assert not out[0].isfinite().all()
    assert torch.equal(out[1:], ex(x[1:], ids[1:], w[1:]))


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("fmt", ["bf16", "int8-row", "int4-g32"])
def test_stacked_and_list_load_identical(fmt):
    stacked = small_engine(fmt, BEST_ISA, SMALL)
    E, H, I = SMALL
    listed = CPUExperts(E, H, I, *FORMATS[fmt], isa=BEST_ISA)
    listed.load(*(list(t.unbind(0)) for t in weights(SMALL)))
    for e in range(E):
        for a, b in zip(stacked.dequantized(e), listed.dequantized(e)):
            assert torch.equal(a, b)
    x, ids, w = inputs(SMALL, 64, 6)
    assert torch.equal(stacked(x, ids, w), listed(x, ids, w))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fmt", ["bf16", "int8-g128", "int4-g32"])
def test_load_source_dtypes(fmt, dtype):
    """Any float source dtype loads as its (fp32-rounded) value."""
    E, H, I = SMALL
    src = [t.to(dtype) for t in weights(SMALL)]
    ex = CPUExperts(E, H, I, *FORMATS[fmt], isa=BEST_ISA)
    ex.load(*src)
    as_fp32 = CPUExperts(E, H, I, *FORMATS[fmt], isa=BEST_ISA)
    as_fp32.load(*(t.float() for t in src))
    x, ids, w = inputs(SMALL, 7, 6)
    assert torch.equal(ex(x, ids, w), as_fp32(x, ids, w))
    check(ex(x, ids, w), moe_reference(x, *src, ids, w), emulated(ex, x, ids, w), FP32_TOL[fmt], f"{fmt} from {dtype}")


def test_partial_loads():
    E, H, I = SMALL
    gate, up, down = weights(SMALL)
    full = small_engine("int8-g128", BEST_ISA, SMALL)
    parts = CPUExperts(E, H, I, "int8", 128, isa=BEST_ISA)
    parts.load(gate[5:], up[5:], down[5:], first_expert=5)
    assert parts.info()["experts_loaded"] == E - 5
    x, ids, w = inputs(SMALL, 64, 6)
    with pytest.raises(RuntimeError, match=r"expert \d is routed to but was never loaded"):
        parts(x, ids, w)
    # Routing only to loaded experts works before the rest is loaded.
    high = torch.where(ids >= 5, ids, -1)
    assert torch.equal(parts(x, high, w), full(x, high, w))
    parts.load([gate[0]], [up[0]], [down[0]])
    parts.load(gate[1:5], up[1:5], down[1:5], first_expert=1)
    assert parts.info()["experts_loaded"] == E
    assert torch.equal(parts(x, ids, w), full(x, ids, w))
    # Reloading an expert replaces it.
    parts.load(gate[:1] * 2, up[:1], down[:1])
    assert torch.equal(parts.dequantized(0)[1], full.dequantized(0)[1])
    assert not torch.equal(parts.dequantized(0)[0], full.dequantized(0)[0])


def test_unloaded_expert_raises_at_sync():
    E, H, I = SMALL
    gate, up, down = weights(SMALL)
    ex = CPUExperts(E, H, I, "bf16", isa=BEST_ISA, pool=WorkerPool(2))
    ex.load(gate[:1], up[:1], down[:1])
    x, ids, w = inputs(SMALL, 3, 2)
    ex.submit(x, ids, w)  # submit validates buffers only; routing is read when the job runs
    with pytest.raises(RuntimeError, match="never loaded"):
        ex.sync()
    with pytest.raises(RuntimeError, match="not loaded"):
        ex.dequantized(3)


# ---------------------------------------------------------------- dequantized weights vs the source


def test_dequantized_bf16_is_rounded_source():
    ex = small_engine("bf16", BEST_ISA, ODD)
    for e, src in enumerate(zip(*weights(ODD))):
        for dq, w in zip(ex.dequantized(e), src):
            assert torch.equal(dq, w.bfloat16().float())


def group_absmax(w: torch.Tensor, group: int) -> torch.Tensor:
    """max |w| over each group of ``group`` consecutive inputs (0 = the whole row), broadcast back to w."""
    rows, n = w.shape
    g = n if group == 0 else group
    n_pad = -(-n // g) * g
    amax = torch.nn.functional.pad(w.abs(), (0, n_pad - n)).view(rows, -1, g).amax(dim=2)
    return amax.repeat_interleave(g, dim=1)[:, :n]


@pytest.mark.parametrize("group", [32, 64, 128, 0])
def test_dequantized_int8_within_half_step(group):
    fmt = "int8-row" if group == 0 else f"int8-g{group}"
    ex = small_engine(fmt, BEST_ISA, ODD)
    for e, src in enumerate(zip(*weights(ODD))):
        for dq, w in zip(ex.dequantized(e), src):
            step = group_absmax(w, group) / 127
            assert ((w - dq).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
            levels = (dq / step).round()
            assert torch.allclose(dq, levels * step, rtol=1e-5, atol=1e-12) and levels.abs().max() <= 127


# Measured ||w - dq|| / ||w|| of int4 on these gaussian weights (max over matrices): 0.087 (g32), 0.096 (g64),
# 0.101 (g128), 0.105 (per row); bounds + ~15 %.
INT4_WEIGHT_TOL = {32: 0.10, 64: 0.11, 128: 0.116, 0: 0.12}


@pytest.mark.parametrize("group", [32, 64, 128, 0])
def test_dequantized_int4_error(group):
    ex = small_engine("int4-row" if group == 0 else f"int4-g{group}", BEST_ISA, ODD)
    for e, src in enumerate(zip(*weights(ODD))):
        for dq, w in zip(ex.dequantized(e), src):
            assert rel_err(dq, w) <= INT4_WEIGHT_TOL[group]
            # at most 16 levels per (row, group); per row: per whole row
            rows, n = w.shape
            for r in range(0, rows, 7):
                for g0 in range(0, n, group or n):
                    assert dq[r, g0:g0 + (group or n)].unique().numel() <= 16


def test_stage_profile_counts_jobs_and_time():
    ex = CPUExperts(8, 64, 96, "int4", 32, pool=shared_pool(2))
    ex.fill_random(seed=3)
    x = torch.randn(5, 64)
    ids = torch.randint(0, 8, (5, 2))
    w = torch.rand(5, 2)
    ex.forward(x, ids, w)
    assert ex.profile()["jobs"] == 0  # off by default
    ex.set_profiling(True)
    for _ in range(3):
        ex.forward(x, ids, w)
    prof = ex.profile()
    assert prof["jobs"] == 3
    assert set(prof["ms"]) == set(CPUExperts.JOB_STAGES)
    assert all(v >= 0 for v in prof["ms"].values()) and prof["ms"]["experts"] > 0
    ex.set_profiling(False)
    ex.forward(x, ids, w)
    assert ex.profile()["jobs"] == 3
    ex.set_profiling(True)  # restarting clears the sums
    assert ex.profile()["jobs"] == 0


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_job_picks_its_deferral_part(fmt):
    """prepare(slots=Slots.immediate(d)) computes each token's k - d highest-weighted slots and Slots.deferred(d) the d
    lowest, from one routing: the same bits as jobs over split_deferred's two id tensors (ties: earlier slot lower)."""
    E, H, I, k, T = 12, 64, 96, 6, 9
    ex = CPUExperts(E, H, I, fmt, 32, pool=shared_pool(2))
    ex.fill_random(seed=5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen)
    w[1] = 0.25  # all tied
    w[2, :3] = torch.tensor([0.0, -0.0, 0.0])  # signed zeros compare equal
    w[3, 4] = w[3, 1]
    for d in (1, 2, 5):
        imm_ids, def_ids = split_deferred(ids, w, d)
        for deferred, ref_ids in ((False, imm_ids), (True, def_ids)):
            job = ex.prepare(x, ids, w, torch.empty(T, H), slots=Slots.deferred(d) if deferred else Slots.immediate(d))
            ex.submit(job)
            ex.sync()
            ref = ex.forward(x, ref_ids, w)
            assert torch.equal(job.out, ref), (d, deferred)
    with pytest.raises(ValueError, match=r"slots defer must be in \[1, k=6\), got 6"):
        ex.prepare(x, ids, w, slots=Slots.immediate(k))
    with pytest.raises(ValueError, match="needs defer >= 1"):
        Slots.deferred(0)
    with pytest.raises(ValueError, match="needs defer >= 1"):
        Slots.immediate(-1)
    with pytest.raises(ValueError, match="defer must be 0"):
        Slots("all", 2)
    with pytest.raises(ValueError, match="part must be one of all, immediate, deferred"):
        Slots("lowest", 2)
    with pytest.raises(TypeError, match="slots must be a Slots"):
        ex.prepare(x, ids, w, slots="all")


def split_deferred(ids: torch.Tensor, w: torch.Tensor, d: int) -> tuple:
    """Reference of the deferral split: (immediate ids, deferred ids), the other part's slots -1; the d lowest weights
    by a stable ascending sort are deferred (among equal weights the earlier slot is the lower)."""
    lowest = w.argsort(dim=-1, stable=True)[:, :d]
    deferred = torch.zeros(ids.shape, dtype=torch.bool).scatter_(1, lowest, True)
    return ids.masked_fill(deferred, -1), ids.masked_fill(~deferred, -1)


def test_job_spec_names_every_field_and_is_checked():
    """make_job takes one _C.JobSpec (named fields, enums for the part and the router): unknown names are refused,
    and a spec no job can run raises ValueError before any job exists."""
    from hetmoe import _C

    assert set(_C.JobPart.__members__) == {"all", "immediate", "deferred"}
    assert set(_C.RouterKind.__members__) == {"softmax", "sigmoid_grouped"}
    spec = _C.JobSpec(k=2, T=3, part=_C.JobPart.deferred, defer=1, router=_C.RouterKind.sigmoid_grouped)
    assert (spec.k, spec.T, spec.part, spec.defer, spec.x, spec.n_group) == (2, 3, _C.JobPart.deferred, 1, 0, 1)
    with pytest.raises(AttributeError):
        _C.JobSpec(topk=2)
    with pytest.raises(TypeError):
        _C.JobSpec(part="deferred")  # an enum, not a string
    ex = CPUExperts(4, 64, 32, "bf16", pool=shared_pool(2))
    ex.fill_random(seed=1)
    x, ids, w, out = torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2), torch.zeros(3, 64)
    ok = dict(x=x.data_ptr(), ids=ids.data_ptr(), weights=w.data_ptr(), out=out.data_ptr(), k=2, T=3)
    with pytest.raises(ValueError, match="x, ids, weights and out must be set"):
        ex._ex.make_job(_C.JobSpec(**{**ok, "weights": 0}))
    with pytest.raises(ValueError, match="T must be >= 0"):
        ex._ex.make_job(_C.JobSpec(**{**ok, "T": -1}))
    with pytest.raises(ValueError, match="1 <= defer_lowest < k"):
        ex._ex.make_job(_C.JobSpec(**ok, part=_C.JobPart.deferred, defer=2))
    with pytest.raises(ValueError, match="defer_lowest is set"):
        ex._ex.make_job(_C.JobSpec(**ok, defer=1))
    with pytest.raises(ValueError, match="n_group 3 does not divide"):
        ex._ex.make_job(_C.JobSpec(**ok, logits=x.data_ptr(), router=_C.RouterKind.sigmoid_grouped, n_group=3))
    job = ex._ex.make_job(_C.JobSpec(**ok))
    assert isinstance(job, _C.MoeJob)


class _Gate:
    """Holds ``pool``'s coordinator in a gate job (_C.GateJob) until the block ends: every job submitted inside
    the block is queued when the first of them starts, whatever the machine's speed. Pairing (the deferred job is
    queued right behind its immediate job) and chaining (the next layer's immediate job is queued behind a
    deferred job) are then decided by the submission order alone, not by a race with a long job."""

    def __init__(self, pool):
        from hetmoe import _C

        self.pool, self.gate = pool, _C.GateJob()

    def __enter__(self):
        self.pool._pool.submit(self.gate)  # a raw _C job: WorkerPool.submit takes MoEJobs only
        return self

    def __exit__(self, *exc):
        self.gate.open()  # also when the block raised: a gate left closed would hang the pool


def _deferral_jobs(ex, T, k, d, gen, addend=True, pair=True):
    H, E = ex.hidden_size, ex.num_experts
    x = torch.randn(T, H, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, k, generator=gen)
    add = torch.randn(T, H, generator=gen) * 0.01 if addend else None
    imm = ex.prepare(x, ids, w, torch.empty(T, H, dtype=torch.bfloat16), slots=Slots.immediate(d), addend=add)
    dfr = ex.prepare(x, ids, w, torch.empty(T, H), slots=Slots.deferred(d, pair=imm if pair else None))
    return imm, dfr


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_paired_deferral_jobs_run_as_one_list_with_the_same_bits(fmt, threads):
    """An immediate job and its paired deferred job submitted back to back run as one list (the immediate job
    completes first, the deferred one joins the rest): the same bits as the two jobs run one at a time, over many
    layers in a row, for every token count a decode step takes; above 16 tokens they run unpaired."""
    from hetmoe import _C

    pool = WorkerPool(threads)
    layers = []
    for seed in range(4):
        ex = CPUExperts(16, 64, 96, fmt, 32, pool=pool)
        ex.fill_random(seed=seed)
        layers.append(ex)
    gen = torch.Generator().manual_seed(3)
    for T in (1, 3, 16, 17):
        jobs = [_deferral_jobs(ex, T, 6, 2, gen) for ex in layers]
        before = _C.paired_deferral_runs()  # process-global, but only this test's pool runs jobs meanwhile
        with _Gate(pool):  # every pair is queued before the first job starts
            for imm, dfr in jobs:  # a hybrid step's order
                pool.submit(imm)
                pool.submit(dfr)
        pool.sync()
        paired = _C.paired_deferral_runs() - before
        # deterministic: the gate queued every deferred job right behind its immediate one; above 16 tokens no pair
        assert paired == (len(layers) if T <= 16 else 0), f"T={T}: {paired} paired runs"
        got = [(imm.out.clone(), dfr.out.clone()) for imm, dfr in jobs]
        for imm, dfr in jobs:  # one at a time: def is never queued behind imm, so nothing pairs
            for job in (imm, dfr):
                job.out.fill_(7)
                pool.submit(job)
                pool.sync()
        assert _C.paired_deferral_runs() - before == paired
        for (a, b), (imm, dfr) in zip(got, jobs):
            assert torch.equal(a, imm.out) and torch.equal(b, dfr.out), f"T={T}"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chained_deferral_pairs_match_one_at_a_time(threads):
    """A hybrid step's jobs queued at once: each layer's immediate job adds the previous layer's deferred output
    (its addend) and is chained behind that deferred job's tasks; outputs have the same bits as the jobs run one
    at a time, for 1 to 16 tokens. The deferred part is the heavy one (7 of 8 experts), so a combine that did not
    wait for the previous deferred job would read its output half written."""
    from hetmoe import _C

    pool = WorkerPool(threads)
    gen = torch.Generator().manual_seed(11)
    layers = []
    for seed in range(5):
        ex = CPUExperts(16, 128, 96, "int4", 32, pool=pool)
        ex.fill_random(seed=seed)
        layers.append(ex)
    for T in (1, 4, 16):
        jobs, prev_out = [], None
        for ex in layers:
            x = torch.randn(T, 128, generator=gen).bfloat16()
            ids = torch.stack([torch.randperm(16, generator=gen)[:8] for _ in range(T)]).to(torch.int32)
            w = torch.rand(T, 8, generator=gen)
            imm = ex.prepare(x, ids, w, torch.empty(T, 128, dtype=torch.bfloat16), slots=Slots.immediate(7),
                             addend=prev_out)
            dfr = ex.prepare(x, ids, w, torch.empty(T, 128), slots=Slots.deferred(7, pair=imm))
            jobs.append((imm, dfr))
            prev_out = dfr.out
        for rnd in range(6):
            paired, chained = _C.paired_deferral_runs(), _C.chained_deferral_runs()
            with _Gate(pool):  # the whole step is queued before its first job starts
                for imm, dfr in jobs:
                    imm.out.fill_(3), dfr.out.fill_(5)
                    pool.submit(imm)
                    pool.submit(dfr)
            pool.sync()
            assert _C.paired_deferral_runs() - paired == len(layers)
            # A deferred job chains the next layer's immediate job when some of its own tasks are left when it runs.
            # With one thread nobody else takes them (deterministic: every layer but the last chains); with more,
            # the workers may finish them first (timing), so only the bound holds.
            n_chained = _C.chained_deferral_runs() - chained
            if threads == 1:
                assert n_chained == len(layers) - 1, f"T={T} round {rnd}: {n_chained} chained"
            else:
                assert 0 <= n_chained <= len(layers) - 1, f"T={T} round {rnd}: {n_chained} chained"
            got = [(imm.out.clone(), dfr.out.clone()) for imm, dfr in jobs]
            for imm, dfr in jobs:
                for job in (imm, dfr):
                    job.out.fill_(7)
                    pool.submit(job)
                    pool.sync()
            for l, ((a, b), (imm, dfr)) in enumerate(zip(got, jobs)):
                assert torch.equal(b, dfr.out), f"T={T} layer {l} deferred"
                assert torch.equal(a, imm.out), f"T={T} layer {l} immediate (round {rnd})"


def test_paired_deferral_jobs_under_load():
    """Many pairs back to back with unrelated jobs between some of them, on a pool with more threads than cores:
    every output matches its one-at-a-time value."""
    pool = WorkerPool(3)
    ex = CPUExperts(16, 64, 96, "int8", 32, pool=pool)
    ex.fill_random(seed=9)
    gen = torch.Generator().manual_seed(4)
    pairs = [_deferral_jobs(ex, 1 + i % 4, 8, 1 + i % 7, gen, addend=i % 2 == 0) for i in range(24)]
    other = ex.prepare(torch.randn(2, 64), torch.randint(0, 16, (2, 3)), torch.rand(2, 3))
    refs = []
    for imm, dfr in pairs:
        for job in (imm, dfr):
            pool.submit(job)
            pool.sync()
        refs.append((imm.out.clone(), dfr.out.clone()))
    for _ in range(5):
        for i, (imm, dfr) in enumerate(pairs):
            imm.out.zero_(), dfr.out.zero_()
            pool.submit(imm)
            if i % 5 == 4:
                pool.submit(other)  # the deferred job is not right behind: both run on their own
            pool.submit(dfr)
        pool.sync()
        for (imm, dfr), (a, b) in zip(pairs, refs):
            assert torch.equal(imm.out, a) and torch.equal(dfr.out, b)


def test_paired_deferral_job_errors():
    """A pair whose deferred part routes to an unloaded expert: the immediate output is still right and the error
    is raised once, at the sync; a pair refuses jobs that do not belong together."""
    E, H, I = 8, 64, 96
    pool = WorkerPool(2)
    ex = CPUExperts(E, H, I, "bf16", pool=pool)
    gen = torch.Generator().manual_seed(5)
    ex.load(torch.randn(6, I, H, generator=gen) * 0.05, torch.randn(6, I, H, generator=gen) * 0.05,
            torch.randn(6, H, I, generator=gen) * 0.05)  # experts 6 and 7 never loaded
    x = torch.randn(1, H, generator=gen)
    ids = torch.tensor([[0, 1, 6]])
    w = torch.tensor([[0.5, 0.4, 0.1]])  # expert 6 is the deferred (lowest-weighted) slot
    imm = ex.prepare(x, ids, w, torch.empty(1, H), slots=Slots.immediate(1))
    dfr = ex.prepare(x, ids, w, torch.empty(1, H), slots=Slots.deferred(1, pair=imm))
    pool.submit(imm)
    pool.submit(dfr)
    with pytest.raises(RuntimeError, match="expert 6 is routed to but was never loaded"):
        pool.sync()
    pool.sync()  # raised once
    ref = ex.forward(x, torch.tensor([[0, 1]]), w[:, :2])
    assert torch.equal(imm.out, ref)
    with pytest.raises(ValueError, match=r"pair goes with Slots.deferred\(d, pair=...\)"):
        Slots("immediate", 1, imm)
    with pytest.raises(ValueError, match="must share x, the routing"):
        ex.prepare(x.clone(), ids, w, torch.empty(1, H),
                   slots=Slots.deferred(1, pair=ex.prepare(x, ids, w, slots=Slots.immediate(1))))
    with pytest.raises(ValueError, match="already paired"):
        ex.prepare(x, ids, w, torch.empty(1, H), slots=Slots.deferred(1, pair=imm))
    other = CPUExperts(E, H, I, "bf16", pool=pool)
    other.fill_random(seed=1)
    with pytest.raises(ValueError, match="same CPUExperts"):
        other.prepare(x, ids, w, torch.empty(1, H), slots=Slots.deferred(1, pair=imm))
    with pytest.raises(ValueError, match="same CPUExperts"):
        ex.prepare(x, ids, w, torch.empty(1, H), slots=Slots.deferred(1, pair=object()))


def test_too_many_experts_per_token_is_refused():
    ex = CPUExperts(4, 64, 32, "int8", 32, pool=shared_pool(2))
    ex.fill_random(seed=1)
    with pytest.raises(ValueError, match=r"k \(experts per token\) must be in \[1, 64\]"):
        ex.prepare(torch.randn(2, 64), torch.zeros(2, 65, dtype=torch.int64), torch.rand(2, 65))
