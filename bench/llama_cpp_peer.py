"""llama.cpp as the peer of hetmoe (issue 23): the same shape, the same bytes per weight, the same threads, one run
on one machine — CPU-only, or with --gpu the hybrid placement (routed experts on the CPU, the rest on the GPU).

    python3 bench/llama_cpp_peer.py --layers 4 --dense-type BF16 --llama-bench /tmp/llama/build/bin/llama-bench
    python3 bench/llama_cpp_peer.py --layers 4 --experts-type Q4_K_M --llama-bench ...    # hetmoe loads the file
    python3 bench/llama_cpp_peer.py --layers 48 --dense-type Q4_0 --llama-bench ... --no-hetmoe   # llama.cpp alone
    python3 bench/llama_cpp_peer.py --layers 1 --gguf tiny.gguf --write-only                     # the file alone
    python3 bench/llama_cpp_peer.py --gpu --layers 48 --experts-type Q4_K_M --dense-type BF16 \\
        --llama-bench /path/llama-cuda/llama-bench --llama-env LD_LIBRARY_PATH=... --dry-run   # print, run nothing

It writes a GGUF file of a hetmoe shape (hetmoe/load/random_weights.py SHAPES, architecture ``qwen3moe``) with random
weights (hetmoe/load/gguf/random_file.py: quantized blocks written directly, random codes and fp16 scales around a
weight std of 0.02, so a multi-GB file takes seconds and no float copy), then times it with ``llama-bench -p 128,512
-n 64 -t 2 -o json`` and, one after the other, hetmoe's ``hetmoe bench e2e`` with the matching formats:

    llama.cpp routed experts Q4_0 (18 bytes / 32 weights)  = hetmoe int4 group 64 (0.5 + 4/64 = 0.5625 B/w), a shape
                                                              of random weights built in memory (CPU mode)
    llama.cpp routed experts Q4_K_M (Q4_K gate/up, Q6_K     = hetmoe --model THE.gguf: the file's own blocks, held
    down), Q4_K, Q6_K; any type with --gpu                    exactly (hetmoe/load/gguf/kquants.py)
    llama.cpp dense Q8_0 (34 / 32 = 1.0625 B/w)             = hetmoe --dense-format int8 (scale per 64)
    llama.cpp dense Q4_0                                     = hetmoe --dense-format int4
    llama.cpp dense F16 / BF16                               = hetmoe --dense-format bf16

Dense means the attention projections and the output (lm_head) matrix. The token embedding is Q8_0 whatever the
dense type (a one-row gather per token: no part of either engine's decode bytes), norms F32, and the router
(``ffn_gate_inp``) F32 as llama.cpp's converter writes it.

--gpu: llama-bench runs with ``-ngl 99 -ot exps=CPU -fa 1`` (every layer on the GPU but the routed experts' tensors),
hetmoe with ``bench e2e --model THE.gguf --device cuda --variants graph --expert-cache off`` (its hybrid placement,
--gpu-prefill auto: long prompts' experts streamed to the GPU, as llama.cpp's op offload does from 32 tokens); the
summary puts decode tok/s (hetmoe: the CUDA-graph variant) and prefill tok/s side by side with their ratio. The
threads default to hetmoe's own for the hybrid placement (physical cores less 2), for both engines. A carried
llama-bench finds its CUDA libraries through --llama-env LD_LIBRARY_PATH=... or the caller's environment.

Differences of method, written down: llama-bench's decode (tg64) starts from an empty cache, hetmoe's decode runs
after a prompt of the shortest --prompt-tokens; llama-bench reports the mean of 5 runs, hetmoe the median of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hetmoe.bench.machine import cpu_model, git_commit, llc_bytes, mem_total_bytes  # noqa: E402
from hetmoe.load.gguf.random_file import EXPERT_MIXES, qwen3moe_plan, write_random_gguf  # noqa: E402
from hetmoe.load.random_weights import shape_config  # noqa: E402

EXPERTS_TYPES = ("Q4_0", "Q4_K_M", "Q4_K", "Q6_K")  # keys of EXPERT_MIXES
SHAPE_FORMATS = {"Q4_0": "int4"}  # llama.cpp type -> hetmoe --experts-format (group 64) of a shape run (CPU mode)
DENSE_TYPES = {"Q8_0": "int8", "Q4_0": "int4", "F16": "bf16", "BF16": "bf16"}  # -> hetmoe --dense-format
EMBED_TYPE = "Q8_0"
DENSE_NAMES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "output.weight")
GPU_ARGS = ["-ngl", "99", "-ot", "exps=CPU", "-fa", "1"]  # llama-bench: all on the GPU but the routed experts

def tensor_plan(cfg, experts_type: str, dense_type: str) -> list:
    """(GGUF name, numpy-order shape, GGML type) of every tensor llama.cpp's qwen3moe model loads, in file order."""
    dense = {k: dense_type for k in ("attn_q", "attn_k", "attn_v", "attn_output", "output")}
    return qwen3moe_plan(cfg, experts_type, {**dense, "token_embd": EMBED_TYPE})


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
    file_type = {"Q4_K_M": "MOSTLY_Q4_K_M", "Q4_K": "MOSTLY_Q4_K_S", "Q6_K": "MOSTLY_Q6_K"}.get(experts_type) or {
        "Q8_0": "MOSTLY_Q8_0", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16"}.get(dense_type, "MOSTLY_Q4_0")
    plan = tensor_plan(cfg, experts_type, dense_type)
    name = f"hetmoe random {shape if isinstance(shape, str) else 'qwen3_moe'} ({cfg.num_hidden_layers} layers)"
    info = write_random_gguf(path, cfg, plan, name, gguf.LlamaFileType[file_type], seed)
    nbytes = info["tensor_bytes"]
    log(f"wrote {path}: {info['bytes'] / 1e9:.2f} GB, {len(plan)} tensors, {cfg.num_hidden_layers} layers, experts "
        f"{experts_type} ({'/'.join(EXPERT_MIXES[experts_type])}), dense {dense_type}, embedding {EMBED_TYPE} in "
        f"{info['write_s']:.1f} s")
    return {"path": str(path), "bytes": info["bytes"], "layers": cfg.num_hidden_layers, "experts_type": experts_type,
            "dense_type": dense_type, "embedding_type": EMBED_TYPE, "write_s": info["write_s"],
            "tensor_bytes": {"experts": sum(v for k, v in nbytes.items() if "_exps" in k),
                             "dense": sum(v for k, v in nbytes.items() if k.endswith(DENSE_NAMES)),
                             "all": sum(nbytes.values())}}


# ------------------------------------------------------------------------------------------ the two runs


def llama_bench_command(args, gguf_path: str) -> list:
    """``llama-bench`` on the file: CPU-only, or (--gpu) everything on the GPU but the routed experts."""
    return [args.llama_bench, "-m", gguf_path, "-p", ",".join(map(str, args.prompt_tokens)),
            "-n", str(args.decode_tokens), "-t", str(args.threads), *(GPU_ARGS if args.gpu else []), "-o", "json"]


def run_llama_bench(cmd: list, env: dict, log=print) -> list:
    """Runs ``cmd`` (llama_bench_command) with ``env`` added to the environment; its JSON records (one per test:
    pp<N>, tg<N>)."""
    exe = cmd[0]
    if not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        raise ValueError(f"--llama-bench {exe!r} is not an executable file (build llama.cpp's llama-bench target)")
    log("$ " + shell_line(cmd, env))
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(run.stdout)


def shell_line(cmd: list, env: dict = None) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), *map(shlex.quote, cmd)])


