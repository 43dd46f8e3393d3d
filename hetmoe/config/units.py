"""Sizes as users type them and as every message writes them: one style for bytes (``gib``), one parser
(``parse_size``), one way to wrap a list into lines (``wrap``). No torch."""

from __future__ import annotations

import re


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
