"""DeepSeek-V2 / V2-Lite (model_type "deepseek_v2") and DeepSeek-V3 / R1 / Kimi-K2 (model_type "deepseek_v3"):
multi-head latent attention (MLA), ``first_k_dense_replace`` dense layers, then MoE layers with shared experts.

* Routing (hetmoe/moe/router.py): V2 softmax (greedy / group_limited_greedy, kind ``deepseek_v2``); V3 sigmoid
  with ``e_score_correction_bias`` and group-limited choice (kind ``sigmoid_grouped``).
* RoPE on the qk_rope_head_dim part only: V2 rotates interleaved pairs as complex numbers (output stays
  interleaved); V3 with ``rope_interleave`` (the default) rotates interleaved pairs and writes the result as
  [evens, odds], otherwise the half-split ``rotate_half`` form. YaRN ``rope_parameters`` give the inverse
  frequencies and cos/sin scale (attention factor), and ``mscale_all_dim`` multiplies the softmax scale by mscale**2.
* The KV cache holds only the compressed latent per position: c_kv (kv_lora_rank, after kv_a_layernorm) in the
  cache's "k" tensor and k_pe (qk_rope_head_dim, after RoPE) in its "v" tensor, one "head" each.
* Attention has two equivalent forms: prefill expands the cached latents into per-head keys/values with kv_b_proj;
  decode (few query tokens) absorbs kv_b_proj into the query and the output and attends in the latent space.

The routed experts sit behind the MoE layer ``mlp.moe`` (hetmoe/moe/), attached by whoever loads the weights; the
shared experts are an ordinary dense MLP (``mlp.shared_experts``) that the layer adds.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import Step, attend, mla_expanded_paged, mla_latent_cpu, mla_latent_paged
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.norm import RMSNorm
from hetmoe.layers.rope import inv_frequencies, yarn_get_mscale, yarn_parameters
from hetmoe.layers.widen import head_products, linear
from hetmoe.models.common import CausalLM, PreNormDecoderLayer, SwiGLUMLP, fused_call, run_layers
from hetmoe.models.config import ModelConfig
from hetmoe.moe import MoELayer, RouterLogits, RouterSpec


def _n_experts(cfg: ModelConfig) -> int:
    return cfg.first("n_routed_experts", "num_local_experts", "num_experts")


def _rope_parameters(cfg: ModelConfig) -> dict:
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.rope_theta)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


class DeepseekV2MLP(SwiGLUMLP):
    """Dense SwiGLU MLP: the layers before first_k_dense_replace, and the shared experts."""


class DeepseekV2TopkRouter(nn.Module):
    """Router weight [E, H]: fp32 logits; softmax routing (greedy or group-limited, ``spec``)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(_n_experts(cfg), cfg.hidden_size))
        self.spec = RouterSpec("deepseek_v2", cfg.num_experts_per_tok, n_group=cfg.get("n_group") or 1,
                               topk_group=cfg.get("topk_group") or 1,
                               routed_scaling_factor=cfg.get("routed_scaling_factor", 1.0),
                               topk_method=cfg.get("topk_method", "greedy"))

    correction_bias = None

    def forward(self, flat: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused and flat.is_cuda and flat.dtype == self.weight.dtype == torch.bfloat16:
            # the same fp32 logits from one GEMM: bf16 products are exact in fp32, and the weight is not cast to a
            # fp32 copy every step
            return torch.mm(flat, self.weight.t(), out_dtype=torch.float32)
        return F.linear(flat.float(), self.weight.float())  # [T, E]


class DeepseekV3TopkRouter(DeepseekV2TopkRouter):
    """Router weight [E, H] plus the (saved) e_score_correction_bias [E]; sigmoid group-limited routing."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.register_buffer("e_score_correction_bias", torch.zeros(_n_experts(cfg)), persistent=True)
        self.spec = RouterSpec("sigmoid_grouped", cfg.num_experts_per_tok, cfg.get("norm_topk_prob", True),
                               cfg.get("n_group", 1) or 1, cfg.get("topk_group", 1) or 1,
                               cfg.get("routed_scaling_factor", 1.0))

    @property
    def correction_bias(self) -> torch.Tensor:
        return self.e_score_correction_bias


class DeepseekV2Moe(nn.Module):
    """router logits -> the MoE layer (hetmoe/moe/), plus the shared experts (moe_intermediate_size *
    n_shared_experts)."""

    router_cls = DeepseekV2TopkRouter

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = self.router_cls(cfg)
        self.moe = MoELayer(self.gate.spec, _n_experts(cfg))
        n_shared = cfg.get("n_shared_experts") or 0
        self.shared_experts = (
            DeepseekV2MLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, cfg.get("mlp_bias", False))
            if n_shared else None
        )

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        logits = (RouterLogits(flat, self.gate.weight, torch.float32, partial(self.gate, flat, True)) if fused
                  else self.gate(flat))
        return self.moe(flat, logits, shared=fused_call(self.shared_experts, fused),
                        correction_bias=self.gate.correction_bias).view_as(x)


class DeepseekV3MoE(DeepseekV2Moe):
    router_cls = DeepseekV3TopkRouter


def _rope_complex(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V2: interleaved pairs (x0, x1), (x2, x3)... rotated as complex numbers, result interleaved (in fp32)."""
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    cos, sin = cos.float(), sin.float()
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).type_as(x)


