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
