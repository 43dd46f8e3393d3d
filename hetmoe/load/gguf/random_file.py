"""Random-weight GGUF files of a qwen3_moe shape, as llama.cpp's ``qwen3moe`` model loads them, for benchmarks
(bench/llama_cpp_peer.py, bench/gguf_load.py).

Blocks are written directly as random bytes (random codes, finite fp16 scales sized for a weight std of about 0.02), one
tensor at a time: a multi-GB file takes seconds and no float copy. Types: F32 / F16 / BF16, Q4_0 / Q8_0, the K-quants
Q2_K .. Q6_K, the 4-bit codebook types IQ4_NL / IQ4_XS / MXFP4 / NVFP4 (MXFP4's scale is an exponent byte, NVFP4's four
UE4M3 bytes, set near what a weight std of 0.02 needs) and the i-quants IQ2_XXS .. IQ1_M (random grid indices, signs and
sub-scales: every byte pattern is a valid block; IQ1_M's d is spread over its scale words); ``EXPERT_MIXES`` names the
routed experts' (gate/up, down) types as llama.cpp's quantizer writes them (Q4_K_M: Q4_K gate/up, Q6_K down). The
tokenizer is a byte-level BPE vocabulary of the shape's vocab size (256 byte tokens, then merges of byte pairs and byte
triples), enough for llama.cpp to load: its benchmarks feed random token ids and never tokenize text.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np

WEIGHT_STD = 0.02  # the std of a published checkpoint's linear weights, about
# std of the weights random codes give at a scale d = 1: Q4_0 q - 8 for q in 0..15, Q8_0 int8 -128..127; K-quants
# (measured with gguf.dequantize) with 6-bit sub-block scales and mins, dmin = d * KQ_MIN_RATIO (centred weights)
# IQ4_NL: the kvalues_iq4nl table's rms; IQ4_XS: times the rms of its random 6-bit sub-block scales ls - 32; MXFP4:
# the doubled E2M1 values' rms (its scale 2^(e - 128) is chosen per block from MXFP4_E)
CODE_STD = {"Q4_0": 4.61, "Q8_0": 73.9, "Q2_K": 13.9, "Q3_K": 43.4, "Q4_K": 259.0, "Q5_K": 532.0, "Q6_K": 1376.0,
            "IQ4_NL": 67.4, "IQ4_XS": 1245.0, "MXFP4": 5.85, "IQ2_XXS": 53.2, "IQ2_XS": 55.6, "IQ2_S": 56.2,
            "IQ3_XXS": 142.0, "IQ3_S": 140.0, "IQ1_S": 7.24, "IQ1_M": 7.21, "NVFP4": 5.85}
# byte offsets of each block's fp16 d and dmin
KQ_D = {"Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
# UE4M3 bytes of NVFP4 blocks, drawn in [lo, hi): the subnormals m * 2^-9, halved, times 5.85 around WEIGHT_STD
NVFP4_S = (3, 6)
MXFP4_E = (119, 121)  # exponent bytes of MXFP4 blocks, drawn in [lo, hi): 2^(e - 128) * 5.85 around WEIGHT_STD
# dmin / d: the mean code (times the mean sub-scale over the mean sub-min), so that a sub-block's mean is about 0
KQ_MIN_RATIO = {"Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}
# routed experts' (gate/up, down) types per llama.cpp file type
EXPERT_MIXES = {"Q4_K_M": ("Q4_K", "Q6_K"), "Q4_K": ("Q4_K", "Q4_K"), "Q5_K": ("Q5_K", "Q5_K"),
                "Q6_K": ("Q6_K", "Q6_K"), "Q8_0": ("Q8_0", "Q8_0"), "Q4_0": ("Q4_0", "Q4_0"),
                "IQ4_NL": ("IQ4_NL", "IQ4_NL"), "IQ4_XS": ("IQ4_XS", "IQ4_XS"), "MXFP4": ("MXFP4", "MXFP4"),
                "NVFP4": ("NVFP4", "NVFP4"),
                **{k: (k, k) for k in ("IQ2_XXS", "IQ3_XXS", "IQ3_S", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")},
                "UD-IQ2_XXS": ("IQ2_XXS", "IQ3_XXS")}  # unsloth's dynamic mixes: a larger down beside gate/up
# the dense part of llama.cpp's Q4_K_M: attention Q4_K but attn_v Q6_K, the embedding Q4_K, the output Q6_K
DENSE_Q4_K_M = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                "output": "Q6_K"}
FLOATS = {"F32": np.float32, "F16": np.uint16, "BF16": np.uint16}  # float types and the numpy type of their bits


def _block(kind: str) -> tuple:
    """(weights per block, bytes per block) of GGML block type ``kind``, from the gguf package's table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[kind]]


