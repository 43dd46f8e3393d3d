"""NVFP4's scales at their file's bytes: lut4 e2m1 group 16 with scale dtype e4m3 (one E4M3 byte per group, one fp32
per-tensor factor f per matrix, scale = fl(e4m3 * f) / 2: ModelOpt's product) or e4m3_div (fl(e4m3 / f) / 2:
compressed-tensors' quotient); GGUF's NVFP4 is e4m3 with f = 1 (csrc/formats/layout.h). On every path this machine
runs:

    scalar, avx2, avx512   the row-block kernels (each level the ISA can run; HETMOE_MAX_ISA caps them)
    amx-emulated           the AMX GEMM's loops in plain C++ (every expert on it: amx_min_tokens=1)
    amx                    the tile unit, where there is one

The kernels widen a byte to the very fp32 scale the NVFP4 references compute, so the same codes loaded with the
references' scales as fp32 give the same output bits on every path (bitwise), and every path gives the bits of the
first row-block path; the outputs are checked against the float64 MoE of the dequantized weights too (EMULATED_TOL,
the bound of test_code_formats.py) and the values against the naive fp32 dequantization, bitwise.
"""

from __future__ import annotations

import pytest
import torch

from hetmoe.cpu import CPUExperts, WorkerPool, cpu_info
from hetmoe.cpu.codes import load_codes
from hetmoe.cpu.layout import CODEBOOKS, layout_bytes
from reference import moe_reference, moe_reference_emulated, rel_err

ROW_ISAS = [isa for isa in cpu_info()["supported_isas"] if isa != "amx"]
AMX_PATHS = ["amx-emulated"] + (["amx"] if "amx" in cpu_info()["supported_isas"] else [])
PATHS = ROW_ISAS + AMX_PATHS
G = 16
EMULATED_TOL = 1e-3
# lut4 e2m1 g16 quantized here from gaussian weights (std 0.02) with e4m3 scales (factor 1, rounded up to a byte's
# scale): against the fp32 source, MEASURED max 0.236 over the shapes and T below (fp16 scales of the same case:
# test_code_formats.py's 0.183 measured: rounding a scale up to 4 significant bits leaves part of E2M1's range
# unused), + ~15 %
FP32_TOL = 0.27


