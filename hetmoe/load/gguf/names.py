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
}
_NO_SUFFIX = {"FFN_EXP_PROBS_B"}  # a buffer: "exp_probs_b.bias" is e_score_correction_bias itself
_WHY_NOT = {"ROPE_FREQS": "RoPE frequency factors (Llama-3 style scaling), which hetmoe's models do not apply",
            "ATTN_ROT_EMBD": "a precomputed RoPE table, which llama.cpp itself ignores"}
_OLD_MIXTRAL_EXPERT = re.compile(r"^blk\.(?P<bid>\d+)\.ffn_(?P<which>gate|up|down)\.(?P<expert>\d+)\.weight$")
_OLD_MIXTRAL_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


@functools.lru_cache(maxsize=None)
def _patterns(arch: str) -> tuple:
    """(regex, MODEL_TENSOR name) of every tensor the gguf package lists for ``arch``."""
    import gguf

    if arch not in TABLES:
        raise GGUFError(f"GGUF architecture {arch!r} has no tensor-name table (supported: {', '.join(TABLES)})")
    arch_enum = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), None)
    kinds = gguf.MODEL_TENSORS[arch_enum] if arch_enum is not None else []
    out = []
    for kind in kinds:
        base = re.escape(gguf.TENSOR_NAMES[kind]).replace(re.escape("{bid}"), r"(?P<bid>\d+)")
        out.append((re.compile(rf"^{base}\.(?P<suffix>weight|bias)$"), kind.name))
    return tuple(out)


def hf_name(gguf_name: str, arch: str) -> tuple:
    """(Hugging Face name, Transform) of the GGUF tensor ``gguf_name`` of a ``arch`` (general.architecture) file.
    For Transform.EXPERTS the name holds ``{expert}``: ``name.format(expert=e)`` is expert e's."""
    for pattern, kind in _patterns(arch):
        m = pattern.match(gguf_name)
        if m is None:
            continue
        if kind not in TABLES[arch]:
            why = _WHY_NOT.get(kind, "a tensor hetmoe's models have no parameter for")
            raise GGUFError(f"GGUF tensor {gguf_name} ({kind}) of a {arch} file is {why}")
        template, transform = TABLES[arch][kind]
        name = template.format(bid=m.groupdict().get("bid"), expert="{expert}")
        if kind in _NO_SUFFIX:
            if m["suffix"] != "bias":
                raise GGUFError(f"GGUF tensor {gguf_name}: exp_probs_b is a bias, not a {m['suffix']}")
            return name, transform
        return f"{name}.{m['suffix']}", transform
    m = _OLD_MIXTRAL_EXPERT.match(gguf_name) if arch == "llama" else None
    if m:  # llama.cpp's loader still reads the per-expert tensors of files converted before April 2024
        name = _OLD_MIXTRAL_NAMES[m["which"]]
        return f"model.layers.{m['bid']}.block_sparse_moe.experts.{m['expert']}.{name}.weight", Transform.COPY
    raise GGUFError(f"unknown GGUF tensor {gguf_name!r} for architecture {arch!r}")


def hf_names(f: GGUFFile) -> dict:
    """GGUF name -> (Hugging Face name, Transform) for every tensor of ``f``; one GGUFError lists all unknown ones."""
    out, bad = {}, []
    for name in f.tensors:
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


def hf_tensors(f: GGUFFile, cfg: Optional[dict] = None) -> Iterator[tuple]:
    """(Hugging Face name, float32 array) of every tensor of ``f`` after its transform; stacked experts come out
    one expert at a time (``cfg``: config_from_gguf(f), computed when not given)."""
    cfg = cfg if cfg is not None else config_from_gguf(f)
    halves: dict = {}
    for gguf_name, (name, transform) in hf_names(f).items():
        t = f.tensors[gguf_name]
        if transform is Transform.EXPERTS:
            for e in range(t.shape[0]):
                yield name.format(expert=e), t.float32(e)
        elif transform in (Transform.UNPERMUTE_Q, Transform.UNPERMUTE_K):
            heads = cfg["num_attention_heads" if transform is Transform.UNPERMUTE_Q else "num_key_value_heads"]
            yield name, unpermute_rope(t.float32(), heads)
        elif transform in (Transform.KV_B_K, Transform.KV_B_V):
            pair = halves.setdefault(name, {})
            pair[transform] = t.float32()
            if len(pair) == 2:
                del halves[name]
                yield name, merge_kv_b(pair[Transform.KV_B_K], pair[Transform.KV_B_V], cfg["num_attention_heads"],
                                       cfg["kv_lora_rank"])
        elif transform is Transform.ROW:
            yield name, t.float32().reshape(1, -1)
        else:
            yield name, t.float32()
    if halves:
        raise GGUFError(f"{f.path}: attn_k_b and attn_v_b come in pairs; {', '.join(sorted(halves))} has only one")