def storage(kind: str, shape: tuple) -> tuple:
    """(numpy-order shape of the raw data, numpy dtype, bytes) of a tensor of ``shape`` in GGML type ``kind``."""
    if kind in FLOATS:
        dtype = np.dtype(FLOATS[kind])
        return shape, dtype, int(np.prod(shape)) * dtype.itemsize
    if kind not in CODE_STD:  # the block types whose random codes have a known spread
        raise ValueError(f"no random writer for GGML type {kind!r}; known: {', '.join([*FLOATS, *CODE_STD])}")
    per, nbytes = _block(kind)
    if shape[-1] % per:
        raise ValueError(f"{kind} needs rows of a multiple of {per} weights, got {shape[-1]} (shape {shape})")
    raw = (*shape[:-1], shape[-1] // per * nbytes)
    return raw, np.dtype(np.uint8), int(np.prod(raw))


def random_tensor(kind: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Random weights of ``shape`` (numpy order: rows..., K) already in GGML type ``kind``'s layout. Block types:
    uint8 blocks [..., K / block * bytes per block], random codes (K-quants: random sub-block scales too) and fp16
    scales around WEIGHT_STD / CODE_STD; F16 / BF16: uint16 bits of a random sign and mantissa at a fixed exponent
    (|w| in [1/64, 1/32)), no float copy; F32: N(0, WEIGHT_STD)."""
    raw, _, _ = storage(kind, shape)
    if kind == "F32":
        return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)
    if kind in ("F16", "BF16"):
        exp_bits, mant_mask = ((15 - 6) << 10, 0x83FF) if kind == "F16" else ((127 - 6) << 7, 0x807F)
        bits = np.frombuffer(rng.bytes(2 * int(np.prod(shape))), dtype=np.uint16).reshape(shape)
        return (bits & np.uint16(mant_mask)) | np.uint16(exp_bits)
    per, nbytes = _block(kind)
    n_blocks = int(np.prod(shape)) // per
    out = np.frombuffer(bytearray(rng.bytes(n_blocks * nbytes)), dtype=np.uint8).reshape(n_blocks, nbytes)
    if kind == "MXFP4":  # one exponent byte per block, no fp16 scale
        out[:, 0] = rng.integers(*MXFP4_E, n_blocks, dtype=np.uint8)
        return out.reshape(raw)
    if kind == "NVFP4":  # four UE4M3 bytes per block, no fp16 scale (and no tensor scale in a GGUF file)
        out[:, 0:4] = rng.integers(*NVFP4_S, (n_blocks, 4), dtype=np.uint8)
        return out.reshape(raw)
    d = WEIGHT_STD / CODE_STD[kind] * rng.uniform(0.5, 1.5, n_blocks).astype(np.float32)
    if kind == "IQ1_M":  # its fp16 d is the top nibbles of its four uint16 scale words (bytes 48..55)
        bits = d.astype(np.float16).view(np.uint16)
        for j in range(4):
            out[:, 49 + 2 * j] = (out[:, 49 + 2 * j] & 0x0F) | (((bits >> (4 * j)) & 0x0F) << 4).astype(np.uint8)
        return out.reshape(raw)
    at_d, at_min = KQ_D.get(kind, (0, None))
    out[:, at_d:at_d + 2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if at_min is not None:
        out[:, at_min:at_min + 2] = (d * KQ_MIN_RATIO[kind]).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return out.reshape(raw)


def byte_level_vocab(n: int) -> tuple:
    """``n`` distinct tokens of a byte-level BPE vocabulary (GPT-2's byte -> printable character table), and the
    merges that build them: the 256 bytes, then byte pairs, then (pair, byte) triples, as many as ``n`` needs."""
    if n < 256:
        raise ValueError(f"a byte-level vocabulary needs at least 256 tokens, got {n}")
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    tokens, merges = list(chars), []
    pairs = ((a, b) for a in chars for b in chars)
    triples = ((a + b, c) for a in chars for b in chars for c in chars)
    for left, right in itertools.chain(pairs, triples):
        if len(tokens) == n:
            break
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    return tokens, merges


def qwen3moe_plan(cfg, experts: str, dense: dict) -> list:
    """(GGUF name, numpy-order shape, GGML type) of every tensor llama.cpp's qwen3moe model loads, in file order.
    ``experts``: a key of EXPERT_MIXES; ``dense``: the GGML type of token_embd, attn_q, attn_k, attn_v, attn_output
    and output (norms and the router are F32, as llama.cpp's converter writes them)."""
    if experts not in EXPERT_MIXES:
        raise ValueError(f"experts type {experts!r}: allowed {', '.join(EXPERT_MIXES)}")
    h, vocab, e = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    i, d, nh, nkv = cfg.moe_intermediate_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    gate_up, down = EXPERT_MIXES[experts]
    plan = [("token_embd.weight", (vocab, h), dense["token_embd"])]
    for b in range(cfg.num_hidden_layers):
        p = f"blk.{b}."
        plan += [
            (p + "attn_norm.weight", (h,), "F32"),
            (p + "attn_q.weight", (nh * d, h), dense["attn_q"]),
            (p + "attn_k.weight", (nkv * d, h), dense["attn_k"]),
            (p + "attn_v.weight", (nkv * d, h), dense["attn_v"]),
            (p + "attn_output.weight", (h, nh * d), dense["attn_output"]),
            (p + "attn_q_norm.weight", (d,), "F32"),
            (p + "attn_k_norm.weight", (d,), "F32"),
            (p + "ffn_norm.weight", (h,), "F32"),
            (p + "ffn_gate_inp.weight", (e, h), "F32"),
            (p + "ffn_gate_exps.weight", (e, i, h), gate_up),
            (p + "ffn_up_exps.weight", (e, i, h), gate_up),
            (p + "ffn_down_exps.weight", (e, h, i), down),
        ]
    return plan + [("output_norm.weight", (h,), "F32"), ("output.weight", (vocab, h), dense["output"])]


def write_random_gguf(path, cfg, plan: list, name: str, file_type, seed: int = 0) -> dict:
    """Writes the qwen3moe GGUF file of ``cfg`` (a qwen3_moe ModelConfig) holding the tensors of ``plan``
    (qwen3moe_plan), one generated and written at a time; RMSNorm weights are 1, as a trained model's are about.
    Returns the path, its size, the seconds taken and the bytes of each tensor."""
    import gguf

    if cfg.model_type != "qwen3_moe":
        raise ValueError(f"a qwen3moe GGUF file is written for qwen3_moe shapes only, got {cfg.model_type!r}")
    infos = [storage(kind, shp) for _, shp, kind in plan]  # every type and shape checked before writing
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(name)
    for add, value in ((w.add_block_count, cfg.num_hidden_layers), (w.add_context_length, cfg.max_position_embeddings),
                       (w.add_embedding_length, cfg.hidden_size), (w.add_feed_forward_length, cfg.intermediate_size),
                       (w.add_head_count, cfg.num_attention_heads), (w.add_head_count_kv, cfg.num_key_value_heads),
                       (w.add_key_length, cfg.head_dim), (w.add_value_length, cfg.head_dim),
                       (w.add_rope_freq_base, cfg.rope_theta), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
                       (w.add_expert_count, cfg.num_experts), (w.add_expert_used_count, cfg.num_experts_per_tok),
                       (w.add_expert_feed_forward_length, cfg.moe_intermediate_size)):
        add(value)
    w.add_file_type(file_type)
    tokens, merges = byte_level_vocab(cfg.vocab_size)
    types = [gguf.TokenType.NORMAL] * len(tokens)
    specials = {cfg.get("bos_token_id"): "<|endoftext|>", cfg.get("eos_token_id"): "<|im_end|>"}
    for tid, text in specials.items():
        if tid is not None and 256 <= tid < len(tokens):
            tokens[tid], types[tid] = text, gguf.TokenType.CONTROL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(merges)
    for tid, add in ((cfg.get("bos_token_id"), w.add_bos_token_id), (cfg.get("eos_token_id"), w.add_eos_token_id)):
        if tid is not None and tid < len(tokens):
            add(tid)
    w.add_add_bos_token(False)
    for (tname, _, kind), (raw, dtype, nbytes) in zip(plan, infos):
        w.add_tensor_info(tname, raw, dtype, nbytes, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tname, shp, kind in plan:
        norm = tname.endswith("norm.weight")
        w.write_tensor_data(np.ones(shp, np.float32) if norm else random_tensor(kind, shp, rng))
    w.close()
    return {"path": str(path), "bytes": os.path.getsize(path), "write_s": time.perf_counter() - t0,
            "tensor_bytes": {tname: nbytes for (tname, _, _), (_, _, nbytes) in zip(plan, infos)}}
