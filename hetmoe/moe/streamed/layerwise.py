"""Layerwise GPU prefill: a dispatch path of the MoE layer for long prompts. Each MoE layer's routed experts are
computed on the GPU from the CPU engine's own packed bytes, streamed over PCIe one layer ahead of the compute.

Per forward call (a prefill chunk of T >= ``min_tokens`` tokens), with S slots (default 2) on the GPU:

    start of the call       copy stream: layers 0 .. S-1's packed experts -> slots 0 .. S-1   (DMA from the engine's
                                         storage, registered with the driver: no second copy in RAM)
    MoE layer i             main stream: route (hetmoe/moe/router.py); wait for slot i % S's copy (an event);
                                         unpack the packed layout to the model dtype (hetmoe/moe/streamed/packed.py;
                                         grid blocks, GGUF's i-quants: decoded by hetmoe/moe/streamed/grid.py);
                                         gate+up, SwiGLU, down as grouped GEMMs over the tokens sorted by expert
                                         (hetmoe/moe/grouped.py); record "slot free"
                            copy stream: after "slot free", layer i + S -> slot i % S (runs while layers
                                         i + 1 .. i + S - 1 compute)
                            main stream: combine (hetmoe/moe/combine.py) with the shared experts

Events order every slot reuse; nothing synchronizes the device. The whole layer is copied: the copy of layer i + 1
starts before its router has run (that is the overlap), and at the token counts where this path wins, T·k is many
times the number of experts, so nearly every expert is routed to anyway; where T·k is small against E, each layer's
copy waits for its router and moves only the routed experts (hetmoe/moe/streamed/copy.py). While the link is the
bottleneck, the CPU engine computes the last c experts of each layer at the same time, and only the first E - c are
copied (hetmoe/moe/streamed/cpu_share.py; c chosen per chunk from the measured rates). Expert Deferral is a decode
feature: here every expert is computed exactly once, on the layer's own input.

**Partly resident layers** (``--gpu-experts``): only the S experts of a layer that are not resident on the GPU are
streamed (a few runs of consecutive ones: copy.py), the CPU's share is the last ~c·S/E of those, and the resident
experts' weights are unpacked from their own storage (``GpuExperts.unpack_into``: only the routed ones) into the
same scratch, after the streamed ones: one grouped GEMM per projection over both. Scratch rows of a layer: its
streamed experts the GPU computes, in order, then its N resident ones, in resident order (``_rows``).

**Expert groups** (``group`` G < E: a budget without room for whole layers): a slot holds G experts; a call's
units are each layer's GPU experts in runs of G, queued in forward order, and a unit's copy is issued once the unit
S places before it has been computed, so the copies run ahead into the next layers as far as the ring allows. A
layer of several units sorts its rows once (one host sync) and computes each unit's rows on its G experts' weights,
at most ``rows`` rows at a time (hetmoe/moe/grouped.py ``swiglu_rows``), resident experts as further units. Out of
GPU memory inside a layer, that layer and the rest of the call take the CPU engine's path (``_fall_back``).

Shape letters: T tokens, k experts per token, E experts, H hidden size, I intermediate size, M = T·k rows.
"""

from __future__ import annotations

import contextvars
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch

from hetmoe.config.options import parse_cpu_share
from hetmoe.moe.combine import combine
from hetmoe.moe.deferral import drop_lowest
from hetmoe.moe.grouped import grouped_swiglu, sort_pairs, swiglu_rows, weight_scratch
from hetmoe.moe.streamed import choice
from hetmoe.moe.streamed.copy import HostMemory, copy_experts, routed_experts
from hetmoe.moe.streamed.cpu_share import CPUShare
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts
from hetmoe.ops.triton import packed as packed_triton

_current: contextvars.ContextVar = contextvars.ContextVar("hetmoe_layerwise_prefill", default=None)


def current() -> Optional["LayerwisePrefill"]:
    """The layerwise prefill running in this context, or None."""
    return _current.get()


