"""The dispatch stage of a hybrid decode step in CUDA stream order (``StreamDecode``): the routed experts of every MoE
layer go to the CPU engine through stream host functions, so one decode step can be captured into a CUDA graph and
replayed (and runs the same way without a graph). Per MoE layer, on the main stream unless noted:

    copy x and the router logits (softmax routers) or the top-k ids and weights -> this layer's pinned buffers
    host function SUBMIT the immediate job [; SUBMIT the deferred job]         (the pool runs them in FIFO order)
    side stream: wait for the main stream; host function SYNC (at most 1 job left pending when this layer defers,
                 else 0); copy the CPU output [and, with GPU experts, the previous layer's deferred output] back
    main stream meanwhile: GPU-resident experts, the model's shared experts
    main stream: wait for the side stream; dispatch.combine: [cpu + resident + previous deferred (fp32) -> dtype]
                 + shared

With the fused decode path (``step(mapped=True)``) a layer whose jobs route and write the output complete takes none
of these copies: one kernel computes the router logits into the pinned buffer and writes x beside them, and the
pinned output is read in place by the next kernel (``_mapped_output``; docs/decode-step.md).

"Host function" stands for either mechanism of ``hetmoe.cpu.HostFuncs``: stream memory operations watched by a thread
(signals, the default where the driver has them) or CUDA host functions (callbacks); both are captured into graphs.
The sync blocks the stream it is on, which is why it sits on a side stream: the main stream keeps computing.

What the GPU does between a layer's attention and the next layer's is on the critical path of a step, so the CPU
takes what it can: the jobs route from the logits themselves (``route_on_host``; the softmax router of Mixtral and
Qwen2/3-MoE, DeepSeek-V3's sigmoid group-limited one: no top-k, masking, renormalisation or float cast kernels, one
copy instead of two), and a layer without
GPU-resident experts gets its routed output *direct*: the immediate job adds the previous layer's deferred output
(``addend``, fp32, after its own sum: the order of the GPU add it replaces) and stores the result in the model dtype,
so one copy comes back and nothing is left to add or cast. A layer with GPU-resident experts needs the ids on the
device and adds its parts there, in fp32, in the same order.

Expert Deferral (d > 0): layer l's deferred job reads layer l's own buffers while the GPU runs layer l+1's
attention; layer l+1's immediate job runs after it (FIFO) and finds its output complete. The two jobs of a layer
are paired (``Slots.deferred(d, pair=...)``): queued back to back, they run as one list of tasks, and the immediate
one completes as soon as its output is written while the pool streams on into the deferred one's. The first MoE
layer of a step has no deferred input, the last defers nothing, so every step ends with the pool idle.

Buffers are static: per MoE layer, pinned x [C, H], ids [C, k], weights [C, k], logits [C, E], outputs [C, H] and
their device copies, with C = ``capacity`` (the largest captured batch). A deferring layer's two jobs read the same
routing and pick their slots themselves (``CPUExperts.prepare(slots=Slots.immediate(d))`` and
``Slots.deferred(d)``): no split of the routing on the GPU. The
CPU jobs are prepared once per layer, with the token count T read at run time from one pinned int64 (``n_tokens``)
that each step sets in stream order from a device scalar (the runner's static input): padded rows past T are never
computed.

A step is active through ``current()`` (a context variable the driver sets for the duration of ``step()``): a MoE
layer asks it whether it is driven (``drives``) and nothing is written into the layers.

Shape letters: T tokens, k experts per token, H hidden size, E experts, C capacity.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

from hetmoe.cpu.experts import HostRoute, Slots
from hetmoe.cpu.host_funcs import HostFuncs
from hetmoe.moe.combine import combine
from hetmoe.moe.deferral import drop_lowest
from hetmoe.moe.router import RouterLogits, logits_of

_current: contextvars.ContextVar = contextvars.ContextVar("hetmoe_stream_decode", default=None)


def current() -> Optional["StreamDecode"]:
    """The stream-ordered decode step running in this context, or None."""
    return _current.get()


@dataclass
class _LayerBuffers:
    key: tuple  # what the buffers and jobs were made for (dtype, k, defer, direct, routing): rebuilt when it changes
    mask: object  # the engine's static skip mask the jobs were prepared with
    x: torch.Tensor  # [C, H] pinned, the layer's input in the model dtype
    ids: torch.Tensor  # [C, k] int64 pinned: the layer's routing (written by the jobs when they route)
    weights: torch.Tensor  # [C, k] fp32 pinned
    logits: Optional[torch.Tensor]  # [C, E] pinned router logits when the jobs route on the host, else None
    out: torch.Tensor  # [C, H] pinned, written by the immediate job: x's dtype when direct, else fp32
    out_def: torch.Tensor  # [C, H] fp32 pinned, written by the deferred job
    dev: torch.Tensor  # [C, H] on the device: out copied back
    dev_prev: Optional[torch.Tensor]  # [C, H] fp32 on the device: the previous layer's out_def (not direct only)
    addend: Optional[torch.Tensor]  # direct: the previous layer's out_def, which the immediate job adds
    bias_src: Optional[torch.Tensor]  # the router's correction bias the jobs were prepared with (a CPU copy of it)
    job: object  # EngineJob over (x, ids, weights, out): every slot, or the immediate ones when defer > 0
    job_def: object  # EngineJob over (x, ids, weights, out_def): each token's `defer` lowest-weighted slots (or None)
    direct: bool  # the job writes the layer's routed output complete, in x's dtype (no GPU-resident experts)


class StreamDecode:
    """Stream-ordered CPU dispatch of the MoE layers ``layers`` of one model, active only inside ``step(...)`` (decode
    steps; prefill keeps the eager path of hetmoe/moe/dispatch.py).

    ``capacity``: the largest batch a step may have. ``cpu=False`` inside a step leaves the CPU out (no host
    function, stale outputs): what the GPU alone costs, for the benchmark's time split.

    ``fake_stream`` (a ``_C.FakeStream``; device "cpu"): the same host functions and buffers on a machine without
    CUDA, for tests. Main and side stream are then that one stream, drained where the main stream would join the
    side stream (no overlap)."""

    def __init__(self, capacity: int, device: torch.device, layers=(), fake_stream=None):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.device = int(capacity), torch.device(device)
        self.fake = fake_stream
        self.pin = fake_stream is None
        self.side = torch.cuda.Stream(self.device) if fake_stream is None else None
        self.host_funcs = HostFuncs()  # owns the payloads of eager and captured host functions alike
        self.n_tokens = torch.zeros(1, dtype=torch.int64, pin_memory=self.pin)  # T the jobs read when they run
        self.active = False
        self.cpu = True
        self.mapped = False  # this step's GPU kernels read and write the pinned buffers themselves (``step``)
        self.route_on_host = True  # the CPU jobs route from the logits where they can (``routes_on_host``)
        self._buffers: dict = {}  # id(MoELayer) -> _LayerBuffers
        self._pending: Optional[_LayerBuffers] = None  # the layer whose deferred job is in flight
        self.pools: set = set()
        self.layers = list(layers)  # the MoE layers this object drives
        self._driven = {id(layer) for layer in self.layers}
        self._jobs_now: list = []
        self.last_jobs: list = []  # the CPU jobs one step submits, in order (of the last step run with the CPU)

    @contextmanager
    def step(self, n_tokens: torch.Tensor, cpu: bool = True, mapped: bool = False):
        """One decode forward call: ``n_tokens`` ([1] int64 on the device) rows of the batch are real.

        ``mapped`` (the fused decode path; needs Triton): a layer whose CPU job routes and writes the complete output
        takes no copy. One kernel computes the router logits straight into the pinned buffer and copies x beside them
        (``triton_fused.router_stage``, given the model's ``RouterLogits``), and the layer returns the job's pinned
        output itself, read over PCIe by the next kernel (the next layer's residual add + RMSNorm), or added to the
        shared experts' output by one kernel (``add_rows``). Otherwise the copies of the module docstring."""
        if self.active:
            raise RuntimeError("a hybrid decode step is already running")
        self.n_tokens.copy_(n_tokens, non_blocking=True)  # stream order: before any job of this step runs
        self.active, self.cpu, self.mapped, self._pending, self._jobs_now = True, cpu, mapped, None, []
        token = _current.set(self)
        try:
            yield self
            if self._pending is not None:
                raise RuntimeError("the last MoE layer of the step deferred experts: their output would be lost")
            if cpu:
                self.last_jobs = self._jobs_now
        finally:
            _current.reset(token)
            self.active, self.cpu, self.mapped, self._pending = False, True, False, None

    def drives(self, layer, x: torch.Tensor) -> bool:
        """Whether this call of MoE layer ``layer`` runs in stream order (a layer of this step, on its device)."""
        return self.active and id(layer) in self._driven and x.device.type == self.device.type

    def routes_on_host(self, layer) -> bool:
        """Whether the CPU jobs of ``layer`` route from the router's logits themselves (``HostRoute``): where the
        router kind allows it and the layer has no GPU-resident experts (they need the ids on the device) and drops
        none. No top-k kernels on the GPU then, and one copy (the logits) instead of two (ids, weights)."""
        return self.route_on_host and layer.gpu is None and layer.router.host_routable and not layer.drop

    def buffers(self, layer) -> Optional[_LayerBuffers]:
        return self._buffers.get(id(layer))

    def _layer_buffers(self, layer, x: torch.Tensor, k: int, defer: int, logits: Optional[tuple],
                       bias_src: Optional[torch.Tensor], prev: Optional[_LayerBuffers]) -> _LayerBuffers:
        """``logits``: (dtype, E) of the router logits the jobs route from, or None."""
        engine = layer.experts
        direct = layer.gpu is None
        addend = prev.out_def if (direct and prev is not None) else None
        mask = engine.skip_mask
        router = layer.router
        key = (x.dtype, k, defer, direct, None if logits is None else (*logits, router.key()))
        buf = self._buffers.get(id(layer))
        if (buf is not None and buf.mask is mask and buf.addend is addend and buf.bias_src is bias_src
                and buf.key == key):
            return buf
        if self.fake is None and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("hybrid decode buffers must exist before a CUDA graph is captured (run one eager step)")
        C, H = self.capacity, x.shape[1]

        def pinned(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=self.pin)

        out_dtype = x.dtype if direct else torch.float32
        xh, w = pinned(C, H, dtype=x.dtype), pinned(C, k, dtype=torch.float32)
        ids = pinned(C, k, dtype=torch.int64)
        ids.fill_(-1)
        lg = pinned(C, logits[1], dtype=logits[0]) if logits is not None else None
        out, out_def = pinned(C, H, dtype=out_dtype), pinned(C, H, dtype=torch.float32)
        route = None
        if lg is not None:  # the jobs read a host copy of the correction bias (a model buffer, fixed after loading)
            bias = bias_src.detach().float().cpu().contiguous() if bias_src is not None else None
            route = HostRoute(lg, router.with_bias(bias))
        slots = Slots.immediate(defer) if defer else Slots.all()
        job = engine.prepare(xh, ids, w, out, n_tokens=self.n_tokens, slots=slots, route=route, addend=addend)
        job_def = engine.prepare(xh, ids, w, out_def, n_tokens=self.n_tokens, slots=Slots.deferred(defer, pair=job),
                                 route=route) if defer else None
        buf = _LayerBuffers(
            key, mask, xh, ids, w, lg, out, out_def,
            torch.zeros(C, H, dtype=out_dtype, device=x.device),
            None if direct else torch.zeros(C, H, dtype=torch.float32, device=x.device),
            addend, bias_src, job, job_def, direct,
        )
        self._buffers[id(layer)] = buf
        self.pools.add(engine.pool)
        return buf

    def run(self, layer, x: torch.Tensor, logits: torch.Tensor, shared=None,
            correction_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The routed (+ ``shared(x)``) output [T, H] of MoE layer ``layer`` (a ``MoELayer``) in x's dtype, from its
        router's ``logits`` [T, E]: routed by the CPU jobs themselves where ``routes_on_host(layer)``, else on the
        device first."""
        T = x.shape[0]
        if T > self.capacity:
            raise ValueError(f"a hybrid decode step holds at most {self.capacity} tokens, got {T}")
        k = layer.router.top_k
        defer = layer.defers_now(k)
        on_host = self.routes_on_host(layer)
        stage = self.mapped and on_host and _stageable(logits, x)  # router_stage computes and stages the logits
        mapped = stage and layer.gpu is None  # (no resident experts: the job writes the output complete)
        if not stage:
            logits = logits_of(logits)
        topk_ids = weights = None
        if not on_host:
            weights, topk_ids = layer.route(logits, correction_bias)
            if layer.drop:
                topk_ids = drop_lowest(topk_ids, weights, layer.drop)
            weights = weights.float()
        prev, self._pending = self._pending, None
        bias_src = correction_bias if correction_bias is not None else layer.router.correction_bias
        meta = (logits.dtype, logits.weight.shape[0] if stage else logits.shape[1]) if on_host else None
        buf = self._layer_buffers(layer, x, k, defer, meta, bias_src if on_host else None, prev)
        self._pending = buf if defer else None
        pool, hf = layer.experts.pool, self.host_funcs
        main = self.fake if self.fake is not None else torch.cuda.current_stream(x.device)
        if stage:
            from hetmoe.ops.triton.fused import router_stage

            router_stage(x, logits.weight, buf.logits[:T], buf.x[:T])
        elif on_host:
            buf.x[:T].copy_(x, non_blocking=True)
            buf.logits[:T].copy_(logits, non_blocking=True)
        else:
            buf.x[:T].copy_(x, non_blocking=True)
            buf.ids[:T].copy_(topk_ids, non_blocking=True)
            buf.weights[:T].copy_(weights, non_blocking=True)
        if self.cpu:
            pool.submit_on_stream(buf.job, main, host_funcs=hf)
            self._jobs_now.append((pool, buf.job))
            if defer:
                pool.submit_on_stream(buf.job_def, main, host_funcs=hf)
                self._jobs_now.append((pool, buf.job_def))
        if mapped:
            return self._mapped_output(pool, buf, T, defer, shared(x) if shared is not None else None, main)
        if self.fake is None:
            self.side.wait_stream(main)
        if self.cpu:
            pool.sync_on_stream(1 if defer else 0, self.side if self.fake is None else self.fake, host_funcs=hf)
        if self.fake is not None:
            self.fake.synchronize()  # the host stands in for the side stream: the copies below follow the sync
        with torch.cuda.stream(self.side) if self.fake is None else nullcontext():
            buf.dev[:T].copy_(buf.out[:T], non_blocking=True)
            if prev is not None and not buf.direct:
                buf.dev_prev[:T].copy_(prev.out_def[:T], non_blocking=True)
        # The GPU works while the CPU does: the resident experts (whole top-k, never deferred), the shared experts.
        resident = layer.gpu(x, topk_ids, weights) if layer.gpu is not None else None
        dense = shared(x) if shared is not None else None
        if self.fake is None:
            main.wait_stream(self.side)
        if buf.direct:  # the job wrote the complete routed output in x's dtype
            return combine(buf.dev[:T], None, None, x.dtype, dense)
        return combine(buf.dev[:T], resident, buf.dev_prev[:T] if prev is not None else None, x.dtype, dense)

    def _mapped_output(self, pool, buf: _LayerBuffers, T: int, defer: int, dense: Optional[torch.Tensor], main):
        """The output of a layer whose job writes it complete, with nothing copied back (``step(mapped=True)``):
        the pinned buffer itself [T, H], or, with shared experts ``dense`` (already queued behind the job's
        submission: the GPU computes them while the CPU works), their sum in one kernel that reads it. The sync
        sits on the main stream, behind the shared experts: what follows needs both, so no side stream is forked."""
        if self.cpu:
            pool.sync_on_stream(1 if defer else 0, main, host_funcs=self.host_funcs)
        if self.fake is not None:
            self.fake.synchronize()  # the host stands in for the stream: the reads below follow the sync
        if dense is None:
            return buf.out[:T]
        from hetmoe.ops.triton.fused import add_rows

        return add_rows(buf.out[:T], dense)

    def close(self) -> None:
        """Free the host functions' payloads (call only when no replay of a graph captured through them is in
        flight or will follow)."""
        self.host_funcs.close()


def _stageable(logits, x: torch.Tensor) -> bool:
    """Whether ``router_stage`` computes these logits: a ``RouterLogits`` over x with the weight in x's dtype, rows
    of unit stride."""
    return (isinstance(logits, RouterLogits) and logits.x is x and logits.weight.dtype == x.dtype
            and x.stride(-1) == 1 and logits.weight.stride(-1) == 1)
