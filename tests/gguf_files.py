"""GGUF files for the tests, written the way llama.cpp's convert_hf_to_gguf.py writes them (a converter in
miniature): its metadata keys per architecture, its tensor transforms (q/k permutation for llama, experts stacked
into one tensor, DeepSeek's kv_b_proj cut into attn_k_b / attn_v_b), gguf's own HF -> GGUF name table
(TensorNameMap) and its tokenizer keys. Shared by tests/load/gguf/; needs the gguf package."""

from __future__ import annotations

import re

import gguf
import numpy as np

from hetmoe.load.gguf.kquants import KQUANTS
from hetmoe.load.gguf.lut4_blocks import LUT4_BLOCKS
from hetmoe.load.loader import build_meta, moe_blocks
from hetmoe.load.random_weights import _config
from hetmoe.models.config import EXPERT_COUNT_FIELDS, ModelConfig

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "deepseek_v3": "deepseek2",
             "deepseek_v2": "deepseek2"}


# ------------------------------------------------------------------------ a llama.cpp-style converter, in miniature

def hf_config(arch: str, **overrides) -> dict:
    return _config(arch, overrides, 512).to_dict()


def _rope(cfg: dict) -> dict:
    return ModelConfig(cfg).rope_scaling_params


def write_metadata(w, arch: str, cfg: dict) -> None:
    """The keys convert_hf_to_gguf.py writes (TextModel.set_gguf_parameters, then the model class's additions)."""
    c = ModelConfig(cfg)
    deepseek = arch.startswith("deepseek")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(1 if deepseek else c.num_key_value_heads)  # DeepseekV2Model: MLA as MQA
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.first(*EXPERT_COUNT_FIELDS[arch]))
    w.add_expert_used_count(c.num_experts_per_tok)
    if c.get("n_group") is not None:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    if deepseek:  # the published config.json files say scoring_func sigmoid (V3) / softmax (V2)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if arch == "deepseek_v3"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    scaling = _rope(cfg)
    if scaling.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(scaling["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(scaling["beta_slow"])
    if c.get("head_dim") and not deepseek:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if arch == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    elif arch == "mixtral":
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(c.head_dim_or_default)
    else:
        w.add_leading_dense_block_count(c.first_k_dense_replace)
        w.add_vocab_size(c.vocab_size)
        if c.get("q_lora_rank") is not None:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_count(c.n_shared_experts)
        w.add_expert_weights_scale(c.routed_scaling_factor)
        if c.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        if scaling.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])  # [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]


def hetmoe_state(arch: str, cfg: dict, seed: int = 0) -> dict:
    """Random fp32 values for every tensor hetmoe's model of ``cfg`` loads: parameters, persistent buffers, and the
    routed experts under their checkpoint names (gate/up [I, H], down [H, I])."""
    model = build_meta(ModelConfig(cfg))
    rng = np.random.default_rng(seed)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for mod_name, module in model.named_modules():
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                shapes[f"{mod_name}.{leaf}"] = tuple(b.shape)
    c = ModelConfig(cfg)
    inter = c.get("moe_intermediate_size") or c.intermediate_size
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for block, layer in moe_blocks(model):
        for e in range(layer.num_experts):
            for which, shape in zip(names, ((inter, c.hidden_size), (inter, c.hidden_size), (c.hidden_size, inter))):
                shapes[f"{block}.experts.{e}.{which}.weight"] = shape
    if c.get("tie_word_embeddings"):
        del shapes["lm_head.weight"]
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def to_gguf_tensors(arch: str, cfg: dict, state: dict, mla: bool = True) -> dict:
    """convert_hf_to_gguf.py's modify_tensors, then gguf's TensorNameMap for the GGUF names."""
    c = ModelConfig(cfg)
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == GGUF_ARCH[arch])
    names = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    out, experts = {}, {}

    def put(name: str, w: np.ndarray):
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # as DeepseekV2Model renames it
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"gguf's TensorNameMap has no name for {name}"
        out[new] = np.ascontiguousarray(w)

    for name, w in state.items():
        m = re.match(r"(.+)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = w
        elif arch == "mixtral" and name.endswith("q_proj.weight"):
            put(name, _permute(w, c.num_attention_heads))
        elif arch == "mixtral" and name.endswith("k_proj.weight"):
            put(name, _permute(w, c.num_key_value_heads))
        elif mla and name.endswith("kv_b_proj.weight"):
            nope, v, r = c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
            kv_b = w.reshape(c.num_attention_heads, nope + v, r)
            put(name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1))
            put(name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:])
        else:
            put(name, w)
    for (prefix, which), per in experts.items():
        put(f"{prefix}.experts.{which}.weight", np.stack([per[e] for e in range(len(per))]))
    return out


