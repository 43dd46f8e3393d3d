"""The CPU engine's packed layout as Python sees it: its geometry, read from ``hetmoe._C`` (csrc/formats/layout.h is
the one source), and the bytes of one matrix, one routed expert, one expert in a code layout. No torch: the memory
plan adds these up before anything loads; hetmoe/moe/streamed/packed.py and hetmoe/ops/triton/packed.py read the
bytes with these constants."""

from __future__ import annotations

from typing import Optional

from hetmoe import _C

VERSION = _C.LAYOUT_VERSION  # bumped whenever the packed bytes change (the expert cache keys on it)
ROWS = _C.LAYOUT["rows_per_block"]  # rows of a row block
LINE = _C.LAYOUT["line_bytes"]  # bytes of a line: the same 4-byte slice of K for each of the ROWS rows
BF16_GROUP = _C.LAYOUT["bf16_group"]  # K padding unit of bf16, which has no scales
K_PER_LINE = dict(_C.LAYOUT["k_per_line"])  # values of K per line, per format (not the bit-plane formats)
# bit-plane formats (int6, int5, int3, int2): (values of K per unit, lines per unit, bits per code); a matrix's K is
# stored in whole units
PLANES = {name: tuple(v) for name, v in _C.LAYOUT["planes"].items()}
# bytes per stored scale, per scale dtype (k8: the int8 sub-scale; k4: the byte of a 4-bit sub-scale and sub-min; a
# zero-point dtype: its base dtype's scale)
SCALE_WIDTH = dict(_C.LAYOUT["scale_width"])
SUPER_BLOCK = _C.LAYOUT["super_block"]  # k8, k4: values of K per fp16 super scale
TWO_LEVEL = ("k8", "k4")  # scale dtypes with an fp16 super scale per (row, SUPER_BLOCK values of K)
# scale dtypes (NVFP4's E4M3 bytes) with one fp32 factor per row block after a set's bytes (csrc/formats/layout.h)
FACTOR_SCALES = ("e4m3", "e4m3_div")
FACTOR_BYTES = 4
# scale dtypes of affine matrices with zero points (GPTQ's, AWQ's, compressed-tensors'): the scales of the base dtype,
# the min set one int8 zero point z per (row, group), min = fl(scale * z) (csrc/formats/layout.h)
ZERO_POINTS = {"fp32_zp": "fp32", "fp16_zp": "fp16", "bf16_zp": "bf16"}
MIN_WIDTH = dict(_C.LAYOUT["min_width"])  # bytes per stored min (the zero-point dtypes: 1)
CODEBOOKS = {name: tuple(values) for name, values in _C.LAYOUT["codebooks"].items()}  # lut4: name -> 16 int8 values
# grid's types (GGUF i-quants): name -> (scale group, bytes per row and SUPER_BLOCK values held, bytes per block in the
# file); a grid matrix's K is whole super-blocks
GRIDS = {name: tuple(v) for name, v in _C.LAYOUT["grids"].items()}


# The fp8 experts a plan's (format, group) means: group 128, block FP8 (one fp32 scale per 16 rows and group, shared:
# csrc/formats/layout.h), group 32, MXFP8 (one e8m0 scale per row and group). CPUExperts' keyword arguments.
FP8_LAYOUTS = {128: {"scale_dtype": "fp32", "shared_scales": True}, 32: {"scale_dtype": "e8m0", "shared_scales": False}}