def cpu_layer_seconds(engine, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, repeats: int = 2) -> float:
    """The best of ``repeats`` timed calls of the CPU engine on x [T, H] (the model dtype, as the CPU prefill path
    stages it) routed by ids / weights [T, k]: every expert of the layer computed. An explicit all-False skip mask
    replaces the engine's static one, which leaves out its GPU-resident experts: timed with it, a layer keeping N of
    E experts on the GPU would compute only E - N of them, and its rate would read E / (E - N) times too high (the
    "CPU experts 475642 tok/s" of a layer with 116 of 128 resident)."""
    everything = torch.zeros(engine.num_experts, dtype=torch.bool)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.forward(x, ids, weights, skip_mask=everything)
        times.append(time.perf_counter() - t)
    return min(times)


class LayerwisePrefill:
    """The layerwise GPU prefill of one model's MoE layers (``layers``: MoELayers with the unsplit CPU engine, in
    forward order). ``min_tokens``: the forward calls with at least this many tokens take this path (the runner
    asks ``wants(T)``); ``slots``: GPU buffers of one layer's packed experts each (>= 2: copy one while computing
    another); ``unpack_batch``: experts unpacked at once where PyTorch ops unpack (no Triton). On a CPU ``device``
    (tests) the same path runs without copies, reading the engine's storage directly. ``share``: the CPU's share of
    each layer's experts (a ``CPUShare``, ``enable_share``), or None: every expert on the GPU. ``routed_copy``:
    "auto" (per chunk, ``prefill_choice.wants_routed_only``), "on" or "off": copy only the routed experts."""

    def __init__(self, layers: list, device, dtype: torch.dtype, min_tokens: int, slots: int = 2,
                 unpack_batch: int = 16, group: Optional[int] = None, rows: Optional[int] = None):
        if slots < 2:
            raise ValueError(f"layerwise prefill needs at least 2 slots, got {slots}")
        if (group is not None and group < 1) or (rows is not None and rows < 1):
            raise ValueError(f"layerwise prefill: group (experts per slot) and rows must be >= 1, got {group}, {rows}")
        for layer in layers:  # grouped_swiglu computes plain SwiGLU without biases, never another activation
            if not layer.plain_swiglu:
                raise ValueError(f"layerwise GPU prefill computes plain SwiGLU experts without biases; a layer's are "
                                 f"{layer.glu.kind}{' with biases' if layer.bias else ''} (run them on the CPU)")
        self.device, self.dtype = torch.device(device), dtype
        self.min_tokens, self.n_slots = int(min_tokens), int(slots)
        self.layers = list(layers)
        self._index = {id(layer): i for i, layer in enumerate(self.layers)}
        self.layouts = [ExpertLayout.of(layer.engine) for layer in self.layers]
        self.host = [expert_ranges(layer.engine) for layer in self.layers]
        self.per = [[b for b in lay.range_bytes() if b] for lay in self.layouts]  # bytes per expert of each range
        self.cuda = self.device.type == "cuda"
        self.unpack_n = int(unpack_batch)
        self.triton_unpack = self.cuda and packed_triton.available()  # else PyTorch ops (tests set it on a CPU)
        lay = self.layouts[0] if self.layouts else None
        most = max((lay.num_experts for lay in self.layouts), default=1)
        self.group = most if group is None else min(int(group), most)  # experts a slot holds (E: whole layers)
        self.max_rows = None if rows is None else int(rows)  # (token, expert) rows computed at once (None: T·k)
        self.scratch = None  # a unit's weights in the model dtype, rewritten by every unit (and the resident path)
        if lay is not None:
            self.scratch = weight_scratch(self.device, dtype, lay.hidden, lay.intermediate)
            self.scratch.reserve(min(lay.num_experts, self.group))
        self._streamed_cache: dict = {}  # layer index -> (its GpuExperts or None, its streamed experts)
        self._row_tables: dict = {}  # (layer index, GPU's streamed count) -> (its GpuExperts, expert -> position)
        self._slot_src: list = [None] * self.n_slots  # CPU device: (layer, first expert) read in place, or None
        # the ring: the running call's units (layer, its experts), in issue order; units issued / computed so far
        self._units: list = []
        self._layer_units: dict = {}  # layer index -> its units' indices
        self._issued = self._done = 0
        self.failed: Optional[str] = None  # the running call fell back to the CPU engine (out of GPU memory): why
        self.fallbacks = 0  # forward calls that fell back since construction
        self._registered = None
        self.slots: Optional[list] = None  # CUDA: the copy slots; CPU (tests): made by the first routed-only copy
        if self.cuda:
            self._registered = HostMemory([t for ranges in self.host for t in ranges])
            self.slots = self._slot_buffers()
            self.copy_stream = torch.cuda.Stream(self.device)
            self.copied = [torch.cuda.Event(enable_timing=True) for _ in range(self.n_slots)]
            self.freed = [None] * self.n_slots  # the event after the last compute that read the slot
        self.layers_run = 0  # MoE layers computed here since construction (for reports and tests)
        self.profiling = False  # when on: CUDA events around every copy, every layer's expert compute and CPU share
        self._events: list = []  # (layer, "copy" | "compute" | "cpu" | "idle", start event, end event)
        self.share: Optional[CPUShare] = None
        self.rates: Optional[dict] = None  # the last ``measure()``
        self.cpu_experts = 0  # the CPU's share of each layer's experts in the running forward call
        self.shares: list = []  # (tokens, cpu_experts) of each forward call since profiling was turned on
        self.routed_copy = "auto"
        self.routed_only = False  # the running call copies each layer's routed experts after its router
        self.routed: list = []  # experts copied by each routed-only layer since profiling was turned on

    def enable_share(self, mode="auto", chunk: int = 8192) -> Optional[CPUShare]:
        """Let the CPU engine compute a share of each layer's experts (hetmoe/moe/streamed/cpu_share.py): ``mode``
        "auto" (chosen per chunk from ``self.rates``), "off" (None: no share) or a fixed number of experts, for chunks
        of up to ``chunk`` tokens (auto: the largest with a share at these rates; its staging buffers hold that
        many)."""
        if self.share is not None:
            self.share.close()
            self.share = None
        mode = parse_cpu_share(mode)
        ks = {layer.router.top_k for layer in self.layers}
        if mode == "off" or not self.layers or len(ks) != 1 or (mode == "auto" and self.rates is None):
            return None
        E = self.layouts[0].num_experts
        capacity = choice.share_capacity(self.rates, E, chunk) if mode == "auto" else chunk
        if capacity < 1:
            return None
        self.share = CPUShare(self.layouts[0].hidden, ks.pop(), self.dtype, self.device, capacity, mode, self.rates)
        return self.share

    @property
    def w_gu(self) -> torch.Tensor:
        """The weight scratch's gate/up rows [n, 2I, H]."""
        return self.scratch.w_gu

    @property
    def w_down(self) -> torch.Tensor:
        return self.scratch.w_down

    def streamed(self, i: int) -> list:
        """Layer i's experts this path streams, ascending: those not resident on the GPU (``layer.gpu``)."""
        gpu = self.layers[i].gpu
        cached = self._streamed_cache.get(i)
        if cached is None or cached[0] is not gpu:
            resident = set(gpu.expert_ids) if gpu is not None else set()
            cached = (gpu, [e for e in range(self.layouts[i].num_experts) if e not in resident])
            self._streamed_cache[i] = cached
        return cached[1]

    def cpu_count(self, i: int) -> int:
        """How many of layer i's streamed experts (the last ones) the CPU computes in the running call: the call's
        share of E, scaled to the S streamed experts (a partly resident layer copies S / E of a layer)."""
        S, E = len(self.streamed(i)), self.layouts[i].num_experts
        return min(S, (self.cpu_experts * S + E // 2) // E) if self.cpu_experts else 0

    def _positions(self, i: int, order: list) -> torch.Tensor:
        """int64 [E + 1] on the device: layer i's expert -> its position in the layer's computation when the GPU
        computes the streamed experts ``order`` (ascending; copied in that order): order[j] -> j, resident expert r
        -> len(order) + r; -1 for the others (the CPU's, uncopied) and at index E (where empty slots point)."""
        gpu, n = self.layers[i].gpu, len(order)
        whole = order == self.streamed(i)[:n]  # the usual set: kept (a routed-only set is made per call)
        cached = self._row_tables.get((i, n)) if whole else None
        if cached is None or cached[0] is not gpu:
            E = self.layouts[i].num_experts
            rows = torch.full((E + 1,), -1, dtype=torch.int64)
            rows[order] = torch.arange(n)
            if gpu is not None:
                rows[gpu.expert_ids] = n + torch.arange(gpu.n)
            cached = (gpu, rows.to(self.device))
            if whole:
                self._row_tables[i, n] = cached
        return cached[1]

    def _slot_buffers(self) -> list:
        widths = [max(b * min(self.group, lay.num_experts) for lay, b in zip(self.layouts, col))
                  for col in zip(*self.per)]
        return [[torch.empty(w, dtype=torch.uint8, device=self.device) for w in widths] for _ in range(self.n_slots)]

    @property
    def slot_bytes(self) -> int:
        """GPU memory the slots hold."""
        return sum(t.numel() for slot in self.slots or [] for t in slot)

    def wants(self, n_tokens: int) -> bool:
        return bool(self.layers) and n_tokens >= self.min_tokens

    def drives(self, layer, x: torch.Tensor) -> bool:
        return self.failed is None and id(layer) in self._index and x.device.type == self.device.type

    @contextmanager
    def prefill(self, n_tokens: Optional[int] = None):
        """One forward call of ``n_tokens`` tokens on this path (the CPU's share is chosen for it; None: no
        share): the first slots' copies start now."""
        if current() is not None:
            raise RuntimeError("a layerwise prefill is already running")
        c = 0
        if self.share is not None and n_tokens:
            c = self.share.experts_for(int(n_tokens), min(lay.num_experts for lay in self.layouts))
            if c:
                self.share.start(int(n_tokens))
        if self.profiling and n_tokens:
            self.shares.append((int(n_tokens), c))
        self.cpu_experts = c
        if n_tokens and self.layers and self.routed_copy != "off":
            k, E = self.layers[0].router.top_k, self.layouts[0].num_experts
            self.routed_only = self.routed_copy == "on" or choice.wants_routed_only(int(n_tokens), k, E, self.rates)
        self._units, self._layer_units, self._issued, self._done, self.failed = [], {}, 0, 0, None
        if not self.routed_only:  # every layer's units now: the copies run ahead as far as the ring allows
            for i in range(len(self.layers)):
                self._add_units(i, self.streamed(i)[:self.gpu_experts(i)])
        self._fill()
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)
            self.cpu_experts, self.routed_only = 0, False
            self._units, self._layer_units = [], {}

    def gpu_experts(self, i: int) -> int:
        """How many of layer i's streamed experts (the first ones) the GPU computes in the running call."""
        return len(self.streamed(i)) - self.cpu_count(i)

    def _add_units(self, i: int, experts: list) -> None:
        """Layer i's GPU-computed streamed ``experts`` (ascending) as units of at most ``group`` experts, queued."""
        self._layer_units[i] = []
        for a in range(0, len(experts), self.group):
            self._layer_units[i].append(len(self._units))
            self._units.append((i, experts[a:a + self.group]))

    def _fill(self) -> None:
        """Issue the queued units' copies while the ring has a slot no uncomputed unit holds."""
        while self._issued < len(self._units) and self._issued < self._done + self.n_slots:
            self._issue(self._issued)
            self._issued += 1

    def _issue(self, u: int) -> None:
        """Copy unit u's experts (a few runs of consecutive ones) into slot u % S, one after another, once the unit
        that held the slot before has been computed."""
        i, experts = self._units[u]
        s = u % self.n_slots
        if not self.cuda:  # tests: consecutive experts are read in place; other sets are copied into host "slots"
            first = experts[0]
            in_place = experts == list(range(first, first + len(experts)))
            self._slot_src[s] = (i, first) if in_place else None
            if not in_place:
                if self.slots is None:
                    self.slots = self._slot_buffers()
                copy_experts(self.slots[s], self.host[i], self.per[i], experts)
            return
        with torch.cuda.stream(self.copy_stream):
            if self.freed[s] is not None:
                self.copy_stream.wait_event(self.freed[s])
            start = self._event()
            copy_experts(self.slots[s], self.host[i], self.per[i], experts)
            self.copied[s].record(self.copy_stream)
            if start is not None:  # an end event of its own: copied[s] is recorded again by the slot's next copy
                self._events.append((i, "copy", start, self._event()))

    def _wait(self, u: int) -> None:
        """The main stream waits for unit u's copy."""
        if self.cuda:
            idle = self._event()
            torch.cuda.current_stream(self.device).wait_event(self.copied[u % self.n_slots])
            if idle is not None:
                self._events.append((self._units[u][0], "idle", idle, self._event()))

    def _release(self, u: int) -> None:
        """Unit u has been computed (queued on the main stream): its slot may take the next unit's copy."""
        if u != self._done:
            raise RuntimeError(f"layerwise prefill: unit {u} computed out of order (expected {self._done})")
        if self.cuda:
            s = u % self.n_slots
            self.freed[s] = torch.cuda.Event()
            self.freed[s].record(torch.cuda.current_stream(self.device))
        self._done += 1
        self._fill()

    def _weights(self, u: int) -> tuple:
        """Unit u's experts, from its slot (or the storage), unpacked into the weight scratch, a few experts at a
        time where PyTorch ops unpack (bounded temporaries) -> (w_gu [n, 2I, H], w_down [n, H, I])."""
        i, experts = self._units[u]
        lay, n, s = self.layouts[i], len(experts), u % self.n_slots
        if not self.cuda and self._slot_src[s] is not None:
            first = self._slot_src[s][1]
            ranges = [r[first * b:(first + n) * b] for r, b in zip(self.host[i], self.per[i])]
        else:
            ranges = [dst[:n * b] for dst, b in zip(self.slots[s], self.per[i])]
        w_gu, w_down = self.scratch.reserve(n)
        if self.triton_unpack and not lay.torch_only:  # one pass, straight into the scratch
            packed_triton.unpack_into(lay, ranges, self.w_gu, self.w_down, n)
            return w_gu, w_down
        # (grid matrices: decoded straight into the scratch.) Where Triton is installed the plan counts no PyTorch
        # temporaries (hetmoe/plan/placement.py _torch_unpacks), so its torch_only layers (grid) go an expert at a
        # time
        step = 1 if self.triton_unpack else self.unpack_n
        for e0 in range(0, n, step):
            m = min(step, n - e0)
            unpack_experts(lay, [r[e0 * b:(e0 + m) * b] for r, b in zip(ranges, self.per[i])], m, self.dtype,
                           (w_gu[e0:e0 + m], w_down[e0:e0 + m]))
        return w_gu, w_down

    def run(self, layer, x: torch.Tensor, logits: torch.Tensor, shared=None,
            correction_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """MoE layer ``layer``'s routed (+ ``shared(x)``) output [T, H] in x's dtype, its experts on this device.
        Out of GPU memory (another process took it): this layer and the rest of the call on the CPU engine."""
        i = self._index[id(layer)]
        weights, ids = layer.route(logits, correction_bias)
        if layer.drop:
            ids = drop_lowest(ids, weights, layer.drop)
        streamed, c = self.streamed(i), self.cpu_count(i)
        n = len(streamed) - c  # the streamed experts the GPU computes
        if c:  # the CPU starts on its experts first, the GPU's rows leave them out
            cpu_start, cpu_done = self._event(), self._event(record=False)
            self.share.submit(i, layer.engine, x, ids, weights.float(), streamed[n:], cpu_done)
            if cpu_done is not None:
                self._events.append((i, "cpu", cpu_start, cpu_done))
        order = streamed[:n]
        why = None
        try:
            if self.routed_only:  # the routed ones among them, after this layer's router (a sync)
                pos = self._positions(i, order)[ids.masked_fill(ids < 0, self.layouts[i].num_experts)]
                used, _ = routed_experts(pos.masked_fill(pos >= n, -1), n)
                if self.profiling:
                    self.routed.append(len(used))
                order = [order[u] for u in used]
                self._add_units(i, order)
                self._fill()
            start = self._event()
            y = self._experts(i, x, ids, weights, order)
            if start is not None:
                self._events.append((i, "compute", start, self._event()))
        except torch.OutOfMemoryError as err:  # handled below, once the traceback (and its tensors) is gone
            why = str(err).splitlines()[0] if str(err) else "out of memory"
        if why is not None:
            return self._fall_back(layer, x, logits, shared, correction_bias, why)
        dense = shared(x) if shared is not None else None
        if c:
            wait = self._event()
            y = self.share.add(y)  # cpu + gpu in fp32: combine's order for a layer's parts
            if wait is not None:  # the GPU's wait for the CPU (and the sum)
                self._events.append((i, "idle", wait, self._event()))
        self.layers_run += 1
        return combine(y, None, None, x.dtype, dense)

    def _experts(self, i: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, order: list) -> torch.Tensor:
        """Layer i's experts on the GPU (the streamed ones in ``order``, copied as the layer's units, then its
        resident ones) -> fp32 [T, H]. One unit holding the whole layer: one grouped GEMM per projection over every
        (token, slot) row, no host sync. Several: the rows sorted by position once (one host sync), then each unit's
        weights unpacked (units no row reaches are neither unpacked nor waited for) and its rows computed, at most
        ``max_rows`` at a time, its sums added to the layer's in unit order."""
        E, gpu = self.layouts[i].num_experts, self.layers[i].gpu
        n, N = len(order), (gpu.n if gpu is not None else 0)
        units = self._layer_units.get(i, [])
        pos = self._positions(i, order)[ids.masked_fill(ids < 0, E)]  # [T, k] positions, -1: not the GPU's
        T, k = ids.shape
        if n + N <= self.group and (self.max_rows is None or T * k <= self.max_rows):
            self.scratch.reserve(n + N)  # before the unpack: growing the scratch later would drop its weights
            if units:
                self._wait(units[0])
                self._weights(units[0])
            if not n + N:  # every pair on the CPU, or skipped
                y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            else:
                w_gu, w_down = self.scratch.reserve(n + N)
                if N:  # the resident experts' rows after the streamed ones, only the routed ones unpacked
                    gpu.unpack_into(w_gu[n:], w_down[n:], gpu.used(torch.where(pos >= n, pos - n, -1)))
                y = grouped_swiglu(x, pos, weights, w_gu, w_down)
            if units:
                self._release(units[0])
            return y
        pairs = sort_pairs(pos, n + N)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        rows = self.max_rows or T * k
        p0 = 0
        for u in units:
            p1 = p0 + len(self._units[u][1])
            if pairs.rows(p0, p1):
                self._wait(u)
                w_gu, w_down = self._weights(u)
                swiglu_rows(x, pairs, p0, p1, weights, w_gu, w_down, y, rows)
            self._release(u)
            p0 = p1
        if N and pairs.rows(n, n + N):
            used = gpu.used(torch.where(pos >= n, pos - n, -1))
            for r0 in range(0, N, self.group):
                r1 = min(N, r0 + self.group)
                if pairs.rows(n + r0, n + r1):
                    w_gu, w_down = self.scratch.reserve(r1 - r0)
                    gpu.unpack_into(w_gu, w_down, used[r0:r1], first=r0)
                    swiglu_rows(x, pairs, n + r0, n + r1, weights, w_gu, w_down, y, rows)
        return y

    def _fall_back(self, layer, x, logits, shared, correction_bias, why: str) -> torch.Tensor:
        """Out of GPU memory inside this path: the rest of the forward call takes the MoE layers' own path (the CPU
        engine), starting with this one; the next call tries the GPU again. A CPU share already submitted for this
        layer is left to finish on its stream (its output is not read)."""
        self.failed = why
        self.fallbacks += 1
        print(f"hetmoe: GPU prefill out of GPU memory ({why}); the rest of this chunk prefills on the CPU engine",
              file=sys.stderr)
        return layer(x, logits, shared, correction_bias)  # drives() is False now: the layer's own dispatch

    def _event(self, record: bool = True):
        if not (self.cuda and self.profiling):
            return None
        e = torch.cuda.Event(enable_timing=True)
        if record:
            e.record()  # on the current stream: the copy stream inside _issue, the main stream in run
        return e

    def profile(self) -> dict:
        """Mean ms per MoE layer recorded since profiling was turned on (synchronizes; clears the record): the
        copy, the GPU's expert compute, the CPU share (from the stream reaching its submission until the job is
        done: 0 without one), the main stream's idle time (waiting for the copy or the CPU share), the mean
        number of experts per layer the CPU computed, the mean number a routed-only layer copied, and how many
        layers copied only their routed experts:
        {"copy_ms", "compute_ms", "cpu_ms", "idle_ms", "cpu_experts", "routed_experts", "routed_layers", "layers"}."""
        torch.cuda.synchronize(self.device)
        sums = {"copy": 0.0, "compute": 0.0, "cpu": 0.0, "idle": 0.0}
        n = 0
        for _, what, a, b in self._events:
            sums[what] += a.elapsed_time(b)
            n += what == "compute"
        shares, routed, self._events, self.shares, self.routed = self.shares, self.routed, [], [], []
        out = {f"{what}_ms": total / max(n, 1) for what, total in sums.items()}
        out["cpu_experts"] = sum(c for _, c in shares) / max(len(shares), 1)
        out["routed_experts"] = sum(routed) / max(len(routed), 1)
        return {**out, "routed_layers": len(routed), "layers": n}

    def measure(self, tokens=(256, 1024), seed: int = 0) -> dict:
        """The rates the threshold is chosen from, measured on the first MoE layer with random activations and
        routing (a few ms on a GPU): the H2D copy of one layer's packed experts, the GPU path's unpack and grouped
        GEMMs at two token counts, the CPU engine's prefill at two token counts (``cpu_layer_seconds``: every expert
        of the layer, whatever the engine's GPU-resident ones). Seconds per layer, all E experts. With slots of G < E
        experts, one slot's copy and compute (its experts' share of the rows, sorted as a layer of several units
        is) are timed and scaled by E / G."""
        if not self.cuda or not self.layers:
            raise RuntimeError("measuring the layerwise prefill needs its CUDA device")
        if current() is not None:
            raise RuntimeError("the layerwise prefill cannot be measured while a prefill runs")
        layer, lay = self.layers[0], self.layouts[0]
        gen = torch.Generator().manual_seed(seed)
        H, E, k = lay.hidden, lay.num_experts, layer.router.top_k
        G = min(self.group, E)
        torch.cuda.synchronize(self.device)
        self._units = [(0, list(range(G)))]  # one unit of the layer's first G experts, resident ones included
        copy = []
        for _ in range(2):
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record(self.copy_stream)
            self._issue(0)
            self.copy_stream.synchronize()
            copy.append(t0.elapsed_time(self.copied[0]) / 1e3 * E / G)
        gpu, cpu = {}, {}
        for T in tokens:
            x = torch.randn(T, H, generator=gen).to(self.dtype)
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            w = torch.rand(T, k, generator=gen)
            xd, idd, wd = x.to(self.device), ids.to(self.device), w.to(self.device)
            for rep in range(2):  # the first call warms the kernels up
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                self._wait(0)
                if G >= E:
                    self.scratch.reserve(E)
                    grouped_swiglu(xd, idd, wd, *self._weights(0))
                else:
                    y = torch.zeros(T, H, dtype=torch.float32, device=self.device)
                    pairs = sort_pairs(torch.where(idd < G, idd, -1), G)
                    swiglu_rows(xd, pairs, 0, G, wd, *self._weights(0), y, self.max_rows or T * k)
                b.record()
                b.synchronize()
            gpu[T] = a.elapsed_time(b) / 1e3 * E / G
            cpu[T] = cpu_layer_seconds(layer.engine, x, ids, w)
        self.freed[0], self._units = None, []
        self.rates = {"copy_s": min(copy), "copy_gbps": self.layer_bytes(0) / min(copy) / 1e9, "gpu_s": gpu,
                      "cpu_s": cpu}
        if self.share is not None:
            self.share.rates = self.rates
        return self.rates

    def layer_bytes(self, i: int) -> int:
        return sum(t.numel() for t in self.host[i])

    def close(self) -> None:
        if self.share is not None:
            self.share.close()
            self.share = None
        if self._registered is not None:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self._registered.close()
            self._registered = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter exit: the CUDA runtime may be gone already, and the process with it
            pass