def hetmoe_on_gguf(args) -> bool:
    """Whether hetmoe loads the GGUF file itself (K-quant experts, or --gpu) rather than building the shape with
    the matching formats."""
    return args.gpu or args.experts_type not in SHAPE_FORMATS


def hetmoe_command(args, gguf_path: str, out_json: str) -> list:
    """``hetmoe bench e2e`` with the formats matching the GGUF file's: on the file itself (hetmoe_on_gguf) or on
    the shape; ``--dense-format`` only where this hetmoe has it."""
    cmd = [sys.executable, "-m", "hetmoe", "bench", "e2e"]
    if hetmoe_on_gguf(args):
        cmd += ["--model", gguf_path, "--expert-cache", "off"]
    else:
        cmd += ["--shape", args.shape, "--layers", str(args.layers), "--experts-format",
                SHAPE_FORMATS[args.experts_type], "--group-size", "64"]
    cmd += ["--device", "cuda" if args.gpu else "cpu", "--dtype", args.hetmoe_dtype, "--threads", str(args.threads),
            "--prompt-tokens", ",".join(map(str, args.prompt_tokens)), "--decode-tokens", str(args.decode_tokens),
            *(["--variants", "graph"] if args.gpu else []), "--json", out_json]
    help_text = subprocess.run([sys.executable, "-m", "hetmoe", "bench", "e2e", "--help"], capture_output=True,
                               text=True, cwd=REPO).stdout
    if "--dense-format" in help_text:
        cmd[cmd.index("--dtype"):cmd.index("--dtype")] = ["--dense-format", DENSE_TYPES[args.dense_type]]
    return cmd


