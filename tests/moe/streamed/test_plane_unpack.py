"""The GPU prefill's readers of the bit-plane formats (int6, int5, int3, int2: GGUF's Q6_K, Q5_K, Q3_K, Q2_K at their
file's bytes, csrc/formats/layout.h): the PyTorch unpack (hetmoe/moe/streamed/packed.py) and the one-pass Triton
kernel (hetmoe/ops/triton/packed.py) against the CPU engine's own values (``CPUExperts.dequantized``: code x scale
(- min) in fp32), and the layerwise prefill's setup taking plane-format layers (hetmoe/moe/streamed/choice.py).

Paths: torch ops on the CPU (bitwise); the Triton kernel in Triton's interpreter in a fresh process where there is no
GPU (bitwise in fp32), on the GPU otherwise (bitwise the engine's values rounded to bf16): the same test.

``fill_random`` gives every group of a matrix the same scale (and min), so the tests of the two-level scale dtypes (k8,
k4) overwrite their scale bytes with random ones (``scramble_two_level``): every sub-scale and sub-min bit pattern,
fp16 super scales and mins of either sign, normal and subnormal, one per (row, super-block).
"""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.cpu.layout import FACTOR_SCALES, SCALE_WIDTH, TWO_LEVEL, ZERO_POINTS
from hetmoe.moe.streamed import layerwise
from hetmoe.moe.streamed.choice import setup
from hetmoe.moe.streamed.packed import ExpertLayout, MatrixShape, expert_ranges, unpack_experts, widen_set
from tests.triton_interp import assert_unpack_equals_engine

# (weight_format, scaling, group, scale dtype): every plane format symmetric and affine; the K-quants' own with k8
# (Q6_K, Q5_K, Q3_K) and k4 (Q2_K), the others with fp32 or fp16 scales, k8 and k4 on other formats and groups
CASES = [("int6", "symmetric", 16, "k8"), ("int6", "affine", 32, "fp32"), ("int5", "affine", 32, "k8"),
         ("int5", "symmetric", 16, "fp32"), ("int3", "symmetric", 16, "k8"), ("int3", "affine", 64, "fp16"),
         ("int2", "affine", 16, "k4"), ("int2", "affine", 16, "k8"), ("int2", "symmetric", 128, "fp32"),
         ("int6", "affine", 32, "k4")]
# Q4_K_M's mixed expert (Q4_K gate/up, Q6_K down), Q3_K_M's (Q3_K gate/up, Q5_K down) and Q2_K's (Q2_K gate/up,
# Q3_K down)
MIXED = [dict(weight_format=("int4", "int6"), group_size=32, down_group_size=16, scaling=("affine", "symmetric"),
              scale_dtype=("k8", "k8")),
         dict(weight_format=("int3", "int5"), group_size=16, down_group_size=32, scaling=("symmetric", "affine"),
              scale_dtype=("k8", "k8")),
         dict(weight_format=("int2", "int3"), group_size=16, scaling=("affine", "symmetric"), scale_dtype=("k4", "k8"))]
MIXED_IDS = ["q4_k_m", "q3_k_m", "q2_k+q3_k"]
# NVFP4 at its file's bytes: E4M3 scale bytes with a factor per row block (ModelOpt's product, compressed-tensors'
# quotient); both readers
E4M3 = [dict(weight_format="lut4", group_size=16, scale_dtype=sdt, codebook="e2m1") for sdt in ("e4m3", "e4m3_div")]
# GPTQ / AWQ / compressed-tensors zero points at their file's bytes: scales of the base dtype, one int8 zero point per
# min (min = fl(scale * z)); both readers
ZP = [dict(weight_format="int4", group_size=32, scaling="affine", scale_dtype="fp16_zp"),
      dict(weight_format="int4", group_size=16, scaling="affine", scale_dtype="bf16_zp"),
      dict(weight_format="int4", group_size=16, scaling="affine", scale_dtype="fp32_zp"),
      dict(weight_format="int8", group_size=16, scaling="affine", scale_dtype="fp16_zp")]
ZP_IDS = ["int4-fp16_zp", "int4-bf16_zp", "int4-fp32_zp", "int8-fp16_zp"]


