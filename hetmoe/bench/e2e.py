"""``hetmoe bench e2e``: prefill and decode of a whole model, per placement, against the decode roofline.

The model is a real shape with random weights (``hetmoe.load.random_weights.SHAPES``, built in memory) or a checkpoint
directory. For each placement — ``cpu`` (everything on the CPU) and ``hybrid`` (routed experts on the CPU, the rest
on the GPU); ``--device auto`` runs both where there is a GPU, building the model once per placement — it reports:

* prefill tok/s per prompt length (random token ids; one warm-up prefill, then the median of ``--repeats``);
* decode tok/s at batch 1 over ``--decode-tokens`` steps after a prompt (random token ids, timed with the GPU
  synchronized; the median of ``--repeats`` runs);
* the decode roofline: the bytes a decoded token must read from CPU DRAM — per MoE layer its top_k routed experts
  x bytes per packed expert, plus, on the CPU alone, every dense weight but the embedding (a one-row gather) —
  divided into the STREAM-read bandwidth the engine's pool measures in the same run, just before that placement's
  timings (the model resident); and the measured decode rate as a % of it, with the GB/s it streamed.

The KV cache is not in the roofline bytes; the engine attends over all ``max_context`` cache positions of a slot,
so ``max_context`` defaults to what the run needs (longest prompt, or shortest prompt + decode steps).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import sys
import time
from typing import Optional

import torch

from hetmoe import cpu, envs
from hetmoe.bench.decode_variants import decode_variants, fmt_variants
from hetmoe.bench.long_context import kv_contexts
from hetmoe.bench.machine import GB, llc_bytes, machine_info, write_json
from hetmoe.bench.prefill import prefill_paths, time_prefill
from hetmoe.config.flags import engine_options
from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.dense import packed_bytes
from hetmoe.load.loader import LoadedModel, load_model, moe_blocks
from hetmoe.load.random_weights import SHAPES, build_random_model
from hetmoe.plan import vram_cap
from hetmoe.plan.placement import dense_name
from hetmoe.plan.sysmem import free_ram

DEFAULT_SHAPE = "qwen3-30b-a3b"
DECODE_WARMUP = 2  # untimed decode steps before each timed run
QUICK = {"layers": 2, "prompt_tokens": [16, 64], "decode_tokens": 8, "repeats": 1, "experts_format": "int4"}
DEFAULTS = {"prompt_tokens": [128, 1024], "decode_tokens": 128, "repeats": 3}
PLACEMENT = {"cpu": "cpu", "cuda": "hybrid"}



def expert_pool(loaded, fallback: cpu.WorkerPool) -> cpu.WorkerPool:
    """The pool the model's routed experts run on, else ``fallback``."""
    for _, layer in moe_blocks(loaded.model):
        if layer.engine is not None:
            return layer.engine.pool
    return fallback

def placements(device: str) -> list:
    """The devices to run: ``auto`` is both the CPU alone and the hybrid placement when a GPU is present."""
    if device == "auto":
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [device]


def roofline_bytes(loaded: LoadedModel) -> dict:
    """Bytes one decoded token (batch 1) must read from CPU DRAM: top_k experts per MoE layer, plus the dense
    weights (all parameters but the embedding) when the dense part is on the CPU."""
    cfg = loaded.config
    per_layer = []
    for _, layer in moe_blocks(loaded.model):
        experts = layer.experts
        info = experts.info()
        per_layer.append((min(cfg.num_experts_per_tok, experts.num_experts), info["bytes_per_expert"], info))
    expert_bytes = sum(k * bpe for k, bpe, _ in per_layer)
    dense = sum(p.numel() * p.element_size() for n, p in loaded.model.named_parameters()
                if n != "model.embed_tokens.weight") + packed_bytes(loaded.model)
    on_cpu = loaded.device.type == "cpu"
    first = per_layer[0][2] if per_layer else {}
    return {
        "moe_layers": len(per_layer), "top_k": cfg.num_experts_per_tok,
        "bytes_per_expert": per_layer[0][1] if per_layer else 0, "kernel": first.get("kernel"),
        "isa": first.get("isa"), "expert_bytes_per_token": expert_bytes,
        "dense_bytes_per_token": dense if on_cpu else 0, "dense_bytes": dense,
        "bytes_per_token": expert_bytes + (dense if on_cpu else 0),
        "dense_format": loaded.plan.dense_format,
        "dense_label": dense_name(loaded.plan.dense_format, loaded.plan.dtype),  # "bf16" in fp32 is fp32
    }


