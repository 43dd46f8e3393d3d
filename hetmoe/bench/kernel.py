"""``hetmoe bench kernel``: the fused CPU MoE layer against the DRAM bandwidth and a naive PyTorch loop.

Per (shape, format, T) it reports ms (median of repeats after warm-up), GB/s of expert weights streamed
(distinct active experts x bytes per packed expert), % of the STREAM-read bandwidth measured by the same pool in
the same run, FLOP/s (2 x 3 x H x I per (token, expert) pair), and the speed-up over a naive PyTorch
per-expert loop timed alongside on the same machine. Consecutive calls use different random routings, so a
decode step reads its experts from DRAM, not from cache.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from hetmoe import cpu
from hetmoe.bench import kernel_amx
from hetmoe.bench.machine import (
    GB,
    check_isa,
    llc_bytes,
    machine_info,
    mem_total_bytes,
    write_json,
)
from hetmoe.cpu.codes import GRID_TYPES, exact_layout
from hetmoe.cpu.layout import FP8_LAYOUTS


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int  # H
    inter: int  # I
    n_expert: int  # E
    top_k: int  # k


SHAPES = {
    s.name: s
    for s in (
        Shape("deepseek-v3", 7168, 2048, 256, 8),
        Shape("qwen3-30b-a3b", 2048, 768, 128, 8),
        Shape("mixtral-8x7b", 4096, 14336, 8, 2),
    )
}
DEFAULT_GROUP = {"bf16": 128, "int8": 128, "int4": 64}
# GGUF experts at their own precision (hetmoe/cpu/codes.py exact_layout): (gate/up type, down type)
GGUF_FORMATS = {"q2_k": ("Q2_K", "Q2_K"), "q3_k": ("Q3_K", "Q3_K"), "q4_k": ("Q4_K", "Q4_K"),
                "q5_k": ("Q5_K", "Q5_K"), "q6_k": ("Q6_K", "Q6_K"), "q4_k_m": ("Q4_K", "Q6_K"),
                "q4_0": ("Q4_0", "Q4_0"), "q8_0": ("Q8_0", "Q8_0"), "q5_0": ("Q5_0", "Q5_0"), "q5_1": ("Q5_1", "Q5_1"),
                "mxfp4": ("MXFP4", "MXFP4"), "iq4_nl": ("IQ4_NL", "IQ4_NL"), "iq4_xs": ("IQ4_XS", "IQ4_XS"),
                "tq2_0": ("TQ2_0", "TQ2_0"), "tq1_0": ("TQ1_0", "TQ1_0"),
                **{k.lower(): (k, k) for k in GRID_TYPES}, "ud_iq2_xxs": ("IQ2_XXS", "IQ3_XXS")}
# NVFP4 experts (lut4 e2m1 group 16): at the file's bytes, E4M3 scale bytes and a per-tensor factor that multiplies
# (GGUF's NVFP4, ModelOpt) or divides (compressed-tensors), and the scales held widened before (fp16, fp32)
NVFP4_FORMATS = {"nvfp4": "e4m3", "nvfp4_div": "e4m3_div", "nvfp4_fp16": "fp16", "nvfp4_fp32": "fp32"}
# int4 with zero points (GPTQ, AWQ, compressed-tensors asymmetric: int4 affine, group --group-size or 128): at the
# file's bytes (fp16 scales, an int8 zero point per group) and as held before (fp32 scales and fp32 mins)
ZP_FORMATS = {"int4_zp": "fp16_zp", "int4_zp_fp32": "fp32"}
# FP8 checkpoints' experts at their own layout (hetmoe/cpu/layout.py FP8_LAYOUTS): block FP8 and MXFP8
FP8_FORMATS = {"fp8": 128, "mxfp8": 32}
FORMATS = (tuple(cpu.WEIGHT_FORMATS) + tuple(GGUF_FORMATS) + tuple(NVFP4_FORMATS) + tuple(ZP_FORMATS)
           + tuple(FP8_FORMATS))


def format_args(fmt: str, group_size) -> dict:
    """CPUExperts' format keyword arguments of a --formats name (group_size: --group-size, int8/int4 only)."""
    if fmt in GGUF_FORMATS:
        return exact_layout(*GGUF_FORMATS[fmt])
    if fmt in NVFP4_FORMATS:
        return {"weight_format": "lut4", "group_size": 16, "scale_dtype": NVFP4_FORMATS[fmt], "codebook": "e2m1"}
    if fmt in FP8_FORMATS:
        return {"weight_format": "fp8", "group_size": FP8_FORMATS[fmt], **FP8_LAYOUTS[FP8_FORMATS[fmt]]}
    if fmt in ZP_FORMATS:
        return {"weight_format": "int4", "group_size": group_size or 128, "scaling": "affine",
                "scale_dtype": ZP_FORMATS[fmt]}
    group = DEFAULT_GROUP[fmt] if group_size is None or fmt == "bf16" else group_size
    return {"weight_format": fmt, "group_size": group}
