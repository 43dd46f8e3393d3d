"""Linears that read the same input, run as one matmul (attention q/k/v, an MLP's gate/up).

``FusedLinears(a, b, c)`` copies the weights (and biases) of the linears into one ``[sum of out_features, in]`` tensor
and makes each linear's parameters views of it: one ``F.linear`` then computes all of them, with no second copy of
the weights in memory. Parameter names, values and ``state_dict`` stay as they were, and writes to the parameters
(``load_state_dict``) land in the fused weight. When a parameter has been replaced since (``module.to(...)``, a new
``nn.Parameter``), ``intact()`` turns False and callers run the linears one by one again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinears:
    def __init__(self, *linears: nn.Linear):
        if len({lin.in_features for lin in linears}) != 1:
            raise ValueError("fused linears must read inputs of one size")
        if len({lin.bias is None for lin in linears}) != 1:
            raise ValueError("fused linears must all have a bias or all have none")
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])  # [sum(out), in]
            self.bias = torch.cat([lin.bias for lin in linears]) if linears[0].bias is not None else None
            for lin, w, b in zip(linears, self.weight.split(self.sizes), self._bias_parts()):
                lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
                if b is not None:
                    lin.bias = nn.Parameter(b, requires_grad=lin.bias.requires_grad)
        self._ptrs = self._param_ptrs()

    def _bias_parts(self) -> list:
        return list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.sizes)

    def _param_ptrs(self) -> list:
        return [p.data_ptr() for lin in self.linears for p in (lin.weight, lin.bias) if p is not None]

    def intact(self) -> bool:
        """Whether every linear's parameters are still the views of the fused weight made at construction."""
        return self._param_ptrs() == self._ptrs and self.weight.device == self.linears[0].weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[..., in] -> [..., sum(out)]: the linears' outputs side by side, in their order."""
        if self.intact():
            return F.linear(x, self.weight, self.bias)
        return torch.cat([lin(x) for lin in self.linears], dim=-1)

    def parts(self, x: torch.Tensor) -> tuple:
        """[..., in] -> each linear's output [..., out_i] (views of one output while fused)."""
        if self.intact():
            return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        return tuple(lin(x) for lin in self.linears)


