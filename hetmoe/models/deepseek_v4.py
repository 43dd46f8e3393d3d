"""DeepSeek-V4 (model_type "deepseek_v4": V4-Flash, V4-Pro), as Transformers' DeepseekV4 classes define it.

* Attention (hetmoe/layers/compressed_attention.py): one shared key/value head of head_dim, a sliding window of
  ``sliding_window`` positions with a learned sink per head, and per ``layer_types`` either nothing more
  ("sliding_attention"), CSA ("compressed_sparse_attention": the past compressed every 4 tokens, a lightning
  indexer keeping index_topk entries per query) or HCA ("heavily_compressed_attention": compressed every 128,
  all attended); a grouped low-rank output projection. Sliding layers turn the last rope_dim dims with the "main"
  RoPE table (rope_theta), compressed layers with the "compress" one (compress_rope_theta, YaRN when config.json
  scales it); ``deepseek_v4_rope`` (models/config.py) derives both as DeepseekV4Config does.
* Residual (hetmoe/layers/hyper_connection.py): hc_mult streams mixed around every attention and MoE block
  (``attn_hc``, ``ffn_hc``) and collapsed at the end (``hc_head``) before the final norm.
* MoE in every layer: routed experts behind ``mlp.moe`` (attached by whoever loads the weights) plus one shared
  expert. The router's weight scores every expert (sqrtsoftplus = sqrt(softplus(logit)), or sigmoid); "moe"
  layers choose the top-k of score + e_score_correction_bias, "hash_moe" layers take the experts of a frozen table
  ``tid2eid[token id]`` (no choice at all); either way the chosen scores are renormalised and scaled by
  routed_scaling_factor. The block routes itself and hands (weights, ids) to its MoE layer (router kind "given").
* SwiGLU with clamp, experts and shared expert alike: silu(min(gate, limit)) * clamp(up, -limit, limit), limit =
  swiglu_limit. The shared expert does it here; the routed experts' MoE layer carries it as its activation
  (``clamped_glu``: hetmoe.cpu.Glu's clamped_swiglu with alpha 1, offset 0), which every experts backend attached
  must compute (the CPU engine does; the GPU experts' kernels do not, so they are left off at load).
* The multi-token-prediction layer of a checkpoint (``mtp.*``) is not built, so never read (said at load).

Norms, sinks, the compressors' position biases and the hyper-connections' weights are fp32 buffers whatever the
model dtype (Transformers keeps those modules in fp32). The cache (``make_cache``) is the compressed attention's own
(``CompressedKVCache``): windows and compressor states per slot that fold in every token, so the runner continues a
slot from its end or from position 0 only (no prefix reuse), and decodes eagerly (no CUDA graph, no lean CPU step).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hetmoe.layers.attention import Step
from hetmoe.layers.compressed_attention import (
    CompressedAttention,
    CompressedKVCache,
    CompressorShape,
    Fp32RMSNorm,
    V4AttentionShape,
    rope_table,
)
from hetmoe.layers.hyper_connection import HyperConnection, HyperHead, mix_streams
from hetmoe.layers.linear import FusedLinears
from hetmoe.layers.rope import inv_frequencies, yarn_parameters
from hetmoe.models.common import CausalLM
from hetmoe.models.config import (
    ModelConfig,
    deepseek_v4_compress_rates,
    deepseek_v4_layer_types,
    deepseek_v4_mlp_layer_types,
    deepseek_v4_rope,
)
from hetmoe.moe import MoELayer, RouterSpec

# DeepSeek's own tensor names (its release, and what Transformers' save_pretrained writes back) -> the model's,
# applied in order, every match firing (Transformers' conversion_mapping for deepseek_v4), to the name without its
# "model." prefix; the per-expert w1 / w3 / w2 are read as they are (load/materialize.py EXPERT_NAMES)
ORIGINAL_NAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as the model has it. Names are taken without their "model." prefix, so that the
    top-level ``norm.weight`` (the final norm) is never an attention's ``.norm.`` (kv_norm); names already the
    model's come out unchanged; the multi-token-prediction layer's (``mtp.*``) too (never read)."""
    if name.startswith("mtp."):
        return name
    short = name[len("model."):] if name.startswith("model.") else name
    for pattern, new in ORIGINAL_NAMES:
        short = pattern.sub(new, short, count=1)
    return short if short == "lm_head.weight" else "model." + short


CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


def attention_shape(cfg: ModelConfig, layer_idx: int) -> V4AttentionShape:
    kind = deepseek_v4_layer_types(cfg)[layer_idx]
    rates = deepseek_v4_compress_rates(cfg)
    compressor = indexer = None
    if kind != SLIDING:
        compressor = CompressorShape(rates[kind], cfg.head_dim, overlap=kind == CSA)
        if kind == CSA:
            indexer = CompressorShape(rates[kind], cfg.index_head_dim, overlap=True)
    return V4AttentionShape(cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups,
                            cfg.o_lora_rank, cfg.sliding_window, cfg.rms_norm_eps, compressor, indexer,
                            cfg.index_n_heads, cfg.index_topk)


class ClampedMLP(nn.Module):
    """A dense MLP or shared expert with clamped SwiGLU inputs: down((u + offset) * g * sigmoid(alpha * g)) on
    g = min(gate(x), limit), u = clamp(up(x), -limit, limit) — DeepSeek-V4's silu(g) * u with alpha 1, offset 0
    (computed as F.silu there, as Transformers does); MiniMax-M3's (gpt-oss's form) with alpha, offset 1."""

    def __init__(self, hidden: int, inter: int, limit: float, alpha: float = 1.0, offset: float = 0.0,
                 bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.limit, self.alpha, self.offset = float(limit), float(alpha), float(offset)
        self.gate_up = None  # a FusedLinears once fuse_projections ran

    def fuse_projections(self) -> None:
        if self.gate_up is None:
            self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up.parts(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        if self.alpha == 1.0 and self.offset == 0.0:
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj((up + self.offset) * (gate * torch.sigmoid(gate * self.alpha)))


def clamped_glu(limit: float, alpha: float = 1.0, offset: float = 0.0) -> tuple:
    """The fields of the experts' activation (hetmoe.cpu.Glu) that clamp the SwiGLU inputs at ``limit``:
    (u + offset) * g * sigmoid(alpha * g) on g = min(gate, limit), u = clamp(up, -limit, limit); alpha 1, offset 0
    is DeepSeek-V4's silu(g) * u."""
    return ("clamped_swiglu", float(alpha), float(limit), float(offset))


class DeepseekV4TopKRouter(nn.Module):
    """weight [E, hidden] and the (saved) e_score_correction_bias [E]: experts chosen by score + bias, weighted by
    their score."""

    def __init__(self, cfg: ModelConfig, n_experts: int):
        super().__init__()
        self.top_k, self.scale = cfg.num_experts_per_tok, float(cfg.routed_scaling_factor)
        self.score = SCORES[cfg.scoring_func]
        self.weight = nn.Parameter(torch.empty(n_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))

    def scores(self, flat: torch.Tensor) -> torch.Tensor:
        return self.score(F.linear(flat, self.weight))  # [T, E] in the model dtype, as Transformers

    def choose(self, scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices

    def forward(self, flat: torch.Tensor, input_ids: torch.Tensor) -> tuple:
        """flat [T, hidden], the tokens' ids [T] -> (weights [T, k] fp32, ids [T, k] int64)."""
        scores = self.scores(flat)
        ids = self.choose(scores, input_ids)
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scale).float(), ids


class DeepseekV4HashRouter(DeepseekV4TopKRouter):
    """The same weighting, the experts read from ``tid2eid`` [vocab, k] (a frozen table of the checkpoint)."""

    def __init__(self, cfg: ModelConfig, n_experts: int):
        super().__init__(cfg, n_experts)
        del self.e_score_correction_bias
        self.n_experts = n_experts
        self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        self._checked = None  # the table checked (its data pointer): ids within the experts

    def choose(self, scores: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.tid2eid
        if self._checked != table.data_ptr():
            if table.numel() and not (0 <= int(table.min()) and int(table.max()) < self.n_experts):
                raise ValueError(f"tid2eid holds expert ids {int(table.min())}..{int(table.max())}; the layer has "
                                 f"{self.n_experts} routed experts")
            self._checked = table.data_ptr()
        return table[input_ids.reshape(-1)].long()


class DeepseekV4SparseMoeBlock(nn.Module):
    """router -> (weights, ids) -> the routed experts (``moe``, clamped) + the shared expert."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        n_experts = cfg.first("n_routed_experts", "num_local_experts")
        hashed = deepseek_v4_mlp_layer_types(cfg)[layer_idx] == "hash_moe"
        self.gate = (DeepseekV4HashRouter if hashed else DeepseekV4TopKRouter)(cfg, n_experts)
        self.moe = MoELayer(RouterSpec("given", cfg.num_experts_per_tok), n_experts, glu=clamped_glu(cfg.swiglu_limit))
        self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit,
                                         bias=cfg.get("mlp_bias", False))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:  # [B, S, H], [B, S]
        flat = x.reshape(-1, x.shape[-1])
        return self.moe(flat, self.gate(flat, input_ids), shared=self.shared_experts).view_as(x)


class DeepseekV4DecoderLayer(nn.Module):
    """streams [B, S, n, H] -> attn_hc collapses them, self_attn(input_layernorm(.)), mixed back; the same with
    ffn_hc around mlp(post_attention_layernorm(.))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.rope_kind = "main" if deepseek_v4_layer_types(cfg)[layer_idx] == SLIDING else "compress"
        self.self_attn = CompressedAttention(attention_shape(cfg, layer_idx), layer_idx)
        self.mlp = DeepseekV4SparseMoeBlock(cfg, layer_idx)
        self.input_layernorm = Fp32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, ropes: dict, step: Step,
                cache: CompressedKVCache) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = mix_streams(streams, self.self_attn(self.input_layernorm(x), ropes[self.rope_kind], step, cache),
                              post, comb)
        post, comb, x = self.ffn_hc(streams)
        return mix_streams(streams, self.mlp(self.post_attention_layernorm(x), input_ids), post, comb)


def rope_inv_freq(cfg: ModelConfig, params: dict) -> tuple:
    """(inverse frequencies [rope_dim / 2] fp32, cos/sin scale) of one of V4's RoPE tables."""
    if params["rope_type"] == "yarn":  # (Transformers reads truncate from the outer dict, which never has it)
        return yarn_parameters({**params, "truncate": True}, cfg.head_dim, cfg.max_position_embeddings)
    dim = int(cfg.head_dim * params.get("partial_rotary_factor", 1.0))
    return inv_frequencies(dim, float(params["rope_theta"])), 1.0


class DeepseekV4Model(nn.Module):
    """embed_tokens -> hc_mult copies of the embedding -> layers -> hc_head -> norm; the two RoPE tables made once
    per call and shared by the layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = Fp32RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
        self.rope_scaling = {}
        for kind, params in deepseek_v4_rope(cfg).items():
            inv_freq, self.rope_scaling[kind] = rope_inv_freq(cfg, params)
            self.register_buffer(f"{kind}_inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, step: Step, cache: CompressedKVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, S, H]
        streams = x.unsqueeze(2).expand(-1, -1, self.hc_mult, -1).contiguous()  # [B, S, n, H]
        ropes = {}
        for kind, scaling in self.rope_scaling.items():
            inv_freq = getattr(self, f"{kind}_inv_freq")
            ropes[kind] = (*rope_table(step.positions, inv_freq, scaling, x.dtype), inv_freq, scaling)
        for layer in self.layers:
            streams = layer(streams, input_ids, ropes, step, cache)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    model_cls = DeepseekV4Model

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", page_size=None,
                   initial_tokens=None) -> CompressedKVCache:
        """The compressed attention's cache (layers/compressed_attention.py); no pages (``page_size`` is ignored: the
        window and the compressed entries are small and per slot)."""
        kinds = [(s.window, s.head_dim, s.compressor, s.indexer)
                 for s in (layer.self_attn.shape for layer in self.model.layers)]
        return CompressedKVCache(kinds, max_batch, max_context, dtype, device, initial_tokens)
