"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual stream is ``n`` parallel streams
[B, S, n, H] instead of one [B, S, H].

Around each block (attention, MLP) a ``HyperConnection`` reads all n streams and, from one linear map of their
RMS-normalised concatenation (``fn`` [(2 + n) n, n H], ``base``, three ``scale``\\ s), makes three mixings per token:

    pre  [n]     = sigmoid(w_pre * s_pre + b_pre) + eps          the block's input: sum_j pre_j * stream_j
    post [n]     = 2 sigmoid(w_post * s_post + b_post)           how the block's output is spread over the streams
    comb [n, n]  = Sinkhorn(softmax(w_comb * s_comb + b_comb) + eps)   how the streams are carried over

and the layer's new streams are ``post_i * block(x) + sum_j comb[j, i] * stream_j``. ``comb`` is made (nearly)
doubly stochastic by ``sinkhorn_iters`` Sinkhorn-Knopp steps (column normalisation first, then rows and columns
alternately; every division adds ``eps``), so the carried-over streams neither grow nor vanish with depth.
After the last layer a ``HyperHead`` collapses the streams into one with its own ``pre`` mixing.

Everything here is computed in fp32 whatever the model dtype, the mixings applied to the streams in their dtype, as
Transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead do (their parameter names: ``fn``, ``base``,
``scale``; ``hc_fn``, ``hc_base``, ``hc_scale``), held as fp32 buffers (Transformers keeps these modules in fp32).

A decode step's mixings are tiny ([n, n] per token) and a model runs two per layer, so they are made with few
whole-tensor ops: the RMS factor applied to the linear's (2 + n) n outputs rather than to its n H inputs (the same
products up to fp32 rounding), the three scales and biases in one multiply-add, each Sinkhorn normalisation one sum
and one in-place division (``sinkhorn``). ``mix_streams``' [n, n] x [n, H] products per token are widened on the CPU
in bf16 (layers/widen.py: PyTorch's batched bf16 product runs each token's alone, slowly).

Shape letters: n streams, H hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.widen import matmul


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, the factor computed in fp32 and rounded to x's dtype first."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The mixings of one block (module docstring): forward(streams [B, S, n, H]) -> (post [B, S, n] fp32,
    comb [B, S, n, n] fp32, the block's input [B, S, H] in the streams' dtype)."""

    def __init__(self, hidden: int, n_streams: int, sinkhorn_iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.sinkhorn_iters, self.eps, self.norm_eps = n_streams, sinkhorn_iters, eps, norm_eps
        width = (2 + n_streams) * n_streams
        self.register_buffer("fn", torch.zeros(width, n_streams * hidden, dtype=torch.float32))
        self.register_buffer("base", torch.zeros(width, dtype=torch.float32))
        self.register_buffer("scale", torch.ones(3, dtype=torch.float32))
        self._scale_index = [0] * n_streams + [1] * n_streams + [2] * n_streams * n_streams  # scale of each mix output

    def forward(self, streams: torch.Tensor) -> tuple:
        B, S = streams.shape[:2]
        n = self.n
        flat = streams.reshape(B, S, -1).float()
        mix = F.linear(flat, self.fn.float()) * rms_factor(flat, self.norm_eps)  # [B, S, (2 + n) n]
        mix = mix * self.scale[self._scale_index] + self.base  # [pre | post | comb] times their scale, + bias
        gates = torch.sigmoid(mix[..., :2 * n])
        pre = gates[..., :n] + self.eps  # [B, S, n]
        post = 2 * gates[..., n:]
        comb = sinkhorn(torch.softmax(mix[..., 2 * n:].view(B, S, n, n), dim=-1), self.sinkhorn_iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * flat.view(B, S, n, -1)).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def rms_factor(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim of fp32 x, [..., 1]: ``unweighted_rms_norm`` of fp32 x is x times
    this, and a linear of the normalised x is the linear of x times it (the factor applied to its few outputs rather
    than to the n H inputs)."""
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb + eps`` [..., n, n] (fp32) made nearly doubly stochastic: its columns normalised, then ``iters - 1``
    times its rows and columns, every division by the sum plus ``eps`` (the module docstring).

    The matrix sits in the top-left corner of an [n + 1, n + 1] one whose last row and last column hold ``eps``:
    a row's sum over its n + 1 entries is then its sum plus eps, and a column's likewise, so that each
    normalisation is one sum and one in-place division (of the corner) rather than a sum, an add and a division
    into a new tensor (a decode step runs 4 (iters - 1) + 2 small ops per mixing instead of 6 (iters - 1) + 3)."""
    n = comb.shape[-1]
    ext = comb.new_full((*comb.shape[:-2], n + 1, n + 1), eps)
    out = ext[..., :n, :n]
    torch.add(comb, eps, out=out)
    rows, cols = ext[..., :n, :], ext[..., :, :n]  # [n, n + 1]: sums of the rows plus eps; [n + 1, n]: of the columns
    row_sums = ext.new_empty((*comb.shape[:-1], 1))
    col_sums = ext.new_empty((*comb.shape[:-2], 1, n))
    out.div_(torch.sum(cols, dim=-2, keepdim=True, out=col_sums))
    for _ in range(iters - 1):
        out.div_(torch.sum(rows, dim=-1, keepdim=True, out=row_sums))
        out.div_(torch.sum(cols, dim=-2, keepdim=True, out=col_sums))
    return out


def mix_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A block's new streams: post_i * out + sum_j comb[j, i] * stream_j, in the streams' dtype.
    streams [B, S, n, H], out [B, S, H], post [B, S, n], comb [B, S, n, n]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the n streams into one: sum_j pre_j * stream_j, pre = sigmoid(hc_fn(norm(streams)) *
    hc_scale + hc_base) + eps. forward(streams [B, S, n, H]) -> [B, S, H]."""

    def __init__(self, hidden: int, n_streams: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.register_buffer("hc_fn", torch.zeros(n_streams, n_streams * hidden, dtype=torch.float32))
        self.register_buffer("hc_base", torch.zeros(n_streams, dtype=torch.float32))
        self.register_buffer("hc_scale", torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.flatten(2).float()
        mix = F.linear(flat, self.hc_fn.float()) * rms_factor(flat, self.norm_eps)
        pre = torch.sigmoid(mix * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.eps).unsqueeze(-1) * flat.view(streams.shape)).sum(dim=2).to(streams.dtype)