def _scale_blocks(ex: CPUExperts, scale_dtypes: tuple):
    """(matrix shape, its scale bytes per row block [blocks, block_scale_bytes], a view of the engine's storage) of
    ``ex``'s gate/up and down matrices whose scale dtype is one of ``scale_dtypes``."""
    lay, ranges = ExpertLayout.of(ex), expert_ranges(ex)
    for shape, sets in ((lay.gate_up, ranges[1] if len(ranges) == 4 else None), (lay.down, ranges[-1])):
        if shape.scale_dtype in scale_dtypes:
            yield shape, sets.view(-1, shape.block_scale_bytes)


def scramble_two_level(ex: CPUExperts, seed: int) -> None:
    """Random bytes in place of ``ex``'s k8 / k4 scale sets (and min sets), in the engine's own storage: random
    sub-scale bytes (k4: sub-scale and sub-min nibbles), random finite fp16 super scales (and mins) of either sign,
    some subnormal. Matrices of other scale dtypes are left as they are."""
    gen = torch.Generator().manual_seed(seed)
    for shape, blocks in _scale_blocks(ex, TWO_LEVEL):
        blocks.copy_(torch.randint(0, 256, blocks.shape, generator=gen, dtype=torch.uint8))
        subs = shape.kp // shape.group * 16
        supers = [(subs, shape.set_bytes)]  # (first, end) byte of each fp16 run of a block
        if shape.affine:
            supers.append((shape.set_bytes + (0 if shape.scale_dtype == "k4" else subs), shape.block_scale_bytes))
        for lo, hi in supers:
            n = (hi - lo) // 2
            mag = torch.exp2(torch.randint(-20, -4, (blocks.shape[0], n), generator=gen).float())  # 2^-20: subnormal
            sign = torch.randint(0, 2, (blocks.shape[0], n), generator=gen).float() * 2 - 1
            val = (sign * mag * (1 + torch.rand(blocks.shape[0], n, generator=gen))).half()
            blocks[:, lo:hi] = val.view(torch.uint8).view(blocks.shape[0], hi - lo)


def scramble_factors(ex: CPUExperts, seed: int) -> None:
    """Random E4M3 bytes (never the NaN codes) and random positive fp32 factors in place of ``ex``'s e4m3 /
    e4m3_div scale sets, in the engine's own storage. Matrices of other scale dtypes are left as they are."""
    gen = torch.Generator().manual_seed(seed)
    for shape, blocks in _scale_blocks(ex, FACTOR_SCALES):
        subs = shape.kp // shape.group * 16
        b = torch.randint(0, 0x7F, (blocks.shape[0], subs), generator=gen, dtype=torch.uint8)
        b |= torch.randint(0, 2, b.shape, generator=gen, dtype=torch.uint8) << 7  # either sign
        blocks[:, :subs] = b
        f = torch.rand(blocks.shape[0], 1, generator=gen) * torch.exp2(torch.randint(-3, 9, (blocks.shape[0], 1),
                                                                                    generator=gen).float()) + 0.01
        blocks[:, subs:subs + 4] = f.float().view(torch.uint8)


def scramble_zero_points(ex: CPUExperts, seed: int) -> None:
    """Random scales of the base dtype (either sign, normal and, fp16, subnormal; some zero) and random zero-point
    bytes (all of int8) in place of ``ex``'s fp32_zp / fp16_zp / bf16_zp scale and min sets, in the engine's own
    storage. Matrices of other scale dtypes are left as they are."""
    gen = torch.Generator().manual_seed(seed)
    for shape, blocks in _scale_blocks(ex, tuple(ZERO_POINTS)):
        n = shape.set_bytes // SCALE_WIDTH[shape.scale_dtype]
        mag = torch.exp2(torch.randint(-20, -4, (blocks.shape[0], n), generator=gen).float())  # 2^-20: subnormal
        sign = torch.randint(0, 2, (blocks.shape[0], n), generator=gen).float() * 2 - 1
        val = sign * mag * (1 + torch.rand(blocks.shape[0], n, generator=gen))
        val[:, ::7] = 0.0
        base = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[ZERO_POINTS[shape.scale_dtype]]
        blocks[:, :shape.set_bytes] = val.to(base).view(torch.uint8).view(blocks.shape[0], -1)
        blocks[:, shape.set_bytes:] = torch.randint(0, 256, (blocks.shape[0], shape.min_set_bytes), generator=gen,
                                                    dtype=torch.uint8)