def _rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V3 rope_interleave: interleaved pairs rotated, result laid out as [rotated evens, rotated odds]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotate_half form (V3 with rope_interleave false)."""
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# each rope function's name in ops/triton/fused.py (the fused decode path)
ROPE_FORMS = {_rope_complex: "complex", _rope_interleave: "interleave", _rope_half: "half"}


class DeepseekV2Attention(nn.Module):
    """Multi-head latent attention (MLA) with Hugging Face parameter names.

    The cache stores c_kv = kv_a_layernorm(latent) [kv_lora_rank] and the roped k_pe [qk_rope_head_dim] per
    position. kv_b_proj.weight [heads * (nope + v_dim), r] is, per head, W_uk [nope, r] then W_uv [v_dim, r].

    * Expanded form (prefill, S > absorb_max_tokens): every cached position is expanded with kv_b_proj into
      per-head k_nope = W_uk c_kv and v = W_uv c_kv, and q = [q_nope, q_pe] attends to k = [k_nope, k_pe]; cost
      O(ctx * heads * (nope + v_dim) * r) per call, amortised over the S query tokens.
    * Weight-absorbed form (decode, S <= absorb_max_tokens): q_nope . (W_uk c_kv) = (W_uk^T q_nope) . c_kv, so the
      query is folded into the latent space (q_lat [heads, r]) and scores are q_lat . c_kv + q_pe . k_pe; the
      output is probs @ c_kv [heads, r] then W_uv per head. Nothing is expanded per cached position: O(ctx * heads
      * (r + rope)) per query token. W_uk / W_uv are views of kv_b_proj.weight taken at call time.

    Both forms give the same result up to rounding.
    """

    rope_fn = staticmethod(_rope_complex)
    absorb_max_tokens = 4  # calls with at most this many query tokens per sequence use the weight-absorbed form

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        H, bias = cfg.hidden_size, cfg.get("attention_bias", False)
        self.n_heads = cfg.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.get("q_lora_rank"), cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_head_dim = self.nope + self.rope
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(H, self.n_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, H, bias=bias)
        self.scale = self.qk_head_dim**-0.5
        params = _rope_parameters(cfg)
        if params["rope_type"] != "default" and params.get("mscale_all_dim"):
            m = yarn_get_mscale(params["factor"], params["mscale_all_dim"])
            self.scale = self.scale * m * m
        self.q_kv_a = None  # a FusedLinears (q_proj or q_a_proj, kv_a_proj_with_mqa) once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.q_kv_a is not None:  # once (see GQAAttention.fuse_projections)
            return
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        if (first.bias is None) == (self.kv_a_proj_with_mqa.bias is None):
            self.q_kv_a = FusedLinears(first, self.kv_a_proj_with_mqa)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache) -> torch.Tensor:
        B, S, _ = x.shape
        if self.q_kv_a is not None:
            q, kv_a = self.q_kv_a.parts(x)
        else:
            q = self.q_proj(x) if self.q_lora_rank is None else self.q_a_proj(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm.add_forward(q, None)[1] if step.fused else self.q_a_layernorm(q))
        if step.fused:  # kv_a_layernorm, both RoPEs and the latent cache write in one kernel
            q_nope, q_pe = self._fused_epilogue(q, kv_a, rope, step, cache)
        else:
            q_nope, q_pe = self._epilogue(q, kv_a, rope, step, cache)
        if S <= self.absorb_max_tokens:
            out = self._attend_absorbed(q_nope, q_pe, cache, step)
        else:
            out = self._attend_expanded(q_nope, q_pe, cache, step)
        return self.o_proj(out.reshape(B, S, -1))  # out: [B, S, h, v_dim]

    def _epilogue(self, q, kv_a, rope: tuple, step: Step, cache: KVCache) -> tuple:
        """q [B, S, h * (nope + rope)], kv_a [B, S, r + rope] -> (q_nope, q_pe roped); the latent and the roped
        k_pe written to the cache."""
        B, S = q.shape[:2]
        q_nope, q_pe = q.reshape(B, S, self.n_heads, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv).view(B, S, 1, self.kv_lora_rank)
        cos, sin = (t.unsqueeze(2) for t in rope)  # [B, S, 1, rope/2]
        q_pe = self.rope_fn(q_pe, cos, sin)
        k_pe = self.rope_fn(k_pe.view(B, S, 1, self.rope), cos, sin)
        cache.write(self.layer_idx, step, c_kv, k_pe)
        return q_nope, q_pe

    def _fused_epilogue(self, q, kv_a, rope: tuple, step: Step, cache: KVCache) -> tuple:
        from hetmoe.ops.triton.fused import mla_epilogue

        B, S = q.shape[:2]
        q = q.reshape(B, S, self.n_heads, self.qk_head_dim)
        c, pe, table, page = cache.layout(self.layer_idx)
        norm = self.kv_a_layernorm
        q_pe = mla_epilogue(kv_a, q, self.nope, norm.weight, norm.variance_epsilon, *rope, ROPE_FORMS[self.rope_fn],
                            c, pe, table, page, step.slots, step.positions)
        return q[..., :self.nope], q_pe

    def _attend_expanded(self, q_nope, q_pe, cache: KVCache, step: Step) -> torch.Tensor:
        """Expand every cached latent into per-head k_nope / v, then ordinary attention -> [B, S, h, v_dim]."""
        c_all, pe_all = (t.to(q_nope.dtype) for t in cache.rows(self.layer_idx, step))  # [B, ctx, 1, r | rope]
        B, ctx = c_all.shape[:2]
        kv = linear(c_all, self.kv_b_proj.weight)  # widened for a prefill's rows on the CPU
        kv = kv.view(B, ctx, self.n_heads, self.nope + self.v_dim)  # [B, ctx, h, nope + v]
        if cache.paged:
            return mla_expanded_paged(q_nope, q_pe, kv, pe_all, cache.page_size, step, self.scale)
        k, v = self._split_expanded(kv, pe_all)
        return attend(torch.cat((q_nope, q_pe), dim=-1), k, v, step, self.scale)

    def _split_expanded(self, kv: torch.Tensor, pe_all: torch.Tensor) -> tuple:
        """kv_b_proj's output for the cached latents [B, ctx, h, nope + v_dim] and the rope keys [B, ctx, 1, rope]
        -> per-head keys [B, ctx, h, nope + rope] and values [B, ctx, h, v_dim]."""
        B, ctx = kv.shape[:2]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat((k_nope, pe_all.expand(B, ctx, self.n_heads, self.rope)), dim=-1), v

    def _latent_weights(self) -> tuple:
        """Views of kv_b_proj.weight per head: W_uk [h, nope, r] (folded into the query) and W_uv^T [h, r, v_dim]
        (applied to the attended latent)."""
        w_kv = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope, self.v_dim], dim=1)  # [h, nope, r], [h, v, r] (views)
        return w_uk, w_uv.transpose(1, 2)

    def _attend_absorbed(self, q_nope, q_pe, cache: KVCache, step: Step) -> torch.Tensor:
        """Attend in the latent space with kv_b_proj folded into the query and the output -> [B, S, h, v_dim]."""
        B, S, h, _ = q_nope.shape
        r = self.kv_lora_rank
        w_uk, w_vu = self._latent_weights()  # [h, nope, r], [h, r, v]
        q_lat = per_head(q_nope, w_uk, step)  # [B, S, h, r]
        out_lat = mla_latent_cpu(q_lat, q_pe, cache, self.layer_idx, step, self.scale)  # None: not a CPU decode step
        if out_lat is not None:
            return per_head(out_lat, w_vu, step)
        if cache.paged:
            out_lat = mla_latent_paged(q_lat, q_pe, cache, self.layer_idx, step, self.scale)
            return per_head(out_lat, w_vu, step)
        c_all, pe_all = (t.to(q_nope.dtype) for t in cache.rows(self.layer_idx, step))
        ctx = c_all.shape[1]
        c, pe = c_all.view(B, ctx, r), pe_all.view(B, ctx, self.rope)  # [B, ctx, r], [B, ctx, rope]
        scores = (q_lat.reshape(B, S * h, r) @ c.transpose(1, 2)
                  + q_pe.reshape(B, S * h, self.rope) @ pe.transpose(1, 2))  # [B, S*h, ctx]
        scores = scores.view(B, S, h, ctx).float() * self.scale  # [B, S, h, ctx]
        mask = step.attn_mask(ctx, scores.dtype).view(B, S, 1, ctx)  # 0 or -inf, shared by the layers
        probs = (scores + mask).softmax(dim=-1).to(c.dtype)  # [B, S, h, ctx]
        out_lat = (probs.view(B, S * h, ctx) @ c).view(B, S, h, r)  # [B, S, h, r]
        return per_head(out_lat, w_vu, step)


def per_head(x: torch.Tensor, w: torch.Tensor, step: Step) -> torch.Tensor:
    """x [B, S, h, K] times each head's w [h, K, N] -> [B, S, h, N]: a fused decode step of at most HEAD_GEMV_MAX_T
    rows (one) through one GEMV-shaped kernel (ops/triton/mla.py ``head_gemv``), else layers/widen.py's
    ``head_products`` (an einsum, on the CPU on its fast paths)."""
    B, S, h, K = x.shape
    if step.fused and x.dtype == w.dtype:  # (a fused step has Triton)
        from hetmoe.ops.triton.mla import HEAD_GEMV_MAX_T, head_gemv

        if B * S <= HEAD_GEMV_MAX_T:
            return head_gemv(x.reshape(B * S, h, K), w).view(B, S, h, w.shape[2])
    return head_products(x, w)


class DeepseekV3Attention(DeepseekV2Attention):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.rope_fn = _rope_interleave if cfg.get("rope_interleave", True) else _rope_half


class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    attn_cls, moe_cls = DeepseekV2Attention, DeepseekV2Moe

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        if self.sparse(cfg, layer_idx):
            mlp = self.moe_cls(cfg)
        else:
            mlp = DeepseekV2MLP(cfg.hidden_size, cfg.intermediate_size, cfg.get("mlp_bias", False))
        super().__init__(cfg, self.attn_cls(cfg, layer_idx), mlp)

    @staticmethod
    def sparse(cfg: ModelConfig, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a MoE layer: from first_k_dense_replace on, when there are experts."""
        return layer_idx >= cfg.get("first_k_dense_replace", 0) and _n_experts(cfg) > 0


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    attn_cls, moe_cls = DeepseekV3Attention, DeepseekV3MoE