def run_hetmoe(cmd: list, log=print) -> dict:
    out = cmd[cmd.index("--json") + 1]
    log("$ " + shell_line(["python3", *cmd[1:]] if cmd[0] == sys.executable else cmd))
    run = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"hetmoe bench e2e failed ({run.returncode}):\n{run.stdout[-4000:]}")
    with open(out) as f:
        doc = json.load(f)
    doc["stdout"] = run.stdout
    return doc


def hetmoe_decode(rec: dict) -> float:
    """hetmoe's batch-1 decode tok/s: the CUDA-graph variant's where it ran (--gpu), else the record's."""
    graph = next((v for v in rec.get("variants") or () if v["variant"] == "graph"), None)
    return (graph or rec)["decode_tok_s"]


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
        rows["decode"]["hetmoe"] = hetmoe_decode(rec)
    for row in rows.values():
        a, b = row.get("hetmoe"), row.get("llama_cpp")
        row["ratio"] = a / b if a and b else None
    return rows


def expert_bytes_per_token(args, written: dict, hetmoe: dict) -> dict:
    """Bytes of routed experts one decoded token reads, per engine: llama.cpp the file's blocks (top_k of each
    layer's experts), hetmoe its own layout (the e2e record's)."""
    out = {}
    if "tensor_bytes" in written:
        cfg = shape_config(args.shape, args.layers)
        out["llama.cpp"] = written["tensor_bytes"]["experts"] / cfg.num_experts * cfg.num_experts_per_tok
    if hetmoe:
        out["hetmoe"] = hetmoe["records"][0]["expert_bytes_per_token"]
    return out


