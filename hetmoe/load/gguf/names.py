"""GGUF tensor names -> the Hugging Face parameter names of hetmoe's models, and the transform each tensor needs.

A GGUF name is parsed with the gguf package's own tables (``TENSOR_NAMES``: ``blk.{bid}.attn_q`` ...; which of them an
architecture has: ``MODEL_TENSORS``) plus a ``.weight`` / ``.bias`` suffix; the table below gives its Hugging Face
name (``{bid}`` the layer, ``{expert}`` the expert). ``hf_name(name, arch)`` returns (name, Transform) and raises
GGUFError for a name it does not know. ``hf_tensors(f, cfg)`` yields every (Hugging Face name, float32 array) of a
GGUFFile with the transforms applied: what a loader copies into the meta-built model. Shapes are Hugging Face
order (``GGUFTensor.shape``: reversed ggml ne), so a Linear weight is [out, in] on both sides.

    token_embd, output_norm, output         model.embed_tokens, model.norm, lm_head (no output: tied embeddings)
    blk.N.attn_norm, ffn_norm               model.layers.N.input_layernorm, post_attention_layernorm
    blk.N.attn_q|k|v|output                 model.layers.N.self_attn.q_proj|k_proj|v_proj|o_proj (weight, bias)
    blk.N.attn_q_norm, attn_k_norm          self_attn.q_norm, k_norm (qwen3moe)
    blk.N.ffn_gate|up|down                  mlp.gate_proj|up_proj|down_proj (dense layers: deepseek2's first ones)
    blk.N.ffn_gate_inp                      mlp.gate (Mixtral: block_sparse_moe.gate), the router [E, H]
    blk.N.ffn_gate|up|down_exps             mlp.experts.{expert}.gate_proj|up_proj|down_proj (Mixtral:
                                            block_sparse_moe.experts.{expert}.w1|w3|w2); EXPERTS
    blk.N.ffn_gate|up|down.E (old Mixtral)  block_sparse_moe.experts.E.w1|w3|w2, one expert per tensor
    blk.N.ffn_gate|up|down_shexp            mlp.shared_expert.* (qwen2moe), mlp.shared_experts.* (deepseek2)
    blk.N.ffn_gate_inp_shexp                mlp.shared_expert_gate [1, H] (qwen2moe); ROW
    blk.N.exp_probs_b.bias                  mlp.gate.e_score_correction_bias (deepseek2 with sigmoid routing)
    blk.N.attn_q_a, attn_q_a_norm, attn_q_b self_attn.q_a_proj, q_a_layernorm, q_b_proj (deepseek2)
    blk.N.attn_kv_a_mqa, attn_kv_a_norm     self_attn.kv_a_proj_with_mqa, kv_a_layernorm
    blk.N.attn_kv_b                         self_attn.kv_b_proj (files from before MLA)
    blk.N.attn_k_b + attn_v_b               self_attn.kv_b_proj, recombined: KV_B_K / KV_B_V
    blk.N.attn_sinks.weight                 self_attn.sinks, a bare parameter (gpt-oss)
    blk.N.ffn_gate_inp, ffn_*_exps.bias     mlp.router (weight, bias), the experts' biases (gpt-oss; EXPERTS)

Transforms (each undoes what convert_hf_to_gguf.py did):

* COPY: the values as they are.
* EXPERTS: the converter stacked the per-expert [out, in] weights of a layer into one [E, out, in] tensor
  (``torch.stack(..., dim=0)``); expert e is ``tensor[e]`` (``GGUFTensor.float32(e)`` dequantizes only that one).
* UNPERMUTE_Q / UNPERMUTE_K (arch ``llama``): LlamaModel.permute reorders each head's rows for llama.cpp's
  interleaved-pair RoPE: ``w.reshape(n_head, 2, d/2, *rest).swapaxes(1, 2)``; undone by
  ``w.reshape(n_head, d/2, 2, *rest).swapaxes(1, 2).reshape(w.shape)`` with n_head = num_attention_heads for q and
  num_key_value_heads for k (weights and biases alike). Other architectures are written unpermuted: Qwen and
  DeepSeek are not permuted by the converter (DeepSeek's rope part is already interleaved pairs in Hugging Face).
* KV_B_K / KV_B_V (deepseek2, MLA-era files): the converter cut kv_b_proj.weight [h * (nope + v), r] into per head
  ``k_b = kv_b.view(h, nope + v, r)[:, :nope].transpose(1, 2)`` -> attn_k_b [h, r, nope] and ``v_b = [:, nope:]`` ->
  attn_v_b [h, v, r]; recombined as ``concat(k_b.transpose(0, 2, 1), v_b, axis=1).reshape(h * (nope + v), r)``.
* ROW: ffn_gate_inp_shexp is [H] in some files and [1, H] in others; Hugging Face's shared_expert_gate is [1, H].
* SKIP: the multi-token-prediction layers (``nextn.*`` tensors, and every tensor of a block at or past
  block_count - nextn_predict_layers), which hetmoe's models do not build: left unread (GGUFCheckpoint notes it).
* INTEGERS: an integer table written as stored (DeepSeek-V4's hash-routing tid2eid, I32 [vocab, k]): read as its
  integers (GGUFCheckpoint.get), never as floats.

minimax-m3 and deepseek4 have tables of their own (below TABLES): M3 is MiniMax-M2's layout with the indexer
(indexer.q_proj / k_proj / q_norm / k_norm) and NORM_OFFSET on every norm; V4 renames DeepSeek's tensors one for
one (attn_kv, attn_output_a / b, attn_sinks, attn_compressor_*, indexer_compressor_*, hc_*, output_hc_*), stacked
experts (MXFP4 as released) and its tid2eid as INTEGERS.

Gated DeltaNet (qwen3next, qwen35moe; Qwen3NextModel and _LinearAttentionVReorderBase in the converter). Hk, Hv key
and value heads of Dk, Dv; r = Hv / Hk:

* NORM_OFFSET: the zero-centred RMSNorms (every norm but the linear attention's gated one) are written as 1 + w;
  w = stored - 1.
* A_LOG: ``A_log`` is written as -exp(A_log) (ssm_a); undone with log(-a). ``dt_bias`` is ssm_dt.bias (COPY).
* CONV: the depthwise conv1d weight [C, 1, K] is written squeezed, [C, K].
* QKVZ_QKV + QKVZ_Z (qwen3next): in_proj_qkvz [Hk * (2 Dk + 2 r Dv), H], laid out per key head as [q, k, v, z], is
  cut into attn_qkv (all q rows, then all k, then all v) and attn_gate (all z); recombined per key head.
  in_proj_ba (ssm_ba) is written as it is.
* V_*: qwen35moe with Hv != Hk: the converter reorders the value heads from grouped by key head ([k0: v0..v(r-1),
  k1: ...]) to tiled ([v0 of k0, v0 of k1, ..., v1 of k0, ...]) in the rows of the v part of attn_qkv (V_QKV), of
  attn_gate (V_ROWS: Dv rows per head), of ssm_alpha / ssm_beta / ssm_a / ssm_dt (V_HEADS: one row per head; A_log
  also negated-exp), of the v channels of ssm_conv1d (V_CONV), and the columns of ssm_out (V_COLS); undone with the
  inverse permutation.
"""

