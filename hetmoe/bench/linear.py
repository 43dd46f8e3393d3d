"""Dense linears on the CPU engine (hetmoe/cpu/linear.py) against the DRAM bandwidth measured in the same run.

Decode (T <= 16): ms per call (the engine's run of a bound call, Python's argument checks left out) and GB/s of
packed weights streamed, % of the STREAM-read bandwidth of the same pool; matrices smaller than 8x the last-level
cache are cycled through enough copies that every call reads DRAM. Prefill (larger T): GFLOPS (2 N K T per call).
Median of repeats after warm-up.

    python -m hetmoe.bench.linear --threads 2 --shape 4096x2048 --shape 151936x2048 --formats int8 int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hetmoe import cpu
from hetmoe.bench.machine import GB, llc_bytes


def time_call(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over repeats, after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(pool: cpu.WorkerPool, n: int, k: int, fmt: str, tokens: list, isa: str = "auto", repeats: int = 20,
            stream_gbps: float = 0.0, baseline: bool = True) -> list:
    """One record per T: ms, GB/s of weights, % of stream_gbps, GFLOPS, and torch's bf16 F.linear ms."""
    group = cpu.linear.dense_format(fmt, "cpu").group
    first = cpu.CPULinear(k, n, fmt, group, isa=isa, pool=pool)
    copies = max(1, min(64, -(-8 * llc_bytes() // first.nbytes)))  # a decode call must not find its weights cached
    linears = [first] + [cpu.CPULinear(k, n, fmt, group, isa=isa, pool=pool) for _ in range(copies - 1)]
    for i, lin in enumerate(linears):
        lin.fill_random(seed=i)
    gen = torch.Generator().manual_seed(0)
    # the baseline these linears replace: torch's bf16 matmul, over as many copies (same DRAM traffic pattern)
    dense = [lin.dequantized_weight().bfloat16() for lin in linears] if baseline else []
    out = []
    for T in tokens:
        x = torch.randn(T, k, generator=gen).bfloat16()
        y = torch.empty(T, n, dtype=torch.bfloat16)
        specs = [lin._bind(x, y, False, None)[0] for lin in linears]  # the engine's call, without Python's checks
        turn = [0]

        def call():
            i = turn[0] % copies
            linears[i]._lin.run(specs[i])
            turn[0] += 1

        s = time_call(call, repeats)
        base = time_call(lambda: torch.nn.functional.linear(x, dense[turn[0] % copies]), repeats) if dense else 0.0
        gbps = first.nbytes / s / GB
        out.append({"n": n, "k": k, "format": fmt, "T": T, "copies": copies, "ms": s * 1e3, "gbps": gbps,
                    "stream_pct": 100 * gbps / stream_gbps if stream_gbps else None, "gflops": 2 * n * k * T / s / 1e9,
                    "kernel": first.info()["kernel"], "amx": first.info()["amx"], "torch_bf16_ms": base * 1e3})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", action="append", default=None, help="NxK (out x in); repeatable")
    ap.add_argument("--formats", nargs="+", default=["int8", "int4"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 512])
    ap.add_argument("--isa", default="auto")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    pool = cpu.WorkerPool(args.threads, numa="off")
    stream = pool.read_bandwidth(1 << 30, 5)
    print(f"threads {pool.threads}, STREAM read {stream:.1f} GB/s")
    for shape in args.shape or ["4096x2048", "151936x2048"]:
        n, k = (int(v) for v in shape.lower().split("x"))
        for fmt in args.formats:
            for r in measure(pool, n, k, fmt, args.tokens, args.isa, args.repeats, stream):
                pct = f"{r['stream_pct']:5.1f}%" if r["T"] <= 16 else "      "
                print(f"{r['n']:>6}x{r['k']:<6} {fmt:4} T={r['T']:<4} {r['ms']:9.3f} ms  {r['gbps']:6.1f} GB/s {pct}"
                      f"  {r['gflops']:7.1f} GFLOPS  torch bf16 {r['torch_bf16_ms']:8.3f} ms  {r['kernel']} "
                      f"(amx {r['amx']}, {r['copies']} copies)")
    after = pool.read_bandwidth(1 << 30, 5)
    print(f"STREAM read after: {after:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
