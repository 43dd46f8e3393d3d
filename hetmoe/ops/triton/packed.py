"""One-pass GPU unpacking of the CPU engine's packed experts (csrc/formats/layout.h; hetmoe/moe/streamed/packed.py has
the same rules in PyTorch ops): a Triton kernel reads each row block's lines and scales once (scales of any stored
dtype, the two levels of k8 and k4, NVFP4's E4M3 bytes with their block's factor and the int8 zero points of the
zero-point dtypes included, lut4's codebook, the bit-plane formats' codes put together from their planes: the values
the CPU kernels multiply by, bit for bit those of the PyTorch reader) and writes the weights in the model dtype
straight into the layer's [E, 2I, H] / [E, H, I] scratch, padding cut. PyTorch ops take about ten passes over a layer
for the same result; this kernel's one pass is what keeps the layerwise prefill's fixed cost per layer below its PCIe
copy. Triton comes with PyTorch's CUDA builds; without it (CPU-only installs) ``available()`` is False and
hetmoe/moe/streamed/packed.py does the work.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from hetmoe.cpu.layout import CODEBOOKS, K_PER_LINE, PLANES, ROWS, SUPER_BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch: no Triton
    triton = None

FMT_CODE = {"bf16": 0, "int8": 1, "int4": 2, "lut4": 3, **{name: 4 for name in PLANES}}  # 4: the bit-plane formats
# csrc/formats/layout.h ScaleType's numbers (its f32_zp / f16_zp are fp32_zp / fp16_zp here)
SCALE_CODE = {"fp32": 0, "fp16": 1, "bf16": 2, "e8m0": 3, "k8": 4, "k4": 5, "e4m3": 6, "e4m3_div": 7, "fp32_zp": 8,
              "fp16_zp": 9, "bf16_zp": 10}
# the torch dtype a scale dtype's bytes are read as (e8m0: its exponent bytes, widened in the kernel; k8: its int8
# sub-scales, k4: its bytes of 4-bit sub-scale and sub-min, the fp16 super scales and mins read through a cast pointer;
# e4m3, e4m3_div and the zero-point dtypes: bytes, their fp32 factor, scales and int8 zero points read through cast
# pointers)
SCALE_VIEW = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "e8m0": torch.uint8,
              "k8": torch.int8, "k4": torch.uint8, "e4m3": torch.uint8, "e4m3_div": torch.uint8,
              "fp32_zp": torch.uint8, "fp16_zp": torch.uint8, "bf16_zp": torch.uint8}
LINES_PER_PROGRAM = 32


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _factor_scale(set_ptr, idx, ok, n_bytes, DIV: tl.constexpr):
        # e4m3 / e4m3_div (csrc/formats/layout.h): E4M3 byte b of a set at byte ``idx`` -> the IEEE half of
        # e4m3(b) * 2^-8 with integer ops (sign to bit 15, the other 7 bits to bits 7..13: subnormals included, the
        # NaN codes 0x7F / 0xFF read as the PyTorch reader reads them), widened to fp32 (exact), then one IEEE
        # multiply by the block's stored fp32 factor (after the set's ``n_bytes`` bytes) or one IEEE division by it
        byte = tl.load(set_ptr + idx, mask=ok, other=0).to(tl.int32)
        bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
        half = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        factor = tl.load((set_ptr + n_bytes).to(tl.pointer_type(tl.float32)))
        if DIV:
            return tl.math.div_rn(half, factor)  # the IEEE quotient (Triton's plain / may be approximate)
        else:
            return half * factor

    @triton.jit
    def _unpack_kernel(words, scales, lut, out, NB, lines, block_lines, G, NS, rows_out, cols_out, mat_stride,
                       FMT: tl.constexpr, GROUP: tl.constexpr, INTERLEAVED: tl.constexpr, BL: tl.constexpr,
                       AFFINE: tl.constexpr, R: tl.constexpr, PER: tl.constexpr, SCALE: tl.constexpr,
                       SUPER: tl.constexpr, OFFSET: tl.constexpr, LO_BITS: tl.constexpr, HI_BITS: tl.constexpr,
                       QUADS: tl.constexpr, UNIT_LINES: tl.constexpr):
        # A program turns a tile of BL lines of one row block (R rows) into R rows of BL * PER weights: every
        # 4-byte cell is read once as an int32 and its PER values are split off with shifts, so the loads are the
        # block's contiguous lines and each row's stores are one contiguous run (coalesced on both sides). The
        # bit-plane formats (FMT 4) are walked in byte lines (4 of K per row: ``lines`` counts them), each put
        # together from the cells of its low and high lines (a block holds ``block_lines`` data lines).
        b = tl.program_id(0).to(tl.int64)  # row block, over every expert of the range
        lt = tl.program_id(1)  # tile of BL lines
        if INTERLEAVED:  # gate and up row blocks alternate: block 2 rb + which of the expert
            e = b // (2 * NB)
            rb = (b // 2) % NB
            which = b % 2
        else:
            e = b // NB
            rb = b % NB
            which = 0
        r = tl.arange(0, R)[:, None]  # [R, 1] rows of the block
        line = lt * BL + tl.arange(0, BL)[None, :]  # [1, BL]
        row = rb * R + r
        ok = (row < rows_out) & (line < lines)
        o = tl.arange(0, PER)[None, None, :]  # [1, 1, PER]: value o of a cell is k = PER * line + o
        if FMT != 4:
            word = tl.load(words + b * lines * R + line * R + r, mask=ok, other=0)  # [R, BL] cells (row r, line)
        if FMT == 0:  # bf16: the low half is k = 2 line, the high half 2 line + 1; bf16 bits << 16 = fp32
            v = ((word[:, :, None] >> (16 * o)) << 16).to(tl.float32, bitcast=True)
        else:
            if FMT == 1:  # int8: byte o, stored q + 128
                u = (word[:, :, None] >> (8 * o)) & 255
            elif FMT == 4:  # bit planes: byte line f of quad q (k = 16 q + 4 f + o), csrc/formats/layout.h
                q = line // 4
                f = line % 4
                unit = b * block_lines * R + (q // QUADS) * UNIT_LINES * R + r  # the unit's first cell of row r
                if LO_BITS == 4:  # two nibble lines per quad: f = 0, 1 in the first, 2, 3 in the second
                    lo_line = (q % QUADS) * 2 + f // 2
                    lo_shift = 4 * (f % 2)
                else:  # one line per quad: bits 2 f, 2 f + 1 of each byte
                    lo_line = q % QUADS
                    lo_shift = 2 * f
                lo = tl.load(words + unit + lo_line * R, mask=ok, other=0)
                u = (lo[:, :, None] >> (8 * o + lo_shift[:, :, None])) & ((1 << LO_BITS) - 1)
                if HI_BITS > 0:  # the unit's last line: 2 bits as the low 2, or bit 4 (q % 2) + f of each byte
                    hi = tl.load(words + unit + (UNIT_LINES - 1) * R, mask=ok, other=0)
                    hi_shift = 2 * f if HI_BITS == 2 else 4 * (q % QUADS) + f
                    u = u | (((hi[:, :, None] >> (8 * o + hi_shift[:, :, None])) & ((1 << HI_BITS) - 1)) << LO_BITS)
            else:  # int4 / lut4: byte o % 4, its low nibble for o < 4, its high nibble for o >= 4; int4 stores q + 8
                u = (word[:, :, None] >> (8 * (o % 4) + 4 * (o // 4))) & 15
            # a cell's values share one group (GROUP is a multiple of PER); a block holds its scale set, then
            # (affine) its min set stored the same way: [G][R] values of the scale dtype (k8: [G][R] int8 sub-scales,
            # then [NS][R] fp16 super scales, one per SUPER values of K; k4: [G][R] bytes, the 4-bit sub-scale in the
            # low nibble and the 4-bit sub-min in the high one, then [NS][R] fp16 super scales, its min set only the
            # [NS][R] fp16 super mins; e4m3 / e4m3_div: [G][R] E4M3 bytes, then the block's fp32 factor; fp32_zp /
            # fp16_zp / bf16_zp: [G][R] scales of the base dtype, the min set [G][R] int8 zero points z, min =
            # fl(scale * z)). value = scale * u - min (two roundings: the launch turns fp fusion off).
            # Narrow values are widened exactly, as the CPU kernels do (csrc/formats/layout.h).
            gi = (line * PER) // GROUP
            if SCALE == 4 or SCALE == 5:  # k8, k4: scale sets of G R + 2 NS R bytes
                set_bytes = G * R + 2 * NS * R
                if SCALE == 5:  # k4: the min set is the 2 NS R bytes of super mins
                    sb = b * (set_bytes + (2 * NS * R if AFFINE else 0))
                else:
                    sb = b * set_bytes * (2 if AFFINE else 1)
                sup = (line * PER) // SUPER
                byte = tl.load(scales + sb + gi * R + r, mask=ok, other=0)
                if SCALE == 5:
                    byte = byte.to(tl.int32)
                    sub = (byte & 15).to(tl.float32)
                else:
                    sub = byte.to(tl.float32)
                d = tl.load((scales + sb + G * R).to(tl.pointer_type(tl.float16)) + sup * R + r, mask=ok, other=0.0)
                s = (sub * d.to(tl.float32))[:, :, None]
                if AFFINE:
                    if SCALE == 5:  # the sub-min is the pair byte's high nibble
                        msub = (byte >> 4).to(tl.float32)
                        mptr = (scales + sb + set_bytes).to(tl.pointer_type(tl.float16))
                    else:
                        msub = tl.load(scales + sb + set_bytes + gi * R + r, mask=ok, other=0).to(tl.float32)
                        mptr = (scales + sb + set_bytes + G * R).to(tl.pointer_type(tl.float16))
                    md = tl.load(mptr + sup * R + r, mask=ok, other=0.0)
                    m = (msub * md.to(tl.float32))[:, :, None]
            elif SCALE == 6 or SCALE == 7:  # e4m3, e4m3_div: sets of G R E4M3 bytes, then the block's fp32 factor
                set_bytes = G * R + 4
                sb = b * set_bytes * (2 if AFFINE else 1)
                s = _factor_scale(scales + sb, gi * R + r, ok, G * R, SCALE == 7)[:, :, None]
                if AFFINE:
                    m = _factor_scale(scales + sb + set_bytes, gi * R + r, ok, G * R, SCALE == 7)[:, :, None]
            elif SCALE >= 8:  # fp32_zp, fp16_zp, bf16_zp: G R scales of the base dtype, then G R int8 zero points
                if SCALE == 8:
                    set_bytes = G * R * 4
                    sb = b * (set_bytes + G * R)
                    sp = (scales + sb).to(tl.pointer_type(tl.float32))
                else:
                    set_bytes = G * R * 2
                    sb = b * (set_bytes + G * R)
                    sp = (scales + sb).to(tl.pointer_type(tl.float16 if SCALE == 9 else tl.bfloat16))
                s2 = tl.load(sp + gi * R + r, mask=ok, other=0.0).to(tl.float32)  # [R, BL]
                s = s2[:, :, None]
                if AFFINE:  # min = fl(scale * z), one rounding (the fp32 min a loader computes)
                    zp = (scales + sb + set_bytes).to(tl.pointer_type(tl.int8))
                    z = tl.load(zp + gi * R + r, mask=ok, other=0).to(tl.float32)
                    m = (s2 * z)[:, :, None]
            else:
                sb = b * G * (2 if AFFINE else 1) * R
                if SCALE == 3:  # e8m0: 2^(e - 128), e < 2 the subnormals 2^-128 << e
                    ex = tl.load(scales + sb + gi * R + r, mask=ok, other=0).to(tl.int32)
                    bits = tl.where(ex < 2, (ex * 0 + 0x00200000) << ex, (ex - 1) << 23)
                    s = bits.to(tl.float32, bitcast=True)[:, :, None]
                else:
                    s = tl.load(scales + sb + gi * R + r, mask=ok, other=0.0).to(tl.float32)[:, :, None]
                if AFFINE:
                    m = tl.load(scales + sb + (G + gi) * R + r, mask=ok, other=0.0).to(tl.float32)[:, :, None]
            if AFFINE:
                v = u.to(tl.float32) * s - m
            elif FMT == 3:  # lut4: the nibble indexes the codebook
                v = tl.load(lut + u).to(tl.float32) * s
            else:  # symmetric: the stored code is q + OFFSET
                v = (u - OFFSET).to(tl.float32) * s
        v = tl.reshape(v, (R, BL * PER))  # row-major: column PER * (line - first line) + o
        k = lt * BL * PER + tl.arange(0, BL * PER)[None, :]
        dst = out + e * mat_stride + (which * rows_out + row) * cols_out  # row start in the [rows, cols] matrix
        tl.store(dst + k, v.to(out.dtype.element_ty), mask=(row < rows_out) & (k < cols_out))


@functools.lru_cache(maxsize=None)
def _codebook(name: str, device: torch.device) -> torch.Tensor:
    """lut4 codebook ``name``'s 16 values, int32, on ``device``: made once (a copy from the host blocks it)."""
    return torch.tensor(CODEBOOKS[name], dtype=torch.int32, device=device)