from __future__ import annotations

import functools
import re
from enum import Enum
from typing import Iterator, Optional

import numpy as np

from hetmoe.load.gguf.metadata import config_from_gguf
from hetmoe.load.gguf.reader import GGUFError, GGUFFile


class Transform(str, Enum):
    COPY = "copy"
    EXPERTS = "experts"
    UNPERMUTE_Q = "unpermute_q"
    UNPERMUTE_K = "unpermute_k"
    KV_B_K = "kv_b_k"
    KV_B_V = "kv_b_v"
    ROW = "row"
    SKIP = "skip"
    NORM_OFFSET = "norm_offset"
    A_LOG = "a_log"
    CONV = "conv"
    QKVZ_QKV = "qkvz_qkv"
    QKVZ_Z = "qkvz_z"
    V_QKV = "v_qkv"
    V_ROWS = "v_rows"
    V_HEADS = "v_heads"
    V_A_LOG = "v_a_log"
    V_CONV = "v_conv"
    V_COLS = "v_cols"
    INTEGERS = "integers"


PAIRS = {Transform.KV_B_K: Transform.KV_B_V, Transform.QKVZ_QKV: Transform.QKVZ_Z}  # two tensors -> one parameter


_L = "model.layers.{bid}."
_COMMON = {
    "TOKEN_EMBD": ("model.embed_tokens", Transform.COPY),
    "OUTPUT_NORM": ("model.norm", Transform.COPY),
    "OUTPUT": ("lm_head", Transform.COPY),
    "ATTN_NORM": (_L + "input_layernorm", Transform.COPY),
    "FFN_NORM": (_L + "post_attention_layernorm", Transform.COPY),
    "ATTN_Q": (_L + "self_attn.q_proj", Transform.COPY),
    "ATTN_K": (_L + "self_attn.k_proj", Transform.COPY),
    "ATTN_V": (_L + "self_attn.v_proj", Transform.COPY),
    "ATTN_OUT": (_L + "self_attn.o_proj", Transform.COPY),
    "FFN_GATE": (_L + "mlp.gate_proj", Transform.COPY),
    "FFN_UP": (_L + "mlp.up_proj", Transform.COPY),
    "FFN_DOWN": (_L + "mlp.down_proj", Transform.COPY),
}
_ROUTED = {
    "FFN_GATE_INP": (_L + "mlp.gate", Transform.COPY),
    "FFN_GATE_EXP": (_L + "mlp.experts.{expert}.gate_proj", Transform.EXPERTS),
    "FFN_UP_EXP": (_L + "mlp.experts.{expert}.up_proj", Transform.EXPERTS),
    "FFN_DOWN_EXP": (_L + "mlp.experts.{expert}.down_proj", Transform.EXPERTS),
}


def _shared_expert(module: str) -> dict:
    """The shared expert's gate/up/down under ``mlp.<module>``."""
    return {f"FFN_{w.upper()}_SHEXP": (_L + f"mlp.{module}.{w}_proj", Transform.COPY) for w in ("gate", "up", "down")}


