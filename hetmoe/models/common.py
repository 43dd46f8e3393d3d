"""The parts every decoder-only model here shares, under Hugging Face parameter names.

``DecoderModel``: embed_tokens -> layers -> norm, with one RoPE table per call shared by all layers.
``CausalLM``: the model plus lm_head; ``forward`` returns hidden states, ``logits`` is a separate step, and
``make_cache`` builds the KV cache (layers/kv_cache.py). A model file subclasses both under its own HF class names
and sets ``layer_cls`` / ``model_cls``; a model whose attention differs (MLA) overrides what differs.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import GQAAttention, Step, attend_cache
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.rope import apply_rope, cos_sin, inv_frequencies
from hetmoe.models.config import ModelConfig
from hetmoe.moe import MoELayer, RouterLogits, RouterSpec


class SwiGLUMLP(nn.Module):
    """Dense gate/up/down MLP (dense layers, shared experts)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_up = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.gate_up is None:  # once (see GQAAttention.fuse_projections)
            self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused`` (a fused decode step): silu(gate) * up in one kernel on the fused projection's output."""
        if fused and self.gate_up is not None:
            from hetmoe.ops.triton.fused import silu_mul

            gate_up = self.gate_up(x)
            swiglu = getattr(self.down_proj, "swiglu", None)  # a packed down_proj reads silu * up in its GEMV
            out = swiglu(gate_up) if swiglu is not None else None
            return out if out is not None else self.down_proj(silu_mul(gate_up))
        gate, up = self.gate_up.parts(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(F.silu(gate) * up)


class SoftmaxMoeBlock(nn.Module):
    """The MoE block of Mixtral, Qwen2-MoE and Qwen3-MoE: the linear router ``gate`` gives the logits, the MoE layer
    (hetmoe/moe/) routes them (softmax, top-k, optional renormalisation) and computes the routed experts;
    ``shared(flat)`` adds a dense part to the routed output (Qwen2-MoE's gated shared expert); the base has none."""

    def __init__(self, cfg: ModelConfig, n_experts: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, n_experts, bias=False)
        self.moe = MoELayer(RouterSpec("softmax", cfg.num_experts_per_tok, norm_topk_prob), n_experts)

    shared = None  # or a method: (flat [T, H], fused) -> [T, H]

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        gate = self.gate  # (an nn.Linear: dense formats keep routers as they are, load/dense.py)
        logits = RouterLogits(flat, gate.weight, flat.dtype, partial(gate, flat)) if fused else gate(flat)
        return self.moe(flat, logits, shared=fused_call(self.shared, fused)).view_as(x)


def fused_call(fn, fused: bool):
    """``fn`` (a shared expert, or None) called with ``fused=True`` when the step is fused, as it is otherwise."""
    return partial(fn, fused=True) if fn is not None and fused else fn


class PreNormDecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)): the layer of every model
    here whose MoE block is named ``mlp``. Subclasses build their attention and MLP and pass them in."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x: torch.Tensor, delta, rope: tuple, step: Step, cache: KVCache) -> tuple:
        """The same layer in a fused decode step (``Step.fused``): the residual stream is x + delta (delta: the
        previous layer's MLP output, not yet added; None at the first layer), added inside the input norm's kernel
        (RMSNorm.add_forward), and likewise the attention output inside the post-attention norm's. Returns (the
        residual after attention, this layer's MLP output)."""
        x, h = self.input_layernorm.add_forward(x, delta)
        x, h = self.post_attention_layernorm.add_forward(x, self.self_attn(h, rope, step, cache))
        return x, self.mlp(h, fused=True)


def run_layers(layers, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache, norm: RMSNorm) -> torch.Tensor:
    """The decoder layers, then the final norm: x [B, S, H] -> normalised hidden states [B, S, H]. A fused step
    carries each layer's MLP output to the next layer's input norm, and the last one to the final norm."""
    if not step.fused:
        for layer in layers:
            x = layer(x, rope, step, cache)
        return norm(x)
    delta = None
    for layer in layers:
        x, delta = layer.forward_fused(x, delta, rope, step, cache)
    return norm.add_forward(x, delta)[1]


