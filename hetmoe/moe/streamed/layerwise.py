"""Layerwise GPU prefill: a dispatch path of the MoE layer for long prompts. Each MoE layer's routed experts are
computed on the GPU from the CPU engine's own packed bytes, streamed over PCIe one layer ahead of the compute.

Per forward call (a prefill chunk of T >= ``min_tokens`` tokens), with S slots (default 2) on the GPU:

    start of the call       copy stream: layers 0 .. S-1's packed experts -> slots 0 .. S-1   (DMA from the engine's
                                         storage, registered with the driver: no second copy in RAM)
    MoE layer i             main stream: route (hetmoe/moe/router.py); wait for slot i % S's copy (an event);
                                         unpack the packed layout to the model dtype (hetmoe/moe/streamed/packed.py);
                                         gate+up, SwiGLU, down as grouped GEMMs over the tokens sorted by expert;
                                         record "slot free"
                            copy stream: after "slot free", layer i + S -> slot i % S (runs while layers
                                         i + 1 .. i + S - 1 compute)
                            main stream: combine (hetmoe/moe/combine.py) with the shared experts

Events order every slot reuse; nothing synchronizes the device. The whole layer is copied: the copy of layer i + 1
starts before its router has run (that is the overlap), and at the token counts where this path wins, T·k is many
times the number of experts, so nearly every expert is routed to anyway; where T·k is small against E, each layer's
copy waits for its router and moves only the routed experts (hetmoe/moe/streamed/copy.py). While the link is the
bottleneck, the CPU engine computes the last c experts of each layer at the same time, and only the first E - c are
copied (hetmoe/moe/streamed/cpu_share.py; c chosen per chunk from the measured rates). Expert Deferral is a decode
feature: here every expert is computed exactly once, on the layer's own input; GPU-resident experts are computed from
the streamed weights like the others (they hold the same values).

Shape letters: T tokens, k experts per token, E experts, H hidden size, I intermediate size, M = T·k rows.
"""

from __future__ import annotations

import contextvars
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from hetmoe.config.options import parse_cpu_share
from hetmoe.moe.combine import combine
from hetmoe.moe.deferral import drop_lowest
from hetmoe.moe.streamed import choice
from hetmoe.moe.streamed.copy import HostMemory, copy_experts, routed_experts
from hetmoe.moe.streamed.cpu_share import CPUShare
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts
from hetmoe.ops.triton import grouped as grouped_triton
from hetmoe.ops.triton import packed as packed_triton

_current: contextvars.ContextVar = contextvars.ContextVar("hetmoe_layerwise_prefill", default=None)


def current() -> Optional["LayerwisePrefill"]:
    """The layerwise prefill running in this context, or None."""
    return _current.get()


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


def grouped_swiglu(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gu: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """The routed experts of every (token, slot) pair: x [T, H], topk_ids / topk_weights [T, k] (-1: skipped),
    w_gu [E, 2I, H] (gate rows, then up rows), w_down [E, H, I], all in one dtype on x's device -> fp32 [T, H]."""
    T, k = topk_ids.shape
    E, two_i, _ = w_gu.shape
    I = two_i // 2
    flat = topk_ids.reshape(-1).long()
    flat = torch.where(flat < 0, E, flat)  # skipped slots sort last, into a bucket no expert reads
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=E + 1)[:E], 0)
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
    order = order[:int(ends[-1])]  # the valid pairs (one host sync per layer)
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