_MLA = {"ATTN_Q_A": (_L + "self_attn.q_a_proj", Transform.COPY),
        "ATTN_Q_A_NORM": (_L + "self_attn.q_a_layernorm", Transform.COPY),
        "ATTN_Q_B": (_L + "self_attn.q_b_proj", Transform.COPY),
        "ATTN_KV_A_MQA": (_L + "self_attn.kv_a_proj_with_mqa", Transform.COPY),
        "ATTN_KV_A_NORM": (_L + "self_attn.kv_a_layernorm", Transform.COPY),
        "ATTN_KV_B": (_L + "self_attn.kv_b_proj", Transform.COPY),
        "ATTN_K_B": (_L + "self_attn.kv_b_proj", Transform.KV_B_K),
        "ATTN_V_B": (_L + "self_attn.kv_b_proj", Transform.KV_B_V)}
_SIGMOID_ROUTED = {**_ROUTED, **_shared_expert("shared_experts"),
                   "FFN_EXP_PROBS_B": (_L + "mlp.gate.e_score_correction_bias", Transform.COPY)}
_DSA = {**_COMMON, **_ROUTED, **_MLA, **_SIGMOID_ROUTED,
        "INDEXER_ATTN_Q_B": (_L + "self_attn.indexer.wq_b", Transform.COPY),
        "INDEXER_ATTN_K": (_L + "self_attn.indexer.wk", Transform.COPY),
        "INDEXER_K_NORM": (_L + "self_attn.indexer.k_norm", Transform.COPY),
        "INDEXER_PROJ": (_L + "self_attn.indexer.weights_proj", Transform.COPY)}


def _gated_deltanet(reorder: bool) -> dict:
    """qwen3next (reorder False) / qwen35moe (True): zero-centred norms, the linear attention, gated attention,
    softmax experts with a sigmoid-gated shared expert."""
    la, off = _L + "linear_attn.", Transform.NORM_OFFSET
    out = {**_COMMON, **_ROUTED, **_shared_expert("shared_expert"),
           "FFN_GATE_INP_SHEXP": (_L + "mlp.shared_expert_gate", Transform.ROW),
           "OUTPUT_NORM": ("model.norm", off), "ATTN_NORM": (_L + "input_layernorm", off),
           "ATTN_POST_NORM": (_L + "post_attention_layernorm", off),
           "ATTN_Q_NORM": (_L + "self_attn.q_norm", off), "ATTN_K_NORM": (_L + "self_attn.k_norm", off),
           "SSM_NORM": (la + "norm", Transform.COPY), "SSM_DT": (la + "dt_bias", Transform.COPY),
           "SSM_A": (la + "A_log", Transform.A_LOG), "SSM_CONV1D": (la + "conv1d", Transform.CONV),
           "SSM_OUT": (la + "out_proj", Transform.COPY)}
    if not reorder:
        return {**out, "ATTN_QKV": (la + "in_proj_qkvz", Transform.QKVZ_QKV),
                "ATTN_GATE": (la + "in_proj_qkvz", Transform.QKVZ_Z),
                "SSM_BETA_ALPHA": (la + "in_proj_ba", Transform.COPY)}
    return {**out, "ATTN_QKV": (la + "in_proj_qkv", Transform.V_QKV), "ATTN_GATE": (la + "in_proj_z", Transform.V_ROWS),
            "SSM_BETA": (la + "in_proj_b", Transform.V_HEADS), "SSM_ALPHA": (la + "in_proj_a", Transform.V_HEADS),
            "SSM_DT": (la + "dt_bias", Transform.V_HEADS), "SSM_A": (la + "A_log", Transform.V_A_LOG),
            "SSM_CONV1D": (la + "conv1d", Transform.V_CONV), "SSM_OUT": (la + "out_proj", Transform.V_COLS)}


# gpt-oss (llama.cpp's "gpt-oss", LLM_ARCH_OPENAI_MOE; GptOssModel in the converter): GQA with biases and a sink
# logit per head (attn_sinks.weight -> self_attn.sinks, a bare parameter), post_attention_norm as the MoE's pre-norm,
# the router with bias (ffn_gate_inp), and gate_up_proj / down_proj split per matrix and stacked (*_exps: weights,
# MXFP4 or float, and biases [E, I] / [E, H]), read one expert at a time as every other stacked expert tensor
_GPT_OSS = {**_COMMON, "ATTN_POST_NORM": (_L + "post_attention_layernorm", Transform.COPY),
            "ATTN_SINKS": (_L + "self_attn.sinks", Transform.COPY),
            "FFN_GATE_INP": (_L + "mlp.router", Transform.COPY),
            "FFN_GATE_EXP": (_L + "mlp.experts.{expert}.gate_proj", Transform.EXPERTS),
            "FFN_UP_EXP": (_L + "mlp.experts.{expert}.up_proj", Transform.EXPERTS),
            "FFN_DOWN_EXP": (_L + "mlp.experts.{expert}.down_proj", Transform.EXPERTS)}
for _kind in ("FFN_NORM", "FFN_GATE", "FFN_UP", "FFN_DOWN"):  # its MoE pre-norm is post_attention_norm; no dense FFN
    del _GPT_OSS[_kind]