WARMUP = 2
N_ROUTINGS = 8  # at least this many distinct routings are cycled through
BASELINE_EXPERTS = 16  # the PyTorch loop keeps at most this many experts (bf16 or int8 codes)
CHECK_TOKENS = 8


# ---------------------------------------------------------------------------------------------- measurements


def random_routing(T: int, E: int, k: int, gen: torch.Generator) -> tuple:
    """k distinct experts per token, uniform: ids [T, k] int64, weights [T, k] fp32 (positive, sum 1)."""
    vals, ids = torch.rand(T, E, generator=gen).topk(k, dim=1)
    return ids.contiguous(), vals.softmax(dim=1).contiguous()


def time_calls(fn, n_calls: int, warmup: int = WARMUP) -> list:
    """fn(i) for i in range(warmup + n_calls); seconds of the timed calls."""
    times = []
    for i in range(warmup + n_calls):
        t0 = time.perf_counter()
        fn(i)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def load_random(experts: cpu.CPUExperts, label: str, gen: torch.Generator, chunk_bytes: int = 512 << 20) -> None:
    """Loads N(0, 0.02) weights a few experts at a time, so the fp32 copies never exceed ``chunk_bytes``."""
    E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
    per_chunk = max(1, chunk_bytes // (3 * H * I * 4))
    t0 = last = time.perf_counter()
    tty = sys.stderr.isatty()
    for e0 in range(0, E, per_chunk):
        n = min(per_chunk, E - e0)
        gate, up = (torch.randn(n, I, H, generator=gen) * 0.02 for _ in range(2))
        down = torch.randn(n, H, I, generator=gen) * 0.02
        experts.load(gate, up, down, first_expert=e0)
        del gate, up, down
        now = time.perf_counter()
        if e0 + n == E or (tty and now - last > 0.5) or now - last > 10:
            end = "\n" if e0 + n == E else ("\r" if tty else "\n")
            print(f"  loading {label}: {e0 + n}/{E} experts, {now - t0:.1f} s", end=end, file=sys.stderr, flush=True)
            last = now


def measure_overhead(pool: cpu.WorkerPool, iters: int = 2000, warmup: int = 200) -> dict:
    """Round trip pool.submit(job) -> pool.sync() of a prepared job whose n_tokens reads 0, in µs."""
    H, I, k = 256, 256, 2
    ex = cpu.CPUExperts(4, H, I, "bf16", pool=pool)
    ex.load(torch.randn(4, I, H) * 0.02, torch.randn(4, I, H) * 0.02, torch.randn(4, H, I) * 0.02)
    x = torch.zeros(1, H, dtype=torch.bfloat16)
    ids = torch.zeros(1, k, dtype=torch.int64)
    ids[0, 1] = 1
    job = ex.prepare(x, ids, torch.ones(1, k), n_tokens=torch.zeros(1, dtype=torch.int64))
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter_ns()
        pool.submit(job)
        pool.sync()
        if i >= warmup:
            times.append((time.perf_counter_ns() - t0) / 1e3)
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    return {"iters": iters, "median_us": statistics.median(times), "p99_us": p99}


def run_overhead_bench(threads=None, iters: int = 2000, stream: bool = False, with_copies: bool = False,
                       layers: int = 48, hidden: int = 2048) -> int:
    """Python submit -> sync round trip; with ``stream``, also the same through CUDA host functions per layer
    (hetmoe/bench/stream.py), which needs a CUDA device."""
    if stream:
        from hetmoe.bench.stream import check_cuda

        check_cuda()  # fail before spending time on the CPU part
    pool = cpu.shared_pool(threads)
    r = measure_overhead(pool, iters)
    print(f"submit->sync round trip, T=0, {pool.threads} threads: median {r['median_us']:.1f} µs, "
          f"p99 {r['p99_us']:.1f} µs ({iters} calls)")
    if stream:
        from hetmoe.bench.stream import run_stream_overhead_bench

        return run_stream_overhead_bench(pool, layers=layers, iters=iters, hidden=hidden, with_copies=with_copies)
    return 0


# ---------------------------------------------------------------------------------------------- baseline


class TorchLoopExperts:
    """The naive baseline: a Python loop over active experts with torch matmuls.

    Holds experts ``0 .. n-1`` of ``experts`` (their dequantized values, so outputs are comparable): bf16
    tensors for bf16, int8 codes + fp32 group scales for int8/int4, dequantized to bf16 on the fly per call.
    """

    def __init__(self, experts: cpu.CPUExperts, n: int, fmt: str, group: int):
        self.fmt = fmt
        self.weights = []
        for e in range(n):
            g, u, d = experts.dequantized(e)
            if fmt == "bf16":
                self.weights.append(tuple(w.bfloat16() for w in (g, u, d)))
            else:
                self.weights.append(tuple(self._quantize(w, group, fmt) for w in (g, u, d)))

    @staticmethod
    def _quantize(w: torch.Tensor, group: int, fmt: str) -> tuple:
        """Codes and scales that reproduce ``w`` (already on the engine's grid): int8 [rows, cols], fp32
        [rows, cols/g]."""
        rows, cols = w.shape
        g = w.view(rows, cols // (group or cols), -1)
        amax = g.abs().amax(dim=-1, keepdim=True)
        best = None
        for qmax in (127.0,) if fmt == "int8" else (7.0, 8.0):  # int4 codes are [-8, 7]: max |code| is 7 or 8
            s = amax / qmax
            q = torch.where(s > 0, g / s, torch.zeros_like(g)).round().clamp(-qmax, 127.0 if fmt == "int8" else 7.0)
            err = (q * s - g).abs().amax(dim=-1, keepdim=True)
            if best is None:
                best = (q, s, err)
            else:
                pick = err < best[2]
                best = (torch.where(pick, q, best[0]), torch.where(pick, s, best[1]), torch.minimum(err, best[2]))
        return best[0].to(torch.int8).view(rows, cols), best[1].view(rows, -1)

    def _expert(self, e: int) -> tuple:
        if self.fmt == "bf16":
            return self.weights[e]
        out = []
        for q, s in self.weights[e]:
            rows, cols = q.shape
            out.append((q.float().view(rows, s.shape[1], -1) * s.unsqueeze(-1)).view(rows, cols).bfloat16())
        return tuple(out)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in ids.unique().tolist():
            tok, slot = torch.where(ids == e)
            g, u, d = self._expert(e)
            xe = x[tok]
            h = torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)
            out.index_add_(0, tok, (h @ d.T).float() * weights[tok, slot].unsqueeze(1))
        return out


# ---------------------------------------------------------------------------------------------- the benchmark


def choose_experts(shape: Shape, requested: int, bytes_per_expert: int, budget: int, notes: list) -> int:
    """E within the memory budget, but at least k and, if possible, several times the last-level cache."""
    cap = budget // bytes_per_expert
    if requested <= cap:
        return requested
    floor = max(shape.top_k, math.ceil(4 * llc_bytes() / bytes_per_expert))
    E = max(cap, min(requested, floor))
    notes.append(f"E capped {requested} -> {E} by --mem-budget-gb {budget / GB:.1f} "
                 f"({bytes_per_expert / 1e6:.1f} MB per expert); routing is uniform over these {E}")
    return E


def fmt_row(r: dict) -> str:
    def opt(key, fmt, width):
        return format(r[key], fmt) if r.get(key) is not None else f"{'-':>{width}}"

    return (f"{r['shape']:14s} {r['format']:5s} {r['routing']:7s} {r['path']:12s} {r['T']:5d} {r['E']:4d} "
            f"{r['ms']:9.3f} {r['gbps']:7.1f} "
            f"{r['pct_stream']:6.1f}% {r['tflops']:7.3f} {r['tflops'] * 1e3:8.1f} "
            f"{opt('ours_same_routing_ms', '10.2f', 10)} {opt('torch_ms', '9.2f', 9)} {opt('speedup', '7.2f', 7)}x")


HEADER = (f"{'shape':14s} {'fmt':5s} {'routing':7s} {'path':12s} {'T':>5s} {'E':>4s} {'ms':>9s} {'GB/s':>7s} "
          f"{'%STREAM':>7s} {'TFLOPS':>7s} "
          f"{'GFLOPS':>8s} {'ours@base':>10s} {'torch ms':>9s} {'speedup':>8s}")


def run_kernel_bench(args) -> int:
    quick = bool(args.quick)
    shapes = [SHAPES[n] for n in (args.shapes or (["qwen3-30b-a3b"] if quick else list(SHAPES)))]
    formats = args.formats or list(cpu.WEIGHT_FORMATS)  # the GGUF formats when asked for
    tokens = args.tokens or ([1, 32] if quick else [1, 4, 32, 512, 2048])
    repeats = args.repeats or (3 if quick else 5)
    warmup = WARMUP if args.warmup is None else args.warmup
    routing_kinds = args.routing or ["uniform"]
    n_experts = args.experts or (16 if quick else None)
    budget = int((args.mem_budget_gb * GB) if args.mem_budget_gb else 0.45 * mem_total_bytes())
    isa = args.isa
    check_isa(isa)
    # Human output goes to stderr when the JSON goes to stdout.
    log = sys.stderr if args.json == "-" else sys.stdout
    say = lambda *a: print(*a, file=log, flush=True)  # noqa: E731

    pool = cpu.shared_pool(args.threads)
    torch.set_num_threads(pool.threads)
    machine = machine_info(pool)
    say(f"hetmoe bench kernel  {machine['date']}  {machine['hostname']}  commit {machine['commit'] or '?'}")
    say(f"cpu: {machine['cpu_model']} [{machine['cpu_flags']}], {pool.threads} threads pinned to {pool.pinned_cpus}, "
        f"torch {machine['torch']} with {torch.get_num_threads()} threads")

    # Large enough to defeat the caches even under a small budget.
    stream_bytes = max(min(2 << 30, budget // 4), 8 * llc_bytes()) // (1 << 20) * (1 << 20)
    stream = pool.read_bandwidth(stream_bytes, 5, None if isa in ("auto", cpu.AMX_EMULATED) else isa)
    say(f"STREAM read ({stream_bytes / GB:.2f} GB, {pool.threads} threads, best of 5): {stream:.1f} GB/s")
    amx_peak = amx_ratio = None
    if not cpu.cpu_info()["amx_unavailable"] and pool.subpools == 1:
        amx_peak = {d: pool.amx_peak(d) for d in ("bf16", "int8")}
        amx_ratio = amx_peak["bf16"] / amx_peak["int8"]
        # Reported, not asserted (a test did, and failed on a shared VM): the tile unit's nominal rate for bf16
        # is half that of int8; far from it, the probe was not measuring the tile unit alone.
        note = "" if 0.3 < amx_ratio < 0.7 else "  (nominal ~0.5: the probe shared the cores or was throttled)"
        say(f"AMX tile unit alone ({pool.threads} threads, tdp* on register tiles, best of 3): "
            f"bf16 {amx_peak['bf16']:.1f} TFLOPS, int8 {amx_peak['int8']:.1f} TOPS, bf16/int8 {amx_ratio:.2f}{note}")
    overhead = measure_overhead(pool)
    say(f"submit->sync round trip (T=0): median {overhead['median_us']:.1f} µs, p99 {overhead['p99_us']:.1f} µs")
    if not args.no_baseline:
        say(f"baseline: PyTorch loop over active experts on its own set of min(E, {BASELINE_EXPERTS}) experts "
            f"(same T, k, x; routing over that set); int8/int4 dequantized to bf16 per call; 'ours@base' is our "
            f"engine timed on that same routing, and speedup = torch ms / ours@base ms")
    say("")
    say(HEADER)

    gen = torch.Generator().manual_seed(0)
    records = []
    crossovers = []
    for shape in shapes:
        for fmt in formats:
            fkw = format_args(fmt, args.group_size)
            group = fkw["group_size"]
            H, I, k = shape.hidden, shape.inter, shape.top_k
            amx_kw = {} if args.amx_min_tokens is None else {"amx_min_tokens": args.amx_min_tokens}
            probe = cpu.CPUExperts(1, H, I, pool=pool, isa=isa, **fkw, **amx_kw)
            bpe = probe.info()["bytes_per_expert"]
            del probe
            notes = []
            E = choose_experts(shape, n_experts or shape.n_expert, bpe, budget, notes)
            if E * bpe < 4 * llc_bytes():
                notes.append(f"all {E} experts ({E * bpe / 1e6:.0f} MB) fit in 4x the last-level cache: "
                             "weights may come from cache, GB/s can exceed DRAM")
            experts = cpu.CPUExperts(E, H, I, pool=pool, isa=isa, **fkw, **amx_kw)
            if args.random_packed or "grid" in str(fkw["weight_format"]):  # (grid: a file's blocks, never floats)
                experts.fill_random(seed=len(records) + 1)
            else:
                load_random(experts, f"{shape.name} {fmt}", gen)
            info = experts.info()
            baseline = None
            if not args.no_baseline:
                # GGUF formats' affine values are not symmetric codes: the loop holds them as bf16
                baseline = TorchLoopExperts(experts, min(E, BASELINE_EXPERTS),
                                            "bf16" if fmt in GGUF_FORMATS or fmt in FP8_FORMATS
                                            or fmt in ZP_FORMATS else fmt,
                                            group)
                xc = torch.randn(CHECK_TOKENS, H, generator=gen).bfloat16()
                ids_c, w_c = random_routing(CHECK_TOKENS, len(baseline.weights), k, gen)
                ours, ref = experts.forward(xc, ids_c, w_c).float(), baseline.forward(xc, ids_c, w_c)
                check = ((ours - ref).norm() / ref.norm()).item()
                notes.append(f"rel. error vs the torch loop at T={CHECK_TOKENS}: {check:.2e}"
                             + ("  <-- WARNING: large" if check > 0.05 else ""))
            groups = f"group {group}" + (f"/{info['down_group_size']}" if info["down_group_size"] != group else "")
            down = info["down_kernel"]
            kernels = info["kernel"] + (f" + down {down}" if down != info["kernel"] else "")
            say(f"# {shape.name} {fmt}: H {H}, I {I}, E {E}, k {k}, kernel {kernels} (isa {info['isa']}, "
                f"activations {info['activation']}{', ' + groups if fmt != 'bf16' else ''}), "
                f"{bpe / 1e6:.2f} MB per expert")
            if info["amx"] != "off":
                say(f"#   AMX ({info['amx']}): experts with >= {info['amx_min_tokens']} tokens run "
                    f"{info['amx_kernel']} (activations {info['amx_activation']}), the others {info['kernel']}")
            paths = kernel_amx.paths_of(experts, args.compare_avx512)
            for note in notes:
                say(f"#   note: {note}")

            points = [(T, r, p) for T in tokens for r in routing_kinds for p in paths]
            for T, routing, (path, threshold) in points:
                if threshold == kernel_amx.NEVER and T > args.compare_max_tokens:
                    continue  # the row-block path at very long prompts costs more time than it tells
                if threshold is not None:
                    experts.amx_min_tokens = threshold
                n_calls = warmup + repeats
                rgen = torch.Generator().manual_seed(T * 7919 + len(routing))  # same routings for every path
                routings = [kernel_amx.make_routing(routing, T, E, k, rgen)
                            for _ in range(max(N_ROUTINGS, n_calls))]
                x = torch.randn(T, H, generator=rgen).bfloat16()
                out = torch.empty(T, H, dtype=torch.bfloat16)
                def call(i):
                    if args.profile and i == warmup:
                        experts.set_profiling(True)  # the timed calls only (a first call also faults pages in)
                    experts.forward(x, *routings[i % len(routings)], out)

                times = time_calls(call, repeats, warmup)
                stages = experts.profile() if args.profile else None
                experts.set_profiling(False)
                # The calls timed are routings[warmup:n_calls]: bytes are their distinct experts.
                distinct = statistics.mean(routings[i][0].unique().numel() for i in range(warmup, n_calls))
                ms = statistics.median(times) * 1e3
                nbytes = distinct * bpe
                flops = 2 * 3 * H * I * T * k
                rec = {
                    "shape": shape.name, "format": fmt, "T": T, "E": E, "E_named": shape.n_expert, "k": k,
                    "H": H, "I": I, "group_size": group if fmt != "bf16" else None, "kernel": info["kernel"],
                    "down_kernel": info["down_kernel"], "down_group_size": info["down_group_size"],
                    "isa": info["isa"], "activation": info["activation"], "threads": pool.threads,
                    "routing": routing, "path": path, "amx_min_tokens": threshold,
                    "amx_kernel": info.get("amx_kernel") if threshold != kernel_amx.NEVER else None,
                    "bytes_per_expert": bpe, "ms": ms, "ms_all": [t * 1e3 for t in times],
                    "distinct_experts": distinct, "bytes": nbytes, "gbps": nbytes / (ms * 1e-3) / GB,
                    "pct_stream": 100 * nbytes / (ms * 1e-3) / GB / stream, "flops": flops,
                    "tflops": flops / (ms * 1e-3) / 1e12, "torch_ms": None, "speedup": None, "notes": notes,
                }
                if baseline is not None and routing == "uniform" and path == paths[0][0]:
                    broutings = [random_routing(T, len(baseline.weights), k, gen) for _ in range(len(routings))]
                    btimes = time_calls(lambda i: baseline.forward(x, *broutings[i % len(broutings)]), repeats,
                                        warmup)
                    # The ratio compares equal work: our engine again, on the baseline's routings and experts.
                    stimes = time_calls(lambda i: experts.forward(x, *broutings[i % len(broutings)], out), repeats,
                                        warmup)
                    rec["torch_ms"] = statistics.median(btimes) * 1e3
                    rec["torch_ms_all"] = [t * 1e3 for t in btimes]
                    rec["ours_same_routing_ms"] = statistics.median(stimes) * 1e3
                    rec["torch_experts"] = len(baseline.weights)
                    rec["speedup"] = rec["torch_ms"] / rec["ours_same_routing_ms"]
                    rec["check_rel_err"] = check
                if stages is not None:
                    rec["stages_ms"] = stages["ms"]
                    rec["stages_jobs"] = stages["jobs"]
                records.append(rec)
                say(fmt_row(rec))
                if stages is not None:
                    say("    stages (ms per timed call): " + "  ".join(
                        f"{st} {v:.3f}" for st, v in stages["ms"].items()))
            if paths[0][1] is not None:
                experts.amx_min_tokens = paths[0][1]
                if args.crossover:
                    crossovers.append({"shape": shape.name, "format": fmt, "E": E,
                                       **kernel_amx.crossover(experts, k, say, repeats, warmup, time_calls)})
            experts = baseline = None  # free this shape's packed experts before the next shape is built

    if args.json:
        doc = {"machine": machine, "stream_gbps": stream, "stream_bytes": stream_bytes, "overhead": overhead,
               "amx_peak_tflops": amx_peak, "amx_peak_bf16_over_int8": amx_ratio,
               "crossover": crossovers,
               "config": {"repeats": repeats, "warmup": warmup, "routing": routing_kinds, "mem_budget_bytes": budget,
                          "isa": isa,
                          "baseline_experts": None if args.no_baseline else BASELINE_EXPERTS},
               "records": records}
        write_json(args.json, doc, say)
    return 0
