"""The *dispatch* stage: ``MoELayer``, one flat object per MoE layer.

A model's MoE block calls ``self.moe(x, logits, shared=...)``; the layer routes (hetmoe/moe/router.py), sends the
(token, slot) pairs to where its experts are (the CPU engine, with activations staged through pinned host memory
when the model is on a GPU; GPU-resident experts on the main stream; Expert Deferral's two parts), and adds the
parts in one fixed order (hetmoe/moe/combine.py). Inside a decode step of the runner the same layer runs in CUDA
stream order instead (hetmoe/moe/stream.py, active through ``stream.current()``: a per-call context, nothing
written into the layer), and a long prefill chunk on the GPU computes the experts there from weights streamed
layer by layer (hetmoe/moe/streamed/layerwise.py, ``layerwise.current()``).

What a layer holds, all set by the loader (hetmoe/load/loader.py) and changeable between calls:
  experts   the experts backend (``CPUExperts``, ``TorchExperts``; hetmoe/moe/experts.py)
  staging   pinned host buffers when the model runs on a GPU and the experts on the CPU (``HostStaging``), else None
  gpu       the layer's GPU-resident experts (``GpuExperts``) or None; the CPU engine skips them (its skip mask)
  defer     Expert Deferral: experts per token deferred to the next MoE layer, with the model's ``DeferralChain``
  drop      accuracy studies: each token's ``drop`` lowest-weighted experts are not computed at all

Shape letters: T tokens, E experts, k experts per token, H hidden size.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import nn

from hetmoe.cpu.experts import SWIGLU, CPUExperts, Glu
from hetmoe.moe import stream
from hetmoe.moe.combine import combine
from hetmoe.moe.deferral import DeferralChain, Deferred, drop_lowest, split_deferred
from hetmoe.moe.router import RouterSpec, logits_of
from hetmoe.moe.streamed import layerwise


class HostStaging:
    """Pinned host buffers through which GPU activations reach the CPU engine and come back; one set serves
    every layer (layers run one after another), grown to the largest token count seen."""

    def __init__(self, hidden: int, top_k: int, dtype: torch.dtype):
        self.hidden, self.top_k, self.dtype = hidden, top_k, dtype
        self.capacity = 0

    def buffers(self, T: int) -> tuple:
        if T > self.capacity:
            self.capacity = max(T, 2 * self.capacity)
            pin = torch.cuda.is_available()
            self.x = torch.empty(self.capacity, self.hidden, dtype=self.dtype, pin_memory=pin)
            self.out = torch.empty(self.capacity, self.hidden, dtype=self.dtype, pin_memory=pin)
            self.ids = torch.empty(self.capacity, self.top_k, dtype=torch.int64, pin_memory=pin)
            self.weights = torch.empty(self.capacity, self.top_k, dtype=torch.float32, pin_memory=pin)
        return self.x[:T], self.ids[:T], self.weights[:T], self.out[:T]


Shared = Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]]


class MoELayer:
    """route -> dispatch -> experts -> combine for one MoE layer (see the module docstring).

    ``router``: how this layer routes; ``num_experts``: E; ``glu``: the experts' gated activation (a
    ``hetmoe.cpu.Glu``, or its fields (kind, alpha, limit): what a model file gives) and ``bias``: whether they have
    biases (gpt-oss: the clamped SwiGLU with gate/up/down biases), which every backend attached must hold alike.
    Call ``attach(experts, staging)`` before the first forward call."""

    def __init__(self, router: RouterSpec, num_experts: int, glu: Union[Glu, tuple] = SWIGLU, bias: bool = False):
        self.router, self.num_experts = router, int(num_experts)
        self.glu, self.bias = (glu if isinstance(glu, Glu) else Glu(*glu)), bool(bias)
        self.experts = None  # an ExpertsBackend
        self.staging: Optional[HostStaging] = None
        self.gpu = None  # a GpuExperts, or None
        self.defer, self.chain, self.index, self.overlap = 0, None, 0, True
        self.drop = 0
        self.route_observer: Optional[Callable[[torch.Tensor], None]] = None  # sees every eager call's topk_ids

    # ------------------------------------------------------------------ configuration (the loader's)

    def attach(self, experts, staging: Optional[HostStaging] = None) -> None:
        if experts.num_experts != self.num_experts:
            raise ValueError(f"{experts.num_experts} experts attached to a layer of {self.num_experts}")
        self._check_glu(experts, type(experts).__name__)
        self.experts, self.staging = experts, staging

    @property
    def plain_swiglu(self) -> bool:
        """Whether this layer's experts are plain SwiGLU without biases (what the GPU experts' kernels compute)."""
        return self.glu == SWIGLU and not self.bias

    def _check_glu(self, experts, what: str) -> None:
        """ValueError unless ``experts`` computes this layer's activation and biases (never plain SwiGLU instead)."""
        glu, bias = getattr(experts, "glu", SWIGLU), getattr(experts, "bias", False)
        if glu != self.glu or bias != self.bias:
            raise ValueError(f"{what} computes {glu.kind}{' with' if bias else ' without'} biases; this layer's "
                             f"experts are {self.glu.kind}{' with' if self.bias else ' without'} biases")

    @property
    def engine(self) -> Optional[CPUExperts]:
        """The CPU engine computing this layer's experts, or None for another backend."""
        return self.experts if isinstance(self.experts, CPUExperts) else None

    def set_gpu_experts(self, gpu) -> None:
        """Give the layer its GPU-resident part (``GpuExperts``; None detaches): the CPU engine skips those experts
        from now on (its static skip mask) and the layer adds their output."""
        engine = self.engine
        if engine is None or self.staging is None:
            raise TypeError("GPU experts need the CPU engine behind a GPU model (a hybrid placement)")
        if gpu is not None and gpu.num_experts != self.num_experts:
            raise ValueError(f"{gpu.num_experts} experts on the GPU side, {self.num_experts} on the CPU side")
        if gpu is not None:
            self._check_glu(gpu, "GPU-resident experts (GpuExperts)")
        engine.set_skip_mask(gpu.skip_mask() if gpu is not None else None)
        self.gpu = gpu

    def set_deferral(self, d: int, chain: Optional[DeferralChain] = None, index: int = 0,
                     overlap: bool = True) -> None:
        """Defer ``d`` experts per token (0: none) as layer ``index`` of ``chain``. ``overlap``: the CPU engine's
        deferred job runs while the caller goes on (``overlap=False`` waits for each job: the same numbers)."""
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"the number of experts to defer must be an integer >= 0, got {d!r}")
        if d and chain is None:
            raise ValueError("deferring experts needs the model's DeferralChain")
        if chain is not None and not 0 <= index < chain.n_layers:
            raise ValueError(f"layer index {index} is outside the chain's {chain.n_layers} MoE layers")
        self.defer, self.chain, self.index, self.overlap = d, (chain if d else None), index, overlap

    def set_drop(self, d: int) -> None:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"the number of experts to drop must be an integer >= 0, got {d!r}")
        self.drop = d

    @property
    def position(self) -> str:
        """Where the layer sits in its deferral chain ("only" without deferral)."""
        return self.chain.position(self.index) if self.chain is not None else "only"

    def defers_now(self, k: int) -> int:
        """Experts per token this layer defers in a forward call (0 for the last layer of the chain)."""
        position = self.position
        if self.defer and position != "only" and self.defer >= k:
            raise ValueError(f"cannot defer {self.defer} of the top-{k} experts of each token (at most {k - 1})")
        return self.defer if position in ("first", "middle") else 0

    # ------------------------------------------------------------------ the call

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, shared: Shared = None,
                 correction_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [T, H], the router's logits [T, E] (or a ``RouterLogits``, computed where this call needs them) ->
        routed (+ ``shared(x)``) experts [T, H] in x's dtype. ``correction_bias``: the router's score correction
        (sigmoid_grouped), a model buffer."""
        if self.experts is None:
            raise RuntimeError("no experts are attached to this MoE layer (MoELayer.attach)")
        driver = stream.current()
        if driver is not None and driver.drives(self, x):
            return driver.run(self, x, logits, shared, correction_bias)
        logits = logits_of(logits)
        driver = layerwise.current()
        if driver is not None and driver.drives(self, x):
            return driver.run(self, x, logits, shared, correction_bias)
        weights, ids = self.route(logits, correction_bias)
        if self.route_observer is not None:
            self.route_observer(ids)
        if self.drop:
            ids = drop_lowest(ids, weights, self.drop)
        if self.chain is not None and self.position != "only":
            main, resident, deferred = self._deferral_parts(x, ids, weights)
        else:
            (main, resident), deferred = self._parts(x, ids, weights), None
        return combine(main, resident, deferred, x.dtype, shared(x) if shared is not None else None)

    def route(self, logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None) -> tuple:
        """(topk_weights [T, k] fp32, topk_ids [T, k] int64) on the logits' device."""
        return self.router.route(logits, correction_bias)

    def _resident(self, x, ids, weights) -> Optional[torch.Tensor]:
        return self.gpu(x, ids, weights) if self.gpu is not None else None

    def _parts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """(the routed experts of every slot but the GPU-resident ones [T, H] in x's dtype on x's device, the
        GPU-resident experts' part fp32 or None). With staging, the resident part runs on the GPU while the CPU
        computes."""
        if self.gpu is not None and self.gpu.n == self.num_experts:  # all resident: no CPU job, no host round trip
            return self._resident(x, ids, weights), None
        if self.staging is None or x.device.type == "cpu":
            return self.experts(x, ids, weights), self._resident(x, ids, weights)
        xh, ih, wh, out = self.staging.buffers(x.shape[0])
        xh.copy_(x, non_blocking=True)
        ih.copy_(ids, non_blocking=True)
        wh.copy_(weights, non_blocking=True)
        torch.cuda.current_stream(x.device).synchronize()
        resident = self._resident(x, ids, weights)
        self.experts.forward(xh, ih, wh, out)
        return out.to(x.device, non_blocking=True), resident

    def _deferral_parts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> tuple:
        """(immediate part fp32, resident part, the previous layer's deferred part): GPU-resident experts are never
        deferred (every slot routed to them is computed now); this layer's deferred part goes into the chain."""
        position, chain = self.position, self.chain
        d = self.defers_now(ids.shape[-1])
        if position == "first":
            chain.reset()
            prev = None
        else:
            prev = chain.take(self.index, x.shape[0])
        imm_ids, def_ids = split_deferred(ids, weights, d) if d else (ids, None)
        resident = self._resident(x, ids, weights)  # the whole top-k
        if self.engine is not None:
            y, deferred = self._engine_parts(x, imm_ids, def_ids, weights)
        else:
            y, deferred = self._backend_parts(x, imm_ids, def_ids, weights)
        if deferred is not None:
            chain.put(deferred)
        if y.device != x.device:
            y = y.to(x.device, non_blocking=True)
        prev_out = None
        if prev is not None:
            pool = self.engine.pool if self.engine is not None else None
            prev_out = prev.wait(pool).to(x.device, non_blocking=True)
        return y, resident, prev_out

    def _engine_parts(self, x, imm_ids, def_ids, weights) -> tuple:
        engine = self.engine
        cuda = x.device.type == "cuda"
        if cuda:  # stage through pinned memory (fresh buffers: the deferred job reads them after this call)
            xh, imm_ids, weights = (_pinned_copy(t) for t in (x, imm_ids, weights))
            def_ids = _pinned_copy(def_ids) if def_ids is not None else None
            torch.cuda.current_stream(x.device).synchronize()
        else:
            xh, imm_ids, weights = x.contiguous(), imm_ids.contiguous(), weights.contiguous()
        out_imm = torch.empty(xh.shape, dtype=torch.float32, pin_memory=cuda)  # [T, H]
        if def_ids is None:
            return engine.forward(xh, imm_ids, weights, out_imm), None
        out_def = torch.empty(xh.shape, dtype=torch.float32, pin_memory=cuda)
        if not self.overlap:
            engine.forward(xh, imm_ids, weights, out_imm)
            return out_imm, Deferred(self.index, engine.forward(xh, def_ids, weights, out_def))
        engine.submit(xh, imm_ids, weights, out_imm)
        job = engine.submit(xh, def_ids, weights, out_def)
        engine.sync(allow_pending=1)  # the immediate job (and, FIFO, every earlier one) is done
        return out_imm, Deferred(self.index, out_def, job, engine.pool)

    def _backend_parts(self, x, imm_ids, def_ids, weights) -> tuple:
        def run(ids):
            return self.experts.forward(x, ids, weights, torch.empty(x.shape, dtype=torch.float32, device=x.device))

        y = run(imm_ids)
        return y, (Deferred(self.index, run(def_ids)) if def_ids is not None else None)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def moe_layers(model: nn.Module) -> list:
    """(name, MoELayer) of every MoE block of ``model`` in forward order; the name is the block's (its weights'
    prefix, e.g. ``model.layers.3.mlp``)."""
    return [(n, m.moe) for n, m in model.named_modules() if isinstance(getattr(m, "moe", None), MoELayer)]