def _engine(E, H, I, seed, **kwargs) -> CPUExperts:
    ex = CPUExperts(E, H, I, pool=WorkerPool(1), **kwargs)
    ex.fill_random(seed=seed)  # codes over each format's whole range (every plane's bits)
    scramble_two_level(ex, seed)
    scramble_factors(ex, seed)
    scramble_zero_points(ex, seed)
    return ex


def _kwargs(case) -> dict:
    fmt, scaling, group, sdt = case
    return dict(weight_format=fmt, group_size=group, scaling=scaling, scale_dtype=sdt)


@pytest.mark.parametrize("kwargs", [_kwargs(c) for c in CASES] + MIXED + E4M3 + ZP,
                         ids=["-".join(map(str, c)) for c in CASES] + MIXED_IDS + ["nvfp4-e4m3", "nvfp4-e4m3_div"]
                         + ZP_IDS)
@pytest.mark.parametrize("H,I", [(48, 80), (288, 40), (512, 272)])
def test_torch_unpack_equals_the_engine(kwargs, H, I):
    """H = 48 with group 16: K ends in half a unit of int5 / int3, and mid-super-block; H = 288: two k8 / k4
    super-blocks, the second partial; H = 512: two whole ones (I = 272: down's K ends 16 into its second); I = 40 in
    groups of 32: K padded. Experts 1..2 of 4 alone, as the GPU path unpacks a few at a time."""
    E = 4
    ex = _engine(E, H, I, H + I, **kwargs)
    lay = ExpertLayout.of(ex)
    ranges = expert_ranges(ex)
    per = lay.range_bytes()
    assert lay.expert_bytes == ex.info()["bytes_per_expert"]
    assert [r.numel() for r in ranges] == [E * b for b in per]
    a, n = 1, 2
    gu, d = unpack_experts(lay, [r[a * b:(a + n) * b] for r, b in zip(ranges, per)], n, torch.float32)
    for i in range(n):
        g, u, dd = ex.dequantized(a + i)
        assert torch.equal(gu[i], torch.cat([g, u])) and torch.equal(d[i], dd), (kwargs, a + i)


def test_the_triton_unpack_equals_the_engine():
    """The one-pass kernel on every plane format, symmetric and affine, k8 / fp32 / fp16 scales, the mixed experts,
    NVFP4's e4m3 / e4m3_div and the zero-point dtypes (H = 48: half a unit; I = 40: padded K)."""
    assert_unpack_equals_engine((2, 48, 40), [_kwargs(c) for c in CASES] + MIXED + E4M3 + ZP)


def test_the_triton_unpack_over_super_blocks():
    """The K-quants' own layouts over two k8 / k4 super-blocks (H = 288, the second partial)."""
    assert_unpack_equals_engine((2, 288, 40), [_kwargs(c) for c in CASES if c[3] in TWO_LEVEL] + MIXED[:1] + MIXED[2:])


TWO_LEVEL_CHECK = """
import sys, torch
sys.path.insert(0, %r)
from tests.moe.streamed.test_plane_unpack import _engine
from hetmoe.ops.triton import packed as packed_triton
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges
cuda = torch.cuda.is_available()
dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
E = 3
for (H, I), kwargs in %r:
    ex = _engine(E, H, I, H + I, **kwargs)
    lay = ExpertLayout.of(ex)
    w_gu = torch.full((E, 2 * I, H), float("nan"), dtype=dtype, device=dev)
    w_d = torch.full((E, H, I), float("nan"), dtype=dtype, device=dev)
    packed_triton.unpack_into(lay, [r.to(dev) for r in expert_ranges(ex)], w_gu, w_d)
    for e in range(E):
        g, u, d = ex.dequantized(e)
        if not (torch.equal(w_gu[e].cpu(), torch.cat([g, u]).to(dtype)) and torch.equal(w_d[e].cpu(), d.to(dtype))):
            sys.exit(f"{H}x{I} {kwargs}, expert {e}: the kernel's weights differ from the engine's")
print("ok")
"""