# GGUF architecture -> MODEL_TENSOR name -> (Hugging Face name without .weight/.bias, transform)
TABLES = {
    "qwen3moe": {**_COMMON, **_ROUTED, "ATTN_Q_NORM": (_L + "self_attn.q_norm", Transform.COPY),
                 "ATTN_K_NORM": (_L + "self_attn.k_norm", Transform.COPY)},
    "qwen2moe": {**_COMMON, **_ROUTED, **_shared_expert("shared_expert"),
                 "FFN_GATE_INP_SHEXP": (_L + "mlp.shared_expert_gate", Transform.ROW)},
    "llama": {**_COMMON,
              "ATTN_Q": (_L + "self_attn.q_proj", Transform.UNPERMUTE_Q),
              "ATTN_K": (_L + "self_attn.k_proj", Transform.UNPERMUTE_K),
              "FFN_GATE_INP": (_L + "block_sparse_moe.gate", Transform.COPY),
              "FFN_GATE_EXP": (_L + "block_sparse_moe.experts.{expert}.w1", Transform.EXPERTS),
              "FFN_UP_EXP": (_L + "block_sparse_moe.experts.{expert}.w3", Transform.EXPERTS),
              "FFN_DOWN_EXP": (_L + "block_sparse_moe.experts.{expert}.w2", Transform.EXPERTS)},
    "deepseek2": {**_COMMON, **_ROUTED,
                  "ATTN_Q_A": (_L + "self_attn.q_a_proj", Transform.COPY),
                  "ATTN_Q_A_NORM": (_L + "self_attn.q_a_layernorm", Transform.COPY),
                  "ATTN_Q_B": (_L + "self_attn.q_b_proj", Transform.COPY),
                  "ATTN_KV_A_MQA": (_L + "self_attn.kv_a_proj_with_mqa", Transform.COPY),
                  "ATTN_KV_A_NORM": (_L + "self_attn.kv_a_layernorm", Transform.COPY),
                  "ATTN_KV_B": (_L + "self_attn.kv_b_proj", Transform.COPY),
                  "ATTN_K_B": (_L + "self_attn.kv_b_proj", Transform.KV_B_K),
                  "ATTN_V_B": (_L + "self_attn.kv_b_proj", Transform.KV_B_V),
                  **_shared_expert("shared_experts"),
                  "FFN_EXP_PROBS_B": (_L + "mlp.gate.e_score_correction_bias", Transform.COPY)},
    "glm4moe": {**_COMMON, **_SIGMOID_ROUTED, "ATTN_POST_NORM": (_L + "post_attention_layernorm", Transform.COPY),
                "ATTN_Q_NORM": (_L + "self_attn.q_norm", Transform.COPY),
                "ATTN_K_NORM": (_L + "self_attn.k_norm", Transform.COPY)},
    "minimax-m2": {**_COMMON, "ATTN_Q_NORM": (_L + "self_attn.q_norm", Transform.COPY),
                   "ATTN_K_NORM": (_L + "self_attn.k_norm", Transform.COPY),
                   "FFN_GATE_INP": (_L + "block_sparse_moe.gate", Transform.COPY),
                   "FFN_EXP_PROBS_B": (_L + "block_sparse_moe.e_score_correction_bias", Transform.COPY),
                   "FFN_GATE_EXP": (_L + "block_sparse_moe.experts.{expert}.w1", Transform.EXPERTS),
                   "FFN_UP_EXP": (_L + "block_sparse_moe.experts.{expert}.w3", Transform.EXPERTS),
                   "FFN_DOWN_EXP": (_L + "block_sparse_moe.experts.{expert}.w2", Transform.EXPERTS)},
    "qwen3next": _gated_deltanet(reorder=False),
    "qwen35moe": _gated_deltanet(reorder=True),
    "glm-dsa": _DSA,
    "deepseek32": _DSA,
    "gpt-oss": _GPT_OSS,
}
# hetmoe's own listing of the GGUF names of the kinds the tables above use or skip (gguf-py's TENSOR_NAMES): the
# gguf package on PyPI may predate an architecture (deepseek32) or a kind, and a file must load all the same.
GGUF_NAMES = {
    "TOKEN_EMBD": "token_embd", "OUTPUT_NORM": "output_norm", "OUTPUT": "output", "ROPE_FREQS": "rope_freqs",
    "ATTN_NORM": "blk.{bid}.attn_norm", "ATTN_POST_NORM": "blk.{bid}.post_attention_norm",
    "FFN_NORM": "blk.{bid}.ffn_norm", "ATTN_Q": "blk.{bid}.attn_q", "ATTN_K": "blk.{bid}.attn_k",
    "ATTN_V": "blk.{bid}.attn_v", "ATTN_QKV": "blk.{bid}.attn_qkv", "ATTN_OUT": "blk.{bid}.attn_output",
    "ATTN_GATE": "blk.{bid}.attn_gate", "ATTN_Q_NORM": "blk.{bid}.attn_q_norm", "ATTN_K_NORM": "blk.{bid}.attn_k_norm",
    "ATTN_ROT_EMBD": "blk.{bid}.attn_rot_embd", "ATTN_SINKS": "blk.{bid}.attn_sinks",
    "FFN_GATE": "blk.{bid}.ffn_gate", "FFN_UP": "blk.{bid}.ffn_up", "FFN_DOWN": "blk.{bid}.ffn_down",
    "FFN_GATE_INP": "blk.{bid}.ffn_gate_inp", "FFN_GATE_EXP": "blk.{bid}.ffn_gate_exps",
    "FFN_UP_EXP": "blk.{bid}.ffn_up_exps", "FFN_DOWN_EXP": "blk.{bid}.ffn_down_exps",
    "FFN_GATE_UP_EXP": "blk.{bid}.ffn_gate_up_exps",
    "FFN_GATE_SHEXP": "blk.{bid}.ffn_gate_shexp", "FFN_UP_SHEXP": "blk.{bid}.ffn_up_shexp",
    "FFN_DOWN_SHEXP": "blk.{bid}.ffn_down_shexp", "FFN_GATE_INP_SHEXP": "blk.{bid}.ffn_gate_inp_shexp",
    "FFN_EXP_PROBS_B": "blk.{bid}.exp_probs_b",
    "ATTN_Q_A": "blk.{bid}.attn_q_a", "ATTN_Q_A_NORM": "blk.{bid}.attn_q_a_norm", "ATTN_Q_B": "blk.{bid}.attn_q_b",
    "ATTN_KV_A_MQA": "blk.{bid}.attn_kv_a_mqa", "ATTN_KV_A_NORM": "blk.{bid}.attn_kv_a_norm",
    "ATTN_KV_B": "blk.{bid}.attn_kv_b", "ATTN_K_B": "blk.{bid}.attn_k_b", "ATTN_V_B": "blk.{bid}.attn_v_b",
    "INDEXER_ATTN_Q_B": "blk.{bid}.indexer.attn_q_b", "INDEXER_ATTN_K": "blk.{bid}.indexer.attn_k",
    "INDEXER_K_NORM": "blk.{bid}.indexer.k_norm", "INDEXER_PROJ": "blk.{bid}.indexer.proj",
    "SSM_A": "blk.{bid}.ssm_a", "SSM_CONV1D": "blk.{bid}.ssm_conv1d", "SSM_DT": "blk.{bid}.ssm_dt",
    "SSM_NORM": "blk.{bid}.ssm_norm", "SSM_OUT": "blk.{bid}.ssm_out", "SSM_BETA_ALPHA": "blk.{bid}.ssm_ba",
    "SSM_BETA": "blk.{bid}.ssm_beta", "SSM_ALPHA": "blk.{bid}.ssm_alpha",
    **{f"NEXTN_{k.upper()}": f"blk.{{bid}}.nextn.{k}" for k in ("eh_proj", "embed_tokens", "enorm", "hnorm",
                                                              "shared_head_head", "shared_head_norm")},
}
# MiniMax-M3 (llama.cpp's "minimax-m3", MiniMaxM3Model in the converter: MiniMax-M2's names and expert stacking, every
# RMSNorm written as 1 + w, the (1 + weight) form baked in): a MoE layer's block under block_sparse_moe, its
# block-sparse attention's indexer (index_q_proj, index_k_proj and their norms) as indexer.q_proj ... .
_M3_OFF, _M3_MOE = Transform.NORM_OFFSET, _L + "block_sparse_moe."
TABLES["minimax-m3"] = {
    **_COMMON, "OUTPUT_NORM": ("model.norm", _M3_OFF), "ATTN_NORM": (_L + "input_layernorm", _M3_OFF),
    "FFN_NORM": (_L + "post_attention_layernorm", _M3_OFF),
    "ATTN_Q_NORM": (_L + "self_attn.q_norm", _M3_OFF), "ATTN_K_NORM": (_L + "self_attn.k_norm", _M3_OFF),
    "INDEXER_Q_PROJ": (_L + "self_attn.index_q_proj", Transform.COPY),
    "INDEXER_K_PROJ": (_L + "self_attn.index_k_proj", Transform.COPY),
    "INDEXER_Q_NORM": (_L + "self_attn.index_q_norm", _M3_OFF),
    "INDEXER_K_NORM": (_L + "self_attn.index_k_norm", _M3_OFF),
    "FFN_GATE_INP": (_M3_MOE + "gate", Transform.COPY),
    "FFN_EXP_PROBS_B": (_M3_MOE + "e_score_correction_bias", Transform.COPY),
    "FFN_GATE_EXP": (_M3_MOE + "experts.{expert}.w1", Transform.EXPERTS),
    "FFN_UP_EXP": (_M3_MOE + "experts.{expert}.w3", Transform.EXPERTS),
    "FFN_DOWN_EXP": (_M3_MOE + "experts.{expert}.w2", Transform.EXPERTS),
    **{f"FFN_{w.upper()}_SHEXP": (_M3_MOE + f"shared_experts.{w}_proj", Transform.COPY)
       for w in ("gate", "up", "down")}}
