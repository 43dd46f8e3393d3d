"""The CPU side of a hybrid decode step alone: batch-1 MoE jobs of the qwen3-30b-a3b shape (int4 g64, 128 experts,
top-8) over L layers, timed per step of L jobs, against the STREAM-read bandwidth of the same pool. Variants:

- cold batched: each layer's job once per step, submitted together, one sync (weights from DRAM);
- deferral split d=4: each layer as two jobs (its 4 highest-weighted experts, then its 4 others), paired and in the
  queue order of a hybrid step with Expert Deferral;
- one by one: submit and sync every job (the latency of each round trip shows);
- warm: layer 0's job L times (its weights stay in the last-level cache).

Also the mean stage times of a job (``CPUExperts.profile()``) for the full and the split jobs. With a third argument
(a CPU list) it repeats the first two variants with busy processes pinned to those CPUs, standing in for the threads
that drive the GPU. Run on the GPU machine from the repo root:

    python3 bench/device/decode_jobs.py [threads=14] [layers=48] [spin_cpus]
"""

import statistics
import subprocess
import sys
import time

import torch

from hetmoe import cpu

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 14
L = int(sys.argv[2]) if len(sys.argv) > 2 else 48
E, H, I, k, D, R = 128, 2048, 768, 8, 4, 6
pool = cpu.WorkerPool(threads)
t0 = time.time()
layers = []
for seed in range(1, L + 1):
    ex = cpu.CPUExperts(E, H, I, "int4", 64, pool=pool)
    ex.fill_random(seed=seed)
    layers.append(ex)
bpe = layers[0].info()["bytes_per_expert"]
huge = [line.split()[1] for line in open("/proc/meminfo") if line.startswith("AnonHugePages")]
print(f"{L} layers in {time.time() - t0:.1f} s, {bpe / 1e6:.2f} MB per expert, {pool.threads} threads, "
      f"AnonHugePages {huge[0] if huge else '?'} kB; STREAM {pool.read_bandwidth(2 << 30, 5):.1f} GB/s", flush=True)

gen = torch.Generator().manual_seed(0)
full, split = [], []  # [round][layer]: a job, or (immediate, deferred) jobs
for r in range(R):
    row, srow = [], []
    for ex in layers:
        x = torch.randn(1, H, generator=gen).bfloat16()
        ids = torch.randperm(E, generator=gen)[:k].view(1, k).to(torch.int32)
        w = torch.rand(1, k, generator=gen)
        row.append(ex.prepare(x, ids, w))
        imm = ex.prepare(x, ids, w, slots=cpu.Slots.immediate(D))
        srow.append((imm, ex.prepare(x, ids, w, slots=cpu.Slots.deferred(D, pair=imm))))
    full.append(row)
    split.append(srow)
step_bytes = L * k * bpe


def batched(r, warm=False):
    t = time.perf_counter()
    for layer in range(L):
        pool.submit(full[r][0] if warm else full[r][layer])
    pool.sync(0)
    return time.perf_counter() - t


def deferred(r):  # a hybrid step's order: imm(l), then def(l), which runs while the GPU does attention(l + 1)
    t = time.perf_counter()
    for layer in range(L):
        pool.submit(split[r][layer][0])
        pool.submit(split[r][layer][1])
    pool.sync(0)
    return time.perf_counter() - t


def one_by_one(r):
    t = time.perf_counter()
    for layer in range(L):
        pool.submit(full[r][layer])
        pool.sync(0)
    return time.perf_counter() - t


def report(name, fn):
    fn(0)
    ms = statistics.median(fn(r % R) for r in range(1, 13)) * 1e3
    print(f"{name:40s}: {ms:6.2f} ms per step, {step_bytes / ms / 1e6:6.1f} GB/s", flush=True)


def stages(name, fn):
    for ex in layers:
        ex.set_profiling(True)
    for r in range(1, R):
        fn(r)
    mean = {}
    for ex in layers:
        for st, v in ex.profile()["ms"].items():
            mean[st] = mean.get(st, 0.0) + v * 1e3 / L
        ex.set_profiling(False)
    print(f"{name:40s}: us per job " + "  ".join(f"{st} {v:.1f}" for st, v in mean.items()), flush=True)


stages("stages, full jobs", batched)
stages("stages, split jobs (mean of both)", deferred)
variants = [("cold batched", batched), (f"cold deferral split d={D}", deferred), ("cold one by one", one_by_one),
            (f"warm batched (layer 0 x{L})", lambda r: batched(r, True))]
for _ in range(2):
    for name, fn in variants:
        report(name, fn)
if len(sys.argv) > 3:
    spinners = [subprocess.Popen(["taskset", "-c", c, sys.executable, "-c", "while True: pass"])
                for c in sys.argv[3].split(",")]
    try:
        time.sleep(0.5)
        for _ in range(2):
            for name, fn in variants[:2]:
                report(f"{name} + busy CPUs {sys.argv[3]}", fn)
    finally:
        for p in spinners:
            p.kill()
print(f"STREAM after: {pool.read_bandwidth(2 << 30, 5):.1f} GB/s", flush=True)
