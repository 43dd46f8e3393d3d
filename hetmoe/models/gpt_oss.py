"""gpt-oss (model_type "gpt_oss": openai/gpt-oss-20b, -120b): GQA attention with q/k/v/o biases and a learned sink
logit per head, sliding-window and full attention alternating as ``layer_types`` says (default: even layers
sliding), YaRN RoPE; every layer MoE, routed experts only.

* Attention: the sinks (``self_attn.sinks`` [heads]) join each head's softmax denominator and attend to nothing;
  a ``sliding_attention`` layer sees the last ``sliding_window`` positions (p - window < j <= p). Both run in the
  attention kernels (layers/attention.py ``attend_cache``): on a GPU the paged Triton kernels, decode steps inside the
  CUDA graph and the fused path (whose epilogue does RoPE and the cache write); on the CPU the engine's decode
  attention, prompts in ``attend_sinks`` (PyTorch SDPA). The cache holds every position of every layer (a sliding
  layer reads only its window of it: docs/attention.md says what a ring would take).
* Router ``mlp.router``: a linear with bias; softmax over the top-k logits, i.e. softmax top-k renormalised
  (hetmoe/moe/router.py kind ``softmax``, norm_topk_prob: the same weights up to rounding).
* Experts (``mlp.moe``, the CPU engine): gate/up/down with biases and the clamped SwiGLU
  h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit) (``swiglu_alpha`` 1.702,
  ``swiglu_limit`` 7.0; hetmoe.cpu.Glu). The checkpoint stores them stacked, ``mlp.experts.gate_up_proj`` [E, H, 2I]
  with gate and up interleaved (columns 0::2 and 1::2) and ``down_proj`` [E, I, H], or as MXFP4 blocks
  (``*_blocks``/``*_scales``): the loader reads both (hetmoe/load/checkpoint.py, ``gpt_oss_experts``).
* RMSNorm as transformers' GptOssRMSNorm: weight times the fp32 normalised x, rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import GQAAttention, Step, attend_cache
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.rope import apply_rope, cos_sin, inv_frequencies, yarn_parameters
from hetmoe.models.common import CausalLM, DecoderModel, PreNormDecoderLayer, run_layers
from hetmoe.models.config import ModelConfig, gpt_oss_layer_types, gpt_oss_rope
from hetmoe.moe import MoELayer, RouterSpec


class GptOssRMSNorm(RMSNorm):
    """weight * normalise(x) in fp32, rounded to x's dtype once (transformers keeps gpt-oss's norms in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
        return (self.weight.float() * normed).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta) -> tuple:
        """The fused decode step's layer boundary: (x + delta, self(x + delta)) in one kernel, rounded as ``forward``
        rounds (the normalised x not rounded before the weight)."""
        if delta is not None and delta.dtype != x.dtype:
            x = x + delta.to(x.device)
            return x, self(x)
        from hetmoe.ops.triton.fused import add_rms_norm

        return add_rms_norm(x, delta, self.weight, self.variance_epsilon, round_normed=False)


class GptOssMLP(nn.Module):
    """The linear router with bias, softmax top-k, the routed experts (clamped SwiGLU with biases) behind ``moe``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n_experts = cfg.first("num_local_experts", "num_experts")
        self.router = nn.Linear(cfg.hidden_size, n_experts, bias=True)
        glu = ("clamped_swiglu", float(cfg.swiglu_alpha), float(cfg.swiglu_limit))
        self.moe = MoELayer(RouterSpec("softmax", cfg.num_experts_per_tok, norm_topk_prob=True), n_experts, glu=glu,
                            bias=True)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        return self.moe(flat, self.router(flat)).view_as(x)


class GptOssAttention(GQAAttention):
    """GQA with biases on q/k/v/o, a sink logit per head and, in sliding layers, a window (module docstring). Its
    forward is its own (the lean CPU decode step, engine/cpu_decode.py, does not cover it); a fused step takes
    GQAAttention's epilogue (biased q/k/v projection, RoPE and the cache write in one kernel)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        bias = cfg.attention_bias
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim_or_default,
                         layer_idx, qkv_bias=bias, o_bias=bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))
        sliding = gpt_oss_layer_types(cfg)[layer_idx] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        H, K, D = self.n_heads, self.n_kv, self.head_dim
        if step.fused and self.qkv is not None:  # RoPE and the cache write in one kernel
            q = self._fused_epilogue(self.qkv(x), rope, step, cache)
        else:
            q, k, v = self.qkv.parts(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
            q, k = apply_rope(q.reshape(B, S, H, D), *rope), apply_rope(k.reshape(B, S, K, D), *rope)
            cache.write(self.layer_idx, step, k, v.reshape(B, S, K, D))
        out = attend_cache(q, cache, self.layer_idx, step, D**-0.5, self.sinks, self.sliding_window)  # [B, S, H, D]
        return self.o_proj(out.reshape(B, S, -1))


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, GptOssAttention(cfg, layer_idx), GptOssMLP(cfg))
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GptOssModel(DecoderModel):
    """embed_tokens -> layers -> norm; one RoPE table per call (YaRN: its frequencies, and cos/sin times its
    attention factor), shared by all layers."""

    layer_cls = GptOssDecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        params, D = gpt_oss_rope(cfg), cfg.head_dim_or_default
        if params["rope_type"] == "yarn":
            inv_freq, self.attention_scaling = yarn_parameters(params, D, cfg.max_position_embeddings)
        else:  # "default" (check_config refuses others)
            inv_freq, self.attention_scaling = inv_frequencies(D, params["rope_theta"]), 1.0
        self.inv_freq = inv_freq

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        rope = cos_sin(step.positions, self.inv_freq, x.dtype, self.attention_scaling)
        return run_layers(self.layers, x, rope, step, cache, self.norm)


class GptOssForCausalLM(CausalLM):
    model_cls = GptOssModel
