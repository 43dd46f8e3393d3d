"""The *experts* stage: what computes a layer's routed experts for the (token, slot) pairs it is given.

Every backend is called the same way (``ExpertsBackend``)::

    out[t] (+)= sum_j topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = topk_ids[t, j]

with ids of -1 (and experts in ``skip_mask``) skipped; a layer whose experts have another gated activation
(``hetmoe.cpu.Glu``, e.g. gpt-oss's clamped SwiGLU) or biases computes ``down_e(glu(gate_e x + bg_e, up_e x + bu_e))
+ bd_e`` instead, and only backends that hold the same ``glu`` and ``bias`` are attached to it (``MoELayer.attach``).
The backends: ``hetmoe.cpu.CPUExperts`` (the CPU engine, csrc/), ``TorchExperts``
below (plain PyTorch: the reference the engine is compared with, and the stand-in where the engine does not apply)
and ``hetmoe.moe.gpu_resident.experts.GpuExperts`` (a layer's GPU-resident experts, which return only their own
part, in fp32).

Shape letters: T tokens, E experts, k experts per token, H hidden size, I expert intermediate size.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from hetmoe.cpu.experts import SWIGLU, Glu


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
    fp32 accumulation of the weighted sum. ``glu``: the gated activation; ``biases``: (gate ``[E, I]``, up ``[E, I]``,
    down ``[E, H]``) or None.
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype = torch.float32,
                 glu: Glu = SWIGLU, biases: Optional[tuple] = None):
        if gate.shape != up.shape or gate.dim() != 3 or down.shape != (gate.shape[0], gate.shape[2], gate.shape[1]):
            raise ValueError(
                f"expert weights must be gate/up [E, I, H] and down [E, H, I]; got {tuple(gate.shape)}, "
                f"{tuple(up.shape)}, {tuple(down.shape)}"
            )
        if not isinstance(glu, Glu):
            raise TypeError(f"glu must be a hetmoe.cpu.Glu, got {glu!r}")
        E, I, H = gate.shape
        if biases is not None and (len(biases) != 3 or [tuple(b.shape) for b in biases] != [(E, I), (E, I), (E, H)]):
            raise ValueError(f"biases must be (gate [E, I], up [E, I], down [E, H]) = ([{E}, {I}], [{E}, {I}], "
                             f"[{E}, {H}])")
        self.gate, self.up, self.down = (w.to(dtype) for w in (gate, up, down))
        self.glu, self.bias = glu, biases is not None
        self.biases = tuple(b.to(dtype) for b in biases) if biases is not None else None
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
            g, u = xc[tok] @ self.gate[e].T, xc[tok] @ self.up[e].T
            if self.biases is not None:
                g, u = g + self.biases[0][e], u + self.biases[1][e]
            y = self.glu(g, u) @ self.down[e].T
            if self.biases is not None:
                y = y + self.biases[2][e]
            acc.index_add_(0, tok, y.float() * topk_weights[tok, slot].float().unsqueeze(1))
        if out is None:
            return acc.to(x.dtype)
        if accumulate:
            acc += out.float()
        out.copy_(acc)
        return out

    __call__ = forward