GGUF_NAMES.update({f"INDEXER_{k.upper()}": f"blk.{{bid}}.indexer.{k}" for k in ("q_proj", "k_proj", "q_norm")})

# DeepSeek-V4 (llama.cpp's "deepseek4", DeepseekV4Model in the converter, which reads DeepSeek's own checkpoint names):
# every tensor written as it is, renamed; the routed experts stacked ([E, out, in], MXFP4 as released) and the hash
# layers' tid2eid table written as I32 [vocab, k] (INTEGERS: read as stored). attn_kv_a_norm is the kv_norm of the
# one shared key/value head (gguf-py's ATTN_KV_NORM, the name deepseek2's kv_a_layernorm has too).
_V4_ATT, _V4_CMP = _L + "self_attn.", _L + "self_attn.compressor."
TABLES["deepseek4"] = {
    "TOKEN_EMBD": ("model.embed_tokens", Transform.COPY), "OUTPUT_NORM": ("model.norm", Transform.COPY),
    "OUTPUT": ("lm_head", Transform.COPY), "ATTN_NORM": (_L + "input_layernorm", Transform.COPY),
    "FFN_NORM": (_L + "post_attention_layernorm", Transform.COPY),
    **{f"HC_HEAD_{k.upper()}": (f"model.hc_head.hc_{k}", Transform.COPY) for k in ("fn", "base", "scale")},
    **{f"HC_{b.upper()}_{k.upper()}": (_L + f"{b}_hc.{k}", Transform.COPY) for b in ("attn", "ffn")
       for k in ("fn", "base", "scale")},
    "ATTN_SINKS": (_V4_ATT + "sinks", Transform.COPY), "ATTN_Q_A": (_V4_ATT + "q_a_proj", Transform.COPY),
    "ATTN_Q_A_NORM": (_V4_ATT + "q_a_norm", Transform.COPY), "ATTN_Q_B": (_V4_ATT + "q_b_proj", Transform.COPY),
    "ATTN_KV": (_V4_ATT + "kv_proj", Transform.COPY), "ATTN_KV_A_NORM": (_V4_ATT + "kv_norm", Transform.COPY),
    "ATTN_OUT_A": (_V4_ATT + "o_a_proj", Transform.COPY), "ATTN_OUT_B": (_V4_ATT + "o_b_proj", Transform.COPY),
    **{f"{who}_COMPRESSOR_{k}": (at + name, Transform.COPY)
       for who, at in (("ATTN", _V4_CMP), ("INDEXER", _V4_CMP + "indexer."))
       for k, name in (("WKV", "kv_proj"), ("WGATE", "gate_proj"), ("APE", "position_bias"), ("NORM", "kv_norm"))},
    "INDEXER_ATTN_Q_B": (_V4_CMP + "indexer.q_b_proj", Transform.COPY),
    "INDEXER_PROJ": (_V4_CMP + "indexer.scorer.weights_proj", Transform.COPY),
    "FFN_GATE_INP": (_L + "mlp.gate", Transform.COPY),
    "FFN_GATE_TID2EID": (_L + "mlp.gate.tid2eid", Transform.INTEGERS),
    "FFN_EXP_PROBS_B": (_L + "mlp.gate.e_score_correction_bias", Transform.COPY),
    "FFN_GATE_EXP": (_L + "mlp.experts.{expert}.w1", Transform.EXPERTS),
    "FFN_UP_EXP": (_L + "mlp.experts.{expert}.w3", Transform.EXPERTS),
    "FFN_DOWN_EXP": (_L + "mlp.experts.{expert}.w2", Transform.EXPERTS),
    **_shared_expert("shared_experts")}
