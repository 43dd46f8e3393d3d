"""Expert Deferral (DESIGN.md, KTransformers §6): per token, the ``d`` lowest-weighted of its top-k routed experts
are computed on layer l's input but added to layer l+1's routed output, so the CPU computes them while the GPU
runs layer l+1's attention. Layer l's MoE output is then

    R_imm_l(x_l) + R_def_{l-1}(x_{l-1})       (+ the shared experts S_l(x_l))

The first MoE layer of a forward call has no deferred input and the last defers nothing. This file holds the
split of a routing (``split_deferred``), a deferred part in flight (``Deferred``) and the ``DeferralChain`` that
carries it from one MoE layer to the next within one forward call; the MoE layer's dispatch
(hetmoe/moe/dispatch.py) runs the two parts and the stream-ordered decode driver (hetmoe/moe/stream.py) does the
same in CUDA stream order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def split_deferred(topk_ids: torch.Tensor, topk_weights: torch.Tensor, d: int) -> tuple:
    """Each token's top-k split for Expert Deferral: ``(immediate_ids, deferred_ids)``, both ``[T, k]`` like
    ``topk_ids`` with the other part's slots set to -1 (every backend skips -1). The ``d`` lowest-weighted slots of
    a row are deferred; among equal weights the earlier slot counts as the lower (a stable ascending sort, the rule
    of ``drop_lowest``)."""
    lowest = topk_weights.argsort(dim=-1, stable=True)[:, :d]  # [T, d]
    deferred = torch.zeros(topk_ids.shape, dtype=torch.bool, device=topk_ids.device).scatter_(1, lowest, True)
    return topk_ids.masked_fill(deferred, -1), topk_ids.masked_fill(~deferred, -1)


def drop_lowest(topk_ids: torch.Tensor, topk_weights: torch.Tensor, d: int) -> torch.Tensor:
    """``topk_ids`` with each token's ``d`` lowest-weighted slots set to -1 (not computed; the other weights are
    *not* renormalised): what simply dropping experts costs, the baseline deferral is compared with. Ties between
    equal weights drop the earlier slot (stable sort). A copy: the router's ids are left as they were."""
    k = topk_ids.shape[-1]
    if d >= k:
        raise ValueError(f"cannot drop {d} of the top-{k} experts of each token (at most {k - 1})")
    lowest = topk_weights.argsort(dim=-1, stable=True)[:, :d]  # [T, d]
    return topk_ids.scatter(1, lowest, -1)


@dataclass
class Deferred:
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
    of the layer just run, until the next MoE layer adds it. One per model, shared by its ``n_layers`` deferring
    MoE layers (indices 0 .. n_layers - 1 in forward order).

    Nothing crosses forward calls: the last layer consumes what is pending and defers nothing, and the first layer
    discards whatever an interrupted call left behind (once its job is done), so every call starts clean."""

    def __init__(self, n_layers: int):
        if n_layers < 1:
            raise ValueError(f"a deferral chain needs at least one MoE layer, got {n_layers}")
        self.n_layers = n_layers
        self.pending: Optional[Deferred] = None

    def position(self, index: int) -> str:
        """"only", "first", "middle" or "last": where layer ``index`` sits in the chain."""
        first, last = index == 0, index == self.n_layers - 1
        return "only" if first and last else "first" if first else "last" if last else "middle"

    def reset(self) -> None:
        stale, self.pending = self.pending, None
        if stale is not None and stale.job is not None:
            stale.pool.sync(0)  # the engine may be writing its buffers: let it finish before they are freed

    def put(self, deferred: Deferred) -> None:
        if self.pending is not None:
            raise RuntimeError(f"MoE layer {deferred.layer} deferred experts while layer {self.pending.layer}'s "
                               "deferred output was still pending")
        self.pending = deferred

    def take(self, layer: int, T: int) -> Deferred:
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