def fmt_summary(rows: dict, hetmoe: dict) -> list:
    num = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
    names = list(rows)
    lines = [f"{'tok/s':24s}" + "".join(f"{n:>14s}" for n in names)]
    for key, label in (("llama_cpp", "llama.cpp"), ("hetmoe", "hetmoe"), ("ratio", "hetmoe / llama.cpp")):
        spec = "14.2f" if key == "ratio" else "14.1f"
        lines.append(f"{label:24s}" + "".join(f"{num(rows[n].get(key), spec):>14s}" for n in names))
    rec = hetmoe["records"][0] if hetmoe else None
    if rec:
        roof = rec["roofline_tok_s"]
        pct = 100 * rows["decode"]["hetmoe"] / roof if roof else None
        lines.append(f"hetmoe ({rec['placement']}): STREAM read {rec['stream_gbps']:.1f} GB/s before, "
                     f"{rec['stream_gbps_after']:.1f} after; decode roofline {num(roof, '.1f')} tok/s "
                     f"({rec['bytes_per_token'] / 1e6:.1f} MB/token read from CPU DRAM), decode at {num(pct, '.1f')}%; "
                     f"dense {rec.get('dense_format', '?')}, experts {rec['experts_format']}"
                     + (f" g{rec['group_size']}" if rec.get("group_size") else ""))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a qwen3_moe shape of SHAPES (default: qwen3-30b-a3b)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    ap.add_argument("--experts-type", default="Q4_0", choices=EXPERTS_TYPES,
                    help="routed experts: Q4_0 (hetmoe: int4 g64 on the shape), or the K-quants Q4_K_M (Q4_K "
                         "gate/up, Q6_K down), Q4_K, Q6_K (hetmoe: the file's own blocks) (default: Q4_0)")
    ap.add_argument("--dense-type", default="BF16", choices=sorted(DENSE_TYPES),
                    help="attention projections and output (lm_head) in llama.cpp; hetmoe gets the matching "
                         "--dense-format (default: BF16)")
    ap.add_argument("--gpu", action="store_true", help="hybrid placement: llama-bench -ngl 99 -ot exps=CPU -fa 1, "
                                                       "hetmoe --device cuda on the same GGUF file")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench executable (--gpu: a CUDA build)")
    ap.add_argument("--llama-env", metavar="KEY=VALUE", action="append", default=[],
                    help="environment of the llama-bench run only, e.g. LD_LIBRARY_PATH=... for a carried CUDA "
                         "build (repeatable; default: the caller's environment)")
    ap.add_argument("--gguf", metavar="PATH", help="where to write the GGUF file (default: a temporary file, deleted "
                                                   "after the run); kept when given")
    ap.add_argument("--threads", type=int, help="CPU threads of both engines (default: 2; --gpu: hetmoe's default "
                                                "for the hybrid placement, physical cores less 2)")
    ap.add_argument("--prompt-tokens", default="128,512", help="prefill lengths (default: 128,512)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode steps (default: 64)")
    ap.add_argument("--hetmoe-dtype", default="bf16", choices=("bf16", "fp32"), help="hetmoe's --dtype (default: bf16)")
    ap.add_argument("--no-hetmoe", action="store_true", help="llama-bench alone")
    ap.add_argument("--reuse", action="store_true", help="use the --gguf file as it is when it exists (written by "
                                                           "an earlier run with the same options)")
    ap.add_argument("--write-only", action="store_true", help="write the GGUF file (--gguf) and stop")
    ap.add_argument("--dry-run", action="store_true", help="print the commands both engines would run, write and "
                                                           "run nothing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write everything as JSON ('-' = stdout)")
    args = ap.parse_args(argv)
    try:
        args.prompt_tokens = [int(t) for t in args.prompt_tokens.split(",") if t]
    except ValueError:
        ap.error(f"--prompt-tokens takes a comma list of integers, got {args.prompt_tokens!r}")
    if not args.prompt_tokens:
        ap.error("--prompt-tokens needs at least one length")
    llama_env = {}
    for item in args.llama_env:
        key, eq, value = item.partition("=")
        if not eq or not key:
            ap.error(f"--llama-env takes KEY=VALUE, got {item!r}")
        llama_env[key] = value
    if (args.write_only or args.reuse) and not args.gguf:
        ap.error("--write-only and --reuse need --gguf PATH")
    if not args.write_only and not args.llama_bench:
        ap.error("--llama-bench PATH is needed (or --write-only)")
    if args.threads is None:
        if args.gpu:
            from hetmoe.cpu import HYBRID_RESERVED_CORES, default_threads

            args.threads = default_threads(reserve=HYBRID_RESERVED_CORES)
        else:
            args.threads = 2
    out = sys.stderr if args.json == "-" else sys.stdout
    log = lambda msg: print(msg, file=out, flush=True)  # noqa: E731

    tmp = None if args.gguf or args.dry_run else tempfile.mkdtemp(prefix="hetmoe-peer-",
                                                                  dir=os.environ.get("TMPDIR", "/tmp"))
    path = args.gguf or os.path.join(tmp or os.environ.get("TMPDIR", "/tmp"),
                                     f"{args.shape}-{args.layers}l-{args.experts_type}-{args.dense_type}.gguf")
    llama_cmd = llama_bench_command(args, path)
    if args.dry_run:
        log(f"# would write {path if args.gguf else 'a temporary file like ' + path}: {args.shape}, {args.layers} "
            f"layers, experts {args.experts_type}, dense {args.dense_type}, embedding {EMBED_TYPE}")
        log(shell_line(llama_cmd, llama_env))
        if not args.no_hetmoe:
            cmd = hetmoe_command(args, path, "HETMOE.json")
            log(shell_line(["python3", *cmd[1:]] if cmd[0] == sys.executable else cmd))
        return 0

    load_before = os.getloadavg()  # other work on the machine shows here: both engines want the cores to themselves
    log(f"load average {load_before[0]:.2f} (1 min), {os.cpu_count()} cpus")
    hetmoe, hetmoe_error = None, None
    try:
        if args.reuse and os.path.isfile(path):  # written by an earlier run with the same options, we trust
            written = {"path": path, "bytes": os.path.getsize(path), "reused": True}
            log(f"reusing {path} ({written['bytes'] / 1e9:.2f} GB)")
        else:
            written = write_peer_gguf(path, args.shape, args.layers, args.experts_type, args.dense_type, args.seed,
                                      log)
        if args.write_only:
            return 0
        llama = run_llama_bench(llama_cmd, llama_env, log)
        for r in llama:
            log(f"llama.cpp {r['build_commit']}: pp{r['n_prompt']} tg{r['n_gen']}: {r['avg_ts']:.2f} "
                f"± {r['stddev_ts']:.2f} tok/s ({r['type_k']} cache, {r['n_threads']} threads"
                + (f", {r['n_gpu_layers']} layers on {r['gpu_info']}" if r.get("gpu_info") else "") + ")")
        if not args.no_hetmoe:
            with tempfile.TemporaryDirectory() as jdir:
                try:  # llama.cpp's numbers are kept when hetmoe's run fails
                    hetmoe = run_hetmoe(hetmoe_command(args, path, os.path.join(jdir, "e2e.json")), log)
                    log(hetmoe["stdout"].rstrip())
                except RuntimeError as e:
                    hetmoe_error = str(e)
                    log(hetmoe_error)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(llama, hetmoe, args.prompt_tokens)
    log("")
    hetmoe_side = (f"hetmoe on the file ({'hybrid' if args.gpu else 'cpu'})" if hetmoe_on_gguf(args) else
                   f"hetmoe {SHAPE_FORMATS[args.experts_type]} g64 on the shape")
    log(f"{args.shape}, {args.layers} layers, experts {args.experts_type} = {hetmoe_side}, dense {args.dense_type} = "
        f"hetmoe {DENSE_TYPES[args.dense_type]}, embedding {EMBED_TYPE}, {args.threads} threads"
        + (", llama.cpp " + " ".join(GPU_ARGS) if args.gpu else "") + f"; {cpu_model()}")
    for line in fmt_summary(rows, hetmoe):
        log(line)
    per_token = expert_bytes_per_token(args, written, hetmoe)
    if per_token:  # the engines' kernels read different layouts of the same weights (fp32 scales against fp16)
        log("routed experts read per decoded token: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in
                                                                 per_token.items()))
    log(f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (1 min)")
    if args.json:
        doc = {"machine": {"cpu_model": cpu_model(), "mem_total_gb": mem_total_bytes() / 1e9,
                           "llc_mb": llc_bytes() / (1 << 20), "commit": git_commit(), "date": time.strftime(
                               "%Y-%m-%dT%H:%M:%S%z"), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
               "config": {k: v for k, v in vars(args).items() if k != "json"}, "gguf": written,
               "llama_cpp": llama, "hetmoe": hetmoe, "hetmoe_error": hetmoe_error, "summary": rows,
               "expert_bytes_per_token": per_token}
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            log(f"wrote {args.json}")
    return 1 if hetmoe_error else 0


if __name__ == "__main__":
    sys.exit(main())
