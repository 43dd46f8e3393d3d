"""How a layer's packed experts reach the GPU in the layerwise prefill (hetmoe/moe/streamed/layerwise.py): the engine's
storage registered with the driver (``HostMemory``: DMA straight from it), and the copies of a slot. Each of a layer's
storage ranges holds the experts one after another (hetmoe/moe/streamed/packed.py), so the GPU's experts [0, n) are a
prefix of every range (the whole layer, or all but the CPU's share), and a set of experts is a few runs of consecutive
ones.

**Routed-only copying.** When a chunk's T·k (token, expert) pairs are few against the E experts, many experts get
no token; then a layer's copy waits for its router: the experts it routes to are read back to the host
(``routed_experts``: one synchronization per layer, microseconds against a copy of milliseconds) and only their
bytes are copied, packed one after another into the slot (``copy_experts``), the routing renumbered to match. The copy
can no longer start a layer ahead (it needs the layer's own routing), so this pays only where it moves far fewer
bytes (``prefill_choice.wants_routed_only``).

Shape letters: T tokens, k experts per token, E experts.
"""

from __future__ import annotations

import torch


class HostMemory:
    """The engine's storage ranges registered with the CUDA driver (page-locked in place), so that copies from them
    are DMA transfers that run on a stream, without a staging copy. ``cudaHostRegister`` through PyTorch's binding of
    the CUDA runtime. Ranges are counted per process: a range inside one registered already (a second prefill over
    the same engine) takes a reference to it instead of a second registration, which the driver refuses (and whose
    error a later kernel launch would report)."""

    _live: dict = {}  # start -> [end, references] of the ranges this process registered

    def __init__(self, tensors: list):
        self.ptrs = []
        cudart = torch.cuda.cudart()
        for t in tensors:
            lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            outer = next((s for s, (e, _) in self._live.items() if s <= lo and hi <= e), None)
            if outer is not None:
                self._live[outer][1] += 1
                self.ptrs.append(outer)
                continue
            err = cudart.cudaHostRegister(lo, hi - lo, 0)
            if int(getattr(err, "value", err)) != 0:
                self.close()
                raise RuntimeError(f"cudaHostRegister of {t.numel() / 2**20:.0f} MiB of expert storage failed "
                                   f"(error {int(getattr(err, 'value', err))})")
            self._live[lo] = [hi, 1]
            self.ptrs.append(lo)

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        for p in self.ptrs:
            entry = self._live.get(p)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                del self._live[p]
                cudart.cudaHostUnregister(p)
        self.ptrs = []


def routed_experts(ids: torch.Tensor, num_experts: int) -> tuple:
    """The experts that ``ids`` [T, k] (-1: skipped) routes to, ascending, as a host list (this synchronizes), and
    ids renumbered to their positions in it (-1 kept) -> (experts, ids [T, k])."""
    flat = torch.where(ids >= 0, ids, num_experts)  # skipped slots in a bucket of their own
    used = torch.bincount(flat.reshape(-1), minlength=num_experts + 1)[:num_experts].nonzero().flatten()
    remap = torch.full((num_experts + 1,), -1, dtype=ids.dtype, device=ids.device)
    remap[used] = torch.arange(used.numel(), dtype=ids.dtype, device=ids.device)
    return used.tolist(), remap[flat]


def runs(experts: list) -> list:
    """Ascending expert ids -> [(first expert, count)] of consecutive ones."""
    out: list = []
    for e in experts:
        if out and out[-1][0] + out[-1][1] == e:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((e, 1))
    return out


def copy_experts(dst: list, src: list, per_expert: list, experts=None, n: int = 0) -> None:
    """Into each slot range of ``dst``, from the layer's range of ``src`` (``per_expert`` bytes per expert): the
    ``experts`` listed, one after another, or (None) the first ``n``. Non-blocking copies on the current stream."""
    for d, s, b in zip(dst, src, per_expert):
        if experts is None:
            d[:n * b].copy_(s[:n * b], non_blocking=True)
            continue
        pos = 0
        for first, count in runs(experts):
            d[pos * b:(pos + count) * b].copy_(s[first * b:(first + count) * b], non_blocking=True)
            pos += count
