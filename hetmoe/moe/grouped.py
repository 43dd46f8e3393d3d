"""The routed experts of a long prefill chunk on the GPU as grouped GEMMs, one computation for both GPU prefill paths:

    layerwise (hetmoe/moe/streamed/layerwise.py)   weights unpacked from the CPU engine's packed bytes, streamed over
                                                  PCIe; a partly resident layer adds its resident experts' weights
    resident  (hetmoe/moe/gpu_resident/experts.py) weights unpacked from the resident storage, only the routed ones

Both unpack a layer's weights into one ``WeightScratch`` [n, 2I, H] / [n, H, I] in the model dtype (shared by every
layer of both paths on a device: layers run one after another on the main stream), then ``grouped_swiglu``: the
(token, slot) pairs sorted by expert once, gate+up as one grouped GEMM, SwiGLU, down as one grouped GEMM, and the
weighted sum of each token's slots (hetmoe/ops/triton/grouped.py). No host synchronization and no loop over experts
on a GPU of compute capability 9.0+ with bf16 weights; elsewhere (a CPU, older GPUs, fp32) one loop over the routed
experts after one host synchronization.

Shape letters: T tokens, k slots per token, n experts in the scratch, H hidden size, I intermediate size, M = T·k.
"""

from __future__ import annotations

import sys
import weakref

import torch
import torch.nn.functional as F

from hetmoe.ops.triton import grouped as grouped_triton


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm on x's dtype and device: bf16 on a GPU of compute capability 9.0 or newer."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        print(message, file=sys.stderr)