def test_the_triton_unpack_reads_every_two_level_byte():
    """The one-pass kernel against ``CPUExperts.dequantized`` itself on random k8 / k4 scale bytes (every sub-scale
    and sub-min, super scales and mins of either sign): Q2_K's k4 (int2 affine), k4 on int6 in groups of 32, Q2_K +
    Q3_K and Q4_K_M; K within one super-block, over two (the second partial) and over two whole ones (down's K ending
    16 into its second). Interpreter: bitwise fp32; GPU: bitwise the engine's values rounded to bf16."""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[3])
    layouts = [_kwargs(CASES[6]), _kwargs(CASES[9]), MIXED[2], MIXED[0]]
    runs = [(hi, kw) for hi in ((48, 80), (288, 40), (512, 272)) for kw in layouts]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", TWO_LEVEL_CHECK % (root, runs)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


class _Driver:
    """Stands in for LayerwisePrefill in ``setup``: reads every layer's packed layout as the real one does (which
    refused the bit-plane formats before they had a GPU reader)."""

    def __init__(self, layers, device, dtype, threshold, slots, unpack, group, rows):
        self.layouts = [ExpertLayout.of(layer.engine) for layer in layers]
        self.group, self.n_slots, self.slot_bytes, self.min_tokens = 8, slots, 1 << 20, threshold

    def enable_share(self, share, chunk):
        return None


@pytest.mark.parametrize("kwargs", [_kwargs(CASES[0]), MIXED[0], _kwargs(CASES[6]), MIXED[2]],
                         ids=["q6_k", "q4_k_m", "q2_k", "q2_k+q3_k"])
def test_setup_streams_plane_format_layers(monkeypatch, kwargs):
    """A plan with the GPU prefill on and layers of plane formats: the prefill is set up (the fallback that kept such
    layers on the CPU is gone), and their layouts are read."""
    monkeypatch.setattr(layerwise, "LayerwisePrefill", _Driver)
    engine = _engine(3, 64, 32, 1, **kwargs)
    layers = [SimpleNamespace(engine=engine, plain_swiglu=True) for _ in range(2)]
    plan = SimpleNamespace(gpu_prefill=True, device="cpu", dtype=torch.float32, prefill_chunk=512)
    said = []
    driver, report = setup(layers, plan, SimpleNamespace(gpu_prefill=64, gpu_prefill_cpu_share="off"), said.append)
    assert isinstance(driver, _Driver) and report["enabled"], (report, said)
    assert not any("off" in line.split(";")[0] for line in said), said
    fmts = {(lay.gate_up.fmt, lay.down.fmt) for lay in driver.layouts}
    want = kwargs["weight_format"]
    assert fmts == {want if isinstance(want, tuple) else (want, want)}


def test_setup_falls_back_where_a_reader_refuses_a_scale_dtype(monkeypatch):
    """A scale dtype one of the GPU readers does not read (here the Triton kernel made to lack k4) is refused by name,
    and the prefill stays on the CPU with that reason logged, not a KeyError at the first prefill."""
    from hetmoe.ops.triton import packed as packed_triton

    monkeypatch.setattr(layerwise, "LayerwisePrefill", _Driver)
    monkeypatch.setattr(packed_triton, "available", lambda: True)
    monkeypatch.setattr(packed_triton, "SCALE_CODE", {k: v for k, v in packed_triton.SCALE_CODE.items() if k != "k4"})
    engine = _engine(3, 64, 32, 1, **MIXED[2])
    layers = [SimpleNamespace(engine=engine, plain_swiglu=True) for _ in range(2)]
    plan = SimpleNamespace(gpu_prefill=True, device="cpu", dtype=torch.float32, prefill_chunk=512)
    said = []
    driver, report = setup(layers, plan, SimpleNamespace(gpu_prefill=64, gpu_prefill_cpu_share="off"), said.append)
    assert driver is None and not report["enabled"] and "k4" in report["why"], report
    assert len(said) == 1 and said[0].startswith("hetmoe: GPU prefill off: int2 experts with k4 scales"), said
    with pytest.raises(ValueError, match="int2 experts with k4 scales: the Triton unpack"):
        packed_triton.check_layout(ExpertLayout.of(engine))


