"""The *route* stage: how a MoE layer turns its router's logits into each token's top-k experts and their weights.

A model builds one ``RouterSpec`` per MoE layer from its config and hands the logits to the layer
(``hetmoe.moe.MoELayer``); whether routing then runs on the device (``RouterSpec.route``, PyTorch) or inside the CPU
job that computes the experts (``host_routable``: csrc/moe/routing.h, same rules and tie-breaking) is the dispatch
stage's choice, never the model's.

Kinds:

* ``"softmax"``: Mixtral, Qwen2-MoE, Qwen3-MoE: softmax over experts, top-k, renormalised if ``norm_topk_prob``.
* ``"deepseek_v2"``: DeepSeek-V2 / V2-Lite: softmax scores; ``topk_method`` ``greedy`` top-k, or
  ``group_limited_greedy`` (top-k within the ``topk_group`` groups whose best expert scores highest); weights times
  ``routed_scaling_factor``. Routed on the device only.
* ``"sigmoid_grouped"``: DeepSeek-V3/R1, Kimi-K2: sigmoid scores; experts *chosen* by score + ``correction_bias``
  within the ``topk_group`` of ``n_group`` groups with the best sum of their two best biased scores, *weighted* by the
  unbiased score (renormalised if ``norm_topk_prob``) times ``routed_scaling_factor``.
* ``"given"``: the model's block routed already (DeepSeek-V4: hash tables, sqrtsoftplus scores) and hands its
  ``(weights, ids)`` over in place of the logits; routed on the device only.

Every route returns ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``. Among equal values the lower id wins; a
token with a non-finite logit gets NaN weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

KINDS = ("softmax", "deepseek_v2", "sigmoid_grouped", "given")
HOST_KINDS = ("softmax", "sigmoid_grouped")  # what the CPU job can route itself (csrc/moe/routing.h)


def route_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple:
    """Softmax over experts (in fp32), top-k, optional renormalisation."""
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


def route_deepseek_v2(logits: torch.Tensor, top_k: int, topk_method: str, n_group: Optional[int],
                      topk_group: Optional[int], routed_scaling_factor: float) -> tuple:
    """DeepSeek-V2 / V2-Lite routing (kind ``"deepseek_v2"``)."""
    scores = torch.softmax(logits.float(), dim=-1)  # [T, E]
    if topk_method == "group_limited_greedy":
        E = scores.shape[-1]
        group_best = scores.view(-1, n_group, E // n_group).amax(dim=-1)
        scores = scores.masked_fill(~_group_mask(group_best, topk_group, E), 0.0)
    elif topk_method != "greedy":
        raise ValueError(f"unknown DeepSeek-V2 topk_method {topk_method!r} (expected greedy or group_limited_greedy)")
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return weights * routed_scaling_factor, ids


def route_deepseek_v3(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int,
                      topk_group: int, norm_topk_prob: bool, routed_scaling_factor: float) -> tuple:
    """DeepSeek-V3/R1 and Kimi-K2 routing (kind ``"sigmoid_grouped"``)."""
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


@dataclass(frozen=True)
class RouterLogits:
    """A router's logits not yet computed: ``x @ weight.T`` in ``dtype`` (the model dtype, or fp32 for DeepSeek's
    routers). A model hands this to its MoE layer in a fused decode step (``Step.fused``) so that the dispatch
    computes the logits where they are needed: a stream-ordered step whose CPU job routes writes them straight into
    the job's pinned buffer (hetmoe/moe/stream.py); everything else calls ``compute()``, the model's own op."""

    x: torch.Tensor  # [T, H]
    weight: torch.Tensor  # [E, H]
    dtype: torch.dtype
    compute: Callable[[], torch.Tensor]  # -> [T, E] in dtype: what the model computes otherwise


def logits_of(logits) -> torch.Tensor:
    """The logits tensor of ``logits`` (a tensor, or a ``RouterLogits`` computed now)."""
    return logits.compute() if isinstance(logits, RouterLogits) else logits


@dataclass(frozen=True, eq=False)
class RouterSpec:
    """How one MoE layer routes (see the module docstring for the kinds).

    ``correction_bias``: the ``[E]`` score correction of ``sigmoid_grouped`` (a model buffer; on the device for
    ``route``, a CPU fp32 copy for a CPU job: ``on_host_bias``)."""

    kind: str
    top_k: int
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # deepseek_v2 only
    correction_bias: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown router kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")

    @property
    def host_routable(self) -> bool:
        """Whether a CPU job can route from the logits itself (``CPUExperts.prepare(route=...)``)."""
        return self.kind in HOST_KINDS

    def key(self) -> tuple:
        """Everything but the bias tensor (compared by identity where it matters)."""
        return (self.kind, self.top_k, bool(self.norm_topk_prob), self.n_group, self.topk_group,
                float(self.routed_scaling_factor), self.topk_method)

    def with_bias(self, correction_bias: Optional[torch.Tensor]) -> "RouterSpec":
        return dataclasses.replace(self, correction_bias=correction_bias)

    def route(self, logits: torch.Tensor, correction_bias: Optional[torch.Tensor] = None) -> tuple:
        """logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64), on logits' device.
        ``correction_bias`` (sigmoid_grouped): overrides the spec's own."""
        if self.kind == "given":  # (weights [T, k] fp32, ids [T, k] int64), the block's own routing
            return logits
        if self.kind == "softmax":
            return route_softmax(logits, self.top_k, self.norm_topk_prob)
        if self.kind == "deepseek_v2":
            return route_deepseek_v2(logits, self.top_k, self.topk_method, self.n_group, self.topk_group,
                                     self.routed_scaling_factor)
        bias = self.correction_bias if correction_bias is None else correction_bias
        if bias is None:
            raise ValueError("a sigmoid_grouped router needs its correction_bias")
        return route_deepseek_v3(logits, bias, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                                 self.routed_scaling_factor)