def data_lines(fmt: str, kp: int) -> int:
    """Lines of one row block of ``fmt`` whose K is padded to ``kp`` (bit-plane formats: whole units)."""
    if fmt in PLANES:
        unit_k, lines, _ = PLANES[fmt]
        return -(-kp // unit_k) * lines
    return kp // K_PER_LINE[fmt]


def set_bytes(n_blocks: int, kp: int, group: int, scale_dtype: str, shared_scales: bool = False) -> int:
    """Bytes of one scale set (a matrix's scales, or an affine matrix's mins but for k4: ``min_set_bytes``) of
    ``n_blocks`` row blocks: one value of ``scale_dtype`` per (row, group) (fp8 ``shared_scales``: per (row block,
    group)); k8 and k4 also an fp16 super scale per (row, SUPER_BLOCK values of K), e4m3 and e4m3_div an fp32 factor
    per row block."""
    rows = n_blocks * ROWS
    supers = -(-kp // SUPER_BLOCK) * 2 if scale_dtype in TWO_LEVEL else 0
    scale_rows = n_blocks if shared_scales else rows
    factors = n_blocks * FACTOR_BYTES if scale_dtype in FACTOR_SCALES else 0
    return scale_rows * (kp // group) * SCALE_WIDTH[scale_dtype] + rows * supers + factors


def min_set_bytes(n_blocks: int, kp: int, group: int, scale_dtype: str) -> int:
    """Bytes of an affine matrix's min set of ``n_blocks`` row blocks: as its scale set, but k4's is only its fp16
    super mins (one per (row, SUPER_BLOCK values of K); the sub-mins share the scale set's bytes) and a zero-point
    dtype's one int8 zero point per (row, group)."""
    if scale_dtype == "k4":
        return n_blocks * ROWS * -(-kp // SUPER_BLOCK) * 2
    if scale_dtype in ZERO_POINTS:
        return n_blocks * ROWS * (kp // group) * MIN_WIDTH[scale_dtype]
    return set_bytes(n_blocks, kp, group, scale_dtype)


def grid_matrix_bytes(grid: str, n: int, k: int) -> int:
    """Bytes of one [n, k] grid matrix of type ``grid`` (csrc/formats/layout.h): each row's blocks less their fp16 d,
    the d apart (IQ1_M: none apart), rows padded to whole row blocks, K to whole super-blocks."""
    _, row_bytes, file_bytes = GRIDS[grid]
    return -(-n // ROWS) * ROWS * -(-k // SUPER_BLOCK) * (row_bytes + (2 if file_bytes > row_bytes else 0))


def packed_matrix_bytes(fmt: str, n: int, k: int, group: int, affine: bool = False, scale_dtype: str = "fp32",
                        shared_scales: bool = False, codebook: Optional[str] = None) -> int:
    """Bytes of one [n, k] matrix in the engine's packed layout (csrc/formats/layout.h), scales (of
    ``scale_dtype``; an affine matrix's mins, stored as the scales are, beside them (k4: in the scales' bytes but for
    their fp16 super mins; a zero-point dtype: one byte each); fp8 ``shared_scales``: one per 16 rows) included."""
    if fmt == "grid":
        return grid_matrix_bytes(codebook, n, k)
    group = BF16_GROUP if fmt == "bf16" else (group or 128)
    n_blocks, kp = -(-n // ROWS), -(-k // group) * group
    data = n_blocks * data_lines(fmt, kp) * LINE
    shared = shared_scales and fmt == "fp8"
    if fmt == "bf16":
        return data
    scales = set_bytes(n_blocks, kp, group, scale_dtype, shared)
    return data + scales + (min_set_bytes(n_blocks, kp, group, scale_dtype) if affine else 0)


def expert_bytes(fmt: str, hidden: int, inter: int, group: int) -> int:
    """One routed expert (gate + up [I, H], down [H, I]) packed (fp8: as FP8_LAYOUTS[group] holds it)."""
    extra = FP8_LAYOUTS.get(group or 128, {}) if fmt == "fp8" else {}
    return (2 * packed_matrix_bytes(fmt, inter, hidden, group, **extra)
            + packed_matrix_bytes(fmt, hidden, inter, group, **extra))


def _pair(value) -> tuple:
    """(gate/up, down) of a CPUExperts argument given once or as a pair."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value, value)


def layout_bytes(layout: dict, hidden: int, inter: int) -> int:
    """One routed expert packed in a code layout (CPUExperts' keyword arguments, hetmoe/cpu/codes.py exact_layout:
    gate/up and down each with its own format, group, scaling and scale dtype), as the engine allocates it."""
    gate_up, down = _pair(layout["weight_format"])
    gu_scaling, down_scaling = _pair(layout.get("scaling", "symmetric"))
    gu_scales, down_scales = _pair(layout.get("scale_dtype", "fp32"))
    gu_shared, down_shared = _pair(layout.get("shared_scales", False))
    gu_book, down_book = _pair(layout.get("codebook"))
    group = layout["group_size"]
    return (2 * packed_matrix_bytes(gate_up, inter, hidden, group, gu_scaling == "affine", gu_scales, gu_shared,
                                    gu_book)
            + packed_matrix_bytes(down, hidden, inter, layout.get("down_group_size") or group,
                                  down_scaling == "affine", down_scales, down_shared, down_book))
