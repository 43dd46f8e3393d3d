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

Shape letters: n streams, H hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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

    def forward(self, streams: torch.Tensor) -> tuple:
        B, S = streams.shape[:2]
        n = self.n
        flat = unweighted_rms_norm(streams.reshape(B, S, -1).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())  # [B, S, (2 + n) n]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps  # [B, S, n]
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(B, S, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


def mix_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A block's new streams: post_i * out + sum_j comb[j, i] * stream_j, in the streams' dtype.
    streams [B, S, n, H], out [B, S, H], post [B, S, n], comb [B, S, n, n]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


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
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float())
        return ((pre + self.eps).unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