def counts_of(values: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each of 0 .. n-1 occurs in ``values`` (all in range). ``torch.bincount`` would read the
    maximum back to the host on a GPU (its output size depends on it); this stays on the device."""
    return torch.zeros(n, dtype=torch.int64, device=values.device).index_add_(0, values, torch.ones_like(values))


def grouped_swiglu(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gu: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """The routed experts of every (token, slot) pair: x [T, H], topk_ids / topk_weights [T, k] (-1: skipped; an id
    is a row of the weights), w_gu [n, 2I, H] (gate rows, then up rows), w_down [n, H, I], all in one dtype on x's
    device -> fp32 [T, H]."""
    T, k = topk_ids.shape
    E, two_i, _ = w_gu.shape
    I = two_i // 2
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, E, flat)  # skipped slots sort last, into a bucket no expert reads
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(counts_of(flat, E + 1)[:E], 0)
    if _grouped_mm_ok(w_gu) and grouped_triton.available():
        # every M row goes in, the skipped ones past the last expert's offset, where no GEMM computes: no host sync
        xs = x[order // k].to(w_gu.dtype)  # [M, H]
        try:
            offs = ends.to(torch.int32)
            h = grouped_triton.swiglu(torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offs))  # [M, I]
            y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)  # [M, H]
            pos = torch.empty_like(order)
            pos[order] = torch.arange(order.numel(), device=order.device)  # slot (t, j) -> its sorted row
            return grouped_triton.combine_slots(y, pos.view(T, k), topk_ids, topk_weights)
        except RuntimeError as err:  # a shape the kernel does not take (alignment): the loop below
            _warn_once(f"hetmoe: grouped GEMM unavailable for this shape ({str(err).splitlines()[0]}); "
                       "computing the GPU prefill's experts one at a time")
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    order = order[:int(ends[-1])] if E else order[:0]  # the valid pairs (one host sync per layer)
    tok = order // k
    xs = x[tok].to(w_gu.dtype)  # [n_valid, H]
    y = torch.empty(order.numel(), w_down.shape[1], dtype=xs.dtype, device=xs.device)
    start = 0
    for e, n in enumerate(counts.tolist()):  # one expert at a time (CPU, older GPUs, fp32 models)
        if n:
            gu = xs[start:start + n] @ w_gu[e].T
            y[start:start + n] = (F.silu(gu[:, :I]) * gu[:, I:]) @ w_down[e].T
        start += n
    y = y.float() * topk_weights.reshape(-1)[order].float().unsqueeze(1)
    return torch.zeros(T, w_down.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)


class SortedPairs:
    """A layer's (token, slot) pairs sorted by the scratch position their expert takes, for computing the layer a
    group of experts at a time (``swiglu_rows``): ``tok`` int64 [M] (each sorted row's token), ``order`` int64 [M]
    (its flat slot t·k + j), ``pos`` int64 [T, k] (each slot's sorted row), ``ends`` int64 [P] on the device and
    ``ends_host`` (the same, a list): where each position's rows end. Slots of no position sort last, past
    ``ends[-1]``."""

    def __init__(self, order: torch.Tensor, pos: torch.Tensor, ends: torch.Tensor, k: int):
        self.order, self.pos, self.ends = order, pos, ends
        self.tok = order // k
        self.ends_host = ends.tolist()  # the one host synchronization of a layer computed in groups

    def start(self, p: int) -> int:
        """The first sorted row of position p."""
        return self.ends_host[p - 1] if p else 0

    def rows(self, p0: int, p1: int) -> int:
        """How many rows positions p0 .. p1-1 hold."""
        return self.start(p1) - self.start(p0)


def sort_pairs(positions: torch.Tensor, n: int) -> SortedPairs:
    """positions [T, k] (each slot's scratch position in [0, n), -1: none) -> ``SortedPairs`` (one host sync)."""
    T, k = positions.shape
    flat = positions.reshape(-1).long()
    flat = torch.where(flat < 0, n, flat)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(counts_of(flat, n + 1)[:n], 0)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return SortedPairs(order, pos.view(T, k), ends, k)


def swiglu_rows(x: torch.Tensor, pairs: SortedPairs, p0: int, p1: int, topk_weights: torch.Tensor,
                w_gu: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor, max_rows: int) -> None:
    """The routed experts of positions p0 .. p1-1 (their weights: rows 0 .. p1-p0-1 of w_gu [., 2I, H] / w_down
    [., H, I]) on their rows of ``pairs``, at most ``max_rows`` rows at a time (bounded activations), weighted by
    topk_weights [T, k] and added to out fp32 [T, H] (contiguous). On a GPU with grouped GEMMs the sums go through
    the combine kernel in slot order (reproducible); elsewhere one expert at a time (``index_add_``)."""
    first, last = pairs.start(p0), pairs.start(p1)
    fast = _grouped_mm_ok(w_gu) and grouped_triton.available()
    I = w_down.shape[2]
    for a in range(first, last, max(1, int(max_rows))):
        b = min(last, a + max_rows)
        tok = pairs.tok[a:b]
        xs = x[tok].to(w_gu.dtype)  # [b - a, H]
        if fast:
            try:
                offs = (pairs.ends[p0:p1] - a).clamp(0, b - a).to(torch.int32)
                h = grouped_triton.swiglu(torch._grouped_mm(xs, w_gu[:p1 - p0].transpose(1, 2), offs=offs))
                y = torch._grouped_mm(h, w_down[:p1 - p0].transpose(1, 2), offs=offs)  # [b - a, H]
                local = pairs.pos - a  # [T, k]: each slot's row in this window
                inside = (local >= 0) & (local < b - a)
                grouped_triton.combine_slots(y, local.clamp(min=0), torch.where(inside, 0, -1), topk_weights, out)
                continue
            except RuntimeError as err:  # a shape the kernel does not take (alignment): the loop below
                _warn_once(f"hetmoe: grouped GEMM unavailable for this shape ({str(err).splitlines()[0]}); "
                           "computing the GPU prefill's experts one at a time")
                fast = False
        y = torch.empty(b - a, w_down.shape[1], dtype=xs.dtype, device=xs.device)
        for p in range(p0, p1):
            s, e = max(a, pairs.start(p)), min(b, pairs.start(p + 1))
            if s < e:
                gu = xs[s - a:e - a] @ w_gu[p - p0].T
                y[s - a:e - a] = (F.silu(gu[:, :I]) * gu[:, I:]) @ w_down[p - p0].T
        w = topk_weights.reshape(-1)[pairs.order[a:b]].float().unsqueeze(1)
        out.index_add_(0, tok, y.float() * w)


class WeightScratch:
    """One layer's expert weights in the model dtype: ``w_gu`` [n, 2I, H] (gate rows, then up rows) and ``w_down``
    [n, H, I], grown to the most experts asked for (``reserve``). Get it with ``weight_scratch``: one per (device,
    dtype, H, I) while something holds it, shared by every layer of the layerwise and the resident prefill."""

    def __init__(self, device: torch.device, dtype: torch.dtype, hidden: int, intermediate: int):
        self.device, self.dtype, self.hidden, self.intermediate = device, dtype, hidden, intermediate
        self.w_gu = torch.empty(0, 2 * intermediate, hidden, dtype=dtype, device=device)
        self.w_down = torch.empty(0, hidden, intermediate, dtype=dtype, device=device)

    @property
    def experts(self) -> int:
        return self.w_gu.shape[0]

    @property
    def nbytes(self) -> int:
        return self.w_gu.nbytes + self.w_down.nbytes

    def reserve(self, n: int) -> tuple:
        """(w_gu [n, 2I, H], w_down [n, H, I]): the first n experts' rows, the buffers grown first if they hold fewer
        (the old ones freed: a grown scratch is not read by anything queued before, as layers run in order)."""
        if n > self.experts:
            H, I = self.hidden, self.intermediate
            self.w_gu = self.w_down = None
            self.w_gu = torch.empty(n, 2 * I, H, dtype=self.dtype, device=self.device)
            self.w_down = torch.empty(n, H, I, dtype=self.dtype, device=self.device)
        return self.w_gu[:n], self.w_down[:n]


_scratches: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def weight_scratch(device, dtype: torch.dtype, hidden: int, intermediate: int) -> WeightScratch:
    """The ``WeightScratch`` of (device, dtype, H, I): the one that exists while any holder keeps it, else a new one
    (empty until ``reserve``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype, int(hidden), int(intermediate))
    scratch = _scratches.get(key)
    if scratch is None:
        scratch = WeightScratch(device, dtype, int(hidden), int(intermediate))
        _scratches[key] = scratch
    return scratch
