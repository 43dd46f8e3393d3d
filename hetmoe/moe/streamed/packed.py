"""The CPU engine's packed expert layout (csrc/formats/layout.h) read with PyTorch ops, on any device: what lets a GPU
compute a layer's experts from the very bytes the CPU engine holds, copied as they are (layerwise prefill,
hetmoe/moe/streamed/layerwise.py) — no second copy in RAM, no re-layout on the CPU.

The layout (row blocks of ROWS rows, lines of LINE bytes, the codes, the scales, gate and up row blocks alternating,
a layer's four storage ranges) is described once, in csrc/formats/layout.h; its constants come from there through
hetmoe/cpu/layout.py. Grid matrices (GGUF's i-quants) hold their file's blocks in the row blocks instead of lines
and scales: hetmoe/moe/streamed/grid.py decodes them, Triton or not (``ExpertLayout.torch_only``). NVFP4's E4M3 scale
bytes (e4m3, e4m3_div) and the int8 zero points of GPTQ / AWQ / compressed-tensors mins (fp32_zp, fp16_zp, bf16_zp)
are widened here and in the Triton unpack (hetmoe/ops/triton/packed.py) with the same fp32 operations, bit for bit.

Shape letters: E experts, H hidden size, I intermediate size, N rows, K columns, Kp K padded, G groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from hetmoe.cpu import layout as cpu_layout
from hetmoe.cpu.layout import BF16_GROUP, CODEBOOKS, K_PER_LINE, LINE, PLANES, ROWS, SCALE_WIDTH, SUPER_BLOCK, set_bytes
from hetmoe.moe.streamed import grid


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


@dataclass(frozen=True)
class MatrixShape:
    """Geometry of one packed matrix [N, K] (MatrixShape::make in csrc/formats/layout.h)."""

    fmt: str
    n: int
    k: int
    group: int  # elements of K per scale (bf16: 32, no scales)
    kp: int
    n_blocks: int
    affine: bool = False  # value = scale * u - min (GGUF's K-quants), else scale * q
    scale_dtype: str = "fp32"  # how the scales (and mins) are stored (fp32, fp16, bf16, e8m0, k8, k4, e4m3, ..._zp)
    codebook: str | None = None  # lut4: the codebook its nibbles index; grid: its type (iq2_xxs, ...)

    @classmethod
    def make(cls, fmt: str, n: int, k: int, group: int, scaling: str = "symmetric", scale_dtype: str = "fp32",
             codebook: str | None = None) -> "MatrixShape":
        if fmt == "grid":  # the file's blocks (hetmoe/moe/streamed/grid.py): whole super-blocks, the type's group
            if codebook not in grid.TYPES or k % SUPER_BLOCK:
                raise ValueError(f"grid experts of type {codebook!r} and K = {k}: a grid type "
                                 f"({', '.join(grid.TYPES)}) in whole super-blocks of {SUPER_BLOCK} is read")
            return cls(fmt, n, k, grid.group_of(codebook), k, -(-n // ROWS), False, "fp16", codebook)
        if fmt not in K_PER_LINE and fmt not in PLANES:
            raise ValueError(f"unknown weight format {fmt!r}")
        if fmt == "fp8":  # (streamed prefill and GPU-resident experts keep fp8 layers off this path)
            raise ValueError("fp8 experts have no GPU unpacking of the packed layout yet")
        if fmt == "bf16":
            group = BF16_GROUP
        elif group <= 0:
            group = 128  # per-row int8/int4: the row's scale repeated in every group of 128
        if (fmt == "lut4") != (codebook is not None):
            raise ValueError(f"{fmt} with codebook {codebook!r}: a codebook goes with lut4, and lut4 needs one")
        if fmt != "bf16" and (scale_dtype or "fp32") not in SCALE_WIDTH:
            raise ValueError(f"{fmt} experts with {scale_dtype!r} scales: the GPU unpacking of the packed layout reads "
                             f"{', '.join(SCALE_WIDTH)} scales")
        if scale_dtype == "k4" and scaling != "affine":
            raise ValueError(f"{fmt} experts with k4 scales must be affine (k4 holds a sub-min beside each sub-scale)")
        if scale_dtype in cpu_layout.ZERO_POINTS and scaling != "affine":
            raise ValueError(f"{fmt} experts with {scale_dtype} scales must be affine (a zero point per min)")
        return cls(fmt, n, k, group, _round_up(k, group), -(-n // ROWS), fmt != "bf16" and scaling == "affine",
                   scale_dtype or "fp32", codebook)

    @property
    def lines(self) -> int:  # data lines of a row block (bit-plane formats: whole units; grid: its blocks' bytes)
        if self.fmt == "grid":
            return self.kp // SUPER_BLOCK * ROWS * grid.row_bytes(self.codebook) // LINE
        return cpu_layout.data_lines(self.fmt, self.kp)

    @property
    def offset(self) -> int:
        """What a symmetric code stores on top of q: 128 for int8, 8 for int4, 2^(b-1) for a b-bit plane format."""
        return 1 << (code_bits(self.fmt) - 1)

    @property
    def block_bytes(self) -> int:
        return self.lines * LINE

    @property
    def set_bytes(self) -> int:  # one block's scales (of scale_dtype; k8 / k4: sub-scales, then fp16 super scales)
        if self.fmt == "grid":  # each row's fp16 d per super-block (IQ1_M: none, its d is in its blocks)
            return self.kp // SUPER_BLOCK * ROWS * 2 if grid.HAS_D[self.codebook] else 0
        return 0 if self.fmt == "bf16" else set_bytes(1, self.kp, self.group, self.scale_dtype)

    @property
    def min_set_bytes(self) -> int:  # an affine block's mins, stored as the scales are (k4: its fp16 super mins alone)
        return cpu_layout.min_set_bytes(1, self.kp, self.group, self.scale_dtype) if self.affine else 0

    @property
    def block_scale_bytes(self) -> int:  # the scale set and an affine block's min set right after it
        return self.set_bytes + self.min_set_bytes


@dataclass(frozen=True)
class ExpertLayout:
    """Where each expert of a layer lives in its four storage ranges, and how to read it."""

    fmt: str  # gate/up's (down's is down.fmt)
    num_experts: int
    hidden: int
    intermediate: int
    gate_up: MatrixShape  # [I, H], one of the two interleaved matrices
    down: MatrixShape  # [H, I]

    @classmethod
    def of(cls, experts) -> "ExpertLayout":
        """The layout of a ``CPUExperts`` (unsplit: NUMA-split layers store their slices apart)."""
        info = experts.info()
        if info.get("numa_subpools", 1) != 1:
            raise ValueError("the packed layout of a layer split over NUMA subpools is per slice")
        fmt, group = info["weight_format"], info["group_size"] or 0
        H, I = experts.hidden_size, experts.intermediate_size
        return cls(fmt, experts.num_experts, H, I,
                   MatrixShape.make(fmt, I, H, group, info["gate_up_scaling"], info["gate_up_scale_dtype"],
                                    info["gate_up_codebook"]),
                   MatrixShape.make(info["down_weight_format"], H, I, info["down_group_size"] or 0,
                                    info["down_scaling"], info["down_scale_dtype"], info["down_codebook"]))

    def range_bytes(self) -> tuple:
        """Bytes per expert of each range: (gate+up data, gate+up scales, down data, down scales)."""
        gu, d = self.gate_up, self.down
        return (2 * gu.n_blocks * gu.block_bytes, 2 * gu.n_blocks * gu.block_scale_bytes,
                d.n_blocks * d.block_bytes, d.n_blocks * d.block_scale_bytes)

    @property
    def expert_bytes(self) -> int:
        return sum(self.range_bytes())

    @property
    def grid(self) -> bool:
        """Whether a matrix holds grid blocks (GGUF's i-quants: decoded by hetmoe/moe/streamed/grid.py)."""
        return "grid" in (self.gate_up.fmt, self.down.fmt)

    @property
    def torch_only(self) -> bool:
        """Whether the PyTorch reader takes this layout even where Triton's one-pass unpack is installed: grid
        blocks (hetmoe/moe/streamed/grid.py), which that kernel does not read. (NVFP4's E4M3 scale bytes with their
        row blocks' factors and the int8 zero points of fp32_zp / fp16_zp / bf16_zp it reads, bit for bit as
        ``widen_sets``.)"""
        return self.grid


def code_bits(fmt: str) -> int:
    """Bits per code of an integer format (csrc/formats/layout.h code_bits)."""
    return PLANES[fmt][2] if fmt in PLANES else {"int8": 8, "int4": 4, "lut4": 4}[fmt]


def plane_split(fmt: str) -> tuple:
    """(low bits, high bits, quads of 16 of K per unit, lines per unit) of a bit-plane format (csrc/formats/layout.h
    Planes: the low part is 4 bits for codes of 5 bits and more, else 2)."""
    unit_k, lines, bits = PLANES[fmt]
    lo = 4 if bits >= 4 else 2
    return lo, bits - lo, unit_k // 16, lines


def _unpack_planes(data: torch.Tensor, shape: MatrixShape, n_mats: int) -> torch.Tensor:
    """uint8 bit-plane row blocks -> their codes u, int16 [n_mats, n_blocks * 16, Kp] (csrc/formats/layout.h: byte
    line f of quad q is ((lo >> s) & m) | (((hi >> t) & m') << low bits), the lines of a unit its quads' low lines,
    then its high line)."""
    lo_bits, hi_bits, quads, unit_lines = plane_split(shape.fmt)
    NB, units = shape.n_blocks, shape.lines // unit_lines
    lines = data.view(n_mats * NB, units, unit_lines, ROWS, 4).to(torch.int16)
    per_quad = []
    for q in range(quads):
        byte_lines = []
        for f in range(4):  # byte line f: k = 16 q + 4 f + e, e the byte of a row's cell
            if lo_bits == 4:
                code = (lines[:, :, 2 * q + f // 2] >> (4 * (f % 2))) & 15
            else:
                code = (lines[:, :, q] >> (2 * f)) & 3
            if hi_bits:
                shift = 2 * f if hi_bits == 2 else 4 * q + f
                code = code | (((lines[:, :, unit_lines - 1] >> shift) & ((1 << hi_bits) - 1)) << lo_bits)
            byte_lines.append(code)
        per_quad.append(torch.stack(byte_lines, dim=2))  # [., units, 4 (f), ROWS, 4 (e)]
    codes = torch.stack(per_quad, dim=2)  # [., units, quads, 4 (f), ROWS, 4 (e)]
    codes = codes.permute(0, 4, 1, 2, 3, 5).reshape(n_mats, NB * ROWS, units * quads * 16)
    return codes[:, :, :shape.kp]


def _unpack_data(data: torch.Tensor, shape: MatrixShape, n_mats: int) -> torch.Tensor:
    """uint8 [n_mats * n_blocks * block_bytes] -> the stored values [n_mats, n_blocks * 16, Kp]: bf16 as bf16, int8 /
    int4 / bit-plane codes as their unsigned codes (int16: q + offset, affine u), lut4 as its indices (int16 0..15)."""
    if shape.fmt in PLANES:
        return _unpack_planes(data, shape, n_mats)
    L, NB = shape.lines, shape.n_blocks
    lines = data.view(n_mats * NB, L, ROWS, 4)
    if shape.fmt == "bf16":
        vals = lines.view(torch.bfloat16).view(n_mats * NB, L, ROWS, 2)  # element 2j (low half), then 2j + 1
        return vals.permute(0, 2, 1, 3).reshape(n_mats, NB * ROWS, shape.kp)
    if shape.fmt == "int8":
        codes = lines.permute(0, 2, 1, 3)  # [., 16, L, 4]: k = 4j + b
    else:
        low, high = lines & 15, lines >> 4  # k = 8j + b, 8j + 4 + b
        codes = torch.stack((low, high), dim=3).permute(0, 2, 1, 3, 4)  # [., 16, L, 2, 4]
    return codes.reshape(n_mats, NB * ROWS, shape.kp).to(torch.int16)


@functools.lru_cache(maxsize=None)
def codebook_values(name: str, device: torch.device) -> torch.Tensor:
    """lut4 codebook ``name``'s 16 values, fp32, on ``device``: made once per device (a copy from the host blocks it,
    and cannot happen inside a CUDA graph capture), then only read."""
    return torch.tensor(CODEBOOKS[name], dtype=torch.float32, device=device)


def widen_scales(raw: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Stored scales of one level (uint8 bytes, a whole number of scales; not k8 or k4, whose sets ``widen_set`` and
    ``widen_sets`` read) -> fp32, exactly as the CPU kernels widen them (csrc/formats/layout.h scale_to_float)."""
    if scale_dtype == "fp32":
        return raw.view(torch.float32)
    if scale_dtype in ("fp16", "bf16"):
        return raw.view(torch.float16 if scale_dtype == "fp16" else torch.bfloat16).float()
    if scale_dtype != "e8m0":
        raise ValueError(f"{scale_dtype} scales are not one value per scale: widen_set reads them")
    e = raw.to(torch.int32)  # e8m0: 2^(e - 128); e < 2 are the subnormals 2^-128 << e
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


def _times_supers(sub: torch.Tensor, supers: torch.Tensor, shape: MatrixShape) -> torch.Tensor:
    """Two-level values: sub-values fp32 [n, G, ROWS] times the fp16 super values (uint8 [n, n_supers * ROWS * 2],
    [n_supers][ROWS]) of each group's super-block of SUPER_BLOCK values of K (exact: at most 8 + 11 significant
    bits)."""
    n, G = sub.shape[0], sub.shape[1]
    sup = supers.contiguous().view(torch.float16).view(n, -1, ROWS).float()  # [n, supers, ROWS]
    which = torch.arange(G, device=sub.device) * shape.group // SUPER_BLOCK
    return sub * sup[:, which]


def widen_set(sets: torch.Tensor, shape: MatrixShape) -> torch.Tensor:
    """Scale sets of ``shape``'s blocks (uint8 [n, shape.set_bytes]: a block's scales, or its mins but k4's, which
    ``widen_sets`` reads) -> fp32 [n, G, ROWS], exactly as the CPU kernels widen them (csrc/formats/layout.h
    RowBlock::value; k8: int8 sub-scale x fp16 super scale of the group's super-block; k4: the low nibble of the pair
    byte x fp16 super scale)."""
    if sets.dim() != 2 or sets.shape[1] != shape.set_bytes:
        raise ValueError(f"{shape.scale_dtype} scale sets of {shape.set_bytes} bytes each, got {tuple(sets.shape)}"
                         + (" (a k4 min set holds only its super mins: widen_sets reads it)"
                            if shape.scale_dtype == "k4" else ""))
    G, n, sdt = shape.kp // shape.group, sets.shape[0], shape.scale_dtype
    head = sets[:, :G * ROWS * SCALE_WIDTH[sdt]].contiguous()
    if sdt in cpu_layout.FACTOR_SCALES:  # the half of e4m3(b) * 2^-8, times (or over) the block's stored factor
        b = head.to(torch.int32)
        half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(torch.int16).view(torch.float16).float()
        factor = sets[:, G * ROWS:G * ROWS + cpu_layout.FACTOR_BYTES].contiguous().view(torch.float32)  # [n, 1]
        return (half / factor if sdt == "e4m3_div" else half * factor).view(n, G, ROWS)
    if sdt not in cpu_layout.TWO_LEVEL:  # (a zero-point dtype's scales: its base dtype's)
        return widen_scales(head.reshape(-1), cpu_layout.ZERO_POINTS.get(sdt, sdt)).view(n, G, ROWS)
    sub = head.view(torch.int8) if sdt == "k8" else head & 15
    return _times_supers(sub.view(n, G, ROWS).float(), sets[:, G * ROWS:], shape)


def widen_sets(blocks: torch.Tensor, shape: MatrixShape) -> tuple:
    """The whole scale bytes of ``shape``'s blocks (uint8 [n, shape.block_scale_bytes]: the scale set, and an affine
    block's min set after it) -> (scales, mins or None), fp32 [n, G, ROWS] each, exactly as the CPU kernels widen them
    (k4's mins: the high nibble of the scale set's pair byte x the min set's fp16 super min; a zero-point dtype's:
    the widened scale x the min set's int8 zero point, one fp32 product)."""
    if blocks.dim() != 2 or blocks.shape[1] != shape.block_scale_bytes:
        raise ValueError(f"scale bytes of {shape.block_scale_bytes} per block, got {tuple(blocks.shape)}")
    scales = widen_set(blocks[:, :shape.set_bytes], shape)
    if not shape.affine:
        return scales, None
    mins = blocks[:, shape.set_bytes:]
    if shape.scale_dtype in cpu_layout.ZERO_POINTS:  # int8 zero points z: min = fl(scale * z)
        return scales, scales * mins.contiguous().view(torch.int8).view(scales.shape).float()
    if shape.scale_dtype != "k4":
        return scales, widen_set(mins, shape)
    G, n = shape.kp // shape.group, blocks.shape[0]
    sub = (blocks[:, :G * ROWS] >> 4).view(n, G, ROWS).float()
    return scales, _times_supers(sub, mins, shape)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, shape: MatrixShape, n_mats: int,
                dtype: torch.dtype) -> torch.Tensor:
    """codes [n_mats, NB * 16, Kp] (q + shape.offset, affine u, or lut4 indices), scales uint8 [n_mats * NB *
    block_scale_bytes] (per block its scale set, and affine its min set) -> values [n_mats, NB * 16, Kp]."""
    G, NB = shape.kp // shape.group, shape.n_blocks
    widened = widen_sets(scales.view(n_mats * NB, shape.block_scale_bytes), shape)

    def per_row(v: torch.Tensor) -> torch.Tensor:  # [n_mats * NB, G, 16] as [n_mats, NB * 16, G, 1]
        return v.view(n_mats, NB, G, ROWS).transpose(2, 3).reshape(n_mats, NB * ROWS, G, 1)

    s = per_row(widened[0])
    if shape.affine:  # two roundings, as gguf's dequantization: fl(fl(scale * u) - min)
        q = codes.view(n_mats, NB * ROWS, G, shape.group)
        return (q.to(torch.float32) * s - per_row(widened[1])).view(n_mats, NB * ROWS, shape.kp).to(dtype)
    if shape.fmt == "lut4":
        q = codebook_values(shape.codebook, codes.device)[codes.long()]
    else:
        q = (codes - shape.offset).to(torch.float32)
    w = q.view(n_mats, NB * ROWS, G, shape.group) * s
    return w.view(n_mats, NB * ROWS, shape.kp).to(dtype)


def _matrix(shape: MatrixShape, data: torch.Tensor, scales, n: int, mats: int, rows: int, cols: int,
            dtype: torch.dtype, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``n`` experts' ``mats`` matrices [rows, cols] (gate/up: 2, their row blocks alternating) from their data and
    scale bytes -> [n, mats * rows, cols] in ``dtype``, padding cut (written into ``out`` where given)."""
    if shape.fmt == "grid":  # decoded straight into place, rows in order
        blocks, d = grid.engine_rows(data, scales, shape.codebook, shape.n_blocks, shape.kp, mats, rows)
        return grid.dequantize(blocks, d, shape.codebook, dtype, out).view(n, mats * rows, cols)
    if shape.fmt == "bf16":
        w = _unpack_data(data, shape, n * mats).to(dtype)
    else:
        w = _dequantize(_unpack_data(data, shape, n * mats), scales, shape, n * mats, dtype)
    rows_p = shape.n_blocks * ROWS
    if mats == 1:
        w = w.view(n, rows_p, shape.kp)[:, :rows, :cols]
    else:  # [n, NB, mats, 16, Kp] -> [n, mats, NB * 16, Kp]
        w = w.view(n, shape.n_blocks, mats, ROWS, shape.kp).transpose(1, 2).reshape(n, mats, rows_p, shape.kp)
        w = w[:, :, :rows, :cols].reshape(n, mats * rows, cols)
    return w if out is None else out.copy_(w)


def unpack_experts(layout: ExpertLayout, ranges, n: int, dtype: torch.dtype = torch.bfloat16,
                   out: Optional[tuple] = None) -> tuple:
    """The weights of ``n`` consecutive experts from their packed bytes ``ranges`` (uint8 tensors, one per storage
    range, each holding those ``n`` experts: ``range_bytes()`` each; the empty ranges left out, as
    ``CPUExperts.storage`` leaves them: bf16's scales, IQ1_M's d), on their device: ``(gate_up [n, 2I, H],
    down [n, H, I])`` in ``dtype`` — gate rows then up rows per expert — the values the CPU kernels multiply by
    (``CPUExperts.dequantized``), rounded to ``dtype``; written into ``out`` (two such contiguous tensors) where
    given (grid matrices are decoded straight into them)."""
    gu, d, I, H = layout.gate_up, layout.down, layout.intermediate, layout.hidden
    given = iter(ranges)
    gu_data, gu_scales, d_data, d_scales = (next(given) if b else None for b in layout.range_bytes())
    out = (None, None) if out is None else out
    return (_matrix(gu, gu_data, gu_scales, n, 2, I, H, dtype, out[0]),
            _matrix(d, d_data, d_scales, n, 1, H, I, dtype, out[1]))


def expert_ranges(experts) -> list:
    """The layer's storage ranges as uint8 CPU tensors over the engine's own memory (no copy): four, or two for bf16
    (``CPUExperts.storage`` leaves the empty scale ranges out)."""
    return [torch.frombuffer(v, dtype=torch.uint8) for v in experts.storage()]