@pytest.mark.parametrize("kwargs", E4M3 + ZP[:1], ids=["e4m3", "e4m3_div", "fp16_zp"])
def test_e4m3_and_zero_point_layers_take_the_triton_unpack(monkeypatch, kwargs):
    """NVFP4 layers with E4M3 scale bytes and layers with zero points: with Triton installed the prefill is set up
    and their layouts go to the one-pass kernel (not ``torch_only``, which only grid layers are)."""
    from hetmoe.ops.triton import packed as packed_triton

    monkeypatch.setattr(layerwise, "LayerwisePrefill", _Driver)
    monkeypatch.setattr(packed_triton, "available", lambda: True)
    engine = _engine(3, 64, 32, 1, **kwargs)
    packed_triton.check_layout(ExpertLayout.of(engine))
    layers = [SimpleNamespace(engine=engine, plain_swiglu=True) for _ in range(2)]
    plan = SimpleNamespace(gpu_prefill=True, device="cpu", dtype=torch.float32, prefill_chunk=512)
    said = []
    driver, report = setup(layers, plan, SimpleNamespace(gpu_prefill=64, gpu_prefill_cpu_share="off"), said.append)
    assert isinstance(driver, _Driver) and report["enabled"], (report, said)
    assert not any(lay.torch_only or lay.grid for lay in driver.layouts)


# (gate/up, down) as MatrixShape.make's (format, scaling, group, scale dtype, codebook): NVFP4's two factor dtypes,
# factor scales on an affine matrix (a min set with its own factor: the readers take it though no loader makes it),
# every zero-point dtype on int4 (and int8), and a layer mixing the two kinds
EDGE_LAYOUTS = [(("lut4", "symmetric", 16, "e4m3", "e2m1"),) * 2, (("lut4", "symmetric", 16, "e4m3_div", "e2m1"),) * 2,
                (("int4", "affine", 32, "e4m3", None), ("int8", "affine", 16, "e4m3_div", None)),
                (("int4", "affine", 32, "fp16_zp", None), ("int4", "affine", 16, "bf16_zp", None)),
                (("int4", "affine", 16, "fp32_zp", None), ("int8", "affine", 32, "fp32_zp", None)),
                (("lut4", "symmetric", 16, "e4m3", "e2m1"), ("int4", "affine", 32, "fp16_zp", None))]


def edge_layout(E: int, H: int, I: int, gate_up: tuple, down: tuple, seed: int) -> tuple:
    """(ExpertLayout, its four ranges of random bytes) for E experts of ``gate_up`` / ``down`` (EDGE_LAYOUTS' rows),
    the scale bytes chosen to reach every case of the widening: e4m3 / e4m3_div sets holding every byte 0x00..0xFF
    (the NaN codes 0x7F / 0xFF, subnormals and both zeros included) then random ones, one random fp32 factor per row
    block (never a power of two; one block's small or large enough to give fp32 subnormal scales); zero-point sets
    holding scales of the base dtype of either sign (fp16: subnormal ones; some zero) and every int8 z."""
    gen = torch.Generator().manual_seed(seed)
    def shape(m: tuple, n: int, k: int) -> MatrixShape:
        fmt, scaling, group, sdt, codebook = m
        return MatrixShape.make(fmt, n, k, group, scaling, sdt, codebook)

    lay = ExpertLayout(gate_up[0], E, H, I, shape(gate_up, I, H), shape(down, H, I))
    ranges = [torch.randint(0, 256, (E * b,), generator=gen, dtype=torch.uint8) for b in lay.range_bytes()]
    for shape, raw in ((lay.gate_up, ranges[1]), (lay.down, ranges[3])):
        blocks = raw.view(-1, shape.block_scale_bytes)
        n, subs = blocks.shape[0], shape.kp // shape.group * 16
        every = torch.randint(0, 256, (n * subs,), generator=gen, dtype=torch.uint8)
        every[:256] = torch.arange(256, dtype=torch.uint8)  # every byte: E4M3 codes, int8 zero points
        if shape.scale_dtype in FACTOR_SCALES:
            for lo in (0, shape.set_bytes) if shape.affine else (0,):
                blocks[:, lo:lo + subs] = every.view(n, subs)
                every = every[torch.randperm(every.numel(), generator=gen)]
                f = (1 + torch.rand(n, generator=gen) * 0.999 + 2.0**-20) * torch.exp2(
                    torch.randint(-12, 13, (n,), generator=gen).float())
                f[1] = 1.3 * (2.0**118 if shape.scale_dtype == "e4m3_div" else 2.0**-118)  # subnormal scales
                blocks[:, lo + subs:lo + subs + 4] = f.view(torch.uint8).view(n, 4)
        else:
            base = {"fp16": torch.float16, "bf16": torch.bfloat16,
                    "fp32": torch.float32}[ZERO_POINTS[shape.scale_dtype]]
            mag = torch.exp2(torch.randint(-20, 6, (n, subs), generator=gen).float())  # 2^-20: an fp16 subnormal
            sign = torch.randint(0, 2, (n, subs), generator=gen).float() * 2 - 1
            val = sign * mag * (1 + torch.rand(n, subs, generator=gen))
            val[:, ::7] = 0.0
            blocks[:, :shape.set_bytes] = val.to(base).view(torch.uint8).view(n, -1)
            blocks[:, shape.set_bytes:] = every.view(n, subs)
    return lay, ranges


