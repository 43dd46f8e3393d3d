"""``hetmoe bench kernel|e2e|serve|overhead``: the benchmarks' arguments. What each one runs and prints is in
hetmoe/bench/ (kernel.py, e2e.py, serve.py)."""

from __future__ import annotations

import argparse
from typing import Optional

from hetmoe.cli.options import add_shape_options
from hetmoe.config.flags import (
    ISAS,
    MODEL_SHAPES,
    SHAPE_NAMES,
    add_engine_options,
    choice_list,
    int_list,
    nonneg_float,
    nonneg_int,
    positive_int,
)

BENCHES = ("kernel", "e2e", "serve", "overhead")  # in the order `hetmoe bench --help` lists them
# hetmoe/bench/kernel.py FORMATS (not imported here: the CLI starts without torch)
KERNEL_FORMATS = ("bf16", "int8", "int4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q4_k_m", "q4_0", "q8_0", "q5_0",
                  "q5_1", "mxfp4", "iq4_nl", "iq4_xs", "tq2_0", "tq1_0", "iq2_xxs", "iq3_xxs", "iq3_s", "iq2_xs",
                  "iq2_s", "iq1_s", "iq1_m", "ud_iq2_xxs", "nvfp4", "nvfp4_div", "nvfp4_fp16", "nvfp4_fp32",
                  "int4_zp", "int4_zp_fp32", "fp8", "mxfp8")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="benchmarks that print bandwidth and FLOP/s, not only time")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH")  # none: main prints bench's help, exit 2
    for name in BENCHES:
        _ADD[name](bench_sub)
    p.benches = bench_sub.choices
    return p


def usage_error(args: argparse.Namespace) -> Optional[str]:
    """What the benchmark's options cannot be, beyond each option's type (None: nothing)."""
    if getattr(args, "with_copies", False) and not args.stream:
        return "--with-copies: needs --stream"
    return None


def _add_kernel(sub) -> None:
    kernel = sub.add_parser(
        "kernel",
        help="fused CPU MoE layer vs STREAM bandwidth and a naive PyTorch loop",
        description="Times CPUExperts.forward per (shape, format, tokens) with random weights and routing; reports "
        "ms, GB/s of expert weights streamed, %% of the STREAM-read bandwidth measured in the same run, FLOP/s, "
        "and the speed-up over a naive PyTorch per-expert loop run alongside.",
    )
    kernel.add_argument("--shapes", type=choice_list(SHAPE_NAMES), default=None,
                        help=f"comma list of {', '.join(SHAPE_NAMES)} (default: all)")
    kernel.add_argument("--formats", type=choice_list(KERNEL_FORMATS), default=None,
                        help="comma list of bf16, int8, int4 (default: these three), and GGUF experts at their own "
                        "precision: q2_k, q3_k, q4_k, q5_k, q6_k, q4_k_m (Q4_K gate/up, Q6_K down), q4_0, q8_0, "
                        "q5_0, q5_1 (fp16 scales), mxfp4, iq4_nl, iq4_xs (lut4: 4-bit codebook indices), tq2_0, "
                        "tq1_0 (ternary: int2 group 128), iq2_xxs, iq3_xxs, iq3_s, iq2_xs, iq2_s, iq1_s, iq1_m, "
                        "ud_iq2_xxs (IQ2_XXS gate/up, IQ3_XXS down; grid: the i-quants' blocks decoded in the "
                        "kernels), nvfp4, nvfp4_div (lut4 e2m1 g16 with E4M3 scale bytes: a factor that "
                        "multiplies, one that divides), nvfp4_fp16, nvfp4_fp32 (the same with widened scales), "
                        "int4_zp (int4 affine, --group-size or 128, fp16 scales and an int8 zero point per group: "
                        "GPTQ / AWQ at their file's bytes), int4_zp_fp32 (the same with fp32 scales and mins)")
    kernel.add_argument("--tokens", type=int_list, default=None, help="comma list of T (default: 1,4,32,512,2048)")
    kernel.add_argument("--threads", type=positive_int, default=None,
                        help="pool and torch threads (default: physical cores)")
    kernel.add_argument("--isa", choices=ISAS, default="auto", help="default: auto, the best this CPU runs")
    kernel.add_argument("--group-size", type=int, default=None,
                        help="int8/int4 scale group (default: 128 for int8, 64 for int4; 0 = per-row scales)")
    kernel.add_argument("--experts", type=positive_int, default=None, help="override E of every shape")
    kernel.add_argument("--mem-budget-gb", type=float, default=None,
                        help="cap E so the packed experts fit in this many GB (default: 45%% of MemTotal)")
    kernel.add_argument("--repeats", type=positive_int, default=None,
                        help="timed calls per point after 2 warm-up calls; the median is reported (default: 5)")
    kernel.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON ('-' = stdout)")
    kernel.add_argument("--no-baseline", action="store_true", help="skip the naive PyTorch loop")
    kernel.add_argument("--quick", action="store_true",
                        help="smoke run: qwen3-30b-a3b with E=16, tokens 1,32, 3 repeats (explicit options win)")
    kernel.add_argument("--routing", type=choice_list(("uniform", "zipf")), default=None,
                        help="comma list of routings: uniform, zipf (expert popularity ~ 1/rank; default: uniform)")
    kernel.add_argument("--compare-avx512", action="store_true",
                        help="with AMX: also time every point with all experts on the AVX-512 kernels (same weights)")
    kernel.add_argument("--compare-max-tokens", type=positive_int, default=1 << 30, metavar="T",
                        help="--compare-avx512 only up to this T (default: all)")
    kernel.add_argument("--amx-min-tokens", type=positive_int, default=None, metavar="N",
                        help="experts with >= N tokens use AMX (default: the engine's measured crossover)")
    kernel.add_argument("--crossover", action="store_true",
                        help="with AMX: measure AMX vs AVX-512 at 1..32 tokens per expert (sets amx_min_tokens)")
    kernel.add_argument("--random-packed", action="store_true",
                        help="random weights written straight into the packed layout (fast; no fp32 source)")
    kernel.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default: 2)")
    kernel.add_argument("--profile", action="store_true",
                        help="also print where each point's time goes: the job's stages (route, quantize, gate+up, "
                        "down, combine) in ms per call")
    kernel.set_defaults(handler=_run_kernel)


