"""A lean decode step on the CPU: the whole step's work queued on the engine as one job, instead of tens of small
PyTorch ops and a round trip through Python per call.

For every decoder layer (pre-norm, GQA attention whose q/k/v and o_proj are packed into the engine,
hetmoe/load/dense.py):

    qkv = self_attn.qkv(x, norm=input_layernorm)          RMSNorm + the fused q/k/v projection
    a   = decode_block(qkv, ...)                          q/k norm, RoPE, cache write, attention
    self_attn.o_proj(a, out=x, accumulate=True)           x += o_proj(a), in place
    logits = mlp.gate(x, norm=post_attention_layernorm,   RMSNorm (h written out, rounded as the eager norm)
                      norm_out=h)                           + the router on the engine
    x += experts(h, route=HostRoute(logits))              the MoE job routes (softmax top-k) and adds into x

then ``logits = lm_head(x, norm=final norm)``. Each call is a prepared engine job; consecutive ones on one pool
run as one ``job_list`` (hetmoe/cpu/pool.py): one submit and one sync per step, the Python thread asleep while the
pool's threads go from call to call. A MoE block the engine cannot take whole (a shared expert, a dense MLP layer,
Expert Deferral, dropped experts, a route observer, a router left in PyTorch) runs as the model's own module
between two job lists; an lm_head left in PyTorch runs after them. The RoPE table is computed once per step and
shared by all layers, as the model does. The model files stay untouched: this reads the modules' attributes.
``CPUDecode.build`` returns None for a model or cache it does not cover (MLA, a paged or GPU cache, linears left
unpacked, a layer or attention whose forward is its own): the runner then keeps the eager path.

Numerics: the projections, router, experts and attention are the same engine kernels as the eager path; the
engine's RMSNorm and the block's q/k norm and RoPE round as PyTorch's fp32 ops (on an AVX2 PyTorch:
csrc/dense/sum_order.h), so an fp32 model's lean step is bitwise the eager one there. bf16: the input norm runs in
fp32 inside the linear (eager rounds its output to bf16 first), o_proj's fp32 output and the experts' fp32 sum are
added to the residual before rounding (eager rounds them first): within the bound measured in
tests/engine/test_cpu_decode.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from hetmoe.cpu.attention import prepare_decode_block
from hetmoe.cpu.experts import HostRoute
from hetmoe.cpu.linear import CPULinear
from hetmoe.cpu.pool import EngineJob, job_list
from hetmoe.layers.attention import GQAAttention
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.rope import cos_sin
from hetmoe.models.common import CausalLM, DecoderModel, PreNormDecoderLayer, SoftmaxMoeBlock

DTYPES = (torch.float32, torch.bfloat16)


def _layer_forwards() -> tuple:
    """The decoder-layer forwards this step reproduces: x + attn(norm(x)), then x + mlp(norm(x))."""
    from hetmoe.models.mixtral import MixtralDecoderLayer  # same pre-norm layer, MoE block under its HF name

    return (PreNormDecoderLayer.forward, MixtralDecoderLayer.forward)


def _norm(module) -> tuple:
    """(fp32 weight, eps) of an RMSNorm: what CPULinear's ``norm=`` takes, converted once."""
    return module.weight.detach().to(torch.float32).contiguous(), float(module.variance_epsilon)


def why_not(model, cache) -> Optional[str]:
    """None when ``CPUDecode`` covers ``model`` and ``cache``, else the reason it does not."""
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


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy made by this thread alone: a second PyTorch thread would wait for a core that the pool's
    workers, spinning after the step, hold (bench/cpu_decode_profile.py "logits out": 25 us alone, ms in a loaded
    decode loop)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return t.to(torch.float32, copy=True)
    finally:
        torch.set_num_threads(n)


