"""The ``hetmoe`` command: ``generate``, ``chat``, ``serve``, ``eval``, ``doctor``, ``bench kernel|overhead|e2e|serve``.

This module imports only the standard library, so ``hetmoe --help`` is instant; torch and ``hetmoe._C`` are
imported inside the subcommand handlers.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional, Sequence

from hetmoe import __version__

SHAPE_NAMES = ("deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b")  # defined in hetmoe.bench.kernel.SHAPES
ISAS = ("auto", "scalar", "avx2", "avx512", "amx")  # hetmoe.cpu.ISAS and auto
MODEL_SHAPES = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b", "deepseek-v2-lite")  # hetmoe.testing.synthetic.SHAPES


_KINDS = {"int": "an integer", "float": "a number"}


class Parser(argparse.ArgumentParser):
    """argparse with hetmoe's one error style: the usage, then ``hetmoe CMD: error: --option: what`` (exit 2)
    with the values as typed (no Python quotes or reprs); runtime errors are ``hetmoe CMD: error: what`` (exit 1,
    in ``main``)."""

    def error(self, message: str):
        message = re.sub(r"^argument ", "", message)
        message = re.sub(r"invalid choice: '([^']*)' \(choose from (.*)\)$",
                         lambda m: f"invalid choice: {m[1]} (choose from {m[2].replace(chr(39), '')})", message)
        message = re.sub(r"invalid (\w+) value: '([^']*)'$",
                         lambda m: f"expected {_KINDS.get(m[1], 'a valid value')}, got {m[2]}", message)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_list(text: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text}")
    return values


def _choice_list(choices: Sequence[str]):
    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
        return values

    return parse


def _number(text: str, kind, ok, expected: str):
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def _nonneg_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def _port(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v <= 65535, "a port in 0..65535")


def _nonneg_float(text: str) -> float:
    return _number(text, float, lambda v: v >= 0, "a number >= 0")


def _top_p(text: str) -> float:
    return _number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _stop(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty string")
    return text


def _numa(text: str):
    from hetmoe.cpu.numa import parse_numa

    try:
        return parse_numa(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number of subpools >= 1, got {text}") from None


def add_engine_options(p: argparse.ArgumentParser, model: bool = True) -> None:
    """The engine options, named the same in every command that runs a model."""
    g = p.add_argument_group("engine")
    if model:
        g.add_argument("--model", metavar="DIR", default=None,
                       help="Hugging Face checkpoint directory (default: the small model built into hetmoe)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: the GPU for everything but the routed experts when there is one (default: auto)")
    g.add_argument("--experts-format", choices=("auto", "bf16", "int8", "int4"), default="auto",
                   help="format of the routed experts on the CPU; auto: the most precise that fits in RAM")
    g.add_argument("--group-size", type=int, default=None, choices=(0, 32, 64, 128),
                   help="int8/int4 scale group (default: 128 for int8, 64 for int4; 0 = per-row int8; bf16 has none)")
    g.add_argument("--threads", type=_positive_int, default=None,
                   help="CPU expert threads (default: physical cores; with a GPU, 2 fewer)")
    g.add_argument("--numa", type=_numa, default="auto", metavar="auto|off|N",
                   help="split each expert across N NUMA subpools (tensor parallel); auto: one per NUMA node")
    g.add_argument("--max-context", type=_positive_int, default=None,
                   help="KV cache positions per sequence (default: min(4096, the model's limit))")
    g.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="dense weights and activations (default: bf16 on GPU, fp32 on CPU for small models)")
    g.add_argument("--defer-experts", type=int, default=0, metavar="D",
                   help="Expert Deferral: per token, compute the D lowest-weighted of its top-k routed experts "
                   "alongside the next layer and add them to the next MoE layer's output (0 <= D < top-k; default: 0)")
    g.add_argument("--gpu-experts", type=int, default=0, metavar="N",
                   help="with a GPU: keep N routed experts of every MoE layer on it as well and compute them there, "
                   "the N most often routed on a calibration text (0 <= N <= experts per layer; default: 0)")
    g.add_argument("--calibration-file", metavar="FILE", default=None,
                   help="UTF-8 text whose routing picks the --gpu-experts (default: a built-in mixed text)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="with a GPU: run each decode step eagerly instead of replaying it as a CUDA graph")
    g.add_argument("--isa", choices=ISAS, default="auto",
                   help="CPU expert kernels (default: auto, the best this CPU runs within $HETMOE_MAX_ISA)")
    g.add_argument("--expert-cache", metavar="DIR", default="auto",
                   help="where converted experts are kept for the next load ('off' disables; "
                        "default: $XDG_CACHE_HOME/hetmoe/experts)")


def add_sampling_options(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens,
                   help=f"most tokens per reply (default: {max_new_tokens})")
    g.add_argument("--temperature", type=_nonneg_float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=_top_p, default=1.0, help="nucleus sampling mass, (0, 1] (default: 1 = off)")
    g.add_argument("--top-k", type=_nonneg_int, default=0,
                   help="sample among the k most likely tokens (default: 0 = off)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", type=_stop, action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def add_shape_options(p: argparse.ArgumentParser) -> None:
    """Serve a real model shape with random weights built in memory instead of a checkpoint (benchmarks)."""
    g = p.add_argument_group("synthetic model (instead of --model)")
    g.add_argument("--shape", choices=MODEL_SHAPES, default=None,
                   help="a real model shape with random weights and a word-per-token tokenizer")
    g.add_argument("--layers", type=_positive_int, default=None, help="decoder layers of --shape (default: all)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hetmoe", description="Giant MoE models on one GPU plus CPU DRAM.")
    parser.add_argument("--version", action="version", version=f"hetmoe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # none: main prints the help

    generate = sub.add_parser("generate", help="generate a completion (text to stdout, progress and timing to stderr)")
    generate.add_argument("--prompt", "-p", default=None,
                          help="the prompt ('-' reads stdin; default: a short built-in prompt)")
    generate.add_argument("--raw", action="store_true",
                          help="use the prompt as is (default: wrap it in the model's chat template when it has one)")
    generate.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, timings) instead")
    add_engine_options(generate)
    add_sampling_options(generate)
    generate.set_defaults(handler=_generate)

    chat = sub.add_parser(
        "chat", help="interactive chat that streams the reply (/help lists its commands)",
        description="A conversation with the model: type a message, the reply streams back. On a terminal: line "
        "editing and history (kept in $XDG_STATE_HOME/hetmoe/chat_history), Ctrl-C clears the line or stops a "
        "reply, Ctrl-D or /exit quits; /help lists the commands. Without a terminal, one message per line of stdin.")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_options(chat)
    add_sampling_options(chat, max_new_tokens=512)
    chat.set_defaults(handler=_chat)

    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models)",
        description="Serves the model over the OpenAI API: point the openai client (or any tool that speaks it) at "
        "http://HOST:PORT/v1. Up to --max-batch requests decode together (continuous batching).")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="TCP port (default: 8000; 0 = any free port, printed)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every /v1 request (default: no key)")
    serve.add_argument("--max-batch", type=_positive_int, default=8,
                       help="sequences that decode together, each with its own KV-cache slot (default: 8)")
    add_shape_options(serve)
    add_engine_options(serve)
    serve.set_defaults(handler=_serve)

    ev = sub.add_parser(
        "eval", help="perplexity of a configuration, and its KL divergence / top-1 agreement against bf16 experts",
        description="Scores --text in consecutive, non-overlapping windows of --window tokens (each from an empty "
        "cache; the first token of a window is context, never scored) with the engine options given, and the same "
        "windows with the model's --reference-format experts (default bf16, nothing dropped or deferred): perplexity "
        "of both, mean KL(reference || configuration) per token and the fraction of positions whose most likely next "
        "token agrees. Both configurations are loaded at once.")
    ev.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score ('-' reads stdin)")
    ev.add_argument("--window", type=int, default=512,
                    help="tokens per window, >= 2 and <= the context (default: 512)")
    ev.add_argument("--max-tokens", type=_positive_int, default=None, metavar="N",
                    help="score only the first N tokens of the text")
    ev.add_argument("--drop-experts", type=int, default=0, metavar="D",
                    help="per token, do not compute the D lowest-weighted of its top-k routed experts (weights not "
                    "renormalised; default: 0)")
    ev.add_argument("--reference-format", choices=("bf16", "int8", "int4", "none"), default="bf16",
                    help="experts format of the reference run ('none': perplexity only; default: bf16)")
    ev.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON ('-' = stdout only)")
    add_engine_options(ev)
    ev.set_defaults(handler=_eval)

    doctor = sub.add_parser("doctor", help="CPU features, chosen ISA and kernel per format, pinned CPUs")
    doctor.add_argument("--threads", type=_positive_int, default=None, help="pool size (default: physical cores)")
    doctor.add_argument("--isa", choices=ISAS, default="auto", help="default: auto, the best this CPU runs")
    doctor.add_argument("--numa", type=_numa, default="auto", metavar="auto|off|N",
                        help="NUMA subpools (default: auto)")
    doctor.set_defaults(handler=_doctor)

    bench = sub.add_parser("bench", help="benchmarks that print bandwidth and FLOP/s, not only time")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")  # none: main prints bench's help, exit 2

    kernel = bench_sub.add_parser(
        "kernel",
        help="fused CPU MoE layer vs STREAM bandwidth and a naive PyTorch loop",
        description="Times CPUExperts.forward per (shape, format, tokens) with random weights and routing; reports "
        "ms, GB/s of expert weights streamed, %% of the STREAM-read bandwidth measured in the same run, FLOP/s, "
        "and the speed-up over a naive PyTorch per-expert loop run alongside.",
    )
    kernel.add_argument("--shapes", type=_choice_list(SHAPE_NAMES), default=None,
                        help=f"comma list of {', '.join(SHAPE_NAMES)} (default: all)")
    kernel.add_argument("--formats", type=_choice_list(("bf16", "int8", "int4")), default=None,
                        help="comma list of bf16, int8, int4 (default: all)")
    kernel.add_argument("--tokens", type=_int_list, default=None, help="comma list of T (default: 1,4,32,512,2048)")
    kernel.add_argument("--threads", type=_positive_int, default=None,
                        help="pool and torch threads (default: physical cores)")
    kernel.add_argument("--isa", choices=ISAS, default="auto", help="default: auto, the best this CPU runs")
    kernel.add_argument("--group-size", type=int, default=None,
                        help="int8/int4 scale group (default: 128 for int8, 64 for int4; 0 = per-row int8)")
    kernel.add_argument("--experts", type=_positive_int, default=None, help="override E of every shape")
    kernel.add_argument("--mem-budget-gb", type=float, default=None,
                        help="cap E so the packed experts fit in this many GB (default: 45%% of MemTotal)")
    kernel.add_argument("--repeats", type=_positive_int, default=None,
                        help="timed calls per point after 2 warm-up calls; the median is reported (default: 5)")
    kernel.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON ('-' = stdout)")
    kernel.add_argument("--no-baseline", action="store_true", help="skip the naive PyTorch loop")
    kernel.add_argument("--quick", action="store_true",
                        help="smoke run: qwen3-30b-a3b with E=16, tokens 1,32, 3 repeats (explicit options win)")
    kernel.set_defaults(handler=_bench_kernel)
    kernel.add_argument("--routing", type=_choice_list(("uniform", "zipf")), default=None,
                        help="comma list of routings: uniform, zipf (expert popularity ~ 1/rank; default: uniform)")
    kernel.add_argument("--compare-avx512", action="store_true",
                        help="with AMX: also time every point with all experts on the AVX-512 kernels (same weights)")
    kernel.add_argument("--compare-max-tokens", type=_positive_int, default=1 << 30, metavar="T",
                        help="--compare-avx512 only up to this T (default: all)")
    kernel.add_argument("--amx-min-tokens", type=_positive_int, default=None, metavar="N",
                        help="experts with >= N tokens use AMX (default: the engine's measured crossover)")
    kernel.add_argument("--crossover", action="store_true",
                        help="with AMX: measure AMX vs AVX-512 at 1..32 tokens per expert (sets amx_min_tokens)")
    kernel.add_argument("--random-packed", action="store_true",
                        help="random weights written straight into the packed layout (fast; no fp32 source)")
    kernel.add_argument("--warmup", type=int, default=None, help="untimed calls per point (default: 2)")
    kernel.add_argument("--profile", action="store_true",
                        help="also print where each point's time goes: the job's stages (route, quantize, gate+up, "
                        "down, combine) in ms per call")

    e2e = bench_sub.add_parser(
        "e2e",
        help="prefill and decode tok/s of a whole model vs the decode roofline (CPU alone and hybrid)",
        description="Builds a real model shape with random weights (or loads --model) once per placement — cpu, and "
        "hybrid (routed experts on the CPU, the rest on the GPU); --device auto runs both where there is a GPU — and "
        "reports prefill tok/s per prompt length, batch-1 decode tok/s, and the decode roofline: bytes each decoded "
        "token must read from CPU DRAM over the STREAM-read bandwidth measured in the same run.",
    )
    source = e2e.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR", default=None,
                        help="a Hugging Face checkpoint directory instead of a shape")
    source.add_argument("--shape", choices=MODEL_SHAPES, default=None,
                        help=f"a real model shape with random weights: {', '.join(MODEL_SHAPES)} "
                        "(default: qwen3-30b-a3b)")
    e2e.add_argument("--layers", type=_positive_int, default=None,
                     help="decoder layers of the shape to build (default: all of them; --quick: 2)")
    e2e.add_argument("--prompt-tokens", type=_int_list, default=None,
                     help="comma list of prompt lengths timed for prefill (default: 128,1024)")
    e2e.add_argument("--decode-tokens", type=_positive_int, default=None, help="decode steps timed (default: 128)")
    e2e.add_argument("--repeats", type=_positive_int, default=None,
                     help="timed runs per point after a warm-up; the median is reported (default: 3)")
    e2e.add_argument("--seed", type=int, default=0, help="random weights and token ids (default: 0)")
    e2e.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON ('-' = stdout)")
    e2e.add_argument("--no-variants", action="store_true",
                     help="hybrid placement: skip the decode variants (eager, CUDA graph, graph + deferral d=1..3, "
                     "graph + --gpu-experts) and their GPU/CPU time split")
    e2e.add_argument("--kv-contexts", type=_int_list, default=None, metavar="N,N",
                     help="hybrid placement: also time graph decode near the end of these context lengths with "
                     "attention over the whole cache vs per 64-position bucket (e.g. 1024,4096)")
    e2e.add_argument("--quick", action="store_true",
                     help="smoke run: 2 layers, int4 experts, prompts 16,64, 8 decode tokens, 1 repeat "
                     "(explicit options win)")
    add_engine_options(e2e, model=False)
    e2e.set_defaults(handler=_bench_e2e)

    bserve = bench_sub.add_parser(
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
    bserve.add_argument("--clients", type=_positive_int, default=64, help="concurrent streaming clients (default: 64)")
    bserve.add_argument("--duration", type=_nonneg_float, default=60.0,
                        help="seconds during which clients start new requests (default: 60)")
    bserve.add_argument("--prompt-tokens", type=_positive_int, default=32, help="prompt length (default: 32)")
    bserve.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens per request (default: 64)")
    bserve.add_argument("--temperature", type=_nonneg_float, default=0.0, help="default: 0 (greedy)")
    bserve.add_argument("--seed", type=int, default=0, help="random prompts (default: 0)")
    bserve.add_argument("--max-batch", type=_positive_int, default=16,
                        help="--max-batch of the server it starts (default: 16)")
    bserve.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON ('-' = stdout)")
    add_shape_options(bserve)
    add_engine_options(bserve)
    bserve.set_defaults(handler=_bench_serve)

    overhead = bench_sub.add_parser("overhead", help="submit -> sync round trip of a prepared job with T=0")
    overhead.add_argument("--threads", type=_positive_int, default=None, help="pool size (default: physical cores)")
    overhead.add_argument("--iters", type=_positive_int, default=2000, help="timed round trips (default: 2000)")
    overhead.add_argument("--stream", action="store_true",
                          help="also through CUDA host functions on a stream, per layer, graph and eager (needs CUDA)")
    overhead.add_argument("--with-copies", action="store_true",
                          help="--stream: add the copies x -> pinned host and out -> device; compare with them alone")
    overhead.add_argument("--layers", type=_positive_int, default=48, help="--stream: layers per step (default: 48)")
    overhead.add_argument("--hidden", type=_positive_int, default=2048,
                          help="--stream: hidden size H of the copied rows, bf16 (default: 2048)")
    overhead.set_defaults(handler=_bench_overhead)
    parser.commands = {"": parser, "bench": bench, **{n: p for n, p in sub.choices.items()},
                       **{f"bench {n}": p for n, p in bench_sub.choices.items()}}
    return parser


def _generate(args: argparse.Namespace) -> int:
    from hetmoe.commands import run_generate

    return run_generate(args)


def _chat(args: argparse.Namespace) -> int:
    from hetmoe.commands import run_chat

    return run_chat(args)


def _serve(args: argparse.Namespace) -> int:
    from hetmoe.server.main import run_serve

    return run_serve(args)


def _eval(args: argparse.Namespace) -> int:
    from hetmoe.eval_command import run_eval

    return run_eval(args)


def _doctor(args: argparse.Namespace) -> int:
    from hetmoe.bench.kernel import doctor

    return doctor(threads=args.threads, isa=args.isa, numa=args.numa)


def _bench_kernel(args: argparse.Namespace) -> int:
    from hetmoe.bench.kernel import run_kernel_bench

    return run_kernel_bench(args)


def _bench_e2e(args: argparse.Namespace) -> int:
    from hetmoe.bench.e2e import run_e2e_bench

    return run_e2e_bench(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from hetmoe.bench.serve import run_serve_bench

    return run_serve_bench(args)


def _bench_overhead(args: argparse.Namespace) -> int:
    from hetmoe.bench.kernel import run_overhead_bench

    return run_overhead_bench(threads=args.threads, iters=args.iters, stream=args.stream,
                              with_copies=args.with_copies, layers=args.layers, hidden=args.hidden)


def _usage_errors(args: argparse.Namespace) -> Optional[str]:
    """Option checks that argparse's per-option types cannot make (kept out of the types so that
    ``build_parser().parse_args`` stays lenient for code that builds EngineOptions from it)."""
    if getattr(args, "gpu_experts", 0) < 0:
        return f"--gpu-experts: expected an integer >= 0, got {args.gpu_experts}"
    if getattr(args, "defer_experts", 0) < 0:
        return f"--defer-experts: expected an integer >= 0, got {args.defer_experts}"
    if getattr(args, "experts_format", None) == "int4" and getattr(args, "group_size", None) == 0:
        return "--group-size: int4 experts need a group size of 32, 64 or 128 (per-row scales are int8 only)"
    if getattr(args, "with_copies", False) and not args.stream:
        return "--with-copies: needs --stream"
    return None


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    name = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
    command = parser.commands[name]
    if extra:
        command.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:  # bare `hetmoe`: the help, as git and pip do
        parser.print_help()
        parser.exit(0)
    if args.command == "bench" and args.bench is None:
        command.print_help(sys.stderr)
        command.exit(2, f"\nhetmoe bench: error: choose a benchmark: {', '.join(_BENCHES)}\n")
    problem = _usage_errors(args)
    if problem:
        command.error(problem)
    return args


_BENCHES = ("kernel", "e2e", "serve", "overhead")


def _quiet_closed_pipe() -> int:
    """stdout (or stderr) is a pipe whose reader has gone (``hetmoe ... | head -1``): stop quietly, as ``cat``
    does, with the status a shell reports for a command SIGPIPE ended (128 + 13). Python ignores SIGPIPE, so
    the write raised BrokenPipeError; both streams go to /dev/null so the final flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError):  # a replaced stream (tests) without a file descriptor
            pass
    return 141


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parse(argv)
    except BrokenPipeError:  # --help into a closed pipe
        return _quiet_closed_pipe()
    # Idle OpenMP threads of torch otherwise spin on the cores the expert engine's pinned threads compute on
    # (measured on the 16-core GPU machine: hybrid decode 140 -> 65 ms per step for 8 qwen3-30b-a3b layers).
    # It must be set before torch is imported, which the handlers do.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _quiet_closed_pipe()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, MemoryError, OSError) as e:
        name = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
        print(f"hetmoe {name}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
