"""GPU-resident copies of CPU experts in the bit-plane formats (int6, int5, int3, int2: GGUF's Q6_K, Q5_K, Q3_K,
Q2_K) and affine K-quants (Q4_K): ``storage auto`` widens the codes exactly (int6 / int5 -> int8, int3 / int2 ->
int4, same group, scales and mins widened to fp32, k8's and Q2_K's k4 two levels included;
hetmoe/moe/gpu_resident/format.py), so the resident values are the CPU engine's bitwise (``CPUExperts.dequantized``),
and every path (dense, grouped, the routed kernels) computes with them: against the float64 reference on those values
(tests/reference.py), bound FP32_BOUND (summation order only).

Paths: torch (dense, grouped) on the CPU; the routed kernels and the prefill unpack in Triton's interpreter (slow
tier, HETMOE_TEST_ALL=1) with its tiles and the GPU's; the GPU (marked gpu): bf16 and fp32 activations.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interp import triton_module

from cases import generator, make_routing
from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.moe.gpu_resident import format as rf
from hetmoe.moe.gpu_resident.experts import GpuExperts
from reference import moe_reference, rel_err

E, H, I = 6, 64, 48
RESIDENT = [4, 1, 3]
FP32_BOUND = 1e-5
BF16_X = 1.5e-2
ENGINES = {  # name: (CPUExperts keyword arguments, the resident (gate/up, down) formats and affinity)
    "q4_k_m": (dict(weight_format=("int4", "int6"), group_size=32, down_group_size=16,
                    scaling=("affine", "symmetric"), scale_dtype=("k8", "k8")), ("int4", "int8", True, False)),
    "q5_k": (dict(weight_format="int5", group_size=32, scaling="affine", scale_dtype="k8"),
             ("int8", "int8", True, True)),
    "q3_k/q2_k": (dict(weight_format=("int3", "int2"), group_size=16, scaling=("symmetric", "affine"),
                       scale_dtype=("k8", "k8")), ("int4", "int4", False, True)),
    "q2_k": (dict(weight_format="int2", group_size=16, scaling="affine", scale_dtype="k4"),
             ("int4", "int4", True, True)),
    "q2_k/q3_k": (dict(weight_format=("int2", "int3"), group_size=16, scaling=("affine", "symmetric"),
                       scale_dtype=("k4", "k8")), ("int4", "int4", True, False)),
    "int6-fp32/int3-fp16": (dict(weight_format=("int6", "int3"), group_size=32, scaling=("affine", "symmetric"),
                                 scale_dtype=("fp32", "fp16")), ("int8", "int4", True, False)),
}


def _engine(name: str) -> CPUExperts:
    ex = CPUExperts(E, H, I, pool=WorkerPool(1), **ENGINES[name][0])
    ex.fill_random(seed=7, std=0.3)
    return ex


def _values(g: GpuExperts) -> tuple:
    """[E, I, H] x 2, [E, H, I] fp32: the resident experts' stored values, zeros elsewhere."""
    st, n = g.storage, g.n
    gu = rf.dequantize(g.w_gate_up.cpu(), g.s_gate_up.cpu(), st.gate_up, st.group, H, mins=g.m_gate_up
                       if g.m_gate_up is None else g.m_gate_up.cpu()).view(n, 2, I, H)
    d = rf.dequantize(g.w_down.cpu(), g.s_down.cpu(), st.down, st.down_group, I,
                      mins=g.m_down if g.m_down is None else g.m_down.cpu()).view(n, H, I)
    out = (torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    out[0][g.expert_ids], out[1][g.expert_ids], out[2][g.expert_ids] = gu[:, 0], gu[:, 1], d
    return out


def _reference(g, x, ids, wts):
    mask = torch.ones(E, dtype=torch.bool)
    mask[g.expert_ids] = False
    return moe_reference(x.cpu().float(), *_values(g), ids.cpu(), wts.cpu(), skip_mask=mask)


def _case(T, k, *params):
    x = torch.randn(T, H, generator=generator("plane x", T, k, *params))
    ids, wts = make_routing(T, k, E, "plane", *params)
    if not any(e in RESIDENT for e in ids[0].tolist()):
        ids[0, 0] = RESIDENT[0]
    return x, ids, wts


@pytest.mark.parametrize("name", ENGINES)
def test_resident_copy_is_the_engines_values(name):
    """storage auto: the widened codes, the engine's group, its scales and mins -- bitwise the engine's values (the
    Q4_K half of a Q4_K_M expert too); the dense and grouped paths on them."""
    ex = _engine(name)
    gu_fmt, d_fmt, gu_affine, d_affine = ENGINES[name][1]
    st = rf.cpu_storage(ex)
    assert (st.gate_up, st.down, st.gate_up_affine, st.down_affine) == (gu_fmt, d_fmt, gu_affine, d_affine)
    assert (st.group, st.down_group) == (ex.info()["group_size"], ex.info()["down_group_size"])
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", decode="dense")
    assert g.storage == st and (g.m_gate_up is not None) == gu_affine and (g.m_down is not None) == d_affine
    assert g.nbytes == len(RESIDENT) * rf.expert_bytes(st, H, I)
    gate, up, down = _values(g)
    for e in RESIDENT:
        cg, cu, cd = ex.dequantized(e)
        assert torch.equal(gate[e], cg) and torch.equal(up[e], cu) and torch.equal(down[e], cd), (name, e)
    for T, k in ((3, 2), (40, 4)):  # dense (T <= 32), grouped (T > 32)
        x, ids, wts = _case(T, k, name)
        ref = _reference(g, x, ids, wts)
        assert ref.abs().max() > 0 and rel_err(g(x, ids, wts), ref) < FP32_BOUND


def _scramble_two_level(ex: CPUExperts, seed: int) -> None:
    """Random bytes in place of ``ex``'s k8 / k4 scale and min sets (``fill_random`` gives every group the same
    scale): every sub-scale / sub-min bit pattern, then finite fp16 super scales and mins of either sign."""
    from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges

    gen = torch.Generator().manual_seed(seed)
    lay, ranges = ExpertLayout.of(ex), expert_ranges(ex)
    for shape, sets in ((lay.gate_up, ranges[1]), (lay.down, ranges[3])):
        blocks = sets.view(-1, shape.block_scale_bytes)
        blocks.copy_(torch.randint(0, 256, blocks.shape, generator=gen, dtype=torch.uint8))
        subs = shape.kp // shape.group * 16
        runs = [(subs, shape.set_bytes)] + ([(shape.set_bytes + (0 if shape.scale_dtype == "k4" else subs),
                                              shape.block_scale_bytes)] if shape.affine else [])
        for lo, hi in runs:  # the fp16 super scales (and mins)
            val = (torch.rand(blocks.shape[0], (hi - lo) // 2, generator=gen) * 2e-2 - 1e-2).half()
            blocks[:, lo:hi] = val.view(torch.uint8).view(blocks.shape[0], hi - lo)


@pytest.mark.parametrize("name", ["q2_k", "q2_k/q3_k", "q3_k/q2_k", "q4_k_m"])
@pytest.mark.parametrize("h,i", [(288, 40), (512, 272)])
def test_resident_two_level_over_super_blocks(name, h, i):
    """k4 (Q2_K) and k8 with random scale bytes over two super-blocks (h = 288: the second partial; 512: two whole
    ones, down's K ending 16 into its second; i = 40: down's K padded to its group): the resident storage holds
    bitwise the engine's values."""
    ex = CPUExperts(E, h, i, pool=WorkerPool(1), **ENGINES[name][0])
    ex.fill_random(seed=h + i)
    _scramble_two_level(ex, h + i)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", decode="dense")
    st, n = g.storage, len(RESIDENT)
    assert (g.m_gate_up is not None, g.m_down is not None) == ENGINES[name][1][2:]
    gu = rf.dequantize(g.w_gate_up, g.s_gate_up, st.gate_up, st.group, h, mins=g.m_gate_up).view(n, 2 * i, h)
    d = rf.dequantize(g.w_down, g.s_down, st.down, st.down_group, i, mins=g.m_down).view(n, h, i)
    for j, e in enumerate(RESIDENT):
        cg, cu, cd = ex.dequantized(e)
        assert cg.unique().numel() > 100  # the scrambled scales reach the values
        assert torch.equal(gu[j], torch.cat([cg, cu])) and torch.equal(d[j], cd), (name, e)


@pytest.mark.parametrize("sdt", ["fp16_zp", "bf16_zp", "fp32_zp"])
def test_resident_zero_points_are_the_engines_values(sdt):
    """int4 affine with zero points (GPTQ / AWQ / compressed-tensors at their file's bytes: scales of the base dtype,
    one int8 zero point per min) and random scale and zero-point bytes: storage auto holds int4 affine with fp32
    scales and mins, bitwise the engine's values (min = fl(scale * z), widened by the PyTorch reader); the dense and
    grouped paths on them."""
    from hetmoe.cpu.layout import SCALE_WIDTH, ZERO_POINTS
    from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges

    ex = CPUExperts(E, H, I, "int4", 32, pool=WorkerPool(1), scaling="affine", scale_dtype=sdt)
    ex.fill_random(seed=3, std=0.3)
    gen = torch.Generator().manual_seed(len(sdt))
    base = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[ZERO_POINTS[sdt]]
    lay, ranges = ExpertLayout.of(ex), expert_ranges(ex)
    for shape, sets in ((lay.gate_up, ranges[1]), (lay.down, ranges[3])):
        blocks = sets.view(-1, shape.block_scale_bytes)
        n = shape.set_bytes // SCALE_WIDTH[sdt]
        val = (torch.rand(blocks.shape[0], n, generator=gen) * 2e-2 - 1e-2).to(base)
        blocks[:, :shape.set_bytes] = val.view(torch.uint8).view(blocks.shape[0], -1)
        blocks[:, shape.set_bytes:] = torch.randint(0, 256, (blocks.shape[0], shape.min_set_bytes), generator=gen,
                                                    dtype=torch.uint8)
    st = rf.cpu_storage(ex)
    assert (st.gate_up, st.down, st.gate_up_affine, st.down_affine) == ("int4", "int4", True, True)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", decode="dense")
    gate, up, down = _values(g)
    for e in RESIDENT:
        cg, cu, cd = ex.dequantized(e)
        assert cg.unique().numel() > 100  # the scrambled bytes reach the values
        assert torch.equal(gate[e], cg) and torch.equal(up[e], cu) and torch.equal(down[e], cd), (sdt, e)
    for T, k in ((3, 2), (40, 4)):  # dense (T <= 32), grouped (T > 32)
        x, ids, wts = _case(T, k, sdt)
        ref = _reference(g, x, ids, wts)
        assert ref.abs().max() > 0 and rel_err(g(x, ids, wts), ref) < FP32_BOUND


def test_affine_storage_is_only_copied():
    with pytest.raises(ValueError, match="cannot be affine"):
        rf.Storage("lut4", "lut4", 32, 32, "e2m1", "e2m1", True, False)
    with pytest.raises(ValueError, match="only holds a CPU engine's codes"):
        w = torch.randn(2, I, H)
        GpuExperts([0, 1], w, w, torch.randn(2, H, I), E, storage=rf.Storage("int4", "int4", 32, 32, None, None,
                                                                            True, False))
    assert rf.matrix_bytes("int4", 4, 64, 32, affine=True) == rf.matrix_bytes("int4", 4, 64, 32) + 4 * 2 * 4
    assert rf.planned_storage("auto", "int6", 16) == rf.Storage.of("int8", 16)
    assert rf.planned_storage("auto", "int2", 16) == rf.Storage.of("int4", 16)


@pytest.mark.parametrize("name", ENGINES)
def test_prefill_unpack_in_the_interpreter(name):
    """The resident prefill's unpack_rows on the widened / affine copies: bitwise their values (fp32)."""
    kernels = triton_module("hetmoe.ops.triton.experts", on_cpu=True)
    g = GpuExperts.from_cpu(_engine(name), RESIDENT, torch.float32, "cpu", "auto", decode="dense")
    n = len(RESIDENT)
    w_gu, w_d = torch.full((n, 2 * I, H), float("nan")), torch.full((n, H, I), float("nan"))
    used = torch.ones(n, dtype=torch.uint8)
    kernels.unpack_rows(g.w_gate_up, g.s_gate_up, g.storage.gate_up, g.storage.group, w_gu.view(-1, H), used, 2 * I,
                        mins=g.m_gate_up)
    kernels.unpack_rows(g.w_down, g.s_down, g.storage.down, g.storage.down_group, w_d.view(-1, I), used, H,
                        mins=g.m_down)
    gate, up, down = _values(g)
    assert torch.equal(w_gu, torch.cat([gate[RESIDENT], up[RESIDENT]], dim=1)) and torch.equal(w_d, down[RESIDENT])


@pytest.mark.parametrize("name", ENGINES)
def test_routed_kernels_in_the_interpreter(name):
    """The routed decode kernels' tensor-core tiles (dots; fp32 here) on the widened / affine copies. (The GEMV
    tiles' scalar masks are refused by Triton 3.9's interpreter, for every resident format: the GPU test runs them.)"""
    kernels = triton_module("hetmoe.ops.triton.experts", on_cpu=True)
    g = GpuExperts.from_cpu(_engine(name), RESIDENT, torch.float32, "cpu", "auto", decode="routed")
    for T, k in ((3, 2), (7, 4)):
        x, ids, wts = _case(T, k, "routed", name)
        ref = _reference(g, x, ids, wts)
        launch = dataclasses.replace(kernels.plan(T, on_gpu=True), gemv=False, defer=False)
        out = kernels.routed_int(x, ids, wts, g._stored(g.w_gate_up, g.s_gate_up, g.m_gate_up),
                                 g._stored(g.w_down, g.s_down, g.m_down), g.storage, g.slot_of, None, E, I,
                                 launch=launch)
        assert rel_err(out, ref) < FP32_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("T,k", [(1, 4), (3, 2), (40, 4)])
def test_cuda_resident_plane_experts(name, T, k):
    """The GPU's kernels (routed decode, the prefill's unpack and grouped GEMMs) on the resident copies, bf16 and
    fp32 activations; the unpacked weights bitwise the engine's values rounded to bf16."""
    pytest.importorskip("triton")
    ex = _engine(name)
    x, ids, wts = (t.cuda() for t in _case(T, k, "cuda", name))
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.bfloat16, "cuda", "auto")
    assert g.decode == "routed" and g.eager_routed
    xb = x.bfloat16()
    ref = _reference(g, xb.float(), ids, wts)
    err = rel_err(g(xb, ids, wts).cpu(), ref)
    print(f"{name} T={T} k={k}: resident vs float64 {err:.2e}")
    assert err < BF16_X
    g32 = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cuda", "auto")
    assert rel_err(g32(x, ids, wts).cpu(), _reference(g32, x, ids, wts)) < FP32_BOUND
    n = len(RESIDENT)
    w_gu = torch.empty(n, 2 * I, H, dtype=torch.bfloat16, device="cuda")
    w_d = torch.empty(n, H, I, dtype=torch.bfloat16, device="cuda")
    g.unpack_into(w_gu, w_d)
    gate, up, down = _values(g)
    assert torch.equal(w_gu.cpu(), torch.cat([gate[RESIDENT], up[RESIDENT]], dim=1).bfloat16())
    assert torch.equal(w_d.cpu(), down[RESIDENT].bfloat16())
