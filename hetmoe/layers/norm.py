"""RMSNorm with Hugging Face semantics: normalise in fp32, cast back, then scale."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm computes in fp32 for bf16/fp16 inputs and returns x's dtype: the same rounding points as
        # Hugging Face's x.float() -> normalise -> .to(dtype), in one kernel instead of five.
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.variance_epsilon)

    def add_forward(self, x: torch.Tensor, delta) -> tuple:
        """The fused decode path's layer boundary (ops/triton/fused.py): (x + delta, self(x + delta)) in one
        kernel, the sum rounded once as ``x + delta`` is; delta None: (x, self(x)). A weight or delta in another
        dtype than x (the unfused ops would promote) takes the unfused ops."""
        if self.weight.dtype != x.dtype or (delta is not None and delta.dtype != x.dtype):
            x = x if delta is None else x + delta.to(x.device)  # (delta: maybe a pinned host buffer, stream.py)
            return x, self(x)
        from hetmoe.ops.triton.fused import add_rms_norm

        return add_rms_norm(x, delta, self.weight, self.variance_epsilon)


class OffsetRMSNorm(nn.Module):
    """RMSNorm in the (1 + weight) form (weight zero at init): normalised in fp32, times (1 + weight) in fp32, rounded
    to x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
