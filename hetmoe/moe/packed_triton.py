"""One-pass GPU unpacking of the CPU engine's packed experts (csrc/formats/layout.h; hetmoe/moe/packed.py has the
same rules in PyTorch ops): a Triton kernel reads each row block's 64-byte lines and scales once and writes the
weights in the model dtype straight into the layer's [E, 2I, H] / [E, H, I] scratch, padding cut. PyTorch ops take
about ten passes over a layer for the same result; this kernel's one pass is what keeps the layerwise prefill's
fixed cost per layer below its PCIe copy. Triton comes with PyTorch's CUDA builds; without it (CPU-only installs)
``available()`` is False and hetmoe/moe/packed.py does the work.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only PyTorch: no Triton
    triton = None

FMT_CODE = {"bf16": 0, "int8": 1, "int4": 2}
LINES_PER_PROGRAM = 32


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _unpack_kernel(data, data16, scales, out, NB, lines, block_bytes, G, rows_out, cols_out, mat_stride,
                       FMT: tl.constexpr, GROUP: tl.constexpr, INTERLEAVED: tl.constexpr, BL: tl.constexpr,
                       AFFINE: tl.constexpr):
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
        r = tl.arange(0, 16)[:, None]  # [16, 1] rows of the block
        line = lt * BL + tl.arange(0, BL)[None, :]  # [1, BL]
        row = rb * 16 + r
        ok = (row < rows_out) & (line < lines)
        dst = out + e * mat_stride + (which * rows_out + row) * cols_out  # row start in the [rows, cols] matrix
        cell = b * block_bytes + line * 64 + r * 4  # byte offset of the 4-byte cell (row r, line)
        if FMT == 0:  # bf16: two values per cell, k = 2 line + j
            for j in tl.static_range(2):
                k = line * 2 + j
                v = tl.load(data16 + cell // 2 + j, mask=ok).to(tl.bfloat16, bitcast=True)
                tl.store(dst + k, v.to(out.dtype.element_ty), mask=ok & (k < cols_out))
        else:
            # affine blocks hold [G][16] scales then [G][16] mins; value = scale * u - min (two roundings: the
            # launch turns fp fusion off) instead of scale * (u - offset)
            sb = b * G * (2 if AFFINE else 1) * 16
            for j in tl.static_range(4):
                byte = tl.load(data + cell + j, mask=ok, other=0).to(tl.int32)
                for h in tl.static_range(2 if FMT == 2 else 1):
                    if FMT == 1:  # int8: k = 4 line + j, stored q + 128
                        k = line * 4 + j
                        u = byte
                    else:  # int4: low nibble k = 8 line + j, high nibble k = 8 line + 4 + j, stored q + 8
                        k = line * 8 + j + 4 * h
                        u = (byte >> (4 * h)) & 15
                    s = tl.load(scales + sb + (k // GROUP) * 16 + r, mask=ok, other=0.0)
                    if AFFINE:
                        m = tl.load(scales + sb + (G + k // GROUP) * 16 + r, mask=ok, other=0.0)
                        v = u.to(tl.float32) * s - m
                    else:
                        v = (u - (128 if FMT == 1 else 8)).to(tl.float32) * s
                    tl.store(dst + k, v.to(out.dtype.element_ty), mask=ok & (k < cols_out))


def _launch(shape, data: torch.Tensor, scales, out: torch.Tensor, n_blocks: int, interleaved: bool) -> None:
    fmt = FMT_CODE[shape.fmt]
    data16 = data.view(torch.int16) if fmt == 0 else data
    sc = scales.view(torch.float32) if scales is not None else data  # unused for bf16
    rows, cols = out.shape[1] // (2 if interleaved else 1), out.shape[2]
    grid = (n_blocks, triton.cdiv(shape.lines, LINES_PER_PROGRAM))
    _unpack_kernel[grid](data, data16, sc, out, shape.n_blocks, shape.lines, shape.block_bytes,
                         shape.kp // shape.group, rows, cols, out.stride(0), FMT=fmt, GROUP=shape.group,
                         INTERLEAVED=interleaved, BL=LINES_PER_PROGRAM, AFFINE=shape.affine, enable_fp_fusion=False)


def unpack_into(layout, ranges, w_gu: torch.Tensor, w_down: torch.Tensor) -> None:
    """Every expert of ``ranges`` (the layer's packed bytes on the device, as ``packed.unpack_experts`` takes them,
    for all ``layout.num_experts`` experts) into ``w_gu`` [E, 2I, H] and ``w_down`` [E, H, I] (contiguous)."""
    E = layout.num_experts
    if layout.fmt == "bf16":
        gu_data, d_data = ranges
        gu_scales = d_scales = None
    else:
        gu_data, gu_scales, d_data, d_scales = ranges
    _launch(layout.gate_up, gu_data, gu_scales, w_gu, E * 2 * layout.gate_up.n_blocks, True)
    _launch(layout.down, d_data, d_scales, w_down, E * layout.down.n_blocks, False)