def write_gguf(path, arch: str, cfg: dict, tensors: dict, tokenizer=None, split_max_tensors: int = 0,
               drop: tuple = ()):
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[arch], split_max_tensors=split_max_tensors)
    write_metadata(w, arch, cfg)
    if tokenizer is not None:
        add_tokenizer(w, *tokenizer)
    for key in drop:
        del w.kv_data[0][key]
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hetmoe_names(cfg: dict) -> set:
    return set(hetmoe_state(ModelConfig(cfg).model_type, cfg))


def add_tokenizer(w, backend, config: dict, pre: str, vocab_size: int = 0) -> None:
    """What convert_hf_to_gguf.py's _set_vocab_gpt2 writes for a tokenizer.json + tokenizer_config.json (the token
    list padded with [PADn] up to the model's ``vocab_size``, as it pads to the embedding's rows)."""
    import json

    spec = json.loads(backend.to_str())
    added = {t["id"]: t for t in spec["added_tokens"]}
    vocab = backend.get_vocab(with_added_tokens=True)
    by_id = {i: t for t, i in vocab.items()}
    n = max(vocab_size, backend.get_vocab_size(with_added_tokens=True))
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    types = [gguf.TokenType.CONTROL if i in added and added[i]["special"] else
             gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))]
    merges = spec["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for name, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                      ("pad_token", w.add_pad_token_id)):
        if config.get(name):
            add(vocab[config[name]])
    if "add_bos_token" in config:
        w.add_add_bos_token(config["add_bos_token"])
    if config.get("chat_template"):
        w.add_chat_template(config["chat_template"])


# ---------------------------------------------------- K-quant and 4-bit codebook blocks (gguf cannot quantize them)

BLOCKS_32 = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # blocks of 32 the gguf package quantizes itself


def scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 scale bytes from eight 6-bit scales and mins [..., 8] (hetmoe/load/gguf/kquants.py reads
    them)."""
    lo, hi = slice(0, 4), slice(4, 8)
    return np.concatenate([(sc[..., lo] & 63) | ((sc[..., hi] >> 4) << 6), (m[..., lo] & 63) | ((m[..., hi] >> 4) << 6),
                           (sc[..., hi] & 15) | ((m[..., hi] & 15) << 4)], axis=-1).astype(np.uint8)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, centered: bool = False) -> np.ndarray:
    """Bytes of a [rows, cols] matrix of type ``kind``: random, with finite fp16 scale fields. ``centered``: weights
    of a std of about 0.1, centred on 0 as real quantized weights are (Q4_K / Q5_K mins near the middle code times
    the scale, small Q6_K scales), else any scale and min bytes."""
    if kind in BLOCKS_32:
        qt = getattr(gguf.GGMLQuantizationType, kind)
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qt)
    if kind in LUT4_BLOCKS:
        return lut4_blocks(kind, rows, cols, rng, centered)
    nb, nbytes = cols // 256, KQUANTS[kind][3]
    raw = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
    d = (rng.uniform(0.2, 1.0, (rows, nb)) * 0.01).astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if kind == "Q6_K":
        raw[..., 208:210] = d
        if centered:  # small positive scales (codes are centred already: q - 32)
            raw[..., 192:208] = rng.integers(1, 4, (rows, nb, 16), dtype=np.uint8)
    elif kind == "Q3_K":
        raw[..., 108:110] = d
        if centered:  # sc - 32 in 1..3 (codes are centred already: -4..3)
            raw[..., 96:108] = q3_scale_bytes(rng.integers(33, 36, (rows, nb, 16)))
    elif kind == "Q2_K":
        raw[..., 80:82], raw[..., 82:84] = d, d  # dmin = d
        if centered:  # scales 1..3, mins near the middle code (1.5) times the scale
            sc = rng.integers(1, 4, (rows, nb, 16))
            raw[..., 0:16] = (sc | (np.rint(sc * 1.5).astype(np.int64) << 4)).astype(np.uint8)
    else:
        raw[..., 0:2], raw[..., 2:4] = d, d  # dmin = d
        if centered:
            mid = 7.5 if kind == "Q4_K" else 15.5
            sc = rng.integers(1, int(63 / mid) + 1, (rows, nb, 8))
            raw[..., 4:16] = scale_bytes(sc, np.rint(sc * mid).astype(np.int64))
    return raw.reshape(rows, -1)


def q3_scale_bytes(sc: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes from sixteen 6-bit scales [..., 16] (csrc/formats/gguf_blocks.cpp reads them): the low
    nibbles of scales j and j + 8 in byte j, the top two bits of scale i + 4 jj at bits 2 jj of byte 8 + i."""
    low = (sc[..., :8] & 15) | ((sc[..., 8:] & 15) << 4)
    high = sum(((sc[..., 4 * jj:4 * jj + 4] >> 4) & 3) << (2 * jj) for jj in range(4))
    return np.concatenate([low, high], axis=-1).astype(np.uint8)


def lut4_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator, centered: bool = False) -> np.ndarray:
    """Bytes of a [rows, cols] matrix of IQ4_NL / IQ4_XS / MXFP4 / NVFP4: random nibbles (every pattern is a valid
    block) and random scales: fp16 d, IQ4_XS's 6-bit sub-block scales, MXFP4's exponent byte, NVFP4's UE4M3 bytes.
    ``centered``: weights of a std of about 0.1 (IQ4_XS sub-block scales of one sign, MXFP4 exponents around 2^-6), else
    any sub-block scale and exponents over a wide range (2^-28 .. 2^0; the edge cases 0, 1 and 255:
    tests/load/gguf/test_lut4_blocks.py)."""
    per, nbytes = LUT4_BLOCKS[kind]
    nb = cols // per
    raw = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
    if kind == "MXFP4":
        raw[..., 0] = rng.integers(120, 124, (rows, nb)) if centered else rng.integers(100, 129, (rows, nb))
        return raw.reshape(rows, -1)
    if kind == "NVFP4":  # UE4M3 scale bytes: near 2^-5 (exponent 2), or any of 0..127 (0, subnormals, 0x7F)
        raw[..., 0:4] = rng.integers(16, 24, (rows, nb, 4)) if centered else rng.integers(0, 128, (rows, nb, 4))
        return raw.reshape(rows, -1)
    d = 0.1 / 67.4 if kind == "IQ4_NL" else 0.1 / (67.4 * 4.5)  # the codebook's rms (times IQ4_XS's mean ls - 32)
    scale = (rng.uniform(0.5, 1.5, (rows, nb)) * (d if centered else 0.01)).astype(np.float16)
    raw[..., 0:2] = scale.view(np.uint8).reshape(rows, nb, 2)
    if kind == "IQ4_XS" and centered:  # ls in 33..40: (ls - 32) in 1..8
        ls = rng.integers(33, 41, (rows, nb, 8))
        raw[..., 2:4] = np.ascontiguousarray(sum(((ls[..., j] >> 4) & 3) << (2 * j) for j in range(8))
                                             .astype(np.uint16)).view(np.uint8).reshape(rows, nb, 2)
        raw[..., 4:8] = ((ls[..., 0::2] & 15) | ((ls[..., 1::2] & 15) << 4)).astype(np.uint8)
    return raw.reshape(rows, -1)