class LayerwisePrefill:
    """The layerwise GPU prefill of one model's MoE layers (``layers``: MoELayers with the unsplit CPU engine, in
    forward order). ``min_tokens``: the forward calls with at least this many tokens take this path (the runner
    asks ``wants(T)``); ``slots``: GPU buffers of one layer's packed experts each (>= 2: copy one while computing
    another); ``unpack_batch``: experts unpacked at once where PyTorch ops unpack (no Triton). On a CPU ``device``
    (tests) the same path runs without copies, reading the engine's storage directly. ``share``: the CPU's share of
    each layer's experts (a ``CPUShare``, ``enable_share``), or None: every expert on the GPU. ``routed_copy``:
    "auto" (per chunk, ``prefill_choice.wants_routed_only``), "on" or "off": copy only the routed experts."""

    def __init__(self, layers: list, device, dtype: torch.dtype, min_tokens: int, slots: int = 2,
                 unpack_batch: int = 16):
        if slots < 2:
            raise ValueError(f"layerwise prefill needs at least 2 slots, got {slots}")
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
        if lay is not None:  # one layer's weights in the model dtype, rewritten by every layer
            E, H, I = lay.num_experts, lay.hidden, lay.intermediate
            self.w_gu = torch.empty(E, 2 * I, H, dtype=dtype, device=self.device)
            self.w_down = torch.empty(E, H, I, dtype=dtype, device=self.device)
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

    def _slot_buffers(self) -> list:
        widths = [max(r[j].numel() for r in self.host) for j in range(len(self.host[0]))]
        return [[torch.empty(w, dtype=torch.uint8, device=self.device) for w in widths] for _ in range(self.n_slots)]

    @property
    def slot_bytes(self) -> int:
        """GPU memory the slots hold."""
        return sum(t.numel() for slot in self.slots or [] for t in slot)

    def wants(self, n_tokens: int) -> bool:
        return bool(self.layers) and n_tokens >= self.min_tokens

    def drives(self, layer, x: torch.Tensor) -> bool:
        return id(layer) in self._index and x.device.type == self.device.type

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
        for i in range(0 if self.routed_only else min(self.n_slots, len(self.layers))):
            self._issue(i)
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)
            self.cpu_experts, self.routed_only = 0, False

    def gpu_experts(self, i: int) -> int:
        """How many of layer i's experts (the first ones) the GPU computes in the running call."""
        return self.layouts[i].num_experts - self.cpu_experts

    def _issue(self, i: int, experts: Optional[list] = None) -> None:
        """Copy layer i's experts [0, gpu_experts(i)), or the ``experts`` listed (routed-only), into its slot."""
        if not self.cuda:  # tests: whole layers are read in place; routed-only copies into host "slots"
            if experts is not None:
                if self.slots is None:
                    self.slots = self._slot_buffers()
                copy_experts(self.slots[i % self.n_slots], self.host[i], self.per[i], experts)
            return
        s = i % self.n_slots
        with torch.cuda.stream(self.copy_stream):
            if self.freed[s] is not None:
                self.copy_stream.wait_event(self.freed[s])
            start = self._event()
            copy_experts(self.slots[s], self.host[i], self.per[i], experts, self.gpu_experts(i))
            self.copied[s].record(self.copy_stream)
            if start is not None:  # an end event of its own: copied[s] is recorded again by the slot's next copy
                self._events.append((i, "copy", start, self._event()))

    def _wait(self, i: int) -> None:
        """The main stream waits for layer i's copy."""
        if self.cuda:
            idle = self._event()
            torch.cuda.current_stream(self.device).wait_event(self.copied[i % self.n_slots])
            if idle is not None:
                self._events.append((i, "idle", idle, self._event()))

    def _weights(self, i: int, E: int) -> tuple:
        """The first E experts of layer i's slot (or storage) unpacked into the weight scratch, a few experts at a
        time (bounded temporaries) -> (w_gu [E, 2I, H], w_down [E, H, I])."""
        lay = self.layouts[i]
        if self.cuda or self.routed_only:
            ranges = [dst[:E * b] for dst, b in zip(self.slots[i % self.n_slots], self.per[i])]
        else:
            ranges = [r[:E * b] for r, b in zip(self.host[i], self.per[i])]
        if self.triton_unpack:  # one pass, straight into the scratch
            packed_triton.unpack_into(lay, ranges, self.w_gu, self.w_down, E)
            return self.w_gu[:E], self.w_down[:E]
        for e0 in range(0, E, self.unpack_n):
            n = min(self.unpack_n, E - e0)
            gu, d = unpack_experts(lay, [r[e0 * b:(e0 + n) * b] for r, b in zip(ranges, self.per[i])], n, self.dtype)
            self.w_gu[e0:e0 + n].copy_(gu)
            self.w_down[e0:e0 + n].copy_(d)
        return self.w_gu[:E], self.w_down[:E]

    def run(self, layer, x: torch.Tensor, logits: torch.Tensor, shared=None,
            correction_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """MoE layer ``layer``'s routed (+ ``shared(x)``) output [T, H] in x's dtype, its experts on this device."""
        i = self._index[id(layer)]
        weights, ids = layer.route(logits, correction_bias)
        if layer.drop:
            ids = drop_lowest(ids, weights, layer.drop)
        n = self.gpu_experts(i)
        if self.cpu_experts:  # the CPU starts on its experts first, the GPU's ids leave them out
            cpu_start, cpu_done = self._event(), self._event(record=False)
            self.share.submit(i, layer.engine, x, ids, weights.float(), self.cpu_experts, cpu_done)
            if cpu_done is not None:
                self._events.append((i, "cpu", cpu_start, cpu_done))
            ids = ids.masked_fill(ids >= n, -1)
        if self.routed_only:  # the routed ones among the GPU's experts, after this layer's router (a host sync)
            experts, ids = routed_experts(ids, n)
            n = len(experts)
            if self.profiling:
                self.routed.append(n)
            self._issue(i, experts)
        self._wait(i)
        start = self._event()
        if n:
            y = grouped_swiglu(x, ids, weights, *self._weights(i, n))
        else:  # every pair on the CPU, or skipped
            y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if start is not None:
            self._events.append((i, "compute", start, self._event()))
        if self.cuda:
            s = i % self.n_slots
            self.freed[s] = torch.cuda.Event()
            self.freed[s].record(torch.cuda.current_stream(self.device))
            if i + self.n_slots < len(self.layers) and not self.routed_only:
                self._issue(i + self.n_slots)
        dense = shared(x) if shared is not None else None
        if self.cpu_experts:
            wait = self._event()
            y = self.share.add(y)  # cpu + gpu in fp32: combine's order for a layer's parts
            if wait is not None:  # the GPU's wait for the CPU (and the sum)
                self._events.append((i, "idle", wait, self._event()))
        self.layers_run += 1
        return combine(y, None, None, x.dtype, dense)

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
        GEMMs at two token counts, the CPU engine's prefill at two token counts. Seconds per layer."""
        if not self.cuda or not self.layers:
            raise RuntimeError("measuring the layerwise prefill needs its CUDA device")
        layer, lay = self.layers[0], self.layouts[0]
        gen = torch.Generator().manual_seed(seed)
        H, E, k = lay.hidden, lay.num_experts, layer.router.top_k
        torch.cuda.synchronize(self.device)
        copy = []
        for _ in range(2):
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record(self.copy_stream)
            self._issue(0)
            self.copy_stream.synchronize()
            copy.append(t0.elapsed_time(self.copied[0]) / 1e3)
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
                grouped_swiglu(xd, idd, wd, *self._weights(0, lay.num_experts))
                b.record()
                b.synchronize()
            gpu[T] = a.elapsed_time(b) / 1e3
            times = []
            for rep in range(2):
                t = time.perf_counter()
                layer.engine.forward(x, ids, w)  # x in the model dtype, as the CPU prefill path stages it
                times.append(time.perf_counter() - t)
            cpu[T] = min(times)
        self.freed[0] = None
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
