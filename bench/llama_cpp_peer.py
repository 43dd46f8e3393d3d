"""llama.cpp's CPU build as the peer of hetmoe's CPU-only runs (issue 23): the same shape, the same bytes per weight,
the same threads, one run on one machine.

    python3 bench/llama_cpp_peer.py --layers 4 --dense-type BF16 --llama-bench /tmp/llama/build/bin/llama-bench
    python3 bench/llama_cpp_peer.py --layers 48 --dense-type Q4_0 --llama-bench ... --no-hetmoe   # llama.cpp alone
    python3 bench/llama_cpp_peer.py --layers 1 --gguf tiny.gguf --write-only                     # the file alone

It writes a GGUF file of a hetmoe shape (hetmoe/testing/synthetic.py SHAPES, architecture ``qwen3moe``) with random
weights — quantized blocks written directly (random codes, fp16 scales around a weight std of 0.02), so a multi-GB
file takes seconds and no float copy — then times it with ``llama-bench -p 128,512 -n 64 -t 2 -o json`` and, one
after the other, hetmoe's ``hetmoe bench e2e --device cpu`` on the same shape and layers with the matching formats:

    llama.cpp routed experts Q4_0 (18 bytes / 32 weights)  = hetmoe int4 group 64 (0.5 + 4/64 = 0.5625 B/w)
    llama.cpp dense Q8_0 (34 / 32 = 1.0625 B/w)             = hetmoe --dense-format int8 (scale per 64)
    llama.cpp dense Q4_0                                     = hetmoe --dense-format int4
    llama.cpp dense F16 / BF16                               = hetmoe --dense-format bf16

Dense means the attention projections and the output (lm_head) matrix. The token embedding is Q8_0 whatever the
dense type (a one-row gather per token: no part of either engine's decode bytes), norms F32, and the router
(``ffn_gate_inp``) F32 as llama.cpp's converter writes it. The tokenizer is a byte-level BPE vocabulary of the
shape's vocab size (256 byte tokens, then merges of byte pairs and byte triples), enough for llama.cpp to load:
llama-bench feeds random token ids and never tokenizes text.

Differences of method, written down: llama-bench's decode (tg64) starts from an empty cache, hetmoe's decode runs
after a prompt of the shortest --prompt-tokens; llama-bench reports the mean of 5 runs, hetmoe the median of 3.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hetmoe.bench.machine import cpu_model, git_commit, llc_bytes, mem_total_bytes  # noqa: E402
from hetmoe.testing.synthetic import shape_config  # noqa: E402

EXPERTS_TYPES = {"Q4_0": "int4"}  # llama.cpp type -> hetmoe --experts-format (group 64)
DENSE_TYPES = {"Q8_0": "int8", "Q4_0": "int4", "F16": "bf16", "BF16": "bf16"}  # -> hetmoe --dense-format
EMBED_TYPE = "Q8_0"
DENSE_NAMES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "output.weight")
WEIGHT_STD = 0.02  # the std of a published checkpoint's linear weights, about
CODE_STD = {"Q4_0": 4.61, "Q8_0": 73.9}  # std of uniform random codes: q - 8 for q in 0..15; int8 -128..127


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


# ------------------------------------------------------------------------------------------ random tensors


def random_tensor(kind: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Random weights of ``shape`` (numpy order: rows..., K) already in llama.cpp's ``kind`` layout. Q4_0 / Q8_0:
    uint8 blocks [..., K / 32 * bytes per block], random codes and an fp16 scale per block; F16 / BF16: uint16
    bits of a random sign and mantissa at a fixed exponent (|w| in [1/64, 1/32)), no float copy; F32: N(0, 0.02)."""
    if kind == "F32":
        return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)
    if kind in ("F16", "BF16"):
        exp_bits, mant_mask = ((15 - 6) << 10, 0x83FF) if kind == "F16" else ((127 - 6) << 7, 0x807F)
        bits = np.frombuffer(rng.bytes(2 * int(np.prod(shape))), dtype=np.uint16).reshape(shape)
        return (bits & np.uint16(mant_mask)) | np.uint16(exp_bits)
    if kind not in CODE_STD:
        raise ValueError(f"no random writer for GGML type {kind!r}; known: F32, F16, BF16, {', '.join(CODE_STD)}")
    k = shape[-1]
    if k % 32:
        raise ValueError(f"{kind} needs rows of a multiple of 32 weights, got {k} (shape {shape})")
    block = 18 if kind == "Q4_0" else 34
    n_blocks = int(np.prod(shape)) // 32
    out = np.frombuffer(bytearray(rng.bytes(n_blocks * block)), dtype=np.uint8).reshape(n_blocks, block)
    scale = WEIGHT_STD / CODE_STD[kind] * rng.uniform(0.5, 1.5, n_blocks).astype(np.float32)
    out[:, :2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return out.reshape(*shape[:-1], k // 32 * block)


def tensor_plan(cfg, experts_type: str, dense_type: str) -> list:
    """(GGUF name, numpy-order shape, GGML type) of every tensor llama.cpp's qwen3moe model loads, in file order."""
    h, vocab, e = cfg.hidden_size, cfg.vocab_size, cfg.num_experts
    i, d, nh, nkv = cfg.moe_intermediate_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    plan = [("token_embd.weight", (vocab, h), EMBED_TYPE)]
    for b in range(cfg.num_hidden_layers):
        p = f"blk.{b}."
        plan += [
            (p + "attn_norm.weight", (h,), "F32"),
            (p + "attn_q.weight", (nh * d, h), dense_type),
            (p + "attn_k.weight", (nkv * d, h), dense_type),
            (p + "attn_v.weight", (nkv * d, h), dense_type),
            (p + "attn_output.weight", (h, nh * d), dense_type),
            (p + "attn_q_norm.weight", (d,), "F32"),
            (p + "attn_k_norm.weight", (d,), "F32"),
            (p + "ffn_norm.weight", (h,), "F32"),
            (p + "ffn_gate_inp.weight", (e, h), "F32"),
            (p + "ffn_gate_exps.weight", (e, i, h), experts_type),
            (p + "ffn_up_exps.weight", (e, i, h), experts_type),
            (p + "ffn_down_exps.weight", (e, h, i), experts_type),
        ]
    plan += [("output_norm.weight", (h,), "F32"), ("output.weight", (vocab, h), dense_type)]
    return plan


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


# ------------------------------------------------------------------------------------------ the GGUF file


def write_peer_gguf(path, shape="qwen3-30b-a3b", layers=None, experts_type: str = "Q4_0", dense_type: str = "BF16",
                    seed: int = 0, log=print) -> dict:
    """Writes the random-weight GGUF of ``shape`` (a SHAPES name or a config dict of a qwen3_moe model) with
    ``layers`` decoder layers; one tensor generated and written at a time. Returns what was written."""
    import gguf

    if experts_type not in EXPERTS_TYPES:
        raise ValueError(f"--experts-type {experts_type!r}: allowed {', '.join(EXPERTS_TYPES)}")
    if dense_type not in DENSE_TYPES:
        raise ValueError(f"--dense-type {dense_type!r}: allowed {', '.join(DENSE_TYPES)}")
    cfg = shape_config(shape, layers)
    if cfg.model_type != "qwen3_moe":
        raise ValueError(f"the llama.cpp peer writes qwen3_moe shapes only (llama.cpp's qwen3moe), got "
                         f"{cfg.model_type!r}")
    plan = tensor_plan(cfg, experts_type, dense_type)
    t0 = time.perf_counter()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(f"hetmoe random {shape if isinstance(shape, str) else 'qwen3_moe'} ({cfg.num_hidden_layers} layers)")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_file_type({"Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16}.get(dense_type, gguf.LlamaFileType.MOSTLY_Q4_0))
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

    rng = np.random.default_rng(seed)
    nbytes = {}
    for name, shp, kind in plan:
        block = {"Q4_0": 18, "Q8_0": 34}.get(kind)
        raw = (*shp[:-1], shp[-1] // 32 * block) if block else shp
        itemsize = {"F32": 4, "F16": 2, "BF16": 2}.get(kind, 1)
        nbytes[name] = int(np.prod(raw)) * itemsize
        dtype = {"F32": np.float32, "F16": np.uint16, "BF16": np.uint16}.get(kind, np.uint8)
        w.add_tensor_info(name, raw, np.dtype(dtype), nbytes[name], raw_dtype=_qtype(kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp, kind in plan:  # RMSNorm weights 1, as a trained model's are about
        w.write_tensor_data(np.ones(shp, np.float32) if name.endswith("norm.weight") else random_tensor(kind, shp, rng))
    w.close()
    size = os.path.getsize(path)
    secs = time.perf_counter() - t0
    log(f"wrote {path}: {size / 1e9:.2f} GB, {len(plan)} tensors, {cfg.num_hidden_layers} layers, experts "
        f"{experts_type}, dense {dense_type}, embedding {EMBED_TYPE} in {secs:.1f} s")
    return {"path": str(path), "bytes": size, "layers": cfg.num_hidden_layers, "experts_type": experts_type,
            "dense_type": dense_type, "embedding_type": EMBED_TYPE, "write_s": secs,
            "tensor_bytes": {"experts": sum(v for k, v in nbytes.items() if "_exps" in k),
                             "dense": sum(v for k, v in nbytes.items() if k.endswith(DENSE_NAMES)),
                             "all": sum(nbytes.values())}}


# ------------------------------------------------------------------------------------------ the two runs


def run_llama_bench(exe: str, gguf_path: str, prompts: list, decode: int, threads: int, log=print) -> list:
    """``llama-bench`` on the file; its JSON records (one per test: pp<N>, tg<N>)."""
    if not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        raise ValueError(f"--llama-bench {exe!r} is not an executable file (build llama.cpp's llama-bench target)")
    cmd = [exe, "-m", gguf_path, "-p", ",".join(map(str, prompts)), "-n", str(decode), "-t", str(threads),
           "-o", "json"]
    log("$ " + " ".join(cmd))
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(run.stdout)


def hetmoe_command(args, out_json: str) -> list:
    """``hetmoe bench e2e --device cpu`` with the formats matching the GGUF file's; ``--dense-format`` only where
    this hetmoe has it."""
    cmd = [sys.executable, "-m", "hetmoe", "bench", "e2e", "--shape", args.shape, "--layers", str(args.layers),
           "--device", "cpu", "--experts-format", EXPERTS_TYPES[args.experts_type], "--group-size", "64",
           "--dtype", args.hetmoe_dtype, "--threads", str(args.threads),
           "--prompt-tokens", ",".join(map(str, args.prompt_tokens)), "--decode-tokens", str(args.decode_tokens),
           "--json", out_json]
    help_text = subprocess.run([sys.executable, "-m", "hetmoe", "bench", "e2e", "--help"], capture_output=True,
                               text=True, cwd=REPO).stdout
    if "--dense-format" in help_text:
        cmd[cmd.index("--dtype"):cmd.index("--dtype")] = ["--dense-format", DENSE_TYPES[args.dense_type]]
    return cmd


def run_hetmoe(args, log=print) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "e2e.json")
        cmd = hetmoe_command(args, out)
        log("$ " + " ".join(cmd[1:] if cmd[0] == sys.executable else cmd))
        run = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"hetmoe bench e2e failed ({run.returncode}):\n{run.stdout[-4000:]}")
        with open(out) as f:
            doc = json.load(f)
    doc["stdout"] = run.stdout
    return doc


def summarize(llama: list, hetmoe: dict, prompts: list) -> dict:
    """tok/s per point for both engines and hetmoe / llama.cpp."""
    rows = {}
    for n in prompts:
        rows[f"prefill@{n}"] = {"llama_cpp": next((r["avg_ts"] for r in llama or () if r["n_prompt"] == n
                                                   and r["n_gen"] == 0), None)}
    rows["decode"] = {"llama_cpp": next((r["avg_ts"] for r in llama or () if r["n_gen"] > 0), None)}
    rec = hetmoe["records"][0] if hetmoe else None
    if rec:
        for p in rec["prefill"]:
            rows.setdefault(f"prefill@{p['tokens']}", {})["hetmoe"] = p["tok_s"]
        rows["decode"]["hetmoe"] = rec["decode_tok_s"]
    for row in rows.values():
        a, b = row.get("hetmoe"), row.get("llama_cpp")
        row["ratio"] = a / b if a and b else None
    return rows


def fmt_summary(rows: dict, hetmoe: dict) -> list:
    num = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    names = list(rows)
    lines = [f"{'tok/s':24s}" + "".join(f"{n:>14s}" for n in names)]
    for key, label in (("llama_cpp", "llama.cpp"), ("hetmoe", "hetmoe"), ("ratio", "hetmoe / llama.cpp")):
        spec = "14.2f" if key == "ratio" else "14.1f"
        lines.append(f"{label:24s}" + "".join(f"{num(rows[n].get(key), spec):>14s}" for n in names))
    rec = hetmoe["records"][0] if hetmoe else None
    if rec:
        lines.append(f"hetmoe: STREAM read {rec['stream_gbps']:.1f} GB/s before, {rec['stream_gbps_after']:.1f} "
                     f"after; decode roofline {num(rec['roofline_tok_s'], '.1f')} tok/s "
                     f"({rec['bytes_per_token'] / 1e6:.1f} MB/token), decode at {num(rec['pct_roofline'], '.1f')}%; "
                     f"dense {rec.get('dense_format', '?')}, experts {rec['experts_format']}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a qwen3_moe shape of SHAPES (default: qwen3-30b-a3b)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    ap.add_argument("--experts-type", default="Q4_0", choices=sorted(EXPERTS_TYPES))
    ap.add_argument("--dense-type", default="BF16", choices=sorted(DENSE_TYPES),
                    help="attention projections and output (lm_head) in llama.cpp; hetmoe gets the matching "
                         "--dense-format (default: BF16)")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench executable")
    ap.add_argument("--gguf", metavar="PATH", help="where to write the GGUF file (default: a temporary file, deleted "
                                                   "after the run); kept when given")
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines (default: 2)")
    ap.add_argument("--prompt-tokens", default="128,512", help="prefill lengths (default: 128,512)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode steps (default: 64)")
    ap.add_argument("--hetmoe-dtype", default="bf16", choices=("bf16", "fp32"), help="hetmoe's --dtype (default: bf16)")
    ap.add_argument("--no-hetmoe", action="store_true", help="llama-bench alone")
    ap.add_argument("--reuse", action="store_true", help="use the --gguf file as it is when it exists (written by "
                                                           "an earlier run with the same options)")
    ap.add_argument("--write-only", action="store_true", help="write the GGUF file (--gguf) and stop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write everything as JSON ('-' = stdout)")
    args = ap.parse_args(argv)
    try:
        args.prompt_tokens = [int(t) for t in args.prompt_tokens.split(",") if t]
    except ValueError:
        ap.error(f"--prompt-tokens takes a comma list of integers, got {args.prompt_tokens!r}")
    if (args.write_only or args.reuse) and not args.gguf:
        ap.error("--write-only and --reuse need --gguf PATH")
    if not args.write_only and not args.llama_bench:
        ap.error("--llama-bench PATH is needed (or --write-only)")
    out = sys.stderr if args.json == "-" else sys.stdout
    log = lambda msg: print(msg, file=out, flush=True)  # noqa: E731

    load_before = os.getloadavg()  # other work on the machine shows here: both engines want the cores to themselves
    log(f"load average {load_before[0]:.2f} (1 min), {os.cpu_count()} cpus")
    tmp = None if args.gguf else tempfile.mkdtemp(prefix="hetmoe-peer-", dir=os.environ.get("TMPDIR", "/tmp"))
    path = args.gguf or os.path.join(tmp, f"{args.shape}-{args.layers}l-{args.dense_type}.gguf")
    try:
        if args.reuse and os.path.isfile(path):  # written by an earlier run with the same options, we trust
            written = {"path": path, "bytes": os.path.getsize(path), "reused": True}
            log(f"reusing {path} ({written['bytes'] / 1e9:.2f} GB)")
        else:
            written = write_peer_gguf(path, args.shape, args.layers, args.experts_type, args.dense_type, args.seed,
                                      log)
        if args.write_only:
            return 0
        llama = run_llama_bench(args.llama_bench, path, args.prompt_tokens, args.decode_tokens, args.threads, log)
        for r in llama:
            log(f"llama.cpp {r['build_commit']}: pp{r['n_prompt']} tg{r['n_gen']}: {r['avg_ts']:.2f} "
                f"± {r['stddev_ts']:.2f} tok/s ({r['type_k']} cache, {r['n_threads']} threads)")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    hetmoe, hetmoe_error = None, None
    if not args.no_hetmoe:
        try:  # llama.cpp's numbers are kept when hetmoe's run fails
            hetmoe = run_hetmoe(args, log)
            log(hetmoe["stdout"].rstrip())
        except RuntimeError as e:
            hetmoe_error = str(e)
            log(hetmoe_error)
    rows = summarize(llama, hetmoe, args.prompt_tokens)
    log("")
    log(f"{args.shape}, {args.layers} layers, experts {args.experts_type} = hetmoe "
        f"{EXPERTS_TYPES[args.experts_type]} g64, dense {args.dense_type} = hetmoe {DENSE_TYPES[args.dense_type]}, "
        f"embedding {EMBED_TYPE}, {args.threads} threads; {cpu_model()}")
    for line in fmt_summary(rows, hetmoe):
        log(line)
    log(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1 min)")
    if args.json:
        doc = {"machine": {"cpu_model": cpu_model(), "mem_total_gb": mem_total_bytes() / 1e9,
                           "llc_mb": llc_bytes() / (1 << 20), "commit": git_commit(), "date": time.strftime(
                               "%Y-%m-%dT%H:%M:%S%z"), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
               "config": {k: v for k, v in vars(args).items() if k != "json"}, "gguf": written,
               "llama_cpp": llama, "hetmoe": hetmoe, "hetmoe_error": hetmoe_error, "summary": rows}
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            log(f"wrote {args.json}")
    return 1 if hetmoe_error else 0


if __name__ == "__main__":
    sys.exit(main())
