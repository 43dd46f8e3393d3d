"""Every environment variable hetmoe reads (or sets for a library it runs), declared once: name, type, default, why.

Values are read when they are asked for (``envs.HETMOE_PDL``), never at ``import hetmoe``, so a test or a script
that sets a variable before the first use sees it. Nothing else in the package touches ``os.environ``
(tests/test_tree.py checks it). The C++ engine reads one variable, ``HETMOE_MAX_ISA``, through one function
(csrc/runtime/cpu_features.cpp); it is declared here too so that ``hetmoe doctor`` and the docs list it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional


def _switch(text: str) -> bool:
    """A kill switch: "0", "off", "false" or "no" turn it off; anything else leaves it on."""
    return text.strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class Var:
    name: str
    parse: Callable[[str], Any]
    default: Any
    why: str
    owner: str = "hetmoe"  # "hetmoe", or the standard or library that defines it


VARS = {v.name: v for v in (
    Var("HETMOE_MAX_ISA", str, None,
        "the highest CPU kernel level the engine may pick (scalar, avx2, avx512, amx): runs the kernels of a smaller "
        "CPU on this one; read by the C++ engine"),
    Var("HETMOE_API_KEY", str, None,
        "the API key `hetmoe serve` requires when neither --api-key nor --api-key-file is given: a key kept out "
        "of the command line, which other users of the machine can read in the process list"),
    Var("HETMOE_PDL", _switch, True,
        "0 turns off programmatic dependent launch of the decode step's Triton kernels (a kill switch for drivers "
        "that mishandle it)"),
    Var("TRITON_INTERPRET", lambda s: s.strip() == "1", False,
        "Triton's interpreter (kernels run on the CPU, for tests); read by Triton at its import", owner="triton"),
    Var("XDG_CACHE_HOME", str, None, "where the converted-expert cache goes (default ~/.cache/hetmoe/experts)",
        owner="XDG"),
    Var("XDG_STATE_HOME", str, None, "where `hetmoe chat` keeps its input history (default ~/.local/state/hetmoe)",
        owner="XDG"),
    Var("PYTORCH_CUDA_ALLOC_CONF", str, None,
        "torch's CUDA allocator settings; under a --gpu-memory cap hetmoe sets expandable_segments:True unless this "
        "or PYTORCH_ALLOC_CONF is given, before CUDA initialises (hetmoe/plan/vram_cap.py: memory freed by one size "
        "serves another within the cap)", owner="torch"),
    Var("PYTORCH_ALLOC_CONF", str, None,
        "torch's newer name for PYTORCH_CUDA_ALLOC_CONF; when given, hetmoe sets neither", owner="torch"),
    Var("OMP_WAIT_POLICY", str, None,
        "the command line sets PASSIVE unless given: OpenMP threads of torch spinning beside the expert pool's "
        "pinned workers slow both", owner="OpenMP"),
)}
# Recorded in a benchmark's JSON (they change CPU timings), never read for a decision.
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "OMP_PROC_BIND", "GOMP_SPINCOUNT")
# Recorded in a GPU benchmark's JSON (they change how torch's allocator reserves VRAM), never read for a decision.
ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def get(name: str) -> Any:
    """The value of a declared variable now: parsed, or its default when unset or blank."""
    var = VARS[name]
    raw = os.environ.get(name)
    return var.default if raw is None or not raw.strip() else var.parse(raw)


def set_default(name: str, value: str) -> None:
    """Set a declared variable for this process and its children unless the user set it."""
    if name not in VARS:
        raise KeyError(f"{name} is not declared in hetmoe/envs.py")
    os.environ.setdefault(name, value)


def snapshot(names: tuple = THREAD_VARS) -> dict:
    """The variables of ``names`` that are set, as typed (for benchmark records)."""
    return {k: os.environ[k] for k in names if k in os.environ}


def __getattr__(name: str) -> Optional[Any]:
    if name in VARS:
        return get(name)
    raise AttributeError(f"module 'hetmoe.envs' has no attribute {name!r}")