def qwen_layer_is_sparse(cfg: ModelConfig, layer_idx: int) -> bool:
    """Qwen2/3-MoE: a layer is MoE unless listed in mlp_only_layers or skipped by decoder_sparse_step."""
    return (
        layer_idx not in cfg.get("mlp_only_layers", [])
        and cfg.first("num_experts", "num_local_experts") > 0
        and (layer_idx + 1) % cfg.get("decoder_sparse_step", 1) == 0
    )


class PartialRopeAttention(GQAAttention):
    """GQA whose RoPE table (``PartialRopeModel``) may cover only the leading dims of each head (the rest pass
    through: layers/rope.py apply_rope), with q/k RMSNorm per head (``qk_norm_eps``, as GQAAttention), over all heads
    at once (``qk_norm_all_heads``: one weight [heads * D] for q, one [kv_heads * D] for k; MiniMax-M2), or none.

    Its forward is its own: the fused decode epilogue (ops/triton/fused.py) and the CPU engine's decode block turn
    and normalise whole heads, so a fused step runs these PyTorch ops, and the CPU decode step leaves such a model
    to the eager forward (engine/cpu_decode.py ``why_not``)."""

    def __init__(self, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, layer_idx: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 qk_norm_all_heads: bool = False):
        super().__init__(hidden, n_heads, n_kv_heads, head_dim, layer_idx, qkv_bias=qkv_bias, o_bias=o_bias,
                         qk_norm_eps=qk_norm_eps)
        self.qk_norm_all_heads = qk_norm_all_heads and qk_norm_eps is not None
        if self.qk_norm_all_heads:
            self.q_norm = RMSNorm(n_heads * head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(n_kv_heads * head_dim, qk_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        q, k, v = self.qkv.parts(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if self.qk_norm_all_heads:  # q [B, S, H * D], k [B, S, K * D]: one RMS over all heads' dims
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.reshape(B, S, H, D), k.reshape(B, S, K, D), v.reshape(B, S, K, D)
        if self.qk_norm_eps is not None and not self.qk_norm_all_heads:  # one RMS per head
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cache.write(self.layer_idx, step, k, v)
        out = attend_cache(q, cache, self.layer_idx, step, D**-0.5)  # [B, S, heads, D]
        return self.o_proj(out.reshape(B, S, -1))


class DecoderModel(nn.Module):
    layer_cls: type = None  # set by each model: (cfg, layer_idx) -> decoder layer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inv_frequencies(cfg.head_dim_or_default, cfg.rope_theta), persistent=False)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        rope = cos_sin(step.positions, self.inv_freq, x.dtype)
        return run_layers(self.layers, x, rope, step, cache, self.norm)


class PartialRopeModel(DecoderModel):
    """A DecoderModel whose RoPE table turns the leading ``cfg.rope_dim`` dims of each head (transformers'
    partial_rotary_factor; ``PartialRopeAttention`` passes the rest through)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.inv_freq = inv_frequencies(cfg.rope_dim, cfg.rope_theta)


class CausalLM(nn.Module):
    """forward(ids, step, cache) -> hidden states [B, S, H]; logits(hidden) -> [B, S, vocab]. ``config``: the
    config.json it was built from, with the defaults of transformers' config class filled in (``with_defaults``)."""

    model_cls: type = None  # set by each model

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg = cfg.with_defaults()
        self.config = cfg
        self.model = self.model_cls(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        return self.model(input_ids, step, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def fuse_projections(self) -> None:
        """Once the weights are loaded: the linears of a layer that read the same input (attention q/k/v, an MLP's
        gate/up) run as one matmul from then on; their parameters become views of one weight (layers/linear.py),
        names and values unchanged."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections()

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", **layout) -> KVCache:
        """``layout``: KVCache's page_size / initial_tokens (layers/kv_cache.py)."""
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, max_batch, max_context, cfg.num_key_value_heads,
                       cfg.head_dim_or_default, dtype, device, **layout)
