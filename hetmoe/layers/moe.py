"""MoE layer: route -> dispatch -> experts -> combine.

This file holds the *route* stage (the routers of every supported architecture, as pure functions of the router
logits), ``TorchExperts``, the plain-PyTorch expert backend with the same call as the CPU engine
(``hetmoe.cpu.CPUExperts``): it is the reference the engine is compared with and the stand-in where the
engine does not apply, and the *dispatch* wrappers around a backend: ``OffloadedExperts`` (GPU activations to the
CPU engine and back), ``DropLowestExperts`` (accuracy studies) and ``DeferredExperts`` (Expert Deferral).

Shape letters: T tokens, E experts, k experts per token, H hidden size, I expert intermediate size.
Every router returns ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


def route_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple:
    """Mixtral (always normalised), Qwen2-MoE and Qwen3-MoE: softmax over experts, top-k, optional renorm."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]: computed in fp32, no separate cast
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _group_mask(group_scores: torch.Tensor, topk_group: int, n_expert: int) -> torch.Tensor:
    """[T, n_group] scores -> bool [T, E]: the experts of each token's topk_group best groups."""
    n_group = group_scores.shape[-1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return keep.unsqueeze(-1).expand(-1, n_group, n_expert // n_group).reshape(-1, n_expert)


def route_deepseek_v2(
    logits: torch.Tensor,
    top_k: int,
    topk_method: str,
    n_group: Optional[int],
    topk_group: Optional[int],
    routed_scaling_factor: float,
) -> tuple:
    """DeepSeek-V2 / V2-Lite: softmax scores; ``greedy`` top-k, or ``group_limited_greedy`` (top-k within the
    topk_group groups whose best expert scores highest); weights scaled by routed_scaling_factor."""
    scores = torch.softmax(logits.float(), dim=-1)  # [T, E]
    if topk_method == "group_limited_greedy":
        E = scores.shape[-1]
        group_best = scores.view(-1, n_group, E // n_group).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(group_best, topk_group, E), 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"unknown DeepSeek-V2 topk_method {topk_method!r} (expected greedy or group_limited_greedy)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return weights * routed_scaling_factor, ids


def route_deepseek_v3(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple:
    """DeepSeek-V3/R1 and Kimi-K2: sigmoid scores; experts are *chosen* by score + e_score_correction_bias
    within the topk_group groups with the best sum of their two best biased scores, and *weighted* by the
    unbiased score (renormalised if norm_topk_prob), times routed_scaling_factor."""
    scores = torch.sigmoid(logits.float())  # [T, E]
    biased = scores + correction_bias.float()
    E = scores.shape[-1]
    group_scores = biased.view(-1, n_group, E // n_group).topk(2, dim=-1).values.sum(dim=-1)
    biased = biased.masked_fill(~_group_mask(group_scores, topk_group, E), float("-inf"))
    ids = torch.topk(biased, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@dataclass(frozen=True, eq=False)
class HostRouter:
    """A router that a CPU MoE job runs itself from the router's logits (``CPUExperts.prepare(logits=...)``; the C++
    is csrc/moe/routing.h), the twin of a route function above:

    * ``"softmax"``: ``route_softmax`` (Mixtral, Qwen2/3-MoE): top-k of the softmax, renormalised if norm_topk_prob;
    * ``"sigmoid_grouped"``: ``route_deepseek_v3`` (DeepSeek-V3/R1, Kimi-K2): sigmoid scores, experts chosen by score +
      ``correction_bias`` ([E] fp32 on the CPU) within the ``topk_group`` of ``n_group`` groups whose two best biased
      scores sum highest, weighted by the unbiased score (renormalised if norm_topk_prob) x routed_scaling_factor.

    Among equal values the lower id wins; a token with a non-finite logit gets NaN weights."""

    kind: str
    top_k: int
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: Optional[torch.Tensor] = None

    def key(self) -> tuple:
        """Everything but the bias tensor (compared by identity where it matters)."""
        return (self.kind, self.top_k, bool(self.norm_topk_prob), self.n_group, self.topk_group,
                float(self.routed_scaling_factor))


class TorchExperts:
    """Routed experts computed with PyTorch, called like ``CPUExperts.forward``.

    Keeps gate/up ``[E, I, H]`` and down ``[E, H, I]`` in ``dtype`` on their device; computes in that dtype with
    fp32 accumulation of the weighted sum.
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype = torch.float32):
        if gate.shape != up.shape or gate.dim() != 3 or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(
                f"expert weights must be gate/up [E, I, H] and down [E, H, I]; got {tuple(gate.shape)}, "
                f"{tuple(up.shape)}, {tuple(down.shape)}"
            )
        self.gate, self.up, self.down = (w.to(dtype) for w in (gate, up, down))
        self.num_experts = gate.shape[0]

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        out: Optional[torch.Tensor] = None,
        *,
        accumulate: bool = False,
        skip_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        xc = x.to(self.gate.dtype)
        for e in topk_ids.unique().tolist():
            if e < 0 or (skip_mask is not None and bool(skip_mask[e])):
                continue
            tok, slot = torch.where(topk_ids == e)
            h = F.silu(xc[tok] @ self.gate[e].T) * (xc[tok] @ self.up[e].T)
            acc.index_add_(0, tok, (h @ self.down[e].T).float() * topk_weights[tok, slot].float().unsqueeze(1))
        if out is None:
            return acc.to(x.dtype)
        if accumulate:
            acc += out.float()
        out.copy_(acc)
        return out

    __call__ = forward


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


class OffloadedExperts:
    """The dispatch stage of a hybrid run: routed experts computed by a CPU backend (``CPUExperts``) for a
    model whose activations live on the GPU. x, ids and weights are copied to pinned host buffers, the CPU
    computes, and the result is copied back on the current stream: the path of prefill. Inside a decode step of the
    runner (``hybrid``, ``layers/hybrid.py``) the same layer runs in CUDA stream order instead (host functions
    submit and wait for the CPU job; capturable into a CUDA graph), computing ``main_stream_part`` meanwhile.

    ``gpu``: the layer's GPU-resident experts (``layers/gpu_experts.py``, attached with ``attach_gpu_experts``, which
    also sets the CPU engine's static skip mask), computed on the main stream while the CPU computes the rest and
    added to the CPU part in fp32."""

    takes_shared = True  # the model passes its shared experts in (models/common.routed_and_shared)

    def __init__(self, experts, staging: HostStaging):
        self.experts, self.staging = experts, staging
        self.num_experts = experts.num_experts
        self.gpu = None  # a GpuExperts, or None
        self.hybrid = None  # a HybridDecode (layers/hybrid.py, set by the runner): decode steps in CUDA stream order

    def main_stream_part(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         shared=None) -> tuple:
        """What the GPU computes while the CPU works on this layer's routed experts (the one place for it):
        (the GPU-resident experts' part, fp32 [T, H] or None; the model's shared experts ``shared()``, [T, H] in
        x's dtype, or None)."""
        resident = self.gpu(x, topk_ids, topk_weights) if self.gpu is not None else None
        return resident, (shared() if shared is not None else None)

    def streaming(self, x: torch.Tensor) -> bool:
        """Whether this call runs in CUDA stream order (inside a decode step of the runner's HybridDecode)."""
        return self.hybrid is not None and self.hybrid.active and x.device.type == self.hybrid.device.type

    def routes_on_host(self, x: torch.Tensor) -> bool:
        """Whether this call takes the router's logits instead of a routing (``forward_logits``): inside a decode
        step whose HybridDecode routes on the host, for a layer without GPU-resident experts (they need the ids on
        the device). The CPU jobs then route themselves (``layers.moe.HostRouter``): no top-k kernels on the GPU and
        one copy (the logits) instead of two (ids, weights)."""
        return self.streaming(x) and self.hybrid.route_on_host and self.gpu is None

    def forward_logits(self, x: torch.Tensor, logits: torch.Tensor, router, shared=None,
                       defer: int = 0) -> torch.Tensor:
        """``forward`` for the router's ``logits`` [T, E] and how to route them (``layers.moe.HostRouter``), only where
        ``routes_on_host(x)``."""
        return self.hybrid.run(self, x, None, None, shared, defer, logits=logits, router=router)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, shared=None) -> torch.Tensor:
        """Routed experts [T, H] (+ ``shared()``, the model's shared experts, when given)."""
        if self.streaming(x):
            return self.hybrid.run(self, x, topk_ids, topk_weights, shared)
        out = self._routed(x, topk_ids, topk_weights)
        dense = shared() if shared is not None else None
        return out if dense is None else out + dense

    def _routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            out = self.experts(x, topk_ids, topk_weights)
            return out if self.gpu is None else (out.float() + self.gpu(x, topk_ids, topk_weights)).to(x.dtype)
        T = x.shape[0]
        xh, ids, w, out = self.staging.buffers(T)
        xh.copy_(x, non_blocking=True)
        ids.copy_(topk_ids, non_blocking=True)
        w.copy_(topk_weights, non_blocking=True)
        torch.cuda.current_stream(x.device).synchronize()
        resident = self.gpu(x, topk_ids, topk_weights) if self.gpu is not None else None  # runs during the CPU part
        self.experts.forward(xh, ids, w, out)
        if resident is not None:
            return (out.to(x.device, non_blocking=True).float() + resident).to(x.dtype)
        return out.to(x.device, non_blocking=True)

    __call__ = forward


class DropLowestExperts:
    """A dispatch option for accuracy studies: per token, the ``d`` lowest-weighted of its top-k routed experts
    are not computed (their ids set to -1 before the wrapped backend runs; the other weights are *not*
    renormalised). What simply dropping experts costs, the baseline that deferring them is compared with.

    ``d = 0`` passes the call through unchanged. Ties between equal weights drop the earlier slot (stable sort).
    """

    def __init__(self, experts, d: int):
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"the number of experts to drop must be an integer >= 0, got {d!r}")
        self.experts, self.d = experts, d
        self.num_experts = experts.num_experts

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *args, **kwargs):
        if self.d:
            k = topk_ids.shape[-1]
            if self.d >= k:
                raise ValueError(f"cannot drop {self.d} of the top-{k} experts of each token (at most {k - 1})")
            lowest = topk_weights.argsort(dim=-1, stable=True)[:, :self.d]  # [T, d]
            topk_ids = topk_ids.scatter(1, lowest, -1)  # a copy: the router's ids are left as they were
        return self.experts(x, topk_ids, topk_weights, *args, **kwargs)

    __call__ = forward


def split_deferred(topk_ids: torch.Tensor, topk_weights: torch.Tensor, d: int) -> tuple:
    """Each token's top-k split for Expert Deferral: ``(immediate_ids, deferred_ids)``, both ``[T, k]`` like
    ``topk_ids`` with the other part's slots set to -1 (every backend skips -1). The ``d`` lowest-weighted slots of
    a row are deferred; among equal weights the earlier slot counts as the lower (a stable ascending sort, the rule
    of DropLowestExperts)."""
    lowest = topk_weights.argsort(dim=-1, stable=True)[:, :d]  # [T, d]
    deferred = torch.zeros(topk_ids.shape, dtype=torch.bool, device=topk_ids.device).scatter_(1, lowest, True)
    return topk_ids.masked_fill(deferred, -1), topk_ids.masked_fill(~deferred, -1)


@dataclass
class _Deferred:
    layer: int  # chain index of the layer that deferred
    out: torch.Tensor  # [T, H] fp32, on the host for the CPU engine: written while ``job`` runs
    job: object = None  # the engine job writing ``out`` (it holds x, ids and weights), None when out is complete
    pool: object = None  # the engine pool running ``job``

    def wait(self, synced_pool) -> torch.Tensor:
        """``out`` once complete. ``synced_pool``: a pool the caller has synced past this job (FIFO: done)."""
        if self.job is not None and self.pool is not synced_pool:
            self.pool.sync(0)
        return self.out


class DeferralChain:
    """What Expert Deferral carries from one MoE layer to the next within one forward call: the deferred output
    of the layer just run, until the next MoE layer adds it. One per model, shared by its ``n_layers``
    ``DeferredExperts`` (indices 0 .. n_layers - 1 in forward order).

    Nothing crosses forward calls: the last layer consumes what is pending and defers nothing, and the first layer
    discards whatever an interrupted call left behind (once its job is done), so every call starts clean."""

    def __init__(self, n_layers: int):
        if n_layers < 1:
            raise ValueError(f"a deferral chain needs at least one MoE layer, got {n_layers}")
        self.n_layers = n_layers
        self.pending: Optional[_Deferred] = None

    def reset(self) -> None:
        stale, self.pending = self.pending, None
        if stale is not None and stale.job is not None:
            stale.pool.sync(0)  # the engine may be writing its buffers: let it finish before they are freed

    def put(self, deferred: _Deferred) -> None:
        if self.pending is not None:
            raise RuntimeError(f"MoE layer {deferred.layer} deferred experts while layer {self.pending.layer}'s "
                               "deferred output was still pending")
        self.pending = deferred

    def take(self, layer: int, T: int) -> _Deferred:
        """The output deferred by layer ``layer - 1`` of this call, for its ``T`` tokens; the chain is left empty."""
        pending, self.pending = self.pending, None
        if pending is None or pending.layer != layer - 1:
            got = "nothing" if pending is None else f"the output of layer {pending.layer}"
            raise RuntimeError(f"MoE layer {layer} expected the experts deferred by layer {layer - 1}, found {got}: "
                               "the MoE layers of a forward call must run in order, each once")
        if pending.out.shape[0] != T:
            raise RuntimeError(f"MoE layer {layer} has {T} tokens; layer {layer - 1} deferred experts for "
                               f"{pending.out.shape[0]}")
        return pending


class DeferredExperts:
    """Expert Deferral (DESIGN.md, KTransformers §6), the dispatch stage of MoE layer ``index`` of ``chain``.

    Per token the ``d`` lowest-weighted of its top-k experts are *deferred* (``split_deferred``): computed on this
    layer's input x_l but added to the next MoE layer's routed output, so this wrapper returns

        R_imm_l(x_l) + R_def_{l-1}(x_{l-1})       (the model then adds its shared experts S_l(x_l))

    The first layer of the chain has no deferred input, the last defers nothing (its whole top-k is immediate).
    ``d = 0`` calls the wrapped backend unchanged. The parts go to separate fp32 buffers, added in a fixed order
    (immediate, then the previous layer's deferred) and cast to x's dtype once.

    With the CPU engine (``CPUExperts``, or ``OffloadedExperts`` around it, whose x is staged through pinned host
    memory) and ``overlap``, the immediate and the deferred job are submitted back to back and only the immediate
    one is waited for (``sync(allow_pending=1)``): the deferred job runs while the caller computes the next layer's
    attention, and the pool's FIFO order has it done by the time the next layer's immediate job is. ``overlap=False``
    waits for each job (bitwise the same numbers). Any other backend is called twice per layer, synchronously.

    GPU-resident experts (``OffloadedExperts.gpu``) are never deferred: every slot routed to them, immediate or
    deferred by the split, is computed on this layer's input and added to this layer's output (after the immediate
    CPU part, before the previous layer's deferred part); the CPU engine skips them in both of its jobs.
    """

    def __init__(self, experts, chain: DeferralChain, index: int, d: int, overlap: bool = True):
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"the number of experts to defer must be an integer >= 0, got {d!r}")
        if not 0 <= index < chain.n_layers:
            raise ValueError(f"layer index {index} is outside the chain's {chain.n_layers} MoE layers")
        self.experts, self.chain, self.index, self.d, self.overlap = experts, chain, index, d, overlap
        self.num_experts = experts.num_experts
        inner = experts.experts if isinstance(experts, OffloadedExperts) else experts
        self.engine = inner if hasattr(inner, "prepare") and hasattr(inner, "pool") else None  # a CPUExperts

    @property
    def position(self) -> str:
        first, last = self.index == 0, self.index == self.chain.n_layers - 1
        return "only" if first and last else "first" if first else "last" if last else "middle"

    takes_shared = True  # the model passes its shared experts in (models/common.routed_and_shared)

    def _check_d(self, k: int) -> str:
        position = self.position
        if self.d and position != "only" and self.d >= k:
            raise ValueError(f"cannot defer {self.d} of the top-{k} experts of each token (at most {k - 1})")
        return position

    def routes_on_host(self, x: torch.Tensor) -> bool:
        """``OffloadedExperts.routes_on_host`` of the wrapped dispatch (False for any other backend)."""
        return isinstance(self.experts, OffloadedExperts) and self.experts.routes_on_host(x)

    def forward_logits(self, x: torch.Tensor, logits: torch.Tensor, router, shared=None) -> torch.Tensor:
        """``forward`` for the router's logits (``OffloadedExperts.forward_logits``), inside a decode step that routes
        on the host."""
        position = self._check_d(router.top_k)
        defer = self.d if position in ("first", "middle") else 0
        return self.experts.forward_logits(x, logits, router, shared, defer)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, shared=None) -> torch.Tensor:
        """R_imm_l(x_l) + R_def_{l-1}(x_{l-1}) [T, H] (+ ``shared()``, the model's shared experts, when given)."""
        position = self._check_d(topk_ids.shape[-1])
        off = self.experts
        if isinstance(off, OffloadedExperts) and off.streaming(x):  # a decode step in CUDA stream order
            defer = self.d if position in ("first", "middle") else 0
            return off.hybrid.run(off, x, topk_ids, topk_weights, shared, defer)
        y = self._routed(x, topk_ids, topk_weights)
        dense = shared() if shared is not None else None
        return y if dense is None else y + dense

    __call__ = forward

    def _routed(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        position = self.position
        if self.d == 0 or position == "only":
            return self.experts(x, topk_ids, topk_weights)
        if position == "first":
            self.chain.reset()
            prev = None
        else:
            prev = self.chain.take(self.index, x.shape[0])
        if position == "last":
            imm_ids, def_ids = topk_ids, None
        else:
            imm_ids, def_ids = split_deferred(topk_ids, topk_weights, self.d)
        parts = self._engine_parts if self.engine is not None else self._backend_parts
        gpu = getattr(self.experts, "gpu", None) if self.engine is not None else None
        resident = gpu(x, topk_ids, topk_weights) if gpu is not None else None  # the whole top-k: never deferred
        y, deferred = parts(x, imm_ids, def_ids, topk_weights)  # y: [T, H] fp32
        if deferred is not None:
            self.chain.put(deferred)
        if y.device != x.device:
            y = y.to(x.device, non_blocking=True)
        if resident is not None:
            y = y + resident
        if prev is not None:
            y = y + prev.wait(self.engine.pool if self.engine is not None else None).to(x.device, non_blocking=True)
        return y.to(x.dtype)

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
            return out_imm, _Deferred(self.index, engine.forward(xh, def_ids, weights, out_def))
        engine.submit(xh, imm_ids, weights, out_imm)
        job = engine.submit(xh, def_ids, weights, out_def)
        engine.sync(allow_pending=1)  # the immediate job (and, FIFO, every earlier one) is done
        return out_imm, _Deferred(self.index, out_def, job, engine.pool)

    def _backend_parts(self, x, imm_ids, def_ids, weights) -> tuple:
        def run(ids):
            if isinstance(self.experts, TorchExperts):
                return self.experts.forward(x, ids, weights, torch.empty(x.shape, dtype=torch.float32, device=x.device))
            return self.experts(x, ids, weights).float()

        y = run(imm_ids)
        return y, (_Deferred(self.index, run(def_ids)) if def_ids is not None else None)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
