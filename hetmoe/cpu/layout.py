"""The CPU engine's packed layout as Python sees it: its geometry, read from ``hetmoe._C`` (csrc/formats/layout.h is
the one source), and the bytes of one matrix, one routed expert, one expert in a code layout. No torch: the memory
plan adds these up before anything loads; hetmoe/moe/streamed/packed.py and hetmoe/ops/triton/packed.py read the
bytes with these constants."""

from __future__ import annotations

from hetmoe import _C

VERSION = _C.LAYOUT_VERSION  # bumped whenever the packed bytes change (the expert cache keys on it)
ROWS = _C.LAYOUT["rows_per_block"]  # rows of a row block
LINE = _C.LAYOUT["line_bytes"]  # bytes of a line: the same 4-byte slice of K for each of the ROWS rows
BF16_GROUP = _C.LAYOUT["bf16_group"]  # K padding unit of bf16, which has no scales
K_PER_LINE = dict(_C.LAYOUT["k_per_line"])  # values of K per line, per format

def packed_matrix_bytes(fmt: str, n: int, k: int, group: int, affine: bool = False) -> int:
    """Bytes of one [n, k] matrix in the engine's packed layout (csrc/formats/layout.h), scales (and an affine
    matrix's mins, one fp32 beside each scale) included."""
    group = BF16_GROUP if fmt == "bf16" else (group or 128)
    rows, kp = -(-n // ROWS) * ROWS, -(-k // group) * group
    data = rows * kp * LINE // (ROWS * K_PER_LINE[fmt])
    scales = 0 if fmt == "bf16" else rows * (kp // group) * 4 * (2 if affine else 1)
    return data + scales


def expert_bytes(fmt: str, hidden: int, inter: int, group: int) -> int:
    """One routed expert (gate + up [I, H], down [H, I]) packed."""
    return 2 * packed_matrix_bytes(fmt, inter, hidden, group) + packed_matrix_bytes(fmt, hidden, inter, group)


def layout_bytes(layout: dict, hidden: int, inter: int) -> int:
    """One routed expert packed in a code layout (CPUExperts' keyword arguments, hetmoe/cpu/codes.py exact_layout:
    gate/up and down each with its own format, group and scaling), as the engine allocates it."""
    fmt = layout["weight_format"]
    gate_up, down = fmt if isinstance(fmt, tuple) else (fmt, fmt)
    scaling = layout.get("scaling", "symmetric")
    gu_scaling, down_scaling = scaling if isinstance(scaling, tuple) else (scaling, scaling)
    group = layout["group_size"]
    return (2 * packed_matrix_bytes(gate_up, inter, hidden, group, gu_scaling == "affine")
            + packed_matrix_bytes(down, hidden, inter, layout.get("down_group_size") or group,
                                  down_scaling == "affine"))
