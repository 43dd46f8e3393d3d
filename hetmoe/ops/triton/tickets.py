"""Split reductions in one kernel: the last program of a split group to finish combines the group's partials.

A kernel that splits one output over several programs (split-K in ``triton_linear``) used to write fp32 partials
and leave their sum to a second kernel. In a decode step that second kernel is one more graph node per linear call,
each costing its launch gap. Here
every program stores its partial and takes a ticket from a per-group counter; the program that draws the last
ticket reads the group's partials back (in split order, so the sum is the same bitwise as the second kernel's) and
writes the result. That program also resets the counter, so the buffer is all zeros between launches and a CUDA
graph replays the kernel without a memset.

Ordering: each program's threads finish their stores, meet at a barrier, and one thread's acquire-release atomic
at GPU scope publishes them; the last program's partial loads bypass L1 (``.cg``). Tests turn
``ENABLED`` off to check that the second kernel gives the same bits.

Not used by the decode attention (``triton_attention``): there one (row, kv head) has up to 128 splits of up to 512
values per head, and one program merging them serially made the GPU part of a qwen3-30b-a3b step slower (8 layers:
0.524 -> 0.584 ms), where its separate reduce kernel merges them in parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = True  # tests turn it off to check that the second kernel gives the same result
CAPACITY = 1 << 16  # split groups one launch may use; a launch with more takes the second kernel
_COUNTERS: dict = {}


@triton.jit
def last_to_arrive(COUNTERS, group, parts):
    """Whether this program is the last of ``parts`` programs of ``group`` to arrive here; every store it and the
    others made before arriving is visible to that last one, which also resets the counter to zero."""
    tl.debug_barrier()
    ticket = tl.atomic_add(COUNTERS + group, 1, sem="acq_rel", scope="gpu")
    last = ticket == parts - 1
    if last:
        tl.atomic_xchg(COUNTERS + group, 0, sem="relaxed", scope="gpu")
    return last


def counters(device: torch.device, groups: int):
    """The zeroed int32 counters for ``groups`` split groups of a launch on the current stream of ``device``, or
    None where the second kernel must run (turned off, or more groups than CAPACITY). One buffer per stream, kept
    for the process: kernels on one stream run one after another and leave it zeroed, and a captured graph keeps
    pointing at it."""
    if not ENABLED or groups > CAPACITY:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
    return buf
