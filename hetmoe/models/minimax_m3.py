"""MiniMax-M3 (model_type "minimax_m3_vl": the language model of the multimodal checkpoint, text only), as
Transformers' MiniMaxM3VL classes define it.

* Attention (hetmoe/layers/block_sparse_attention.py): GQA with per-head q/k RMSNorm in the (1 + weight) form and
  RoPE over the leading rope dims of each head (rope_parameters' partial_rotary_factor: the dims Transformers turns);
  the layers that ``layer_types`` names "minimax_m3_sparse" attend, per query, to the index_topk_blocks blocks of
  index_block_size keys that their lightning indexer scores best (plus the index_local_blocks blocks ending at the
  query's own), the others ("full_attention") to the whole causal context.
* MLP per ``mlp_layer_types``: "dense" a dense MLP (dense_intermediate_size), "sparse" a MoE block: a sigmoid router
  whose top-k is chosen by score + e_score_correction_bias and weighted by the scores renormalised, times
  routed_scaling_factor (hetmoe/moe/router.py ``sigmoid_grouped`` with one group), the routed experts behind
  ``moe`` (attached by whoever loads the weights) plus one shared expert.
* Every MLP, expert and shared expert alike, runs the clamped SwiGLU of gpt-oss on unfused gate / up halves:
  g = min(gate, limit), u = clamp(up, -limit, limit), h = (u + 1) * g * sigmoid(alpha g), alpha = swiglu_alpha,
  limit = swiglu_limit. The dense and shared MLPs do it here; the routed experts' MoE layer carries it as its
  activation (hetmoe.cpu.Glu's clamped_swiglu, offset 1), which every experts backend attached must compute (the
  CPU engine does; the GPU experts' kernels do not, so they are left off at load).
* Every norm is the (1 + weight) RMSNorm, computed in fp32.

Checkpoint names are those of the Hub and of Transformers' save_pretrained: the language model's tensors under
``language_model.`` (dropped on load, models/config.py ``MULTIMODAL``; the vision tower's and projectors' never
read), a MoE layer's block ``model.layers.N.block_sparse_moe`` (router ``gate.weight``, the block's own
``e_score_correction_bias``, experts ``experts.E.w1|w3|w2.weight`` = gate|up|down, ``shared_experts.gate_proj|
up_proj|down_proj``), a dense layer's ``mlp.gate_proj|up_proj|down_proj``. ``layer.mlp`` is the layer's MLP either
way (an alias of ``block_sparse_moe`` in a MoE layer), so the MoE layer is ``layer.mlp.moe`` like every other
model's. The multi-token-prediction modules (``mtp.*``) are not built, so never read.

The cache is the KV cache with the indexer's key of every position of every sparse layer beside the keys and values
(layers/kv_cache.py ``indexer``), so prefix reuse works as for DeepSeek-V3.2. Images and videos are not run: a
prompt holding the image or video placeholder token (image_token_index / video_token_index) is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.attention import Step
from hetmoe.layers.block_sparse_attention import BlockSparseAttention, BlockSparseShape
from hetmoe.layers.kv_cache import KVCache
from hetmoe.layers.norm import OffsetRMSNorm
from hetmoe.layers.rope import cos_sin, inv_frequencies
from hetmoe.layers.sparse_attention import SparseCall
from hetmoe.models.common import CausalLM
from hetmoe.models.config import ModelConfig, minimax_m3_config, minimax_m3_rope_dim
from hetmoe.models.deepseek_v4 import ClampedMLP, clamped_glu
from hetmoe.moe import MoELayer, RouterSpec

SPARSE, MOE = "minimax_m3_sparse", "sparse"


class MiniMaxM3SparseMoeBlock(nn.Module):
    """router ``gate`` (logits in the model dtype, sigmoid in fp32) + the block's e_score_correction_bias -> the
    routed experts (``moe``, clamped) + the shared expert."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n_experts = cfg.num_local_experts
        self.gate = nn.Linear(cfg.hidden_size, n_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))
        router = RouterSpec("sigmoid_grouped", cfg.num_experts_per_tok, norm_topk_prob=True,
                            routed_scaling_factor=float(cfg.routed_scaling_factor))
        self.moe = MoELayer(router, n_experts, glu=clamped_glu(cfg.swiglu_limit, cfg.swiglu_alpha, 1.0))
        self.shared_experts = ClampedMLP(cfg.hidden_size, cfg.shared_intermediate_size, cfg.swiglu_limit,
                                         cfg.swiglu_alpha, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H]
        flat = x.reshape(-1, x.shape[-1])
        return self.moe(flat, self.gate(flat), shared=self.shared_experts,
                        correction_bias=self.e_score_correction_bias).view_as(x)