def time_decode(runner: Runner, prompt: int, steps: int, gen: torch.Generator) -> list:
    """Seconds of each of ``steps`` decode steps (random tokens) after a ``prompt``-token prefill and
    DECODE_WARMUP untimed steps."""
    runner.prefill(torch.randint(runner.vocab_size, (prompt,), generator=gen).tolist())
    tokens = torch.randint(runner.vocab_size, (DECODE_WARMUP + steps,), generator=gen).tolist()
    times = []
    for i, tok in enumerate(tokens):
        runner.synchronize()
        t0 = time.perf_counter()
        runner.decode(tok)
        runner.synchronize()
        if i >= DECODE_WARMUP:
            times.append(time.perf_counter() - t0)
    return times


def measure(loaded: LoadedModel, prompts: list, decode_tokens: int, repeats: int, stream_gbps: float,
            seed: int) -> dict:
    runner = Runner(loaded)
    gen = torch.Generator().manual_seed(seed)
    roof = roofline_bytes(loaded)
    prefill = []
    for n in prompts:
        times = time_prefill(runner, n, repeats, gen)
        s = statistics.median(times)
        prefill.append({"tokens": n, "tok_s": n / s, "ms": s * 1e3, "ms_all": [t * 1e3 for t in times]})
    runs = [time_decode(runner, min(prompts), decode_tokens, gen) for _ in range(repeats)]
    rates = [len(r) / sum(r) for r in runs]
    tok_s = statistics.median(rates)
    steps = sorted(t for r in runs for t in r)
    nbytes = roof["bytes_per_token"]
    roofline = stream_gbps * GB / nbytes if nbytes else None
    del runner
    return {
        **roof,
        "prefill": prefill,
        "decode_tok_s": tok_s, "decode_tok_s_all": rates, "ms_per_token": 1e3 / tok_s,
        "decode_step_ms_median": statistics.median(steps) * 1e3,
        "decode_step_ms_p90": steps[min(len(steps) - 1, int(0.9 * len(steps)))] * 1e3,
        "roofline_tok_s": roofline, "pct_roofline": 100 * tok_s / roofline if roofline else None,
        "gbps_effective": nbytes * tok_s / GB,
    }


def bench_options(args, device: str, max_context: int) -> EngineOptions:
    fmt = QUICK["experts_format"] if args.quick and args.experts_format == "auto" else args.experts_format
    return dataclasses.replace(engine_options(args), device=device, experts_format=fmt, max_context=max_context)


def build_model(args, shape: Optional[str], layers: Optional[int], options: EngineOptions, log) -> LoadedModel:
    if args.model:
        cache = None if args.expert_cache == "off" else args.expert_cache
        return load_model(args.model, options, expert_cache=cache, progress=sys.stderr.isatty(), log=log)
    return build_random_model(shape, layers, options, seed=args.seed, log=log)


def gpu_peak(loaded: LoadedModel) -> dict:
    """The GPU's peak allocation since the last reset, beside the VRAM budget the plan was made for, and the peak
    VRAM the process held: torch's peak reserved (its caching allocator's segments) plus what it holds outside
    torch now (the CUDA context, cuBLAS workspaces, ...: used on the device by mem_get_info less torch's reserved;
    other processes on the GPU count too). With --gpu-memory, the cap it is held to and torch's allocator limit
    under it (hetmoe/plan/vram_cap.py: what was outside torch when the plan was made, what was kept for it)."""
    budget = loaded.plan.budgets.get("VRAM", (None,))[0]
    free, total = torch.cuda.mem_get_info()
    outside = max(0, total - free - torch.cuda.memory_reserved())
    reserved = torch.cuda.max_memory_reserved()
    lim = loaded.plan.vram_limit
    cap = loaded.options.gpu_memory
    return {"gpu_peak_bytes": torch.cuda.max_memory_allocated(), "gpu_budget_bytes": budget,
            "gpu_peak_reserved_bytes": reserved, "gpu_outside_torch_bytes": outside,
            "gpu_peak_vram_bytes": reserved + outside, "gpu_total_bytes": total, "gpu_cap_bytes": cap,
            "gpu_within_cap": None if cap is None else reserved + outside <= cap,
            "gpu_torch_limit_bytes": lim.limit if lim else None,
            "gpu_outside_at_plan_bytes": lim.outside if lim else None,
            "gpu_outside_reserve_bytes": lim.reserve if lim else None,
            "gpu_expandable_segments": lim.expandable if lim else None,
            "alloc_env": envs.snapshot(envs.ALLOC_VARS)}


