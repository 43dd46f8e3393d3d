"""``hetmoe bench e2e --gpu-experts-sweep 0,16,32,64,96,112,all``: the hybrid placement with N routed experts of every
MoE layer resident on the GPU, for each N of the list, in one table: batch-1 decode after the shortest prompt and
prefill at each prompt length (``--prompt-tokens``, default 512,8192), with the resident bytes, the layerwise
prefill's token threshold as loaded (off where every expert is resident) and the decode roofline of the e2e bench
(the bytes a token still reads from CPU DRAM at that N are not in it: the column shows the all-CPU roofline).

Each N is a fresh load with ``--gpu-experts N`` (the plan, the layerwise prefill and its measured threshold as a
user's run gets them): ``all`` is the model's experts per layer. The e2e bench's other options apply (the model or
shape, formats, ``--gpu-prefill``, ``--repeats``, ``--json``).
"""

from __future__ import annotations

import dataclasses
import gc

import torch

from hetmoe import cpu
from hetmoe.bench.machine import GB, machine_info, write_json

DEFAULT_PROMPTS = [512, 8192]


def parse_sweep(text: str) -> list:
    """"0,16,all" -> [0, 16, "all"]: integers >= 0 and ``all``, each once."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if part == "all":
            value = part
        else:
            try:
                value = int(part)
            except ValueError:
                raise ValueError(f"--gpu-experts-sweep: expected integers >= 0 or 'all', got {part!r}") from None
            if value < 0:
                raise ValueError(f"--gpu-experts-sweep: expected integers >= 0 or 'all', got {part!r}")
        if value in out:
            raise ValueError(f"--gpu-experts-sweep: {part} is listed twice")
        out.append(value)
    if not out:
        raise ValueError("--gpu-experts-sweep: expected a comma-separated list, e.g. 0,16,32,64,96,112,all")
    return out


def experts_per_layer(args, shape) -> int:
    """E of the model's MoE layers, from its config alone (no weight read)."""
    from hetmoe.load.loader import check_model_dir
    from hetmoe.load.random_weights import shape_config

    cfg = check_model_dir(args.model) if args.model else shape_config(shape)
    return int(cfg.first("num_experts", "n_routed_experts", "num_local_experts"))


def resolve(counts: list, n_experts: int) -> list:
    """The sweep's counts with ``all`` as ``n_experts``; a count above it refused before anything loads."""
    out = [n_experts if n == "all" else n for n in counts]
    over = [n for n in out if n > n_experts]
    if over:
        raise ValueError(f"--gpu-experts-sweep {','.join(map(str, over))}: the MoE layers have {n_experts} routed "
                         f"experts each; at most {n_experts} can stay on the GPU")
    return sorted(set(out))


def fmt_sweep(records: list, prompts: list) -> list:
    head = (f"{'N':>5s} {'resident':>9s} {'gpu-prefill':>11s} {'decode':>8s} "
            + " ".join(f"{'prefill@' + str(n):>13s}" for n in prompts))
    units = f"{'':>5s} {'GiB':>9s} {'from T':>11s} {'tok/s':>8s} " + " ".join(f"{'tok/s':>13s}" for _ in prompts)
    lines = [head, units]
    for r in records:
        pre = {p["tokens"]: p["tok_s"] for p in r["prefill"]}
        lw = "off" if r["gpu_prefill_min_tokens"] is None else str(r["gpu_prefill_min_tokens"])
        lines.append(f"{r['gpu_experts']:5d} {r['resident_bytes'] / 2**30:9.2f} {lw:>11s} {r['decode_tok_s']:8.2f} "
                     + " ".join(f"{pre.get(n, float('nan')):13.1f}" for n in prompts))
    return lines


def run_sweep(args, shape, layers, log, say) -> int:
    """The sweep (see the module docstring); ``shape``, ``layers``: as the e2e bench resolved them."""
    from hetmoe.bench.e2e import DECODE_WARMUP, bench_options, build_model, expert_pool, measure
    from hetmoe.bench.machine import llc_bytes
    from hetmoe.plan.sysmem import free_ram

    if not torch.cuda.is_available():
        raise RuntimeError("--gpu-experts-sweep needs a CUDA device (the resident experts live there)")
    if args.device not in ("auto", "cuda"):
        raise ValueError(f"--gpu-experts-sweep runs the hybrid placement; --device {args.device} does not")
    if args.gpu_experts not in (0, None):
        raise ValueError("--gpu-experts-sweep sets --gpu-experts for each run; give one or the other")
    counts = resolve(parse_sweep(args.gpu_experts_sweep), experts_per_layer(args, shape))
    prompts = args.prompt_tokens or DEFAULT_PROMPTS
    decode_tokens = args.decode_tokens or 32
    repeats = args.repeats or 2
    need = max(max(prompts), min(prompts) + DECODE_WARMUP + decode_tokens)
    max_context = args.max_context or need
    pool = cpu.shared_pool(args.threads)
    machine = machine_info(pool)
    machine["gpu"] = torch.cuda.get_device_name(0)
    say(f"hetmoe bench e2e --gpu-experts-sweep  {machine['date']}  {machine['hostname']}  commit "
        f"{machine['commit'] or '?'}; gpu: {machine['gpu']}")
    say(f"model: {args.model or shape}; N = {counts}; prompts {prompts}, decode {decode_tokens} tokens after "
        f"{min(prompts)}, median of {repeats}")
    records = []
    for n in counts:
        torch.cuda.reset_peak_memory_stats()
        options = dataclasses.replace(bench_options(args, "cuda", max_context), gpu_experts=n)
        loaded = build_model(args, shape, layers, options, log)
        try:
            epool = expert_pool(loaded, pool)
            stream_bytes = max(min(2 << 30, free_ram() // 4), 8 * llc_bytes()) // (1 << 20) * (1 << 20)
            stream = epool.read_bandwidth(stream_bytes, 3)
            rec = {"gpu_experts": n, "resident_bytes": (loaded.info.get("gpu_experts") or {}).get("bytes", 0),
                   "gpu_prefill_min_tokens": loaded.layerwise.min_tokens if loaded.layerwise is not None else None,
                   "gpu_prefill": loaded.info.get("gpu_prefill"), "stream_gbps": stream, "threads": epool.threads,
                   "experts_format": loaded.plan.experts_format,
                   **measure(loaded, prompts, decode_tokens, repeats, stream, args.seed),
                   "gpu_peak_bytes": torch.cuda.max_memory_allocated()}
        finally:
            del loaded
            gc.collect()
            torch.cuda.empty_cache()
        records.append(rec)
        pre = ", ".join(f"prefill@{p['tokens']} {p['tok_s']:.1f}" for p in rec["prefill"])
        say(f"N={n}: decode {rec['decode_tok_s']:.2f} tok/s, {pre} tok/s (GPU peak "
            f"{rec['gpu_peak_bytes'] / GB:.1f} GB)")
    say("")
    for line in fmt_sweep(records, prompts):
        say(line)
    if args.json:
        doc = {"machine": machine, "config": {"model": args.model, "shape": shape, "layers": layers,
                                              "sweep": counts, "prompt_tokens": prompts,
                                              "decode_tokens": decode_tokens, "repeats": repeats,
                                              "max_context": max_context, "seed": args.seed},
               "records": records}
        write_json(args.json, doc, say)
    return 0