EDGE_CHECK = """
import sys, torch
sys.path.insert(0, %r)
from tests.moe.streamed.test_plane_unpack import edge_layout
from hetmoe.ops.triton import packed as packed_triton
from hetmoe.moe.streamed.packed import unpack_experts
cuda = torch.cuda.is_available()
dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
if not cuda:
    from tests.triton_interp import checked_accesses
else:
    import contextlib
    checked_accesses = contextlib.nullcontext
E = 3
for i, ((H, I), (gate_up, down)) in enumerate(%r):
    lay, ranges = edge_layout(E, H, I, gate_up, down, seed=i)
    assert not lay.torch_only
    ref_gu, ref_d = unpack_experts(lay, ranges, E, torch.float32)
    w_gu = torch.full((E, 2 * I, H), float("nan"), dtype=dtype, device=dev)
    w_d = torch.full((E, H, I), float("nan"), dtype=dtype, device=dev)
    with checked_accesses():
        packed_triton.unpack_into(lay, [r.to(dev) for r in ranges], w_gu, w_d)
    for got, ref, what in ((w_gu, ref_gu, "gate/up"), (w_d, ref_d, "down")):
        ref = ref.to(dtype)
        if not (torch.isfinite(ref).all() and torch.equal(got.cpu().view(torch.int16 if cuda else torch.int32),
                                                          ref.view(torch.int16 if cuda else torch.int32))):
            sys.exit(f"{H}x{I} {gate_up} / {down}: {what} differs from the PyTorch reader")
print("ok")
"""


def test_the_triton_unpack_reads_factor_scales_and_zero_points_as_the_torch_reader():
    """The one-pass kernel against the PyTorch reader (``unpack_experts``) on random bytes of e4m3 / e4m3_div and
    fp32_zp / fp16_zp / bf16_zp layouts (``edge_layout``: every E4M3 code and every int8 zero point, subnormal scales,
    factors that are not powers of two, one per row block), every load and store inside its tensor under the
    interpreter (``checked_accesses``). Interpreter: bitwise fp32; GPU: bitwise the reader's values rounded to bf16.
    K = 48 (padded to 64 in groups of 32), 288 and 40 (padded)."""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parents[3])
    runs = [(hi, lay) for hi in ((48, 40), (288, 80)) for lay in EDGE_LAYOUTS]
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", EDGE_CHECK % (root, runs)], env=env, cwd=root, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_torch_reader_refuses_what_it_cannot_read():
    """Unknown scale dtypes, symmetric k4 and a k4 min set read as a scale set: a ValueError naming them."""
    with pytest.raises(ValueError, match="'k5' scales"):
        MatrixShape.make("int2", 32, 256, 16, "affine", "k5")
    with pytest.raises(ValueError, match="k4 scales must be affine"):
        MatrixShape.make("int2", 32, 256, 16, "symmetric", "k4")
    shape = MatrixShape.make("int2", 32, 256, 16, "affine", "k4")
    assert (shape.set_bytes, shape.min_set_bytes, shape.block_scale_bytes) == (16 * 16 + 32, 32, 16 * 16 + 64)
    with pytest.raises(ValueError, match="widen_sets reads it"):
        widen_set(torch.zeros(2, shape.min_set_bytes, dtype=torch.uint8), shape)
