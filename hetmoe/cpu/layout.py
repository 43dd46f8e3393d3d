"""Bytes of the CPU engine's packed layout (csrc/formats/layout.h): one matrix, one routed expert, one expert in a
code layout. No torch: the memory plan adds these up before anything loads."""

from __future__ import annotations


def packed_matrix_bytes(fmt: str, n: int, k: int, group: int, affine: bool = False) -> int:
    """Bytes of one [n, k] matrix in the engine's packed layout (csrc/formats/layout.h), scales (and an affine
    matrix's mins, one fp32 beside each scale) included."""
    group = 32 if fmt == "bf16" else (group or 128)
    rows, kp = -(-n // 16) * 16, -(-k // group) * group
    data = rows * kp * {"bf16": 2, "int8": 1, "int4": 1}[fmt] // (2 if fmt == "int4" else 1)
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
