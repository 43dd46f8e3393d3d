"""Sizes as users type them and as every message writes them: one style for bytes (``gib``), one parser
(``parse_size``), one way to wrap a list into lines (``wrap``), one way to show progress (``show_progress``).
No torch."""

from __future__ import annotations

import re
import sys
import time
from typing import Callable, Optional, TextIO


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


class _Lines:
    """Progress for a log (a stream that is not a terminal): a plain line at most every ``every_s`` seconds, no
    carriage returns, nothing at all for work shorter than that."""

    def __init__(self, total: int, desc: str, unit: str, say: Callable[[str], None], every_s: float):
        self.total, self.desc, self.unit, self.say, self.every_s = total, desc, unit, say, every_s
        self.n, self.t0 = 0, time.perf_counter()
        self.last = self.t0

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        if now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            self.say(f"hetmoe: {self.desc} {self.n}/{self.total} {self.unit}s ({now - self.t0:.0f} s)")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def show_progress(total: int, desc: str, unit: str, enabled: bool = True, stream: Optional[TextIO] = None,
             say: Optional[Callable[[str], None]] = None, every_s: float = 30.0):
    """Progress of ``total`` ``unit``s of work, used as ``with progress(...) as bar: bar.update(n)``: on a terminal
    a tqdm bar on ``stream`` (stderr), cleared when done; in a log (``stream`` not a TTY) no bar, only a plain line
    through ``say`` (printed to ``stream`` by default) every ``every_s`` seconds; nothing when not ``enabled``."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if enabled and isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False)
    return _Lines(total, desc, unit, (say or (lambda m: print(m, file=stream, flush=True))) if enabled else _quiet,
                  every_s)


def _quiet(message: str) -> None:
    pass


# Units of a size: a bare letter and "i" forms are powers of 1024 (K, KiB, G, GiB: as `free -g` and llama.cpp);
# "B" after a letter without "i" is a power of 1000 (KB, GB, TB: as disks are sold).
_UNITS = {"": 1, "b": 1, **{f"{u}{s}": (1 << 10 * (i + 1)) for i, u in enumerate("kmgt") for s in ("", "i", "ib")},
          **{f"{u}b": 1000 ** (i + 1) for i, u in enumerate("kmgt")}}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


BARE_MIN = 1 << 20  # a number without a unit below this is refused: "--gpu-memory 24" meant 24 GiB, not 24 bytes


def parse_size(value, name: str = "size") -> int:
    """Bytes of a size as typed: ``24GiB``, ``24G``, ``500MiB``, ``1.5TB``, ``1048576`` (bytes), or an int. A bad
    one is a ValueError naming ``name`` (the flag) and the forms allowed; so is a number without a unit (an int
    included) below 1 MiB, which is a unit forgotten, not a budget (``500B`` says bytes on purpose)."""
    bare = isinstance(value, int) and not isinstance(value, bool)
    if bare:
        n = number = value
    else:
        m = _SIZE.fullmatch(value) if isinstance(value, str) else None
        unit = _UNITS.get(m[2].lower()) if m else None
        n = int(float(m[1]) * unit) if unit else None
        bare, number = m is not None and not m[2], float(m[1]) if m else 0
    if bare and 0 < number < BARE_MIN:
        number = str(value).strip()  # as typed
        raise ValueError(f"{name}: {number} bytes is too small; did you mean {number}GiB? (a number without a unit "
                         "is bytes)")
    if n is None or n < 1:
        raise ValueError(f"{name}: expected a size such as 24GiB, 24G, 500MiB, 1.5TB or a number of bytes, got "
                         f"{value}")
    return n