GGUF_NAMES.update({
    **{f"HC_HEAD_{k.upper()}": f"output_hc_{k}" for k in ("fn", "base", "scale")},
    **{f"HC_{b.upper()}_{k.upper()}": f"blk.{{bid}}.hc_{b}_{k}" for b in ("attn", "ffn")
       for k in ("fn", "base", "scale")},
    "ATTN_SINKS": "blk.{bid}.attn_sinks", "ATTN_KV": "blk.{bid}.attn_kv", "ATTN_OUT_A": "blk.{bid}.attn_output_a",
    "ATTN_OUT_B": "blk.{bid}.attn_output_b", "FFN_GATE_TID2EID": "blk.{bid}.ffn_gate_tid2eid",
    "FFN_EXP_PROBS_B_VL": "blk.{bid}.exp_probs_b_vl",
    **{f"{who}_COMPRESSOR_{k}": f"blk.{{bid}}.{who.lower()}_compressor_{name}" for who in ("ATTN", "INDEXER")
       for k, name in (("WKV", "kv"), ("WGATE", "gate"), ("APE", "ape"), ("NORM", "norm"))}})
_SKIPPED = tuple(k for k in GGUF_NAMES if k.startswith("NEXTN_"))  # multi-token prediction: not built
# "exp_probs_b.bias" is e_score_correction_bias itself (a buffer), "ssm_dt.bias" dt_bias (a parameter)
_NO_SUFFIX = {"FFN_EXP_PROBS_B", "SSM_DT"}
_BARE = {"SSM_A"}  # written without a .weight suffix (ssm_a: A_log, a parameter of its own)
_WEIGHT_ONLY = {"ATTN_SINKS"}  # written as .weight, a bare parameter in Hugging Face (self_attn.sinks)
_WHY_NOT = {"ROPE_FREQS": "RoPE frequency factors (Llama-3 style scaling), which hetmoe's models do not apply",
            "ATTN_ROT_EMBD": "a precomputed RoPE table, which llama.cpp itself ignores",
            "FFN_GATE_UP_EXP": "gate and up experts fused in one tensor, which hetmoe does not read yet"}
# DeepSeek-V4's bare parameters and buffers (hyper-connections, sinks, compressor position biases, tid2eid), each
# written with .weight; its vision variant's routing bias of image tokens is refused (hetmoe runs text only)
_WEIGHT_ONLY.update({"HC_HEAD_FN", "HC_HEAD_BASE", "HC_HEAD_SCALE", "ATTN_COMPRESSOR_APE", "INDEXER_COMPRESSOR_APE",
                     "FFN_GATE_TID2EID", *(f"HC_{b}_{k}" for b in ("ATTN", "FFN") for k in ("FN", "BASE", "SCALE"))})