def moe_on_engine(layer) -> Optional[str]:
    """None when the engine takes ``layer``'s whole MoE block (norm + router + routed experts, added into the
    residual), else why not: the block then runs as the model's module."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, SoftmaxMoeBlock) or type(mlp).forward is not SoftmaxMoeBlock.forward or mlp.shared:
        return "not a softmax MoE block without a shared expert"
    if type(layer.post_attention_layernorm) is not RMSNorm:
        return "the post-attention norm is not an RMSNorm"
    gate, moe = mlp.gate, mlp.moe
    if not isinstance(gate, CPULinear) or gate.bias is not None:
        return "the router is not a bias-free linear on the engine"
    router = moe.router
    if moe.engine is None or not router.host_routable or router.correction_bias is not None:
        return "the experts are not the CPU engine's, or the router is not one the engine's job runs"
    if moe.staging is not None or moe.gpu is not None or moe.chain is not None or moe.drop or moe.route_observer:
        return "the layer stages, defers, drops or observes its routing"
    if moe.experts.pool is not gate.pool:
        return "the router and the experts run on different pools"
    return None


def _moe_state(layers) -> tuple:
    """What decides ``moe_on_engine`` and may change between steps (deferral, drop, observers, the experts)."""
    return tuple((id(m.experts), m.drop, m.chain, m.route_observer, m.gpu, m.staging)
                 for m in (getattr(getattr(layer, "mlp", None), "moe", None) for layer, *_ in layers) if m is not None)


class CPUDecode:
    """One decode step (one token per sequence) of a packed GQA model on the CPU; see the module docstring."""

    def __init__(self, model, cache):
        reason = why_not(model, cache)
        if reason:
            raise ValueError(f"CPUDecode does not cover this model: {reason}")
        self.model, self.cache = model, cache
        self.layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            qk = None
            if attn.qk_norm_eps is not None:
                qk = (_norm(attn.q_norm)[0], _norm(attn.k_norm)[0], float(attn.qk_norm_eps))
            self.layers.append((layer, attn, _norm(layer.input_layernorm), qk))
        self._plans, self._plans_key = {}, None  # batch size -> _make_plan's, for one cache allocation and MoE state

    @classmethod
    def build(cls, model, cache) -> Optional["CPUDecode"]:
        """A CPUDecode, or None where it does not apply (the runner stays eager)."""
        return None if why_not(model, cache) else cls(model, cache)

    def _plan(self, B: int) -> dict:
        """The buffers and bound calls of a step of B tokens, made once per B (again after the cache grows or a
        MoE layer changes how it runs)."""
        key = (self.cache.version, _moe_state(self.layers))
        if self._plans_key != key:
            self._plans, self._plans_key = {}, key
        plan = self._plans.get(B)
        if plan is None:
            plan = self._plans[B] = self._make_plan(B)
        return plan

    def _make_plan(self, B: int) -> dict:
        inner = self.model.model
        weight = inner.embed_tokens.weight  # [vocab, H]
        dtype, D, H = weight.dtype, self.cache.head_dim, weight.shape[1]
        x = torch.empty(B, H, dtype=dtype)  # the residual stream, updated in place by every layer
        cos, sin = torch.empty(B, D, dtype=dtype), torch.empty(B, D, dtype=dtype)
        rows, pos = torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64)
        buffers = {}  # shared by the layers (one runs at a time): by name and shape

        def buf(name, shape, dt=dtype):
            return buffers.setdefault((name, shape, dt), torch.empty(*shape, dtype=dt))

        segments, jobs = [], []  # a segment: (pool, one job_list) or a decoder layer whose MLP Python runs
        calls = []  # (name, pool, job) of every call, for bench/cpu_decode_profile.py

        def queue(name: str, pool, job: EngineJob):
            if jobs and jobs[0][0] is not pool:
                close()
            jobs.append((pool, job))
            calls.append((name, pool, job))

        def close():
            if jobs:
                segments.append((jobs[0][0], job_list([j for _, j in jobs])))
                jobs.clear()

        for i, (layer, attn, norm, qk) in enumerate(self.layers):
            qkv = buf("qkv", (B, attn.qkv.out_features))
            out = buf("out", (B, attn.n_heads * D))
            q_norm, k_norm, eps = qk if qk else (None, None, 1e-6)
            block = prepare_decode_block(qkv, attn.n_heads, attn.n_kv, cos, sin, self.cache.k[i], self.cache.v[i],
                                         rows, pos, D**-0.5, q_norm, k_norm, eps, out=out, pool=attn.qkv.pool)
            queue("qkv", attn.qkv.pool, attn.qkv.prepare(x, out=qkv, norm=norm))  # qkv = W norm(x)
            queue("attention", attn.qkv.pool, block.job())  # q/k norm, rope, cache write, attention
            queue("o_proj", attn.o_proj.pool, attn.o_proj.prepare(out, out=x, accumulate=True))  # x += o_proj(a)
            if moe_on_engine(layer) is None:
                mlp, moe = layer.mlp, layer.mlp.moe
                h, k = buf("h", (B, H)), moe.router.top_k
                logits = buf("router", (B, mlp.gate.out_features))
                ids, w = buf("ids", (B, k), torch.int64), buf("w", (B, k), torch.float32)
                queue("norm+router", mlp.gate.pool, mlp.gate.prepare(
                    x, out=logits, norm=_norm(layer.post_attention_layernorm), norm_out=h))  # h = norm(x), logits
                queue("experts", moe.experts.pool, moe.experts.prepare(
                    h, ids, w, x, accumulate=True, route=HostRoute(logits, moe.router)))  # x += experts(h)
            else:
                close()
                segments.append(layer)
                calls.append(("mlp (PyTorch)", None, layer))
        lm_head = self.model.lm_head
        logits = None
        if isinstance(lm_head, CPULinear) and type(inner.norm) is RMSNorm:
            logits = torch.empty(B, lm_head.out_features, dtype=dtype)
            queue("norm+lm_head", lm_head.pool, lm_head.prepare(x, out=logits, norm=_norm(inner.norm),
                                                                norm_out=buf("h", (B, H))))
        close()
        return {"x": x, "cos": cos, "sin": sin, "rows": rows, "pos": pos, "segments": segments, "logits": logits,
                "calls": calls}

    def inputs(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> dict:
        """The plan of a step of these B tokens with its inputs written: embeddings, RoPE rows, positions, slots."""
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
        return plan

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """ids, positions [B, 1] and slots [B] (the cache reserved for them) -> the logits after each token,
        fp32 [B, vocab]."""
        plan = self.inputs(ids, positions, slots)
        x = plan["x"]
        for seg in plan["segments"]:
            if isinstance(seg, tuple):
                pool, job = seg
                pool.submit(job)
                pool.sync()
            else:  # a decoder layer whose MoE block runs as the model's module
                x += seg.mlp(seg.post_attention_layernorm(x)[:, None])[:, 0]
        if plan["logits"] is not None:
            return _fp32_copy(plan["logits"])  # the caller's own (the buffer is the next step's)
        return self.model.logits(self.model.model.norm(x)).float()