def assert_torch_unpack_equals_engine(experts, n_experts: int) -> None:
    """hetmoe/moe/streamed/packed.py's torch twin of the GPU prefill's unpack reads ``experts``' packed layout (any
    format, scaling, group or scale type) bitwise (fp32) like the engine's own dequantization."""
    import torch

    from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts

    lay = ExpertLayout.of(experts)
    ranges = expert_ranges(experts)
    assert sum(lay.range_bytes()) == experts.info()["bytes_per_expert"]
    gu, d = unpack_experts(lay, ranges, n_experts, torch.float32)
    for e in range(n_experts):
        g, u, dd = experts.dequantized(e)
        assert torch.equal(gu[e], torch.cat([g, u])) and torch.equal(d[e], dd)


# ----------------------------------- this year's architectures, from a Transformers checkpoint directory (miniature)

FRONTIER_ARCH = {"glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "qwen3_next": "qwen3next",
                 "qwen3_5_moe_text": "qwen35moe", "glm_moe_dsa": "glm-dsa", "deepseek_v32": "deepseek32"}
# gguf's TensorNameMap of an architecture the installed package may lack: one with the same tensor names
_NAME_MAP_ARCH = {"deepseek32": "glm-dsa"}


def _reorder_v_heads(w: np.ndarray, axis: int, n_k: int, r: int, head_dim: int) -> np.ndarray:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled, along ``axis``."""
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(n_k, r, head_dim, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.moveaxis(w, 0, axis)


def _linear_attention(name: str, w: np.ndarray, c: dict, reorder: bool) -> list:
    """Qwen3NextModel.modify_tensors (after _LinearAttentionVReorderBase's v-head reorder for Qwen3.5): (HF-style
    name the name map knows, array), or the GGUF names of in_proj_qkvz's two parts."""
    n_k, n_v, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                        c["linear_value_head_dim"])
    r = n_v // n_k
    if reorder and r > 1 and "linear_attn." in name:
        keys = 2 * n_k * dk
        if ".in_proj_qkv." in name:
            w = np.concatenate([w[:keys], _reorder_v_heads(w[keys:], 0, n_k, r, dv)])
        elif ".in_proj_z." in name:
            w = _reorder_v_heads(w, 0, n_k, r, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name or ".A_log" in name or ".dt_bias" in name:
            w = _reorder_v_heads(w, 0, n_k, r, 1)
        elif ".conv1d" in name:
            w = np.concatenate([w[:keys], _reorder_v_heads(w[keys:], 0, n_k, r, dv)])
        elif ".out_proj." in name:
            w = _reorder_v_heads(w, 1, n_k, r, dv)
    if name.endswith(".A_log"):  # -torch.exp, as the converter computes it (numpy's exp rounds differently)
        import torch

        w = (-torch.from_numpy(np.ascontiguousarray(w)).exp()).numpy()
    elif name.endswith(".dt_bias"):
        name = name[:-len(".dt_bias")] + ".dt_proj.bias"
    elif "conv1d" in name:
        w = w.reshape(w.shape[0], -1)
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w + np.float32(1)
    if "in_proj_qkvz.weight" in name:  # per key head [q, k, v, z] -> all q, all k, all v | all z
        bid = name.split(".")[2]
        hidden = w.shape[1]
        g = w.reshape(n_k, -1, hidden)
        q, k, v, z = np.split(g, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        qkv = np.concatenate([t.reshape(-1, hidden) for t in (q, k, v)])
        return [(f"blk.{bid}.attn_qkv.weight", qkv), (f"blk.{bid}.attn_gate.weight", z.reshape(-1, hidden))]
    return [(name, w)]


def frontier_metadata(w, arch: str, c: dict) -> None:
    """What convert_hf_to_gguf.py writes for these architectures (TextModel.set_gguf_parameters, then the model
    class: Glm4MoeModel, MiniMaxM2Model, Qwen3NextModel / Qwen3_5MoeTextModel, GlmMoeDsaModel / DeepseekV32Model)."""
    dsa = arch in ("glm-dsa", "deepseek32")
    w.add_block_count(c["num_hidden_layers"] + (c.get("num_nextn_predict_layers") or 0 if arch == "glm4moe" else 0))
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if c.get("intermediate_size"):
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1 if dsa else c["num_key_value_heads"])
    w.add_rope_freq_base(ModelConfig(c).rope_theta)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c.get("n_routed_experts") or c.get("num_experts") or c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    if c.get("scoring_func") == "sigmoid":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if c.get("head_dim") and not dsa:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if arch == "glm4moe":
        w.add_rope_dimension_count(int(head_dim * c.get("partial_rotary_factor", 0.5)))
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        if c.get("num_nextn_predict_layers") is not None:
            w.add_nextn_predict_layers(c["num_nextn_predict_layers"])
    elif arch == "minimax-m2":
        w.add_expert_feed_forward_length(c["intermediate_size"])
        w.add_rope_dimension_count(c["rotary_dim"])
    elif arch in ("qwen3next", "qwen35moe"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(c["linear_key_head_dim"])
        w.add_ssm_group_count(c["linear_num_key_heads"])
        w.add_ssm_time_step_rank(c["linear_num_value_heads"])
        w.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        w.add_array(f"{arch}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])
        w.add_full_attention_interval(c.get("full_attention_interval", 4))
        factor = (c.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)
        w.add_rope_dimension_count(int(head_dim * factor))
        if arch == "qwen35moe":
            w.add_rope_dimension_sections([11, 11, 10, 0])
    else:
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_vocab_size(c["vocab_size"])
        w.add_q_lora_rank(c["q_lora_rank"])
        w.add_kv_lora_rank(c["kv_lora_rank"])
        w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
        w.add_value_length(c["kv_lora_rank"])
        w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
        w.add_value_length_mla(c["v_head_dim"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c.get("norm_topk_prob", True))
        w.add_rope_dimension_count(c["qk_rope_head_dim"])
        w.add_uint32(f"{arch}.attention.indexer.head_count", c["index_n_heads"])
        w.add_uint32(f"{arch}.attention.indexer.key_length", c["index_head_dim"])
        w.add_uint32(f"{arch}.attention.indexer.top_k", c["index_topk"])
        if c.get("indexer_types") is not None:
            w.add_array(f"{arch}.attention.indexer.types", [t == "full" for t in c["indexer_types"]])


def convert_frontier(src, path, expert_type: str = "F32", tokenizer: bool = False) -> dict:
    """A GGUF file at ``path`` from the Transformers checkpoint directory ``src``, written as convert_hf_to_gguf.py
    writes it; routed experts stacked and stored as ``expert_type`` (F32, or Q8_0 / Q4_0 quantized by gguf), the
    rest F32. Returns the GGUF tensors as written (name -> array: quantized experts as their dequantized values)."""
    import json
    from pathlib import Path

    from safetensors.numpy import load_file

    src = Path(src)
    c = json.loads((src / "config.json").read_text())
    arch = FRONTIER_ARCH[c["model_type"]]
    name_arch = _NAME_MAP_ARCH.get(arch, arch)
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name_arch)
    names = gguf.get_tensor_name_map(arch_enum, c["num_hidden_layers"] + 1)
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        state.update({k: v.astype(np.float32) for k, v in load_file(str(shard)).items()})
    out, experts = {}, {}

    def put(name: str, w: np.ndarray):
        if name.startswith("blk."):
            out[name] = np.ascontiguousarray(w)
            return
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"gguf's TensorNameMap has no name for {name}"
        out[new] = np.ascontiguousarray(w)

    for name, w in state.items():
        m = re.match(r"(.+)\.experts\.(\d+)\.(\w+)\.weight$", name)
        if m:
            experts.setdefault((m[1], m[3]), {})[int(m[2])] = w
        elif arch in ("qwen3next", "qwen35moe"):
            for new, value in _linear_attention(name, w, c, reorder=arch == "qwen35moe"):
                put(new, value)
        elif arch in ("glm-dsa", "deepseek32") and name.endswith("kv_b_proj.weight"):
            nope, v, r = c["qk_nope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
            kv_b = w.reshape(c["num_attention_heads"], nope + v, r)
            put(name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1))
            put(name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:])
        else:
            put(name, w)
    for (prefix, which), per in experts.items():
        put(f"{prefix}.experts.{which}.weight", np.stack([per[e] for e in range(len(per))]))
    writer = gguf.GGUFWriter(str(path), arch)
    frontier_metadata(writer, arch, c)
    if tokenizer:
        from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

        add_tokenizer(writer, build_tokenizer(c["vocab_size"]), tokenizer_config(c["max_position_embeddings"]),
                      "gpt-2")
    qt = getattr(gguf.GGMLQuantizationType, expert_type)
    for name, t in out.items():
        if "_exps." in name and expert_type != "F32":
            raw = gguf.quants.quantize(t, qt)
            out[name] = gguf.quants.dequantize(raw, qt)
            writer.add_tensor(name, raw, raw_dtype=qt)
        else:
            writer.add_tensor(name, t)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    return out