_WHY_NOT["FFN_EXP_PROBS_B_VL"] = ("the routing bias of image tokens (DeepSeek-V4's vision variant), which hetmoe's "
                                  "text-only DeepSeek-V4 never uses")
_OLD_MIXTRAL_EXPERT = re.compile(r"^blk\.(?P<bid>\d+)\.ffn_(?P<which>gate|up|down)\.(?P<expert>\d+)\.weight$")
_OLD_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


@functools.lru_cache(maxsize=None)
def _patterns(arch: str) -> tuple:
    """(regex, MODEL_TENSOR name) of every tensor of ``arch`` hetmoe knows: its table's and the skipped kinds, named
    by GGUF_NAMES, plus the others the gguf package lists for the architecture (so that they are refused by kind)."""
    import gguf

    if arch not in TABLES:
        raise GGUFError(f"GGUF architecture {arch!r} has no tensor-name table (supported: {', '.join(TABLES)})")
    names = {kind: GGUF_NAMES[kind] for kind in (*TABLES[arch], *_SKIPPED, *_WHY_NOT) if kind in GGUF_NAMES}
    arch_enum = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    for kind in gguf.MODEL_TENSORS.get(arch_enum, []):
        names.setdefault(kind.name, gguf.TENSOR_NAMES[kind])
    out = []
    for kind, name in names.items():
        base = re.escape(name).replace(re.escape("{bid}"), r"(?P<bid>\d+)")
        suffix = r"(?:\.(?P<suffix>weight|bias))?" if kind in _BARE else r"\.(?P<suffix>weight|bias)"
        out.append((re.compile(rf"^{base}{suffix}$"), kind))
    return tuple(out)


def hf_name(gguf_name: str, arch: str) -> tuple:
    """(Hugging Face name, Transform) of the GGUF tensor ``gguf_name`` of a ``arch`` (general.architecture) file.
    For Transform.EXPERTS the name holds ``{expert}``: ``name.format(expert=e)`` is expert e's."""
    for pattern, kind in _patterns(arch):
        m = pattern.match(gguf_name)
        if m is None:
            continue
        if kind in _SKIPPED:
            return None, Transform.SKIP
        if kind not in TABLES[arch]:
            why = _WHY_NOT.get(kind, "a tensor hetmoe's models have no parameter for")
            raise GGUFError(f"GGUF tensor {gguf_name} ({kind}) of a {arch} file is {why}")
        template, transform = TABLES[arch][kind]
        name = template.format(bid=m.groupdict().get("bid"), expert="{expert}")
        if kind in _BARE:
            return name, transform
        if kind in _WEIGHT_ONLY:
            if m["suffix"] != "weight":
                raise GGUFError(f"GGUF tensor {gguf_name}: {kind} is a weight, not a {m['suffix']}")
            return name, transform
        if kind in _NO_SUFFIX:
            if m["suffix"] != "bias":
                raise GGUFError(f"GGUF tensor {gguf_name}: {kind} is a bias, not a {m['suffix']}")
            return name, transform
        return f"{name}.{m['suffix']}", transform
    m = _OLD_MIXTRAL_EXPERT.match(gguf_name) if arch == "llama" else None
    if m:  # llama.cpp's loader still reads the per-expert tensors of files converted before April 2024
        name = _OLD_MIXTRAL_NAMES[m["which"]]
        return f"model.layers.{m['bid']}.block_sparse_moe.experts.{m['expert']}.{name}.weight", Transform.COPY
    raise GGUFError(f"unknown GGUF tensor {gguf_name!r} for architecture {arch!r}")


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def main_layers(f: GGUFFile) -> Optional[int]:
    """The decoder layers hetmoe runs: block_count less the multi-token-prediction blocks the converter appends
    (A.nextn_predict_layers), or None when the file does not say."""
    blocks, nextn = f.metadata.get(f"{f.arch}.block_count"), f.metadata.get(f"{f.arch}.nextn_predict_layers") or 0
    return blocks - nextn if isinstance(blocks, int) and isinstance(nextn, int) else None


def hf_names(f: GGUFFile) -> dict:
    """GGUF name -> (Hugging Face name, Transform) for every tensor of ``f``; one GGUFError lists all unknown ones.
    The tensors of the multi-token-prediction blocks are (None, Transform.SKIP)."""
    out, bad = {}, []
    n_main = main_layers(f)
    for name in f.tensors:
        m = _BLOCK.match(name)
        if m and n_main is not None and int(m[1]) >= n_main:
            out[name] = (None, Transform.SKIP)
            continue
        try:
            out[name] = hf_name(name, f.arch)
        except GGUFError as e:
            bad.append(str(e))
    if bad:
        raise GGUFError(f"{f.path}: {len(bad)} tensor(s) hetmoe cannot place: " + "; ".join(bad))
    return out


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's LlamaModel.permute of a q or k weight [n_head * d, in] (or bias [n_head * d])."""
    d = w.shape[0] // n_head
    if d * n_head != w.shape[0] or d % 2:
        raise GGUFError(f"cannot undo the RoPE permutation: {w.shape[0]} rows are not {n_head} heads of an even size")
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def merge_kv_b(k_b: np.ndarray, v_b: np.ndarray, n_head: int, kv_lora_rank: int) -> np.ndarray:
    """kv_b_proj.weight [h * (nope + v), r] from attn_k_b [h, r, nope] and attn_v_b [h, v, r]."""
    k_b = k_b.reshape(n_head, kv_lora_rank, -1)
    v_b = v_b.reshape(n_head, -1, kv_lora_rank)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kv_lora_rank)