class DeepseekV2Model(nn.Module):
    """embed_tokens -> layers -> norm; one RoPE table (half-size cos/sin [B, S, rope/2], times the YaRN attention
    factor) per call shared by all layers."""

    layer_cls = DeepseekV2DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        params = _rope_parameters(cfg)
        dim = cfg.qk_rope_head_dim  # transformers' config sets head_dim = qk_rope_head_dim
        if params["rope_type"] == "yarn":
            inv_freq, self.attention_scaling = yarn_parameters(params, dim, cfg.max_position_embeddings)
        elif params["rope_type"] == "default":
            inv_freq, self.attention_scaling = inv_frequencies(dim, params["rope_theta"]), 1.0
        else:
            raise NotImplementedError(f"rope_type {params['rope_type']!r} is not supported for DeepSeek models")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        return run_layers(self.layers, x, self.rope_table(step.positions, x.dtype), step, cache, self.norm)

    def rope_table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(cos, sin) [B, S, rope/2] of ``positions`` [B, S], times the YaRN attention factor, in ``dtype``."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)  # [B, S, rope/2]
        return (freqs.cos() * self.attention_scaling).to(dtype), (freqs.sin() * self.attention_scaling).to(dtype)


class DeepseekV3Model(DeepseekV2Model):
    layer_cls = DeepseekV3DecoderLayer


class DeepseekV2ForCausalLM(CausalLM):
    model_cls = DeepseekV2Model

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", **layout) -> KVCache:
        """Latent cache: "k" holds c_kv [.., 1, kv_lora_rank], "v" holds k_pe [.., 1, qk_rope_head_dim]."""
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, max_batch, max_context, 1, cfg.kv_lora_rank, dtype, device,
                       v_head_dim=cfg.qk_rope_head_dim, **layout)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 and Kimi-K2."""

    model_cls = DeepseekV3Model