def set_deferrals(layers: list, ds: list, overlap: bool = True) -> list:
    """Expert Deferral per MoE layer (``layers`` in forward order, ``ds[i]`` experts per token for layer i; 0: none).
    Layer i with d_i > 0 adds its d_i lowest-weighted experts per token to the next MoE layer's output: each run of
    deferring layers and the layer after it share one DeferralChain (the run's last layer only adds); the last MoE
    layer of a model defers nothing. Returns the chains."""
    chains, i, n = [], 0, len(layers)
    while i < n:
        if not ds[i] or (i == n - 1 and n > 1):
            layers[i].set_deferral(0)
            i += 1
            continue
        j = i
        while j < n - 1 and ds[j]:
            j += 1  # j: the layer that takes the run's last deferred part
        chain = DeferralChain(j - i + 1)
        for t in range(i, j + 1):
            layers[t].set_deferral(ds[t] or ds[t - 1], chain, t - i, overlap)
        chains.append(chain)
        i = j + 1
    return chains


def defer_experts(model: nn.Module, d: int, overlap: bool = True) -> Optional[DeferralChain]:
    """Expert Deferral of ``d`` experts per token on every MoE layer of ``model``, all sharing one
    ``DeferralChain`` (returned); d = 0 turns deferral off and returns None."""
    layers = [layer for _, layer in moe_layers(model)]
    if d and not layers:
        raise ValueError(f"cannot defer {d} experts: the model has no MoE blocks")
    chains = set_deferrals(layers, [d] * len(layers), overlap)
    return chains[0] if chains else None