def merge_qkvz(qkv: np.ndarray, z: np.ndarray, n_k_heads: int) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz [Hk * (2 Dk + 2 r Dv), H] (per key head: q, k, v, z) from attn_qkv (q of every head,
    then k, then v) and attn_gate (z)."""
    hidden, vz = qkv.shape[-1], z.shape[0] // n_k_heads
    dk = (qkv.shape[0] - z.shape[0]) // (2 * n_k_heads)
    q, k, v = np.split(qkv, [n_k_heads * dk, 2 * n_k_heads * dk])
    parts = [t.reshape(n_k_heads, -1, hidden) for t in (q, k, v, z)]
    if any(p.shape[1] != want for p, want in zip(parts, (dk, dk, vz, vz))):
        raise GGUFError(f"attn_qkv {qkv.shape} and attn_gate {z.shape} are not {n_k_heads} key heads of q, k, v, z")
    return np.concatenate(parts, axis=1).reshape(-1, hidden)


def untile_heads(w: np.ndarray, axis: int, cfg: dict, head_dim: int) -> np.ndarray:
    """Undo _LinearAttentionVReorderBase._reorder_v_heads along ``axis``: the value heads back from tiled
    ([r, Hk, head_dim]) to grouped by key head ([Hk, r, head_dim])."""
    n_k = cfg["linear_num_key_heads"]
    r = cfg["linear_num_value_heads"] // n_k
    if r == 1:
        return w
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(r, n_k, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def undo(transform: Transform, w: np.ndarray, cfg: dict) -> np.ndarray:
    """The Hugging Face values of a GGUF tensor ``w`` (float32, Hugging Face order) of a one-tensor transform."""
    if transform in (Transform.UNPERMUTE_Q, Transform.UNPERMUTE_K):
        return unpermute_rope(w, cfg["num_attention_heads" if transform is Transform.UNPERMUTE_Q
                                     else "num_key_value_heads"])
    if transform is Transform.ROW:
        return w.reshape(1, -1)
    if transform is Transform.NORM_OFFSET:
        return w - np.float32(1)
    if transform in (Transform.A_LOG, Transform.V_A_LOG):
        with np.errstate(divide="ignore", invalid="ignore"):
            w = np.log(-w)
        return untile_heads(w, 0, cfg, 1) if transform is Transform.V_A_LOG else w
    if transform is Transform.CONV:
        return w.reshape(w.shape[0], 1, -1)
    if transform is Transform.V_CONV:
        keys = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        v = untile_heads(w[keys:], 0, cfg, cfg["linear_value_head_dim"])
        return np.concatenate([w[:keys], v]).reshape(w.shape[0], 1, -1)
    if transform is Transform.V_QKV:
        keys = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
        return np.concatenate([w[:keys], untile_heads(w[keys:], 0, cfg, cfg["linear_value_head_dim"])])
    if transform is Transform.V_ROWS:
        return untile_heads(w, 0, cfg, cfg["linear_value_head_dim"])
    if transform is Transform.V_HEADS:
        return untile_heads(w, 0, cfg, 1)
    if transform is Transform.V_COLS:
        return untile_heads(w, w.ndim - 1, cfg, cfg["linear_value_head_dim"])
    return w


def merge_pair(first: Transform, a: np.ndarray, b: np.ndarray, cfg: dict) -> np.ndarray:
    """The parameter written as two tensors (PAIRS): kv_b_proj from attn_k_b + attn_v_b, in_proj_qkvz from attn_qkv
    + attn_gate."""
    if first is Transform.KV_B_K:
        return merge_kv_b(a, b, cfg["num_attention_heads"], cfg["kv_lora_rank"])
    return merge_qkvz(a, b, cfg["linear_num_key_heads"])


def hf_tensors(f: GGUFFile, cfg: Optional[dict] = None) -> Iterator[tuple]:
    """(Hugging Face name, float32 array) of every tensor of ``f`` after its transform; stacked experts come out
    one expert at a time (``cfg``: config_from_gguf(f), computed when not given); the skipped ones not at all."""
    cfg = cfg if cfg is not None else config_from_gguf(f)
    halves: dict = {}
    second = {b: a for a, b in PAIRS.items()}
    for gguf_name, (name, transform) in hf_names(f).items():
        t = f.tensors[gguf_name]
        if transform is Transform.SKIP:
            continue
        if transform is Transform.EXPERTS:
            for e in range(t.shape[0]):
                yield name.format(expert=e), t.float32(e)
        elif transform in PAIRS or transform in second:
            pair = halves.setdefault(name, {})
            pair[transform] = t.float32()
            if len(pair) == 2:
                del halves[name]
                first = transform if transform in PAIRS else second[transform]
                yield name, merge_pair(first, pair[first], pair[PAIRS[first]], cfg)
        elif transform is Transform.INTEGERS:  # an integer table (DeepSeek-V4's tid2eid), as stored
            yield name, np.array(t.data)
        else:
            yield name, undo(transform, t.float32(), cfg)
    if halves:
        raise GGUFError(f"{f.path}: {', '.join(sorted(halves))} is written as two tensors (attn_k_b + attn_v_b, "
                        "attn_qkv + attn_gate); the file has only one")
