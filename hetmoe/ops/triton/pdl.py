"""Programmatic dependent launch (PDL) between the decode step's Triton kernels.

In a CUDA graph each kernel node normally starts only once the node before it has finished and its memory is
flushed: a gap of a microsecond or two per node, and a decode step is some 17 kernels per layer. A kernel launched
with PDL (``launch_pdl``, Hopper and later) may be scheduled while its predecessor still runs: its programs start,
then wait at ``griddepcontrol.wait`` until the predecessor has completed and its writes are visible. The wait is at
the top of every kernel that takes part (``pdl_begin``), before it reads or writes any global memory, so the data
order is the same as without PDL; only the launch and the programs' scheduling overlap the predecessor's tail.
Right after the wait, a program signals ``griddepcontrol.launch_dependents``, so the next kernel is scheduled once
every program of this one has passed its wait. A kernel after a non-kernel node (a copy, a host function) or launched
without the attribute waits as usual, so the CPU jobs' ordering on the stream is untouched.

What it saves on an H200: BENCHMARKS.md, "GPU part of the decode step". ``HETMOE_PDL=0`` turns it off (an
A/B: bench/device/gpu_step_profile.py); without a GPU of compute capability 9.0 or more, and under Triton's
interpreter, kernels launch as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from hetmoe import envs

_CAPABLE: dict = {}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """First statement of a kernel launched with ``launch``'s arguments: wait for the predecessor, then let the
    successor be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL: on, a CUDA device of compute capability >= 9.0, not Triton's
    interpreter (``HETMOE_PDL`` and ``TRITON_INTERPRET`` read at a device's first launch)."""
    if device.type != "cuda":
        return False
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _CAPABLE:
        _CAPABLE[key] = (envs.HETMOE_PDL and not envs.TRITON_INTERPRET
                         and torch.cuda.get_device_capability(key) >= (9, 0))
    return _CAPABLE[key]


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel taking ``PDL: tl.constexpr`` (and calling ``pdl_begin(PDL)`` first)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}