def attention_shape(cfg: ModelConfig, layer_idx: int) -> BlockSparseShape:
    sparse = cfg.layer_types[layer_idx] == SPARSE
    index = dict(index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim, block=cfg.index_block_size,
                 topk=cfg.index_topk_blocks, local=cfg.index_local_blocks) if sparse else {}
    return BlockSparseShape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.rms_norm_eps, sparse, **index)


class MiniMaxM3DecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        index_layer = cfg.layer_types[:layer_idx].count(SPARSE)
        self.self_attn = BlockSparseAttention(attention_shape(cfg, layer_idx), layer_idx, index_layer)
        if cfg.mlp_layer_types[layer_idx] == MOE:
            self.block_sparse_moe = MiniMaxM3SparseMoeBlock(cfg)
        else:
            self.mlp = ClampedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_limit, cfg.swiglu_alpha, 1.0)
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __getattr__(self, name: str):
        if name == "mlp" and "block_sparse_moe" in self._modules:  # a MoE layer's MLP: its block (its names stay)
            return self._modules["block_sparse_moe"]
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor, rope: tuple, step: Step, cache: KVCache, call: SparseCall) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, step, cache, call)
        return x + self.mlp(self.post_attention_layernorm(x))


class MiniMaxM3Model(nn.Module):
    """embed_tokens -> layers -> norm; one RoPE table and one ``SparseCall`` per forward call, shared by the layers.
    A fused decode step (``Step.fused``) runs the same eager layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MiniMaxM3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("inv_freq", inv_frequencies(minimax_m3_rope_dim(cfg), cfg.rope_theta), persistent=False)
        self.dense_positions = cfg.index_topk_blocks * cfg.index_block_size
        ids = [(name, cfg.get(name)) for name in ("image_token_index", "video_token_index")]
        self.placeholders = [(n, i) for n, i in ids if isinstance(i, int) and 0 <= i < cfg.vocab_size]

    def forward(self, input_ids: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        if input_ids.shape[1] > 1 or step.start == 0:  # a prompt (decode steps feed the model's own tokens)
            self._refuse_media(input_ids)
        x = self.embed_tokens(input_ids)  # [B, S, H]
        rope = cos_sin(step.positions, self.inv_freq, x.dtype)
        call = SparseCall(step, self.dense_positions)
        for layer in self.layers:
            x = layer(x, rope, step, cache, call)
        return self.norm(x)

    def _refuse_media(self, input_ids: torch.Tensor) -> None:
        for name, token in self.placeholders:
            if bool((input_ids == token).any()):
                raise ValueError(f"the prompt holds token {token}, MiniMax-M3's {name.split('_')[0]} placeholder "
                                 f"({name}): hetmoe runs its language model only, images and videos are not "
                                 "supported")


class MiniMaxM3ForCausalLM(CausalLM):
    model_cls = MiniMaxM3Model
    # its decode steps read no device value on the host when the step says it is captured (SparseCall), so the
    # runner decodes it through CUDA graphs (kv_len from sparse_attention.sparse_kv_len over dense_positions)
    sparse_steps_captured = True

    def __init__(self, cfg: ModelConfig):
        super().__init__(minimax_m3_config(cfg))

    @property
    def dense_positions(self) -> int:
        """Contexts up to this many positions keep every block: attention is dense (SparseCall's topk)."""
        return self.model.dense_positions

    def make_cache(self, max_batch: int, max_context: int, dtype=torch.float32, device="cpu", **layout) -> KVCache:
        """The KV cache of every layer, plus the indexer keys [.., index_head_dim] of every sparse layer."""
        cfg = self.config
        n_index = cfg.layer_types.count(SPARSE)
        return KVCache(cfg.num_hidden_layers, max_batch, max_context, cfg.num_key_value_heads, cfg.head_dim, dtype,
                       device, indexer=(n_index, cfg.index_head_dim) if n_index else None, **layout)