def check(shape) -> None:
    """Refuses by name (ValueError) a packed matrix (hetmoe/moe/streamed/packed.py MatrixShape) this kernel cannot
    read: its format, its scale dtype, a group that splits a cell."""
    if shape.fmt not in FMT_CODE:
        raise ValueError(f"{shape.fmt} experts have no GPU unpacking of the packed layout yet")
    sdt = getattr(shape, "scale_dtype", "fp32")
    if shape.fmt != "bf16" and sdt not in SCALE_CODE:
        raise ValueError(f"{shape.fmt} experts with {sdt} scales: the Triton unpack of the packed layout reads "
                         f"{', '.join(SCALE_CODE)} scales")
    per = 4 if shape.fmt in PLANES else K_PER_LINE[shape.fmt]  # values per 4-byte cell (bit planes: per byte line)
    if FMT_CODE[shape.fmt] and shape.group % per:
        raise ValueError(f"{shape.fmt} groups of {shape.group}: the GPU unpack needs a multiple of {per}")


def check_layout(layout) -> None:
    """``check`` on both matrices of a layer's ExpertLayout."""
    check(layout.gate_up)
    check(layout.down)


def _launch(shape, data: torch.Tensor, scales, out: torch.Tensor, n_blocks: int, interleaved: bool) -> None:
    check(shape)
    fmt = FMT_CODE[shape.fmt]
    per = 4 if shape.fmt in PLANES else K_PER_LINE[shape.fmt]  # values per 4-byte cell (bit planes: per byte line)
    lines = shape.kp // 4 if shape.fmt in PLANES else shape.lines  # the lines a program's tile walks
    lo_bits, hi_bits, quads, unit_lines = 0, 0, 1, 1
    if shape.fmt in PLANES:  # (values of K per unit, lines per unit, bits): the low part 4 bits from 5 bits up, else 2
        unit_k, unit_lines, bits = PLANES[shape.fmt]
        lo_bits, quads = 4 if bits >= 4 else 2, unit_k // 16
        hi_bits = bits - lo_bits
    offset = shape.offset if fmt else 0
    sdt = getattr(shape, "scale_dtype", "fp32")
    sc = scales.view(SCALE_VIEW[sdt]) if scales is not None else data.view(torch.float32)  # unused for bf16
    lut = _codebook(shape.codebook, data.device) if fmt == 3 else data.view(torch.int32)  # unread unless lut4
    rows, cols = out.shape[1] // (2 if interleaved else 1), out.shape[2]
    bl = min(LINES_PER_PROGRAM, triton.next_power_of_2(lines))
    grid = (n_blocks, triton.cdiv(lines, bl))
    n_supers = -(-shape.kp // SUPER_BLOCK)
    _unpack_kernel[grid](data.view(torch.int32), sc, lut, out, shape.n_blocks, lines, shape.lines,
                         shape.kp // shape.group, n_supers, rows, cols, out.stride(0), FMT=fmt, GROUP=shape.group,
                         INTERLEAVED=interleaved, BL=bl, AFFINE=shape.affine, R=ROWS, PER=per, SCALE=SCALE_CODE[sdt],
                         SUPER=SUPER_BLOCK, OFFSET=offset, LO_BITS=lo_bits, HI_BITS=hi_bits, QUADS=quads,
                         UNIT_LINES=unit_lines, enable_fp_fusion=False)


def unpack_into(layout, ranges, w_gu: torch.Tensor, w_down: torch.Tensor, n_experts: Optional[int] = None) -> None:
    """The first ``n_experts`` experts (default: all ``layout.num_experts``) of ``ranges`` (the layer's packed bytes on
    the device, as ``packed.unpack_experts`` takes them) into ``w_gu`` [E, 2I, H] and ``w_down`` [E, H, I]
    (contiguous; rows past ``n_experts`` are left as they are)."""
    E = layout.num_experts if n_experts is None else int(n_experts)
    if layout.fmt == "bf16":
        gu_data, d_data = ranges
        gu_scales = d_scales = None
    else:
        gu_data, gu_scales, d_data, d_scales = ranges
    _launch(layout.gate_up, gu_data, gu_scales, w_gu, E * 2 * layout.gate_up.n_blocks, True)
    _launch(layout.down, d_data, d_scales, w_down, E * layout.down.n_blocks, False)