def _add_e2e(sub) -> None:
    e2e = sub.add_parser(
        "e2e",
        help="prefill and decode tok/s of a whole model vs the decode roofline (CPU alone and hybrid)",
        description="Builds a real model shape with random weights (or loads --model) once per placement — cpu, and "
        "hybrid (routed experts on the CPU, the rest on the GPU); --device auto runs both where there is a GPU — and "
        "reports prefill tok/s per prompt length, batch-1 decode tok/s, and the decode roofline: bytes each decoded "
        "token must read from CPU DRAM over the STREAM-read bandwidth measured in the same run.",
    )
    source = e2e.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR|FILE.gguf", default=None,
                        help="a Hugging Face checkpoint directory or a GGUF file instead of a shape")
    source.add_argument("--shape", choices=MODEL_SHAPES, default=None,
                        help=f"a real model shape with random weights: {', '.join(MODEL_SHAPES)} "
                        "(default: qwen3-30b-a3b)")
    e2e.add_argument("--layers", type=positive_int, default=None,
                     help="decoder layers of the shape to build (default: all of them; --quick: 2)")
    e2e.add_argument("--prompt-tokens", type=int_list, default=None,
                     help="comma list of prompt lengths timed for prefill (default: 128,1024)")
    e2e.add_argument("--decode-tokens", type=positive_int, default=None, help="decode steps timed (default: 128)")
    e2e.add_argument("--repeats", type=positive_int, default=None,
                     help="timed runs per point after a warm-up; the median is reported (default: 3)")
    e2e.add_argument("--seed", type=int, default=0, help="random weights and token ids (default: 0)")
    e2e.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON ('-' = stdout)")
    e2e.add_argument("--no-variants", action="store_true",
                     help="hybrid placement: skip the decode variants (eager, CUDA graph, graph + deferral d=1..k-1, "
                     "graph + --gpu-experts) and their GPU/CPU time split")
    e2e.add_argument("--variants", type=_name_list, default=None, metavar="NAME,NAME",
                     help="hybrid placement: run only these decode variants, e.g. graph,graph+d6 (names as the table "
                     "prints them; graph+gpu: the model's GPU experts, whatever their count; also the off-by-default "
                     "switches, e.g. graph+topk-gpu: the top-k on the GPU instead of inside the CPU jobs)")
    e2e.add_argument("--kv-contexts", type=int_list, default=None, metavar="N,N",
                     help="hybrid placement: also time, per attention path (triton / sdpa), graph decode near these "
                     "context lengths (tok/s, GPU part of the step), batch 16 at mixed lengths, and the attention "
                     "of a prefill of each length (e.g. 512,8192,32768,131072)")
    e2e.add_argument("--quick", action="store_true",
                     help="smoke run: 2 layers, int4 experts, prompts 16,64, 8 decode tokens, 1 repeat "
                     "(explicit options win)")
    e2e.add_argument("--gpu-experts-sweep", default=None, metavar="N,N,...",
                     help="hybrid placement only: one load per N routed experts of every MoE layer resident on the "
                     "GPU (integers, 'all' = every expert), one table of decode and prefill tok/s (default prompts "
                     "512,8192; 32 decode tokens; 2 repeats), e.g. 0,16,32,64,96,112,all")
    add_engine_options(e2e, model=False)
    e2e.set_defaults(handler=_run_e2e)


