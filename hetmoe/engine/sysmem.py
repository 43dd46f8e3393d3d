"""Bytes: what the engine's packed experts take, what this machine has free, and how plans write them (one
style in every message)."""

from __future__ import annotations

import os
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


def packed_matrix_bytes(fmt: str, n: int, k: int, group: int) -> int:
    """Bytes of one [n, k] matrix in the engine's packed layout (csrc/formats/layout.h), scales included."""
    group = 32 if fmt == "bf16" else (group or 128)
    rows, kp = -(-n // 16) * 16, -(-k // group) * group
    data = rows * kp * {"bf16": 2, "int8": 1, "int4": 1}[fmt] // (2 if fmt == "int4" else 1)
    scales = 0 if fmt == "bf16" else rows * (kp // group) * 4
    return data + scales


def expert_bytes(fmt: str, hidden: int, inter: int, group: int) -> int:
    """One routed expert (gate + up [I, H], down [H, I]) packed."""
    return 2 * packed_matrix_bytes(fmt, inter, hidden, group) + packed_matrix_bytes(fmt, hidden, inter, group)
