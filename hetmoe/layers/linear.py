"""Linears that read the same input, run as one matmul (attention q/k/v, an MLP's gate/up).

``FusedLinears(a, b, c)`` copies the weights (and biases) of the linears into one ``[sum of out_features, in]`` tensor
and makes each linear's parameters views of it: one ``F.linear`` then computes all of them, with no second copy of
the weights in memory. Parameter names, values and ``state_dict`` stay as they were, and writes to the parameters
(``load_state_dict``) land in the fused weight. When a parameter has been replaced since (``module.to(...)``, a new
``nn.Parameter``), ``intact()`` turns False and callers run the linears one by one again.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# ---------------------------------------------------------------------------------------------- dense formats
# The one table of formats for dense weights (attention projections, shared experts, dense MLPs, lm_head), on the
# CPU (hetmoe/cpu/linear.py: the engine's packed row blocks and kernels) and on the GPU (hetmoe/layers/gpu_linear.py).
# `tolerance`: the bound on a linear's output error against the bf16 weights, ||y - y_bf16|| / ||y_bf16||, over
# random N(0, 1) activations and N(0, 0.02) weights, measured by tests/kernels/test_linear.py and
# tests/models/test_gpu_linear.py (the worst device and ISA path, with margin).


@dataclass(frozen=True)
class DenseFormat:
    name: str
    bits: int  # per weight element
    group: int  # weight elements along K per fp32 scale (0: no scales; fp8: a block of group x group)
    devices: tuple  # where it runs: "cpu", "cuda"
    tolerance: float

    def nbytes(self, n: int, k: int) -> int:
        """Bytes of an [n, k] weight in this format (scales included; padding of the CPU row blocks excluded)."""
        data = n * k * self.bits // 8
        if not self.group:
            return data
        if self.name == "fp8":
            return data + -(-n // self.group) * -(-k // self.group) * 4
        return data + n * -(-k // self.group) * 4


# MEASURED worst cases (tests named above): bf16 1.7e-3 (the CPU's AMX class rounds activations to bf16; 3e-7 on
# the row blocks, 0 on the GPU); fp8 3.7e-2 (scaled_mm, activations in fp8 too); int8 g64 8.6e-3 (CPU AMX class),
# 6.6e-3 (GPU); int4 g64 9.6e-2 (CPU), 1.1e-1 (GPU).
DENSE_FORMATS = {
    "bf16": DenseFormat("bf16", 16, 0, ("cpu", "cuda"), 4e-3),
    "fp8": DenseFormat("fp8", 8, 128, ("cuda",), 6e-2),
    "int8": DenseFormat("int8", 8, 64, ("cpu", "cuda"), 1.5e-2),
    "int4": DenseFormat("int4", 4, 64, ("cpu", "cuda"), 1.5e-1),
}
DENSE_FORMAT_CHOICES = ("auto",) + tuple(DENSE_FORMATS)


def dense_format(name: str, device: str) -> DenseFormat:
    """The table entry for ``name`` on ``device`` ("cpu" or "cuda"); a clear error when it does not run there."""
    fmt = DENSE_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"dense format must be one of {', '.join(DENSE_FORMATS)}, got {name!r}")
    if device not in fmt.devices:
        raise ValueError(f"dense format {name} does not run on {device} (it runs on: {', '.join(fmt.devices)})")
    return fmt
