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

from hetmoe.cpu.attention import prepare_decode_block
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
        self._plans, self._plans_version = {}, None  # batch size -> _make_plan's, for one cache allocation

    @classmethod
    def build(cls, model, cache) -> Optional["LeanDecode"]:
        """A LeanDecode, or None where it does not apply (the runner stays eager)."""
        return None if why_not(model, cache) else cls(model, cache)

    def _plan(self, B: int) -> dict:
        """The buffers and bound calls of a step of B tokens, made once per B (again after the cache grows)."""
        if self._plans_version != self.cache.version:
            self._plans, self._plans_version = {}, self.cache.version
        plan = self._plans.get(B)
        if plan is None:
            plan = self._plans[B] = self._make_plan(B)
        return plan

    def _make_plan(self, B: int) -> dict:
        weight = self.model.model.embed_tokens.weight  # [vocab, H]
        dtype, D = weight.dtype, self.cache.head_dim
        x = torch.empty(B, weight.shape[1], dtype=dtype)  # the residual stream, updated in place by every layer
        cos, sin = torch.empty(B, D, dtype=dtype), torch.empty(B, D, dtype=dtype)
        rows, pos = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64)
        buffers = {}  # shared by the layers (one runs at a time): by shape
        steps = []
        for i, (layer, attn, norm, qk) in enumerate(self.layers):
            qkv_width, out_width = attn.qkv.out_features, attn.n_heads * D
            qkv = buffers.setdefault(("qkv", qkv_width), torch.empty(B, qkv_width, dtype=dtype))
            out = buffers.setdefault(("out", out_width), torch.empty(B, out_width, dtype=dtype))
            q_norm, k_norm, eps = qk if qk else (None, None, 1e-6)
            block = prepare_decode_block(qkv, attn.n_heads, attn.n_kv, cos, sin, self.cache.k[i], self.cache.v[i],
                                         rows, pos, D**-0.5, q_norm, k_norm, eps, out=out, pool=attn.qkv.pool)
            steps.append((layer, attn.qkv.pool, attn.qkv.prepare(x, out=qkv, norm=norm), block, attn.o_proj.pool,
                          attn.o_proj.prepare(out, out=x, accumulate=True)))
        return {"x": x, "cos": cos, "sin": sin, "rows": rows, "pos": pos, "steps": steps}

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """ids, positions [B, 1] and slots [B] (the cache reserved for them) -> final-normed hidden [B, 1, H]."""
        inner = self.model.model
        B = ids.shape[0]
        plan = self._plan(B)
        x = plan["x"]
        torch.index_select(inner.embed_tokens.weight, 0, ids[:, 0], out=x)
        cos, sin = cos_sin(positions, inner.inv_freq, x.dtype)  # [B, 1, 1, D] each: the model's table
        plan["cos"].copy_(cos.view(B, -1))
        plan["sin"].copy_(sin.view(B, -1))
        plan["pos"].copy_(positions[:, 0])
        plan["rows"].copy_(slots)
        for layer, qkv_pool, qkv_job, block, o_pool, o_job in plan["steps"]:
            qkv_pool.submit(qkv_job)  # qkv = W norm(x)
            block.run()  # after it on the pool: q/k norm, rope, cache write, attention
            o_pool.submit(o_job)  # x += o_proj(attention)
            o_pool.sync()
            x += layer.mlp(layer.post_attention_layernorm(x)[:, None])[:, 0]
        return inner.norm(x)[:, None]
