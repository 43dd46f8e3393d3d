"""The AMX GEMM's loop variants (csrc/kernels/amx/gemm.h) give the same bits, checked on the emulated GEMM in-process
(_C.amx_emulated_gemm, one call on one or two row blocks; the variant is a parameter, amx::GemmVariant in
csrc/kernels/dispatch.h). Grouped int8 calls of up to 32 tokens take the 16-token loop with two sets of C tiles, longer
ones the 32-token loop (loop="engine"); "two_set" and "one_set" send every call to one of them. Per output the groups
are summed in the same order either way, so all three must agree bitwise. int4 weights take the two-set loop at every
length whatever the loop: their cases check that the choice does not reach them. Symmetric int4 expanded to unsigned
bytes (int4_signed=False: tdpbsud, offset 8 undone in the epilogue) gives the bits of the engine's signed bytes
(tdpbssd, no offset); affine int4 takes the unsigned bytes either way."""

from __future__ import annotations

import numpy as np
import pytest

from hetmoe import _C

# (rows, K): two row blocks, two with zero-padded rows, one block; K not a multiple of 64 (partial groups and chunks),
# and K past one chunk of 1024 (the next chunk's prefetch, chunk boundaries inside the loops)
SHAPES = [(32, 200), (20, 136), (16, 200), (32, 1100)]
TOKENS = (1, 7, 16, 17, 32, 33, 51, 77)
LOOPS = ("engine", "two_set", "one_set")


def data(rows: int, k: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, k)) * 0.02).astype(np.float32)
    x = rng.standard_normal((max(TOKENS), k)).astype(np.float32)
    x[3] *= 50  # one token far larger than the others (its own activation scales)
    return w, x


def gemm(fmt, group, w, x, scaling="symmetric", **variant) -> np.ndarray:
    out = _C.amx_emulated_gemm(fmt, group, w, np.ascontiguousarray(x), scaling=scaling, **variant)
    return np.asarray(out, dtype=np.float32).reshape(len(x), -1)


# Scales stored narrower than fp32 and lut4's codebooks (csrc/formats/layout.h): widened exactly before the same
# epilogue, so the loops agree as they do with fp32 scales. (32, 64): K in one group of 64 (the per-row branch's
# whole-K sums, whose epilogue widens the group's scales too).
NARROW = [("lut4", 32, "fp32", "iq4nl"), ("lut4", 16, "fp16", "e2m1"), ("lut4", 64, "e8m0", "e2m1"),
          ("lut4", 128, "bf16", "iq4nl"), ("int8", 32, "fp16", ""), ("int8", 16, "e8m0", ""), ("int8", 64, "bf16", ""),
          ("int4", 32, "fp16", ""), ("int4", 64, "e8m0", ""), ("int4", 128, "bf16", "")]


@pytest.mark.parametrize("fmt, group, scale_dtype, codebook", NARROW, ids=lambda v: str(v or "-"))
def test_narrow_scales_and_lut4_give_the_same_bits_in_every_loop(fmt, group, scale_dtype, codebook):
    narrow = dict(scale_dtype=scale_dtype, codebook=codebook)
    for i, (rows, k) in enumerate(SHAPES + [(32, 64)]):
        w, x = data(rows, k, 30 + i)
        for T in TOKENS:
            outs = {loop: gemm(fmt, group, w, x[:T], loop=loop, **narrow) for loop in LOOPS}
            ref = outs["engine"]
            assert np.isfinite(ref).all() and np.abs(ref).max() > 0, f"{rows}x{k}, T={T}: no output"
            for loop, out in outs.items():
                assert np.array_equal(out, ref), f"{rows}x{k}, T={T}: the {loop} loop differs"
            prod = x[:T] @ w.T
            tol = 0.03 if fmt == "int8" else 0.35  # the weights' quantization (e8m0 halves int8's code range)
            assert np.abs(ref[:, :rows] - prod).max() <= tol * np.abs(prod).max(), f"{rows}x{k}, T={T}"


@pytest.mark.parametrize(
    "fmt, group, scaling",
    [("int4", 32, "symmetric"), ("int4", 64, "symmetric"), ("int4", 128, "symmetric"), ("int4", 0, "symmetric"),
     ("int4", 32, "affine"), ("int8", 16, "symmetric"), ("int8", 32, "symmetric"), ("int8", 64, "symmetric"),
     ("int8", 128, "symmetric"), ("int8", 0, "symmetric"), ("int8", 32, "affine"), ("int8", 64, "affine")],
)
def test_grouped_loops_give_the_same_bits(fmt, group, scaling):
    for i, (rows, k) in enumerate(SHAPES):
        w, x = data(rows, k, i)
        for T in TOKENS:
            outs = {loop: gemm(fmt, group, w, x[:T], scaling, loop=loop) for loop in LOOPS}
            ref = outs["engine"]
            assert ref.shape == (T, 16 * ((rows + 15) // 16))
            assert np.isfinite(ref).all() and np.abs(ref).max() > 0, f"{rows}x{k}, T={T}: no output"
            for loop, out in outs.items():
                diff = np.abs(out - ref).max()
                assert np.array_equal(out, ref), f"{rows}x{k}, T={T}: the {loop} loop differs by {diff:.3g}"


@pytest.mark.parametrize("group, scaling", [(32, "symmetric"), (64, "symmetric"), (128, "symmetric"), (0, "symmetric"),
                                            (32, "affine")])
def test_signed_and_unsigned_int4_give_the_same_bits(group, scaling):
    for i, (rows, k) in enumerate(SHAPES):
        w, x = data(rows, k, 10 + i)
        for T in TOKENS:
            signed = gemm("int4", group, w, x[:T], scaling)
            assert np.abs(signed).max() > 0
            for loop in LOOPS:
                unsigned = gemm("int4", group, w, x[:T], scaling, loop=loop, int4_signed=False)
                diff = np.abs(signed - unsigned).max()
                assert np.array_equal(signed, unsigned), f"{rows}x{k}, T={T}, {loop}: unsigned differs by {diff:.3g}"


def test_engine_variant_is_close_to_the_product():
    w, x = data(32, 200, 20)
    for fmt, group, tol in [("int8", 32, 0.02), ("int4", 32, 0.2)]:
        out = gemm(fmt, group, w, x)
        ref = x @ w.T
        assert np.abs(out - ref).max() <= tol * np.abs(ref).max(), fmt


def test_bad_arguments():
    w, x = data(32, 64, 0)
    with pytest.raises(ValueError, match="unknown AMX loop"):
        _C.amx_emulated_gemm("int8", 32, w, x, loop="both")
    with pytest.raises(ValueError, match="group_size"):
        _C.amx_emulated_gemm("int8", 48, w, x)
    with pytest.raises(ValueError, match="w must be"):
        _C.amx_emulated_gemm("int8", 32, np.zeros((33, 64), np.float32), x)
    with pytest.raises(ValueError, match="affine"):
        _C.amx_emulated_gemm("int8", 0, w, x, scaling="affine")
    with pytest.raises(ValueError, match="lut4 weights need a codebook"):
        _C.amx_emulated_gemm("lut4", 32, w, x)
    with pytest.raises(ValueError, match="unknown scale dtype 'fp8'"):
        _C.amx_emulated_gemm("int4", 32, w, x, scale_dtype="fp8")
