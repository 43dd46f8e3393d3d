"""Where the GPU time of one batch-1 hybrid decode step goes (qwen3-30b-a3b shape, N layers, int4 experts): CUDA
kernels per step and their total time from torch.profiler over eager steps with the CPU experts left out, then the
graph replay time of the GPU part alone and of the whole step. Run on the GPU machine from the repo root:

    python3 bench/device/gpu_step_profile.py [layers] [--no-profiler] [--threads=N]

With the CPU in the step, the CPU jobs' own stage times (CPUExperts profile) are printed beside the step time, and the
step's jobs are re-run on the pool alone (as bench e2e's time split does).
"""

import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hetmoe.bench.decode_variants import _offloaded
from hetmoe.engine.placement import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.testing.synthetic import build_random_model

args = [a for a in sys.argv[1:] if not a.startswith("--")]
layers = int(args[0]) if args else 8
use_profiler = "--no-profiler" not in sys.argv
threads = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--threads=")), None)
loaded = build_random_model("qwen3-30b-a3b", layers, EngineOptions(device="cuda", experts_format="int4",
                                                                   max_context=1024, threads=threads),
                            log=lambda m: None)
cpu_experts = [off.experts for off in _offloaded(loaded.model)]
for graph in (False, True):
    runner = Runner(loaded, cuda_graph=graph)
    runner.prefill(list(range(1, 65)))
    dec = runner.decoder
    pos = runner.lengths[0] - 1

    def step(cpu):
        dec.step([5], [pos], [0], cpu=cpu)
        torch.cuda.synchronize()

    for _ in range(3):
        step(False), step(True)
    if not graph and use_profiler:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step(False)
        ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
        per = len(ev) / 5
        total = sum(e.device_time for e in ev) / 5 / 1e3
        print(f"eager, GPU part only: {per:.0f} kernels per step ({per / layers:.1f} per layer), kernel time "
              f"{total:.3f} ms per step ({total / layers * 1e3:.1f} us per layer)")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=25, max_name_column_width=60))
    for cpu in (False, True):
        for ex in cpu_experts:
            ex.set_profiling(cpu)
        ts = []
        for _ in range(30):
            t0 = time.perf_counter()
            step(cpu)
            ts.append(time.perf_counter() - t0)
        ms = statistics.median(ts) * 1e3
        print(f"{'graph' if graph else 'eager'} step, cpu={cpu}: {ms:.3f} ms ({ms / layers * 1e3:.1f} us per layer)")
        if cpu:
            profs = [ex.profile() for ex in cpu_experts]
            jobs = sum(p["jobs"] for p in profs)
            stages = {st: sum(p["ms"][st] * p["jobs"] for p in profs) / max(jobs, 1) for st in profs[0]["ms"]}
            print(f"  CPU jobs in those steps: {jobs}, per job (ms): "
                  + "  ".join(f"{k} {v:.3f}" for k, v in stages.items()))
            for ex in cpu_experts:
                ex.set_profiling(False)
            jobs_now = list(runner.hybrid.last_jobs)

            def cpu_alone():
                for pool, job in jobs_now:
                    pool.submit(job)
                for pool in {p for p, _ in jobs_now}:
                    pool.sync()

            ts = []
            for _ in range(30):
                t0 = time.perf_counter()
                cpu_alone()
                ts.append(time.perf_counter() - t0)
            print(f"  the step's {len(jobs_now)} CPU jobs alone on the pool: {statistics.median(ts) * 1e3:.3f} ms")
    dec.close()
    del runner
