"""Bytes: what the engine's packed experts take, what this machine has free, and how plans write them (one
style in every message)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def gib(n: int) -> str:
    """Bytes in one style everywhere: MiB with one decimal below 1 GiB, GiB with two from there."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def wrap(head: str, items: list, width: int = 100, indent: str = "hetmoe:     ", sep: str = ",") -> list:
    """``head`` then ``items`` (each but the last followed by ``sep``), as lines of at most ``width`` columns;
    continuation lines start with ``indent``. An item longer than a line (a path) overflows on a line of its own."""
    lines, line, fresh = [], head, True
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else "")
        if not fresh and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line, fresh = indent + piece, False
        else:
            line, fresh = f"{line} {piece}", False
    return lines + [line]


# Units of a size: a bare letter and "i" forms are powers of 1024 (K, KiB, G, GiB: as `free -g` and llama.cpp);
# "B" after a letter without "i" is a power of 1000 (KB, GB, TB: as disks are sold).
_UNITS = {"": 1, "b": 1, **{f"{u}{s}": (1 << 10 * (i + 1)) for i, u in enumerate("kmgt") for s in ("", "i", "ib")},
          **{f"{u}b": 1000 ** (i + 1) for i, u in enumerate("kmgt")}}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value, name: str = "size") -> int:
    """Bytes of a size as typed: ``24GiB``, ``24G``, ``500MiB``, ``1.5TB``, ``1048576`` (bytes), or an int. A bad
    one is a ValueError naming ``name`` (the flag) and the forms allowed."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.fullmatch(value) if isinstance(value, str) else None
        unit = _UNITS.get(m[2].lower()) if m else None
        n = int(float(m[1]) * unit) if unit else None
    if n is None or n < 1:
        raise ValueError(f"{name}: expected a size such as 24GiB, 24G, 500MiB, 1.5TB or a number of bytes, got "
                         f"{value}")
    return n


def free_ram() -> int:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_vram(device: torch.device) -> int:
    import torch

    return torch.cuda.mem_get_info(device)[0]


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