def vram_verdict(rec: dict) -> str:
    """The peak VRAM line's verdict: against --gpu-memory where given (the cap the run is held to), else against the
    plan's budget (what was free, less a margin)."""
    vram, cap, budget = rec["gpu_peak_vram_bytes"], rec["gpu_cap_bytes"], rec["gpu_budget_bytes"]
    if cap is not None:
        limit = rec["gpu_torch_limit_bytes"]
        held = ("" if limit is None else f"; torch held to {limit / 2**30:.2f} GiB, "
                f"{rec['gpu_outside_at_plan_bytes'] / 2**30:.2f} GiB was outside torch at the plan")
        return (f"--gpu-memory {cap / 2**30:.2f} GiB{held}: " + ("within the cap" if vram <= cap else "OVER THE CAP"))
    if budget is None:
        return "no VRAM budget in the plan"
    return f"the plan's budget {budget / 2**30:.2f} GiB: " + ("within the budget" if vram <= budget else
                                                                "OVER THE BUDGET")


def experts_layout(loaded) -> Optional[str]:
    """How the first MoE layer's CPU experts hold gate/up and down, where that differs between them or is affine
    (a GGUF file's K-quants: "gate/up int4 affine g32, down int8 g16"); None for one symmetric format."""
    engine = next((m.engine for _, m in moe_blocks(loaded.model) if m.engine is not None), None)
    if engine is None:
        return None
    info = engine.info()
    gu = (info["weight_format"], info["group_size"], info["gate_up_scaling"])
    down = (info["down_weight_format"], info["down_group_size"], info["down_scaling"])
    if gu == down and gu[2] == "symmetric":
        return None

    def name(fmt, group, scaling):
        kind = f"{fmt} affine" if scaling != "symmetric" else fmt
        return kind if group is None else f"{kind} per-row" if group == 0 else f"{kind} g{group}"

    return f"gate/up {name(*gu)}, down {name(*down)}"


def fmt_table(records: list, prompts: list) -> list:
    def num(v, spec):
        return format(v, spec) if v is not None else "-"

    head = (f"{'placement':9s} {'experts':7s} {'dtype':8s} {'layers':>6s} "
            + " ".join(f"{'prefill@' + str(n):>12s}" for n in prompts)
            + f" {'dense':>5s} {'decode':>8s} {'roofline':>9s} {'%roof':>6s} {'ms/tok':>8s} {'MB/tok':>8s}"
            f" {'GB/s eff':>8s} {'STREAM':>7s}")
    lines = [head, f"{'':9s} {'':7s} {'':8s} {'':6s} " + " ".join(f"{'tok/s':>12s}" for _ in prompts)
             + f" {'':>5s} {'tok/s':>8s} {'tok/s':>9s} {'':>6s} {'':>8s} {'':>8s} {'':>8s} {'GB/s':>7s}"]
    for r in records:
        pre = {p["tokens"]: p["tok_s"] for p in r["prefill"]}
        dense = r.get("dense_label", r.get("dense_format", "-"))
        lines.append(
            f"{r['placement']:9s} {r['experts_format']:7s} {r['dtype']:8s} {r['layers']:6d} "
            + " ".join(f"{num(pre.get(n), '12.1f'):>12s}" for n in prompts)
            + f" {dense:>5s} {r['decode_tok_s']:8.2f} {num(r['roofline_tok_s'], '9.2f'):>9s}"
            f" {num(r['pct_roofline'], '5.1f'):>5s}%"
            f" {r['ms_per_token']:8.1f} {r['bytes_per_token'] / 1e6:8.1f} {r['gbps_effective']:8.2f}"
            f" {r['stream_gbps']:7.1f}"
        )
    return lines