def _name_list(text: str) -> list:
    names = [v.strip() for v in text.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of variant names")
    return names


def _add_serve(sub) -> None:
    bserve = sub.add_parser(
        "serve",
        help="N concurrent streaming clients against an OpenAI-compatible server: tok/s, TTFT, per-token latency",
        description="Runs --clients streaming /v1/completions clients for --duration seconds (each request: "
        "--prompt-tokens token ids, --max-tokens generated with ignore_eos) against --url, or against a "
        "`hetmoe serve` it starts itself with --model, the engine options and --max-batch. Reports output tok/s, "
        "TTFT, time per output token and inter-token latency (p50/p99), completed requests and errors.",
    )
    bserve.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000/v1 "
                        "(default: start hetmoe serve with the engine options below)")
    bserve.add_argument("--api-key", default=None, metavar="KEY", help="sent as 'Authorization: Bearer KEY'")
    bserve.add_argument("--clients", type=positive_int, default=64, help="concurrent streaming clients (default: 64)")
    bserve.add_argument("--duration", type=nonneg_float, default=60.0,
                        help="seconds during which clients start new requests (default: 60)")
    bserve.add_argument("--prompt-tokens", type=positive_int, default=32, help="prompt length (default: 32)")
    bserve.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request (default: 64)")
    bserve.add_argument("--temperature", type=nonneg_float, default=0.0, help="default: 0 (greedy)")
    bserve.add_argument("--constrained", type=nonneg_int, default=0, metavar="N",
                        help="N of the clients ask /v1/chat/completions for a json_schema response format, measured "
                        "against a phase where they send the same chat requests without one (default: 0)")
    bserve.add_argument("--seed", type=int, default=0, help="random prompts (default: 0)")
    bserve.add_argument("--max-batch", type=positive_int, default=16,
                        help="--max-batch of the server it starts (default: 16)")
    bserve.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON ('-' = stdout)")
    add_shape_options(bserve)
    add_engine_options(bserve)
    bserve.set_defaults(handler=_run_serve)


def _add_overhead(sub) -> None:
    overhead = sub.add_parser("overhead", help="submit -> sync round trip of a prepared job with T=0")
    overhead.add_argument("--threads", type=positive_int, default=None, help="pool size (default: physical cores)")
    overhead.add_argument("--iters", type=positive_int, default=2000, help="timed round trips (default: 2000)")
    overhead.add_argument("--stream", action="store_true",
                          help="also through CUDA host functions on a stream, per layer, graph and eager (needs CUDA)")
    overhead.add_argument("--with-copies", action="store_true",
                          help="--stream: add the copies x -> pinned host and out -> device; compare with them alone")
    overhead.add_argument("--layers", type=positive_int, default=48, help="--stream: layers per step (default: 48)")
    overhead.add_argument("--hidden", type=positive_int, default=2048,
                          help="--stream: hidden size H of the copied rows, bf16 (default: 2048)")
    overhead.set_defaults(handler=_run_overhead)


_ADD = {"kernel": _add_kernel, "e2e": _add_e2e, "serve": _add_serve, "overhead": _add_overhead}


def _run_kernel(args: argparse.Namespace) -> int:
    from hetmoe.bench.kernel import run_kernel_bench

    return run_kernel_bench(args)


def _run_e2e(args: argparse.Namespace) -> int:
    from hetmoe.bench.e2e import run_e2e_bench

    return run_e2e_bench(args)


def _run_serve(args: argparse.Namespace) -> int:
    from hetmoe.bench.serve import run_serve_bench

    return run_serve_bench(args)


def _run_overhead(args: argparse.Namespace) -> int:
    from hetmoe.bench.kernel import run_overhead_bench

    return run_overhead_bench(threads=args.threads, iters=args.iters, stream=args.stream,
                              with_copies=args.with_copies, layers=args.layers, hidden=args.hidden)
