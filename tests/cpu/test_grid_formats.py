"""The grid format (csrc/formats/layout.h): GGUF's i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M held
at their file's bytes and decoded in the kernels, on every path this machine runs:

    scalar, avx2, avx512   the row-block kernels (each level the CPU can run; HETMOE_MAX_ISA caps them)
    amx-emulated           the AMX GEMM's loops in plain C++ (every expert on it: amx_min_tokens=1)
    amx                    the tile unit, where there is one

Blocks are random (hetmoe/load/gguf/random_file.py: random grid indices, signs and sub-scales, an fp16 d around a
weight std of 0.02). Each type is checked three ways: the packed weights dequantize bitwise to gguf.quants.dequantize
of the same blocks; every path gives bitwise the same outputs (the same int8 codes and fp32 scales from the one
decoder, exact int32 sums, one epilogue; int8 activations on both classes); and the outputs match the float64 MoE on
the dequantized weights with the engine's int8 activation rounding (EMULATED_TOL, the bound of
tests/cpu/test_kernels.py) and, without it, the fp32 MoE within FP32_TOL (the activations' int8 rounding alone).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from cases import make_routing, make_x
from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import EXACT_TYPES, GRID_TYPES, load_codes
from hetmoe.cpu.layout import GRIDS, packed_matrix_bytes
from hetmoe.load.gguf.checkpoint import grid_blocks
from hetmoe.load.gguf.random_file import random_tensor
from reference import _moe, fake_quantize, moe_reference, moe_reference_emulated, rel_err

ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
AMX_PATHS = ["amx-emulated"] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
PATHS = ROW_ISAS + AMX_PATHS
EMULATED_TOL = 1e-3
# ||out - ref|| / ||ref|| against the fp32 MoE on the dequantized weights: the int8 rounding of x and h only. MEASURED
# 0.0092 .. 0.0122 over these types, shapes and T, + ~50 %
FP32_TOL = 0.018
E, H, I = 5, 512, 256
TS = (1, 2, 3, 7, 64, 300)


def gguf_type(kind: str):
    import gguf

    return gguf.GGMLQuantizationType[kind]


@functools.lru_cache(maxsize=None)
def blocks(kind: str, shape=(E, H, I)) -> tuple:
    """Random blocks of ``kind`` for gate, up [E, I, H] and down [E, H, I], as the file holds them (uint8)."""
    e, h, i = shape
    rng = np.random.default_rng(GRID_TYPES.index(kind) if kind in GRID_TYPES else 99)
    return tuple(random_tensor(kind, s, rng) for s in ((e, i, h), (e, i, h), (e, h, i)))


def engine(gate_up: str, down: str, path: str, shape=(E, H, I), pool=None) -> CPUExperts:
    """Experts holding gate/up of GGML type ``gate_up`` and down of ``down`` (grid types, or any exact type) from
    their random blocks, on ``path``."""
    from hetmoe.cpu.codes import exact_layout
    from hetmoe.load.gguf.checkpoint import block_codes
    from hetmoe.load.gguf.kquants import KQUANTS, kquant_codes

    layout = exact_layout(gate_up, down)
    kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
    ex = CPUExperts(*shape, pool=pool or WorkerPool(1), **layout, **kw)
    codes, scales, mins = [], [], []
    raws = blocks(gate_up, shape)[:2] + blocks(down, shape)[2:]
    for m, (kind, raw) in enumerate(zip((gate_up, gate_up, down), raws)):
        rows_cols = raw.shape[:-1] + ((shape[1], shape[2])[m == 2],)
        if kind in GRID_TYPES:
            q, s, mn = grid_blocks(raw, kind, rows_cols), None, None
        elif kind in KQUANTS:
            q, s, mn = kquant_codes(raw, kind, rows_cols)
        else:
            q, s, mn = block_codes(raw, kind, rows_cols)
        codes.append(q)
        scales.append(s)
        mins.append(mn)
    load_codes(ex, codes, scales, mins=mins)
    return ex


@pytest.mark.parametrize("kind", GRID_TYPES)
def test_packed_weights_are_gguf_dequantization(kind):
    """scale * q of every weight, bitwise gguf.quants.dequantize of the file's blocks, on every path's engine."""
    import gguf

    raws = blocks(kind)
    for path in PATHS:
        ex = engine(kind, kind, path)
        assert ex.info()["weight_format"] == "grid" and ex.info()["kernel"].startswith("grid/")
        for e in range(E):
            for m, got in enumerate(ex.dequantized(e)):
                want = gguf.quants.dequantize(raws[m][e].reshape(-1), gguf_type(kind)).reshape(got.shape)
                assert np.array_equal(got.numpy().view(np.int32), want.astype(np.float32).view(np.int32)), \
                    (kind, path, e, m)


@pytest.mark.parametrize("kind", GRID_TYPES)
def test_every_path_gives_the_same_bits_and_matches_the_references(kind):
    engines = {p: engine(kind, kind, p) for p in PATHS}
    base = engines[ROW_ISAS[0]]
    dq = list(zip(*(base.dequantized(e) for e in range(E))))
    group = EXACT_TYPES[kind][2]
    for T in TS:
        k = 2 if T < 64 else 4
        x = make_x(T, H, kind)
        ids, w = make_routing(T, k, E, kind, n_cold=1)
        want = base(x, ids, w)
        for p, ex in engines.items():
            out = ex(x, ids, w)
            assert torch.equal(out, want), f"{kind} {p} T={T}: differs from {ROW_ISAS[0]}"
        act = base.info()["activation"]
        assert act == "int8"
        emu = moe_reference_emulated(x, *dq, ids, w, act, group)
        assert rel_err(want, emu) <= EMULATED_TOL, f"{kind} T={T}: {rel_err(want, emu):.3g} vs the emulated reference"
        ref = moe_reference(x, torch.stack(dq[0]), torch.stack(dq[1]), torch.stack(dq[2]), ids, w)
        assert rel_err(want, ref) <= FP32_TOL, f"{kind} T={T}: {rel_err(want, ref):.3g} vs the fp32 reference"


@pytest.mark.parametrize("kind", GRID_TYPES)
def test_a_token_gets_the_same_bits_with_any_number_of_tokens(kind):
    """An expert's tokens take the row kernels' paths by their count (AVX2: 1-3 tokens decode each row into
    registers, in tiles of 1, 2 and 3; more decode each super-block into lines shared by up to 6 tokens): every
    count gives each token the bits it gets alone, on every row path, and the scalar kernel's. K of several
    super-blocks (H 768: 3, I 512: 2); expert 1 gets no token."""
    shape = (3, 768, 512)
    engines = {p: engine(kind, kind, p, shape) for p in ROW_ISAS}
    x = make_x(13, shape[1], kind, "counts")
    _, w = make_routing(13, 2, shape[0], kind, "counts", n_cold=1, p_skip=0.0)
    ids = torch.tensor([[0, 2]] * 13)
    alone = {p: torch.cat([ex(x[t:t + 1], ids[t:t + 1], w[t:t + 1]) for t in range(13)]) for p, ex in engines.items()}
    for p, ex in engines.items():
        assert torch.equal(alone[p], alone[ROW_ISAS[0]]), f"{kind} {p}: one token differs from {ROW_ISAS[0]}"
        for n in (2, 3, 4, 5, 6, 7, 8, 13):
            out = ex(x[:n], ids[:n], w[:n])
            assert torch.equal(out, alone[p][:n]), f"{kind} {p}: {n} tokens per expert differ from one at a time"


@pytest.mark.parametrize("gate_up,down", [("IQ2_XXS", "IQ3_XXS"), ("IQ2_XS", "IQ3_S"), ("IQ1_M", "IQ2_XXS"),
                                          ("IQ2_XXS", "Q4_K"), ("Q4_K", "IQ3_XXS"), ("IQ3_XXS", "Q6_K")])
def test_mixed_layers(gate_up, down):
    """A layer whose gate/up and down differ (the files' mixes: IQ2_XXS beside IQ3_XXS, an i-quant beside a
    K-quant, groups of 32 beside 16): the paths of one class the same bits (Q6_K's int6 reads int16 activations on the
    row blocks, int8 on AMX), each against the float64 reference with its own activation rounding and groups."""
    engines = {p: engine(gate_up, down, p) for p in PATHS}
    dq = list(zip(*(engines[ROW_ISAS[0]].dequantized(e) for e in range(E))))
    qmax = {"int8": 127, "int16": 32767}
    for T in (1, 7, 64):
        x = make_x(T, H, gate_up, down)
        ids, w = make_routing(T, 2, E, gate_up, down, n_cold=1)
        for paths in (ROW_ISAS, AMX_PATHS):
            info = engines[paths[0]].info()
            want = engines[paths[0]](x, ids, w)
            for p in paths:
                assert torch.equal(engines[p](x, ids, w), want), f"{gate_up}/{down} {p} T={T}"
            amx = paths is AMX_PATHS
            acts = (info["amx_activation"],) * 2 if amx else (info["activation"], info["down_activation"])
            qx = lambda v: fake_quantize(v, info["group_size"], qmax[acts[0]]).double()  # noqa: E731
            qh = lambda v: fake_quantize(v, info["down_group_size"], qmax[acts[1]]).double()  # noqa: E731
            emu = _moe(x.double(), lambda e: tuple(m[e].double() for m in dq), E, ids, w, None, qx, qh)
            assert rel_err(want, emu) <= EMULATED_TOL, f"{gate_up}/{down} {paths[0]} T={T}: {rel_err(want, emu):.3g}"


@pytest.mark.parametrize("kind", GRID_TYPES)
def test_held_bytes_are_the_files(kind):
    """A grid matrix is its blocks' bytes, the d apart: exactly the file's bytes per 256 values (rows in whole row
    blocks), and the engine allocates what hetmoe/cpu/layout.py counts."""
    import gguf

    per, nbytes = gguf.GGML_QUANT_SIZES[gguf_type(kind)]
    book = EXACT_TYPES[kind][4]
    assert GRIDS[book][2] == nbytes and per == 256
    ex = CPUExperts(E, H, I, "grid", EXACT_TYPES[kind][2], pool=WorkerPool(1), scale_dtype="fp16", codebook=book)
    file_bytes = (2 * I * H + H * I) // per * nbytes
    assert ex.info()["bytes_per_expert"] == file_bytes == ex.nbytes // E
    assert packed_matrix_bytes("grid", I, H, 0, codebook=book) == I * H // per * nbytes
    assert packed_matrix_bytes("grid", 20, 256, 0, codebook=book) == 32 * nbytes  # rows padded to a row block


def test_numa_split_is_the_unsplit_engine():
    """Two subpools cut I at a multiple of 256 (whole blocks of down's rows): the same packed values, the same outputs
    up to the fp32 order of the partial sums."""
    shape = (4, 256, 512)
    for gate_up, down in (("IQ2_XXS", "IQ3_XXS"), ("IQ2_XXS", "Q4_K")):
        one = engine(gate_up, down, ROW_ISAS[-1], shape)
        two = engine(gate_up, down, ROW_ISAS[-1], shape, pool=WorkerPool(2, numa=2))
        for e in range(shape[0]):
            assert all(torch.equal(a, b) for a, b in zip(one.dequantized(e), two.dequantized(e)))
        x = make_x(5, shape[1], "numa")
        ids, w = make_routing(5, 2, shape[0], "numa", n_cold=1)
        assert rel_err(two(x, ids, w), one(x, ids, w)) <= 1e-6


def test_bad_blocks_are_refused_by_name():
    raw = blocks("IQ2_XXS")[0]
    with pytest.raises(ValueError, match="IQ2_XXS .* needs .* bytes, got .* truncated"):
        grid_blocks(raw.reshape(-1)[:-10], "IQ2_XXS", (E, I, H))
    with pytest.raises(ValueError, match="not whole blocks of 256"):
        grid_blocks(raw, "IQ2_XXS", (E, I, H - 8))
    bad = [torch.from_numpy(r.copy()) for r in blocks("IQ3_XXS")]
    bad[2][1, 3, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # down of expert 1: a d of +Inf
    ex = CPUExperts(E, H, I, "grid", 32, pool=WorkerPool(1), scale_dtype="fp16", codebook="iq3_xxs")
    with pytest.raises(ValueError, match="down of expert 1 .*d that is not finite"):
        load_codes(ex, bad, [None] * 3)
    with pytest.raises(ValueError, match=r"up \(iq3_xxs blocks\) must be uint8"):
        load_codes(ex, [bad[0], bad[1][:, :, :-98], bad[2]], [None] * 3)
    with pytest.raises(ValueError, match="floats are not quantized into them"):
        ex.load(torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    with pytest.raises(ValueError, match="groups of 32, got 16"):
        CPUExperts(E, H, I, "grid", 16, pool=WorkerPool(1), scale_dtype="fp16", codebook="iq2_xxs")
    with pytest.raises(ValueError, match="grid type"):
        CPUExperts(E, H, I, "grid", 32, pool=WorkerPool(1), scale_dtype="fp16", codebook="iq4nl")


def test_the_gpu_paths_take_grid_layers():
    """The streamed prefill reads grid blocks (hetmoe/moe/streamed/grid.py decodes them on the GPU), and GPU-resident
    experts take int8 in the type's group, the engine's own codes and scales (cpu_codes decodes the blocks);
    tests/moe/streamed/test_grid_unpack.py checks their values."""
    from types import SimpleNamespace

    from hetmoe.moe.gpu_resident import format as rf
    from hetmoe.moe.streamed.choice import unreadable

    ex = engine("IQ2_XS", "IQ3_XXS", ROW_ISAS[0])
    assert unreadable([SimpleNamespace(engine=ex)]) is None
    st = rf.cpu_storage(ex)
    assert (st.gate_up, st.down, st.group, st.down_group) == ("int8", "int8", 16, 32)
    assert st.gate_up_codebook is None and st.down_codebook is None
    gate_up, down = rf.cpu_codes(ex, 0, st)
    assert gate_up is not None and down is not None
    layout = {"weight_format": "grid", "group_size": 16, "down_group_size": 32, "codebook": ("iq2_xs", "iq3_xxs")}
    assert rf.planned_storage("auto", "int4", 16, layout) == st
