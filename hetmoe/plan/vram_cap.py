"""--gpu-memory made binding while the engine runs: torch's caching allocator is limited so that what it reserves
plus what the process holds on the GPU outside torch stays within the cap.

The plan (placement.py) adds up what torch will allocate and counts CUDA_CONTEXT_BYTES for the rest. At run time
torch's caching allocator keeps freed blocks reserved, in segments of the sizes first asked for, and its reserved
bytes can pass the plan by gigabytes while what it has allocated stays within it (issue 51). With a cap on a GPU
this machine has:

* ``prepare``: expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), unless the user set the
  allocator's variable: a segment grows and shrinks in place, so memory freed by one size serves another. Set
  before CUDA initialises (the allocator reads it once);
* ``measure`` -> ``VramLimit``: torch's reserved bytes are limited to ``cap - reserve``, reserve the larger of the
  plan's CUDA_CONTEXT_BYTES and what ``mem_get_info`` shows outside torch now plus LATE_CUDA_BYTES (kernel modules
  load on first use, after the plan); ``set_per_process_memory_fraction(limit / total)`` then makes torch free its
  cached blocks and retry before it would pass the limit, and raise ``torch.OutOfMemoryError`` where it still would;
* ``bind``: the limit holds while the plan that set it is alive (the model holding it); when the last such plan is
  collected the fraction goes back to 1. A plan without a cap sets nothing.

mem_get_info cannot tell this process's memory from other processes' on the same GPU: more than SHARED_GPU_BYTES
outside torch is taken as theirs, and the plan's CUDA_CONTEXT_BYTES is reserved instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

from hetmoe import envs
from hetmoe.config.units import gib

if TYPE_CHECKING:
    import torch

# What a process holds on the GPU outside torch's allocator (the CUDA context, cuBLAS/cuBLASLt handles, the kernel
# modules of torch, Triton and the engine), from what a long capped run measured outside torch, rounded up
# (BENCHMARKS.md "Long prompts under a VRAM cap"); the plan counts it as "CUDA context".
CUDA_CONTEXT_BYTES = 800 << 20
# Outside torch, loaded after the plan measured it: CUDA loads a kernel's module when it first runs (lazy loading),
# so the bytes outside torch grow during the first prefills and decodes (docs/running.md#the-vram-cap).
LATE_CUDA_BYTES = 256 << 20
# More than this outside torch when the plan is made is not one process's CUDA context: other processes share the
# GPU (mem_get_info counts them too); their bytes are not this process's to cap.
SHARED_GPU_BYTES = 2 << 30
ALLOC_CONF = "expandable_segments:True"


@dataclass(frozen=True)
class VramLimit:
    """torch's allocator limit for a --gpu-memory ``cap`` on a GPU of ``total`` bytes with ``outside`` bytes held
    outside torch when it was measured: ``reserve`` kept for outside torch, ``limit`` = cap - reserve for torch's
    reserved bytes, ``fraction`` = limit / total (at most 1) as torch takes it. ``shared``: ``outside`` was more than
    one process's (other processes on the GPU), so ``reserve`` is the plan's CUDA_CONTEXT_BYTES."""

    cap: int
    total: int
    outside: int
    reserve: int
    limit: int
    fraction: float
    shared: bool = False
    expandable: Optional[bool] = None  # expandable segments set by hetmoe (None: not known)

    def describe(self) -> str:
        why = (f"{gib(self.outside)} outside torch now, other processes' too; this process's counted as "
               f"{gib(self.reserve)}" if self.shared else
               f"{gib(self.reserve)} kept for the CUDA context and kernels: the larger of {gib(CUDA_CONTEXT_BYTES)} "
               f"and {gib(self.outside)} outside torch now + {gib(LATE_CUDA_BYTES)} for kernels loaded later")
        return (f"torch's allocator is limited to {gib(self.limit)} of this GPU's {gib(self.total)} (--gpu-memory "
                f"{gib(self.cap)} less {why})")


def vram_limit(cap: int, total: int, outside: int, context: int = CUDA_CONTEXT_BYTES, late: int = LATE_CUDA_BYTES,
               shared_above: int = SHARED_GPU_BYTES) -> VramLimit:
    """The ``VramLimit`` of ``cap`` bytes on a GPU of ``total`` bytes with ``outside`` bytes outside torch now:
    reserve = max(context, outside + late) (``context`` alone when ``outside`` > ``shared_above``), limit = cap -
    reserve, fraction = min(1, limit / total). MemoryError, saying what the reserve holds, when nothing is left
    for torch."""
    shared = outside > shared_above
    reserve = context if shared else max(context, outside + late)
    limit = cap - reserve
    if limit <= 0:
        raise MemoryError(
            f"--gpu-memory {gib(cap)} leaves nothing for the model: {gib(reserve)} of it is kept for what the process "
            f"holds on the GPU outside torch (the CUDA context and kernel modules: the larger of {gib(context)} and "
            f"{gib(outside)} outside torch now + {gib(late)} for kernels loaded later). Give a larger --gpu-memory.")
    return VramLimit(cap, total, outside, reserve, limit, min(1.0, limit / total), shared)


_prepared = False  # PYTORCH_CUDA_ALLOC_CONF set by prepare in this process


def prepare() -> Optional[bool]:
    """Expandable segments for torch's CUDA allocator unless the user configured it (PYTORCH_CUDA_ALLOC_CONF or
    torch's newer PYTORCH_ALLOC_CONF set): True when set here (now or by an earlier call), False when the user's
    stands, None when CUDA was initialised first (the allocator has read its configuration; nothing is changed)."""
    import torch

    global _prepared
    ours = envs.get("PYTORCH_CUDA_ALLOC_CONF")
    if ours is not None or envs.get("PYTORCH_ALLOC_CONF") is not None:
        return _prepared and ours == ALLOC_CONF
    if torch.cuda.is_initialized():
        return None
    envs.set_default("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    _prepared = True
    return True


def measure(device: torch.device, cap: int) -> VramLimit:
    """``prepare``, then the ``VramLimit`` of ``cap`` on ``device`` from what mem_get_info shows there now (the
    first CUDA call of a run: it creates the context). Sets nothing: ``bind`` does, once the plan fits."""
    import torch

    expandable = prepare()
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))
    return replace(vram_limit(cap, total, outside), expandable=expandable)


# device index -> [(token, fraction)] of the plans alive that set a limit there, oldest first: the newest one's holds
_held: dict = {}


def bind(plan, lim: VramLimit) -> None:
    """Limit torch's allocator on ``plan.device`` to ``lim`` while ``plan`` is alive (the newest live plan's limit
    holds; none alive: fraction 1, torch's default)."""
    import torch

    index = plan.device.index if plan.device.index is not None else torch.cuda.current_device()
    token = object()
    _held.setdefault(index, []).append((token, lim.fraction))
    torch.cuda.set_per_process_memory_fraction(float(lim.fraction), index)
    weakref.finalize(plan, _unbind, index, token).atexit = False  # (at exit there is nothing left to limit)


def _unbind(index: int, token: object) -> None:
    import torch

    held = [h for h in _held.get(index, []) if h[0] is not token]
    _held[index] = held
    torch.cuda.set_per_process_memory_fraction(float(held[-1][1]) if held else 1.0, index)


def held_fraction(index: int) -> Optional[float]:
    """The fraction a live plan holds on CUDA device ``index``, or None."""
    held = _held.get(index)
    return held[-1][1] if held else None
