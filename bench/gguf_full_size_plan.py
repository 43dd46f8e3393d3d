"""What the full DeepSeek-V3 / R1 (671 B) needs in RAM as hetmoe holds it, for the type mixes of the published
low-bit GGUF files, without 200 GB of disk: each mix is written as a GGUF file whose header is the real one (every
tensor of llama.cpp's deepseek2 model with its shape and type) and whose data is a hole (a sparse file of the full
size: its blocks are never read, since ``hetmoe plan --model FILE.gguf`` reads the tensor headers alone). Then
``hetmoe plan`` prints RAM per GGML type (file bytes, held bytes) and whether the plan fits ``--cpu-memory``.

    python3 bench/gguf_full_size_plan.py [--mixes UD-Q2_K_XL,UD-IQ2_XXS,...] [--cpu-memory 256GB] [--dir /tmp]
        [--plan-args "--dense-format int4"]

With ``--with-data --layers N --experts E`` the file is a real one of fewer layers and experts (every other size as
the full model's; random blocks, hetmoe/load/gguf/random_file.py), loaded and run: ``hetmoe plan`` as above, then
``hetmoe bench e2e --model FILE --device cpu`` (prefill and decode; the routed experts' held bytes against the
file's are in the plan's type table).

The mixes follow the published files' pattern (unsloth's dynamic quants of DeepSeek-R1: low-bit routed experts, a
wider down_proj where named, the dense part at 4-8 bits); the exact per-layer choices of those files differ.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

# DeepSeek-V3 / R1 (config.json of deepseek-ai/DeepSeek-V3): the shape of every tensor llama.cpp's converter writes
V3 = dict(layers=61, dense_layers=3, hidden=7168, inter=18432, moe_inter=2048, experts=256, used=8, heads=128,
          q_lora=1536, kv_lora=512, nope=128, rope=64, v=128, vocab=129280, shared=1)
# (gate/up type, down type, down type of the first n MoE layers, n) per mix; dense (attention, dense MLP, shared
# experts), embedding and output types
MIXES = {
    "UD-Q2_K_XL": ("Q2_K", "Q2_K", "Q4_K", 3),
    "Q2_K+Q3_K": ("Q2_K", "Q3_K", "Q3_K", 0),
    "UD-IQ2_XXS": ("IQ2_XXS", "IQ3_XXS", "IQ3_XXS", 0),
    "UD-IQ1_M": ("IQ1_M", "IQ2_XXS", "IQ3_XXS", 3),
    "UD-IQ1_S": ("IQ1_S", "IQ2_XXS", "IQ3_XXS", 3),
    "Q4_K_M": ("Q4_K", "Q6_K", "Q6_K", 0),
}
# (attn_k_b's rows are 128 long, under a K-quant's 256: llama-quantize falls back to Q8_0 for it)
DENSE = {"attn": "Q4_K", "attn_k_b": "Q8_0", "attn_v_b": "Q6_K", "dense_ffn": "Q4_K", "shexp": "Q6_K",
         "token_embd": "Q4_K", "output": "Q6_K"}


def tensors(mix: str, s: dict = V3) -> list:
    """(GGUF name, numpy-order shape, GGML type) of every tensor of the model of shape ``s``, in llama.cpp's file
    order."""
    gate_up, down, early_down, n_early = MIXES[mix]
    h, f32 = s["hidden"], "F32"
    out = [("token_embd.weight", (s["vocab"], h), DENSE["token_embd"])]
    for b in range(s["layers"]):
        p = f"blk.{b}."
        out += [(p + "attn_norm.weight", (h,), f32),
                (p + "attn_q_a_norm.weight", (s["q_lora"],), f32),
                (p + "attn_kv_a_norm.weight", (s["kv_lora"],), f32),
                (p + "attn_q_a.weight", (s["q_lora"], h), DENSE["attn"]),
                (p + "attn_q_b.weight", (s["heads"] * (s["nope"] + s["rope"]), s["q_lora"]), DENSE["attn"]),
                (p + "attn_kv_a_mqa.weight", (s["kv_lora"] + s["rope"], h), DENSE["attn"]),
                (p + "attn_k_b.weight", (s["heads"], s["kv_lora"], s["nope"]), DENSE["attn_k_b"]),
                (p + "attn_v_b.weight", (s["heads"], s["v"], s["kv_lora"]), DENSE["attn_v_b"]),
                (p + "attn_output.weight", (h, s["heads"] * s["v"]), DENSE["attn"]),
                (p + "ffn_norm.weight", (h,), f32)]
        if b < s["dense_layers"]:
            out += [(p + "ffn_gate.weight", (s["inter"], h), DENSE["dense_ffn"]),
                    (p + "ffn_up.weight", (s["inter"], h), DENSE["dense_ffn"]),
                    (p + "ffn_down.weight", (h, s["inter"]), DENSE["dense_ffn"])]
            continue
        e, i = s["experts"], s["moe_inter"]
        moe_index = b - s["dense_layers"]
        out += [(p + "ffn_gate_inp.weight", (e, h), f32),
                (p + "exp_probs_b.bias", (e,), f32),
                (p + "ffn_gate_exps.weight", (e, i, h), gate_up),
                (p + "ffn_up_exps.weight", (e, i, h), gate_up),
                (p + "ffn_down_exps.weight", (e, h, i), early_down if moe_index < n_early else down),
                (p + "ffn_gate_shexp.weight", (i * s["shared"], h), DENSE["shexp"]),
                (p + "ffn_up_shexp.weight", (i * s["shared"], h), DENSE["shexp"]),
                (p + "ffn_down_shexp.weight", (h, i * s["shared"]), DENSE["shexp"])]
    return out + [("output_norm.weight", (h,), f32), ("output.weight", (s["vocab"], h), DENSE["output"])]


def write_gguf(path: str, mix: str, s: dict = V3, data: bool = False) -> int:
    """The GGUF file of ``mix`` and shape ``s`` -> its size in bytes. ``data``: random blocks (norms 1, the
    selection bias 0); else the data section is a hole of the right size."""
    import gguf

    from hetmoe.load.gguf.random_file import byte_level_vocab, random_tensor

    w = gguf.GGUFWriter(path, "deepseek2")
    w.add_name(f"DeepSeek-V3 shape, {mix} experts")
    for add, value in ((w.add_block_count, s["layers"]), (w.add_context_length, 163840),
                       (w.add_embedding_length, s["hidden"]), (w.add_feed_forward_length, s["inter"]),
                       (w.add_head_count, s["heads"]), (w.add_head_count_kv, 1),
                       (w.add_key_length, s["kv_lora"] + s["rope"]), (w.add_value_length, s["kv_lora"]),
                       (w.add_key_length_mla, s["nope"] + s["rope"]), (w.add_value_length_mla, s["v"]),
                       (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_rope_dimension_count, s["rope"]), (w.add_q_lora_rank, s["q_lora"]),
                       (w.add_kv_lora_rank, s["kv_lora"]), (w.add_leading_dense_block_count, s["dense_layers"]),
                       (w.add_expert_count, s["experts"]), (w.add_expert_used_count, s["used"]),
                       (w.add_expert_shared_count, s["shared"]), (w.add_expert_feed_forward_length, s["moe_inter"]),
                       (w.add_expert_weights_scale, 2.5), (w.add_expert_weights_norm, True),
                       (w.add_expert_gating_func, gguf.ExpertGatingFuncType.SIGMOID),
                       (w.add_expert_group_count, 8), (w.add_expert_group_used_count, 4)):
        add(value)
    tokens, merges = byte_level_vocab(s["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("deepseek-v3")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.NORMAL)] * len(tokens))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    total = 0
    plan = tensors(mix, s)
    for name, shape, kind in plan:
        qtype = gguf.GGMLQuantizationType[kind]
        per, block = gguf.GGML_QUANT_SIZES[qtype]
        if shape[-1] % per:
            raise ValueError(f"{name}: rows of {shape[-1]} are not whole {kind} blocks of {per}")
        nbytes = (math.prod(shape) // per) * block
        raw = (*shape[:-1], shape[-1] // per * block) if per > 1 else shape
        w.add_tensor_info(name, raw, np.dtype(np.uint8) if per > 1 else np.dtype(np.float32), nbytes,
                          raw_dtype=qtype)
        total += nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    if data:
        rng = np.random.default_rng(0)
        for name, shape, kind in plan:
            if name.endswith("norm.weight"):
                w.write_tensor_data(np.ones(shape, np.float32))
            elif name.endswith("exp_probs_b.bias"):
                w.write_tensor_data(np.zeros(shape, np.float32))
            else:
                w.write_tensor_data(random_tensor(kind, shape, rng))
        w.close()
        return os.path.getsize(path)
    w.fout[0].flush()
    start = w.fout[0].tell()
    w.close()
    with open(path, "r+b") as fh:  # the data section as a hole (each tensor padded to 32 bytes at most)
        fh.truncate(start + total + 32 * len(plan))
    return os.path.getsize(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixes", default=",".join(MIXES))
    ap.add_argument("--cpu-memory", default="256GB")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--plan-args", default="", help="more options for hetmoe plan, e.g. '--dense-format int4'")
    ap.add_argument("--with-data", action="store_true", help="write random blocks and run the model (with --layers,"
                    " --experts: a smaller model)")
    ap.add_argument("--layers", type=int, default=V3["layers"])
    ap.add_argument("--experts", type=int, default=V3["experts"])
    ap.add_argument("--e2e-args", default="--prompt-tokens 128 --decode-tokens 16 --repeats 1",
                    help="options for hetmoe bench e2e (--with-data)")
    args = ap.parse_args()
    for mix in args.mixes.split(","):
        shape = {**V3, "layers": args.layers, "experts": args.experts, "used": min(V3["used"], args.experts)}
        path = os.path.join(args.dir, f"deepseek-v3-{mix}.gguf")
        size = write_gguf(path, mix, shape, data=args.with_data)
        print(f"== {mix}: {shape['layers']} layers, {shape['experts']} experts: {size / 1e9:.1f} GB file "
              f"({size / 2**30:.1f} GiB){'' if args.with_data else ', header only (sparse)'}", flush=True)
        runs = [["plan", "--model", path, "--device", "cpu", "--cpu-memory", args.cpu_memory, *args.plan_args.split()]]
        if args.with_data:
            runs.append(["bench", "e2e", "--model", path, "--device", "cpu", *args.plan_args.split(),
                         *args.e2e_args.split()])
        for run in runs:
            print("$ hetmoe " + " ".join(run), flush=True)
            subprocess.run([sys.executable, "-m", "hetmoe", *run], check=False)
        os.remove(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
