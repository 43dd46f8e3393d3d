"""Experts packed from codes quantized already (hetmoe/cpu/codes.py, csrc/formats/pack.cpp pack_row_block_codes):
the values the kernels multiply by are exactly code x scale — bitwise what the ``gguf`` package's own
dequantization of a Q8_0 / Q4_0 tensor gives — on one pool and split over two NUMA subpools; a MoE call over them
matches the float64 reference on those values with the engine's activation rounding; what the engine cannot hold
exactly is refused with the matrix named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.cpu.codes import load_codes
from reference import moe_reference_emulated, rel_err

E, H, I, G = 3, 64, 96, 32


def random_codes(fmt: str, gen: torch.Generator):
    """(codes, scales, the values they stand for) for gate, up, down."""
    lo, hi = (-127, 127) if fmt == "int8" else (-8, 7)
    codes, scales, values = [], [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        q = torch.randint(lo, hi + 1, (E, rows, cols), generator=gen, dtype=torch.int8)
        s = torch.rand(E, rows, cols // G, generator=gen) * 0.01 + 1e-4
        codes.append(q), scales.append(s)
        values.append(q.float() * s.repeat_interleave(G, dim=2))
    return codes, scales, values


@pytest.fixture(scope="module")
def two_subpools():
    return WorkerPool(2, numa=2)


@pytest.mark.parametrize("split", [False, True], ids=["one-pool", "numa2"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_packed_values_are_exactly_code_times_scale(fmt, split, two_subpools):
    gen = torch.Generator().manual_seed(1)
    codes, scales, values = random_codes(fmt, gen)
    experts = CPUExperts(E, H, I, fmt, G, pool=two_subpools if split else WorkerPool(1))
    load_codes(experts, codes, scales)
    for e in range(E):
        for got, want in zip(experts.dequantized(e), values):
            assert torch.equal(got, want[e])


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_moe_call_over_code_packed_experts_matches_the_reference(fmt):
    """The row-block kernels (AVX2 / AVX-512 / scalar, whichever this CPU runs): pinned there, because on an AMX CPU
    T = 5 tokens would reach the AMX GEMM, whose activation rounding this reference does not model (the K-quant
    tests in test_kquants.py cover code-packed experts on the AMX paths)."""
    gen = torch.Generator().manual_seed(2)
    codes, scales, _ = random_codes(fmt, gen)
    experts = CPUExperts(E, H, I, fmt, G, pool=WorkerPool(1), amx_min_tokens=10**6)
    load_codes(experts, codes, scales)
    T = 5
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, 2), generator=gen)
    w = torch.rand(T, 2, generator=gen)
    got = experts.forward(x, ids, w)
    dq = [experts.dequantized(e) for e in range(E)]
    info = experts.info()
    ref = moe_reference_emulated(x, *zip(*dq), ids, w, info["activation"], info["group_size"])
    assert rel_err(got, ref) < 1e-5  # the same values and roundings; fp32 summation order only


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_blocks_load_bitwise(qtype):
    """Blocks of 32 quantized by the gguf package, split into codes, scales (and Q4_1 / Q5_1's mins, -m) by the
    loader's decoder (hetmoe/load/gguf/checkpoint.py) and held in their exact layout (hetmoe/cpu/codes.py: fp16 scales,
    and mins): the engine's values equal gguf.quants.dequantize bit for bit, at the file's bytes for Q8_0, Q4_0 and
    Q4_1."""
    gguf = pytest.importorskip("gguf")
    from hetmoe.cpu.codes import exact_layout
    from hetmoe.load.gguf.checkpoint import block_codes

    qt = getattr(gguf.GGMLQuantizationType, qtype)
    gen = torch.Generator().manual_seed(3)
    experts = CPUExperts(E, H, I, pool=WorkerPool(1), **exact_layout(qtype, qtype))
    codes, scales, mins, refs = [], [], [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        w = torch.randn(E, rows, cols, generator=gen).numpy()
        raw = gguf.quants.quantize(w, qt)
        refs.append(torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qt))))
        q, d, m = block_codes(raw, qtype, (E, rows, cols))
        assert (m is None) == (qtype in ("Q8_0", "Q4_0", "Q5_0"))
        codes.append(q), scales.append(d), mins.append(m)
    load_codes(experts, codes, scales, mins=mins)
    for e in range(E):
        for got, want in zip(experts.dequantized(e), refs):
            assert torch.equal(got.view(torch.int32), want[e].view(torch.int32))
    file_bytes = gguf.GGML_QUANT_SIZES[qt][1] * (3 * I * H) // 32
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        assert experts.info()["bytes_per_expert"] == file_bytes


def test_what_the_engine_cannot_hold_exactly_is_refused():
    gen = torch.Generator().manual_seed(4)
    codes, scales, _ = random_codes("int4", gen)
    experts = CPUExperts(E, H, I, "int4", G, pool=WorkerPool(1))
    bad = codes[1].clone()
    bad[0, 0, 0] = 8
    with pytest.raises(ValueError, match=r"up has codes in \[-8, 8\]; int4 holds \[-8, 7\]"):
        load_codes(experts, [codes[0], bad, codes[2]], scales)
    nan = scales[2].clone()
    nan[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="down has scales that are NaN"):
        load_codes(experts, codes, [scales[0], scales[1], nan])
    with pytest.raises(ValueError, match=r"gate scales must be \[3, 96, 2\]"):
        load_codes(experts, codes, [scales[0][..., :1], scales[1], scales[2]])
    with pytest.raises(ValueError, match="gate codes must be int8"):
        load_codes(experts, [codes[0].int(), codes[1], codes[2]], scales)
    with pytest.raises(ValueError, match=r"grouped int8, int4, lut4, grid or bit-plane \(int6, int5, int3, int2\)"):
        load_codes(CPUExperts(E, H, I, "bf16", 0, pool=WorkerPool(1)), codes, scales)
    with pytest.raises(ValueError, match="do not fit"):
        load_codes(experts, codes, scales, first_expert=1)
    assert experts.info()["experts_loaded"] == 0  # nothing of a refused call