def run_e2e_bench(args) -> int:
    quick = bool(args.quick)
    if args.model and args.layers is not None:
        raise ValueError("--layers applies to --shape models only (a checkpoint is loaded whole)")
    shape = None if args.model else (args.shape or DEFAULT_SHAPE)
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known shapes: {', '.join(SHAPES)}")
    layers = args.layers if args.layers is not None else (QUICK["layers"] if quick and shape else None)
    if getattr(args, "gpu_experts_sweep", None):  # one table over resident expert counts (gpu_experts_sweep.py)
        from hetmoe.bench.gpu_experts_sweep import run_sweep

        out = sys.stderr if args.json == "-" else sys.stdout
        return run_sweep(args, shape, layers, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                         say=lambda *a: print(*a, file=out, flush=True))
    conf = QUICK if quick else DEFAULTS
    prompts = args.prompt_tokens or conf["prompt_tokens"]
    decode_tokens = args.decode_tokens or conf["decode_tokens"]
    repeats = args.repeats or conf["repeats"]
    need = max(max(prompts), min(prompts) + DECODE_WARMUP + decode_tokens)
    if args.max_context is not None and args.max_context < need:
        raise ValueError(f"--max-context {args.max_context} is too small for this run: it needs {need} positions "
                         f"(longest prompt, or shortest prompt + {DECODE_WARMUP} + --decode-tokens)")
    max_context = args.max_context or need
    devices = placements(args.device)
    if "cuda" in devices and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device (use --device cpu)")
    for d in devices:  # validate the options before any measurement
        bench_options(args, d, max_context)
    if "cuda" in devices and bench_options(args, "cuda", max_context).gpu_memory:
        vram_cap.prepare()  # before the first CUDA call below (the device's name): the allocator reads it once

    out = sys.stderr if args.json == "-" else sys.stdout  # the JSON alone on stdout when it goes there
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    pool = cpu.shared_pool(args.threads)
    machine = machine_info(pool)
    machine["torch_threads"] = torch.get_num_threads()
    machine["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    machine["cuda"] = torch.version.cuda
    # Threading settings that change CPU timings (OpenMP threads spin-waiting beside the pinned expert pool).
    machine["env"] = envs.snapshot()
    say(f"hetmoe bench e2e  {machine['date']}  {machine['hostname']}  commit {machine['commit'] or '?'}")
    say(f"cpu: {machine['cpu_model']} [{machine['cpu_flags']}], expert pool {pool.threads} threads pinned to "
        f"{pool.pinned_cpus}, torch {machine['torch']} with {machine['torch_threads']} threads"
        + (f"; gpu: {machine['gpu']}" if machine["gpu"] else ""))
    source = args.model or f"{shape} (random weights{f', {layers} layers' if layers else ''})"
    say(f"model: {source}; prompts {prompts} tokens, decode {decode_tokens} tokens after {min(prompts)}, "
        f"median of {repeats} repeats, max_context {max_context}"
        + (f", {args.defer_experts} experts deferred per token" if args.defer_experts else ""))

    records = []
    for device in devices:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loaded = build_model(args, shape, layers, bench_options(args, device, max_context), log)
        try:
            expert_total = loaded.info.get("expert_bytes", 0)
            notes = []
            if expert_total and expert_total < 4 * llc_bytes():
                notes.append(f"all routed experts ({expert_total / 1e6:.0f} MB) fit in 4x the last-level cache: "
                             "decode may read them from cache, above the DRAM roofline")
            # Measured alongside, with the model resident: the buffer defeats the caches and fits next to it.
            cap = (512 << 20) if quick else (2 << 30)
            stream_bytes = max(min(cap, free_ram() // 4), 8 * llc_bytes()) // (1 << 20) * (1 << 20)
            epool = expert_pool(loaded, pool)  # the hybrid placement's pool leaves cores to the GPU side
            stream = epool.read_bandwidth(stream_bytes, 5)
            say(f"{PLACEMENT[device]}: STREAM read ({stream_bytes / GB:.2f} GB, {epool.threads} threads, best of 5): "
                f"{stream:.1f} GB/s")
            layout = experts_layout(loaded)
            if layout:
                say(f"{PLACEMENT[device]}: routed experts held as {layout} (the table's format is the plan's widest)")
            rec = {
                "placement": PLACEMENT[device], "device": device, "model": source, "shape": shape,
                "experts_layout": layout,
                "layers": loaded.config.num_hidden_layers, "experts_format": loaded.plan.experts_format,
                "group_size": loaded.plan.group_size if loaded.plan.experts_format != "bf16" else None,
                "dtype": str(loaded.plan.dtype).replace("torch.", ""), "max_context": loaded.plan.max_context,
                "defer_experts": loaded.options.defer_experts,
                "build_s": loaded.info.get("load_s"), "expert_bytes_total": expert_total, "notes": notes,
                "stream_gbps": stream, "stream_bytes": stream_bytes, "threads": epool.threads,
                **measure(loaded, prompts, decode_tokens, repeats, stream, args.seed),
            }
            if device == "cuda" and loaded.layerwise is not None:
                say(f"{PLACEMENT[device]}: prefill by path (routed experts on the CPU / streamed to the GPU / auto, "
                    f"from {loaded.layerwise.min_tokens} tokens), {repeats} repeats:")
                rec["prefill_paths"] = prefill_paths(loaded, prompts, repeats, args.seed, log=say)
            if device == "cuda" and not getattr(args, "no_variants", False):  # eager / graph / deferral / GPU experts
                say(f"{PLACEMENT[device]}: decode variants, batch 1, {decode_tokens} steps x {repeats} after "
                    f"{min(prompts)} tokens:")
                rec["variants"] = decode_variants(
                    loaded, min(prompts), decode_tokens, repeats, rec["roofline_tok_s"], args.seed, log=say,
                    stream=lambda: epool.read_bandwidth(stream_bytes, 3), bytes_per_token=rec["bytes_per_token"],
                    only=getattr(args, "variants", None))
                if getattr(args, "kv_contexts", None):
                    say(f"{PLACEMENT[device]}: long contexts, graph decode at batch 1 and prefill attention, per "
                        "attention path (triton: paged cache and hetmoe's kernels; sdpa: contiguous cache):")
                    rec["kv_contexts"] = kv_contexts(loaded, args.kv_contexts, min(decode_tokens, 64), args.seed,
                                                     log=say)
            if device == "cuda":
                rec.update(gpu_peak(loaded))
                peak, budget = rec["gpu_peak_bytes"], rec["gpu_budget_bytes"]
                verdict = ("no VRAM budget in the plan" if budget is None else
                           f"the plan's VRAM budget: {budget / 2**30:.2f} GiB"
                           + ("" if peak <= budget else ", OVER THE BUDGET"))
                say(f"{PLACEMENT[device]}: GPU peak allocated {peak / 2**30:.2f} GiB (torch.cuda.max_memory_allocated "
                    f"over the load and every timing above); {verdict}")
                vram = rec["gpu_peak_vram_bytes"]
                say(f"{PLACEMENT[device]}: peak VRAM {vram / 2**30:.2f} GiB (torch's peak reserved "
                    f"{rec['gpu_peak_reserved_bytes'] / 2**30:.2f} GiB + {rec['gpu_outside_torch_bytes'] / 2**30:.2f} "
                    f"GiB outside torch, from torch.cuda.mem_get_info); {vram_verdict(rec)}")
            # Shared machines' bandwidth drifts over minutes: a second probe after all timings brackets the
            # roofline the rows were measured against.
            rec["stream_gbps_after"] = epool.read_bandwidth(stream_bytes, 5)
            say(f"{PLACEMENT[device]}: STREAM read after the timings: {rec['stream_gbps_after']:.1f} GB/s "
                f"(before: {stream:.1f})")
        finally:
            del loaded
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        records.append(rec)
        for note in notes:
            say(f"note ({rec['placement']}): {note}")

    say("")
    for line in fmt_table(records, prompts):
        say(line)
    for r in records:
        if r.get("variants"):
            say("")
            say(f"decode variants ({r['placement']}, {r['experts_format']} experts; step = GPU + CPU - overlap; "
                f"adj.roof: the roofline from the STREAM probed right before and after the variant's runs):")
            for line in fmt_variants(r["variants"]):
                say(line)
    per_placement = ", ".join(f"{r['placement']} {r['threads']}" for r in records)
    say(f"roofline = STREAM read GB/s (measured per placement, column STREAM) / bytes per decoded token (MB/tok: "
        f"top_k x bytes per expert x MoE layers; cpu adds every dense weight but the embedding, in its dense "
        f"format); "
        f"expert threads per placement: {per_placement}; {machine['torch_threads']} torch threads")

    if args.json:
        doc = {"machine": machine, "threads": pool.threads,
               "config": {"model": args.model, "shape": shape, "layers": layers, "prompt_tokens": prompts,
                          "decode_tokens": decode_tokens, "decode_warmup": DECODE_WARMUP, "repeats": repeats,
                          "max_context": max_context, "seed": args.seed, "device": args.device,
                          "defer_experts": args.defer_experts},
               "records": records}
        write_json(args.json, doc, say)
    return 0
