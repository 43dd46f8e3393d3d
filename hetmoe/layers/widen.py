"""Products of bf16 / fp16 tensors on the CPU, computed on their fp32 widenings and rounded once to the input's
dtype, as a low-precision GEMM rounds its fp32 sums. Without native bf16 FMA (AVX2, AVX-512 without BF16) PyTorch's
CPU build runs bf16 matrix products far slower than fp32 ones: batched products loop over their matrices one at a
time, each at a few GFLOP/s (BENCHMARKS.md#products-in-bf16-on-the-cpu). Elsewhere (GPU, fp32) these are PyTorch's
own products.

Widening a weight costs a pass over it each call, so a linear widens only for a prefill's rows (``WIDEN_ROWS``); a
decode step's few rows read the bf16 weight as it is.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

WIDEN_ROWS = 32  # a linear on the CPU widens its bf16 weight to fp32 for at least this many rows (a prefill)


def low_precision_on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.matmul(a, b)``, widened on the CPU in bf16 / fp16 (module docstring)."""
    if low_precision_on_cpu(a):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def einsum(spec: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.einsum(spec, a, b)``, widened on the CPU as ``matmul``."""
    if low_precision_on_cpu(a):
        return torch.einsum(spec, a.float(), b.float()).to(a.dtype)
    return torch.einsum(spec, a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, widened on the CPU as ``matmul`` when x has at least ``WIDEN_ROWS`` rows."""
    if low_precision_on_cpu(x) and x.numel() >= WIDEN_ROWS * x.shape[-1]:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def head_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, S, h, K] times each head's w [h, K, N] -> [B, S, h, N] (MLA's absorbed products). On the CPU in bf16 /
    fp16 with fewer than ``WIDEN_ROWS`` rows: with N contiguous in w, one matrix-vector product per row over w^T
    (PyTorch's batched product of that layout runs each head's matrix alone, slowly; this takes its fast path), with K
    contiguous PyTorch's own einsum (bf16 dot products, fast); more rows, the widened einsum."""
    B, S, h, _ = x.shape
    if low_precision_on_cpu(x) and B * S < WIDEN_ROWS:
        if w.stride(-1) == 1:
            rows = [torch.matmul(w.transpose(1, 2), row) for row in x.reshape(B * S, h, -1, 1).unbind(0)]  # [h, N, 1]
            return torch.stack(rows).view(B, S, h, w.shape[2])
        return torch.einsum("bshk,hkn->bshn", x, w)
    return einsum("bshk,hkn->bshn", x, w)
