"""NUMA tensor parallelism benchmark: one pool vs the same threads cut into subpools, experts split along I.

    python -m hetmoe.bench.numa --shape deepseek-v3 --experts 64 --threads 16 --formats int8,bf16 \\
        --tokens 1,4,32,512 --json out.json

Both engines are built in the same process on the same cores, with random packed weights of the same
distribution (``fill_random``), and timed in alternating rounds (warm-up call, then ``repeats`` timed calls per
round; a fresh uniform routing per call so decode reads its experts from DRAM). Per (format, T): median ms of
each, the split engine's overhead (split / single - 1), GB/s of expert weights streamed and % of the STREAM-read
bandwidth measured by each configuration in the same run, TFLOPS (2 x 3 x H x I per (token, expert) pair). The
submit -> sync round trip of an empty job (T = 0) shows the fixed cost of the fan-out.

On a one-node machine the split cannot remove remote reads (there are none): it shows what tensor parallelism
costs where it cannot help. On a multi-node machine the same run shows what it gains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from hetmoe import cpu
from hetmoe.bench.kernel import DEFAULT_GROUP, SHAPES, measure_overhead, random_routing
from hetmoe.bench.machine import machine_info
from hetmoe.cpu.numa import describe, topology

GB = 1e9


def _time_round(experts, x, routings, start: int, calls: int, out) -> list:
    """One warm-up call, then ``calls`` timed ones (seconds), each on the next routing."""
    times = []
    for i in range(calls + 1):
        ids, w = routings[(start + i) % len(routings)]
        t0 = time.perf_counter()
        experts.forward(x, ids, w, out)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def run(args) -> dict:
    say = lambda *a: print(*a, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    shape = SHAPES[args.shape]
    H, I, k = shape.hidden, shape.inter, shape.top_k
    E = args.experts or shape.n_expert
    configs = {"single": cpu.WorkerPool(args.threads, numa="off"),
               f"split{args.subpools}": cpu.WorkerPool(args.threads, numa=args.subpools)}
    names = list(configs)
    split_pool = configs[names[1]]
    machine = machine_info(configs["single"])
    say(f"hetmoe bench numa  {machine['date']}  {machine['hostname']}  commit {machine['commit'] or '?'}")
    say(f"cpu: {machine['cpu_model']}, best isa {machine['best_isa']}, {machine['physical_cores']} cores")
    for line in describe(split_pool):
        say(line)
    stream = {n: p.read_bandwidth(args.stream_gb * GB, 3) for n, p in configs.items()}
    overhead = {n: measure_overhead(p, iters=300, warmup=50) for n, p in configs.items()}
    for n in names:
        say(f"{n:8s}: {configs[n].threads} threads in {configs[n].subpools} pool(s); STREAM read {stream[n]:.1f} GB/s; "
            f"submit->sync T=0 median {overhead[n]['median_us']:.1f} us, p99 {overhead[n]['p99_us']:.1f} us")
    say(f"\n{args.shape}: H {H}, I {I}, E {E}, k {k}; overhead = split ms / single ms - 1")
    say(f"{'fmt':5s} {'T':>5s} " + " ".join(f"{n + ' ms':>12s} {'GB/s':>6s} {'%STR':>5s} {'TFLOPS':>6s}" for n in names)
        + f" {'overhead':>9s}")
    gen = torch.Generator().manual_seed(0)
    records = []
    doc = {"machine": machine, "topology": topology(), "numa_plans": split_pool.numa_plans,
           "numa_binding": split_pool.numa_binding, "stream_gbps": stream, "overhead_us": overhead,
           "config": vars(args), "records": records}
    for fmt in args.formats:
        if time.perf_counter() - t_start > args.budget_s:
            say(f"{fmt}: skipped, time budget spent")
            continue
        group = DEFAULT_GROUP[fmt]
        experts = {}
        for n, pool in configs.items():
            ex = cpu.CPUExperts(E, H, I, fmt, group, pool=pool)
            ex.fill_random(seed=1, std=0.02)
            experts[n] = ex
        info = experts[names[1]].info()
        bpe = info["bytes_per_expert"]
        for T in args.tokens:
            if time.perf_counter() - t_start > args.budget_s:
                say(f"{fmt} T={T}: skipped, time budget spent")
                break
            big = T >= 256
            rounds, calls = (2, max(1, args.repeats // 2)) if big else (3, args.repeats)
            routings = [random_routing(T, E, k, gen) for _ in range(max(8, rounds * (calls + 1)))]
            x = torch.randn(T, H, generator=gen).bfloat16()
            out = torch.empty(T, H, dtype=torch.bfloat16)
            times = {n: [] for n in names}
            for r in range(rounds):
                for n in names:
                    times[n] += _time_round(experts[n], x, routings, r * (calls + 1), calls, out)
            distinct = statistics.mean(ids.unique().numel() for ids, _ in routings)
            rec = {"format": fmt, "T": T, "E": E, "H": H, "I": I, "k": k,
                   "group_size": group if fmt != "bf16" else None,
                   "kernel": info["kernel"], "amx": info.get("amx"), "numa_slices": info["numa_slices"],
                   "bytes_per_expert": bpe, "distinct_experts": distinct, "flops": 2 * 3 * H * I * T * k}
            for n in names:
                ms = statistics.median(times[n]) * 1e3
                rec[n] = {"ms": ms, "ms_all": [t * 1e3 for t in times[n]], "gbps": distinct * bpe / (ms * 1e-3) / GB,
                          "pct_stream": 100 * distinct * bpe / (ms * 1e-3) / GB / stream[n],
                          "tflops": rec["flops"] / (ms * 1e-3) / 1e12}
            rec["overhead"] = rec[names[1]]["ms"] / rec[names[0]]["ms"] - 1
            records.append(rec)
            say(f"{fmt:5s} {T:5d} " + " ".join(f"{rec[n]['ms']:12.3f} {rec[n]['gbps']:6.1f} "
                                               f"{rec[n]['pct_stream']:5.1f} {rec[n]['tflops']:6.2f}" for n in names)
                + f" {100 * rec['overhead']:+8.1f}%")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(doc, f, indent=1)
        del experts
    doc["elapsed_s"] = time.perf_counter() - t_start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        say(f"wrote {args.json}")
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hetmoe.bench.numa", description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3")
    p.add_argument("--experts", type=int, default=64, help="E (default: 64)")
    p.add_argument("--threads", type=int, default=None, help="threads in all (default: physical cores)")
    p.add_argument("--subpools", type=int, default=2, help="subpools of the split engine (default: 2)")
    p.add_argument("--formats", type=lambda s: s.split(","), default=["int8", "bf16", "int4"])
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 32, 512])
    p.add_argument("--repeats", type=int, default=5, help="timed calls per round (halved for T >= 256)")
    p.add_argument("--stream-gb", type=float, default=2.0, help="buffer of the STREAM-read probe")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining points after this many seconds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for f in args.formats:
        if f not in cpu.WEIGHT_FORMATS:
            p.error(f"unknown format {f}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