def nvfp4_codes(shape, sdt, gen, factor_range=(-6, 6)):
    """(codes, fp32 scales, factors) of NVFP4 experts: random E2M1 indices, random E4M3 bytes (zeros, subnormals and
    the largest among them; never the NaN 0x7F), and per matrix an arbitrary positive fp32 factor; the scales as the
    references compute them: one fp32 product (e4m3) or quotient (e4m3_div), halved."""
    E, H, I = shape
    out = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        q = torch.randint(0, 16, (E, rows, cols), generator=gen, dtype=torch.int8)
        b = torch.randint(0, 0x7F, (E, rows, cols // G), generator=gen, dtype=torch.uint8)
        b[:, 0, 0], b[:, 0, -1] = 0, 0x7E
        b[:, -1, 0] = 3  # a subnormal: 3 * 2^-9
        e4m3 = b.view(torch.float8_e4m3fn).float()
        f = torch.rand(E, generator=gen) * torch.exp2(torch.randint(*factor_range, (E,), generator=gen).float()) + 1e-3
        f = f.float()
        full = e4m3 / f[:, None, None] if sdt == "e4m3_div" else e4m3 * f[:, None, None]
        out.append((q, full * 0.5, f))
    return tuple(zip(*out))


def values(codes, scales):
    """The naive fp32 dequantization: codebook value x scale, [E, rows, cols]."""
    book = torch.tensor(CODEBOOKS["e2m1"], dtype=torch.float32)
    return book[codes.long()] * scales.repeat_interleave(G, dim=-1)


@pytest.mark.parametrize("shape", [(5, 96, 160), (3, 48, 80), (4, 512, 256)], ids=["E5-H96-I160", "E3-H48-I80",
                                                                                    "E4-H512-I256"])
@pytest.mark.parametrize("sdt", ["e4m3", "e4m3_div"])
def test_e4m3_scales_give_the_bits_of_fp32_scales(sdt, shape):
    """The same NVFP4 codes loaded with e4m3 / e4m3_div scales (bytes and factors) and with the references' fp32
    scales: the same values (bitwise the naive dequantization), 9 bytes per 16 weights (+ 4 per row block) against
    fp32's 12, and on every path decode (T = 1) and prefill (T = 3, 37, 64) calls give the same output bits as the
    fp32 scales and as the first row-block path."""
    E, H, I = shape
    gen = torch.Generator().manual_seed(H + I + len(sdt))
    codes, scales, factors = nvfp4_codes(shape, sdt, gen)
    x = torch.randn(64, H, generator=gen)
    ids = torch.randint(0, E, (64, 2), generator=gen)
    ids[5, 1] = -1
    w = torch.rand(64, 2, generator=gen)
    want = [values(q, s) for q, s in zip(codes, scales)]
    first = {}
    for path in PATHS:
        kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
        pair = [CPUExperts(E, H, I, "lut4", G, pool=WorkerPool(1), scale_dtype=t, codebook="e2m1", **kw)
                for t in (sdt, "fp32")]
        load_codes(pair[0], codes, scales, factors=factors)
        load_codes(pair[1], codes, scales)
        narrow, f32 = pair
        layout = {"weight_format": "lut4", "group_size": G, "scale_dtype": sdt, "codebook": "e2m1"}
        assert narrow.nbytes == E * layout_bytes(layout, H, I)
        file_bytes = E * 3 * H * I * 9 // 16
        assert narrow.nbytes - file_bytes == E * 4 * (2 * -(-I // 16) + -(-H // 16))  # the row blocks' factors
        if path == PATHS[0]:
            for e in range(E):
                for got, ref in zip(narrow.dequantized(e), want):
                    assert torch.equal(got.view(torch.int32), ref[e].view(torch.int32))
        for T in (1, 3, 37, 64):
            a, b = narrow(x[:T], ids[:T], w[:T]), f32(x[:T], ids[:T], w[:T])
            assert torch.equal(a, b), f"{sdt} {path} T={T}: differs from fp32 scales"
            first.setdefault(T, a)
            if path not in AMX_PATHS or T > 1:
                assert torch.equal(a, first[T]), f"{sdt} {path} T={T}: differs from {PATHS[0]}"
            emu = moe_reference_emulated(x[:T], *want, ids[:T], w[:T], "int8", G)
            assert rel_err(a, emu) <= EMULATED_TOL, f"{sdt} {path} T={T}: {rel_err(a, emu):.3g}"


def test_gguf_nvfp4_scales_are_the_bytes_with_factor_one():
    """GGUF's NVFP4 scales, ue4m3(b) / 2 (hetmoe/load/gguf/lut4_blocks.py), load with no factors (f = 1) and are
    held exactly, every byte 0 .. 0x7E (0x7F reads as 0 there)."""
    from hetmoe.load.gguf.lut4_blocks import ue4m3_half

    E, H, I = 2, 64, 128
    gen = torch.Generator().manual_seed(3)
    ex = CPUExperts(E, H, I, "lut4", G, pool=WorkerPool(1), scale_dtype="e4m3", codebook="e2m1")
    codes, scales = [], []
    for rows, cols in ((I, H), (I, H), (H, I)):
        b = torch.arange(E * rows * cols // G).remainder(0x80).to(torch.uint8).reshape(E, rows, cols // G)
        codes.append(torch.randint(0, 16, (E, rows, cols), generator=gen, dtype=torch.int8))
        scales.append(torch.from_numpy(ue4m3_half(b.numpy())))
    load_codes(ex, codes, scales)
    for e in range(E):
        for got, q, s in zip(ex.dequantized(e), codes, scales):
            assert torch.equal(got, values(q[e], s[e]))


@pytest.mark.parametrize("shape", [(5, 96, 160), (7, 200, 88)], ids=["E5-H96-I160", "E7-H200-I88"])
def test_quantized_here_every_path_matches_the_references(shape):
    """Weights quantized here into lut4 e2m1 g16 e4m3 (factor 1): every path the same bits, the float64 MoE of the
    dequantized weights within EMULATED_TOL and the fp32 source within FP32_TOL."""
    E, H, I = shape
    gen = torch.Generator().manual_seed(E * H)
    src = [torch.randn(E, I, H, generator=gen) * 0.02, torch.randn(E, I, H, generator=gen) * 0.02,
           torch.randn(E, H, I, generator=gen) * 0.02]
    engines = {}
    for path in PATHS:
        kw = dict(isa=path, amx_min_tokens=1) if path in AMX_PATHS else dict(isa=path)
        engines[path] = CPUExperts(E, H, I, "lut4", G, pool=WorkerPool(1), scale_dtype="e4m3", codebook="e2m1", **kw)
        engines[path].load(*src)
    dq = list(zip(*(engines[PATHS[0]].dequantized(e) for e in range(E))))
    dq = [torch.stack(m) for m in dq]
    for T, k in ((1, 1), (3, 2), (7, 4), (64, 2)):
        x = torch.randn(T, H, generator=gen)
        ids = torch.randint(0, E, (T, k), generator=gen)
        w = torch.rand(T, k, generator=gen)
        outs = {p: ex(x, ids, w) for p, ex in engines.items()}
        ref = moe_reference(x, *src, ids, w)
        emu = moe_reference_emulated(x, *dq, ids, w, "int8", G)
        for p, out in outs.items():
            assert torch.equal(out, outs[PATHS[0]]), f"{p} T={T}: differs from {PATHS[0]}"
            assert rel_err(out, emu) <= EMULATED_TOL, f"{p} T={T}: {rel_err(out, emu):.3g} vs the emulated reference"
            assert rel_err(out, ref) <= FP32_TOL, f"{p} T={T}: {rel_err(out, ref):.4g} vs the fp32 reference"


def test_what_e4m3_cannot_hold_is_refused():
    E, H, I = 2, 64, 32
    pool = WorkerPool(1)
    with pytest.raises(ValueError, match="e4m3 scales .* go with lut4 weights only"):
        CPUExperts(E, H, I, "int4", 16, pool=pool, scale_dtype="e4m3")
    ex = CPUExperts(E, H, I, "lut4", G, pool=pool, scale_dtype="e4m3_div", codebook="e2m1")
    gen = torch.Generator().manual_seed(1)
    codes, scales, factors = nvfp4_codes((E, H, I), "e4m3_div", gen)
    with pytest.raises(ValueError, match="down has scales that e4m3_div does not hold exactly at its factor"):
        load_codes(ex, codes, scales[:2] + (scales[2] * 1.0000001 + 1e-6,), factors=factors)
    with pytest.raises(ValueError, match="up has factors that are not finite and positive"):
        load_codes(ex, codes, scales, factors=(factors[0], -factors[1], factors[2]))
    with pytest.raises(ValueError, match="gate has scales that e4m3_div does not hold exactly"):
        load_codes(ex, codes, scales)  # the factors left out: f = 1
