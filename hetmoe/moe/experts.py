"""The *experts* stage: what computes a layer's routed experts for the (token, slot) pairs it is given.

Every backend is called the same way (``ExpertsBackend``)::

    out[t] (+)= sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

with ids of -1 (and experts in ``skip_mask``) skipped. The backends: ``hetmoe.cpu.CPUExperts`` (the CPU engine,
csrc/), ``TorchExperts`` below (plain PyTorch: the reference the engine is compared with, and the stand-in where the
engine does not apply) and ``hetmoe.moe.gpu_resident.experts.GpuExperts`` (a layer's GPU-resident experts, which return
only their own part, in fp32).

Shape letters: T tokens, E experts, k experts per token, H hidden size, I expert intermediate size.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch
import torch.nn.functional as F


@runtime_checkable
class ExpertsBackend(Protocol):
    """The call every experts backend implements. ``out``: write (``accumulate``: add) the result there and return
    it; ``skip_mask``: bool ``[E]``, experts not to compute in this call."""

    num_experts: int

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None, *, accumulate: bool = False,
                skip_mask: Optional[torch.Tensor] = None) -> torch.Tensor: ...


class TorchExperts:
    """Routed experts computed with PyTorch, an ``ExpertsBackend``.

    Keeps gate/up ``[E, I, H]`` and down ``[E, H, I]`` in ``dtype`` on their device; computes in that dtype with
    fp32 accumulation of the weighted sum. ``swiglu_limit`` (DeepSeek-V4; ``set_swiglu_limit``): the SwiGLU's inputs
    clamped first, gate to at most the limit and up to [-limit, limit].
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype = torch.float32,
                 swiglu_limit: Optional[float] = None):
        if gate.shape != up.shape or gate.dim() != 3 or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(
                f"expert weights must be gate/up [E, I, H] and down [E, H, I]; got {tuple(gate.shape)}, "
                f"{tuple(up.shape)}, {tuple(down.shape)}"
            )
        self.gate, self.up, self.down = (w.to(dtype) for w in (gate, up, down))
        self.num_experts = gate.shape[0]
        self.swiglu_limit = swiglu_limit
        self.swiglu_alpha: Optional[float] = None  # set: gpt-oss's form (set_swiglu_alpha)

    def set_swiglu_limit(self, limit: Optional[float]) -> None:
        self.swiglu_limit = limit

    def set_swiglu_alpha(self, alpha: Optional[float]) -> None:
        """MiniMax-M3 (gpt-oss's clamped SwiGLU): h = (u + 1) * g * sigmoid(alpha * g) on the clamped g, u in place
        of silu(g) * u; None: silu(g) * u."""
        self.swiglu_alpha = alpha

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
            g, u = xc[tok] @ self.gate[e].T, xc[tok] @ self.up[e].T
            if self.swiglu_limit is not None:
                g, u = g.clamp(max=self.swiglu_limit), u.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            h = F.silu(g) * u if self.swiglu_alpha is None else (u + 1) * (g * torch.sigmoid(g * self.swiglu_alpha))
            acc.index_add_(0, tok, (h @ self.down[e].T).float() * topk_weights[tok, slot].float().unsqueeze(1))
        if out is None:
            return acc.to(x.dtype)
        if accumulate:
            acc += out.float()
        out.copy_(acc)
        return out

    __call__ = forward
