"""A lean decode step on the CPU: per layer three engine calls and the MoE block, instead of tens of small PyTorch
ops (issue 23).

For every decoder layer (pre-norm, GQA attention whose q/k/v and o_proj are packed into the engine,
hetmoe/engine/dense.py):

    qkv = self_attn.qkv(x, norm=input_layernorm)          one job: RMSNorm + the fused q/k/v projection
    a   = decode_block(qkv, ...)                          one job: q/k norm, RoPE, cache write, attention
    self_attn.o_proj(a, out=x, accumulate=True)           one job: x += o_proj(a), in place
    x  += mlp(post_attention_layernorm(x))                the model's own MoE block (routing, shared experts, deferral)

then the final norm; the runner computes the logits as for any step. The RoPE table is computed once per step and
shared by all layers, as the model does. The model files stay untouched: this reads the modules' attributes.
``LeanDecode.build`` returns None for a model or cache it does not cover (MLA, a paged or GPU cache, linears left
unpacked, a layer or attention whose forward is its own): the runner then keeps the eager path.

Numerics: the projections and attention are the same engine kernels as the eager path, and the engine's RMSNorm and
the block's q/k norm and RoPE round as PyTorch's fp32 ops (on an AVX2 PyTorch: csrc/dense/sum_order.h), so an fp32
model's lean step is bitwise the eager one there. bf16: the input norm runs in fp32 inside the linear (eager rounds
its output to bf16 first) and o_proj's fp32 output is added to the residual before rounding (eager rounds it
first): within the bound measured in tests/engine/test_lean_decode.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from hetmoe.cpu.attention import decode_block
from hetmoe.cpu.linear import CPULinear
from hetmoe.layers.attention import GQAAttention
from hetmoe.layers.rope import cos_sin
from hetmoe.models.common import CausalLM, DecoderModel, PreNormDecoderLayer

DTYPES = (torch.float32, torch.bfloat16)


def _layer_forwards() -> tuple:
    """The decoder-layer forwards this step reproduces: x + attn(norm(x)), then x + mlp(norm(x))."""
    from hetmoe.models.mixtral import MixtralDecoderLayer  # same pre-norm layer, MoE block under its HF name

    return (PreNormDecoderLayer.forward, MixtralDecoderLayer.forward)


def _norm(module) -> tuple:
    """(fp32 weight, eps) of an RMSNorm: what CPULinear's ``norm=`` takes, converted once."""
    return module.weight.detach().to(torch.float32).contiguous(), float(module.variance_epsilon)


def why_not(model, cache) -> Optional[str]:
    """None when ``LeanDecode`` covers ``model`` and ``cache``, else the reason it does not."""
    if type(model).forward is not CausalLM.forward or type(model.model).forward is not DecoderModel.forward:
        return "the model's forward is its own"
    if cache.paged or cache.device.type != "cpu" or cache.dtype not in DTYPES or cache.v_head_dim != cache.head_dim:
        return "the KV cache is not a contiguous fp32/bf16 CPU cache with one head dim"
    if model.model.embed_tokens.weight.dtype not in DTYPES:
        return "the model's dtype is not fp32 or bf16"
    forwards = _layer_forwards()
    for i, layer in enumerate(model.model.layers):
        attn = getattr(layer, "self_attn", None)
        if type(layer).forward not in forwards:
            return f"layer {i} is not a pre-norm decoder layer"
        if not isinstance(attn, GQAAttention) or type(attn).forward is not GQAAttention.forward:
            return f"layer {i}'s attention is not the GQA attention"
        H, K, D = attn.n_heads, attn.n_kv, attn.head_dim
        if not isinstance(attn.qkv, CPULinear) or list(attn.qkv.sizes) != [H * D, K * D, K * D]:
            return f"layer {i}'s q/k/v projections are not packed into the engine as one linear"
        if not isinstance(attn.o_proj, CPULinear):
            return f"layer {i}'s o_proj is not packed into the engine"
        if attn.layer_idx != i or K != cache.kv_heads or D != cache.head_dim:
            return f"layer {i}'s attention does not match the KV cache"
    return None


class LeanDecode:
    """One decode step (one token per sequence) of a packed GQA model on the CPU; see the module docstring."""

    def __init__(self, model, cache):
        reason = why_not(model, cache)
        if reason:
            raise ValueError(f"LeanDecode does not cover this model: {reason}")
        self.model, self.cache = model, cache
        self.layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            qk = None
            if attn.qk_norm_eps is not None:
                qk = (_norm(attn.q_norm)[0], _norm(attn.k_norm)[0], float(attn.qk_norm_eps))
            self.layers.append((layer, attn, _norm(layer.input_layernorm), qk))
        self._kv = None  # (cache.version, [(k, v) of each layer]): views rebuilt when the cache grows

    @classmethod
    def build(cls, model, cache) -> Optional["LeanDecode"]:
        """A LeanDecode, or None where it does not apply (the runner stays eager)."""
        return None if why_not(model, cache) else cls(model, cache)

    def _cache_views(self) -> list:
        if self._kv is None or self._kv[0] != self.cache.version:
            self._kv = (self.cache.version, [(self.cache.k[i], self.cache.v[i]) for i in range(len(self.layers))])
        return self._kv[1]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """ids, positions [B, 1] and slots [B] (the cache reserved for them) -> final-normed hidden [B, 1, H]."""
        inner = self.model.model
        x = inner.embed_tokens(ids[:, 0])  # [B, H], a fresh tensor: the residual stream, updated in place
        B = x.shape[0]
        cos, sin = cos_sin(positions, inner.inv_freq, x.dtype)  # [B, 1, 1, D] each
        cos, sin = cos.view(B, -1), sin.view(B, -1)
        pos = positions[:, 0].contiguous()
        rows = slots.to(torch.int64).contiguous()
        for (layer, attn, norm, qk), (k, v) in zip(self.layers, self._cache_views()):
            qkv = attn.qkv(x, norm=norm)  # [B, (Hq + 2 Hkv) D]
            q_norm, k_norm, eps = qk if qk else (None, None, 1e-6)
            a = decode_block(qkv, attn.n_heads, attn.n_kv, cos, sin, k, v, rows, pos, attn.head_dim**-0.5,
                             q_norm, k_norm, eps, pool=attn.qkv.pool)  # [B, Hq D]
            attn.o_proj(a, out=x, accumulate=True)
            x += layer.mlp(layer.post_attention_layernorm(x)[:, None])[:, 0]
        return inner.norm(x)[:, None]
