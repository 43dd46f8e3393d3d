"""Where the GPU time of one batch-1 hybrid decode step goes, with the fused decode path on and off (issue 27), per
model shape (int4 experts, N layers): CUDA kernels per step and their total time from torch.profiler over eager
steps with the CPU experts left out, then the graph replay time of the GPU part alone and of the whole step. Run on
the GPU machine from the repo root (both shapes, 8 layers: about 2 minutes):

    python3 bench/device/gpu_step_profile.py [layers] [--shapes=qwen3-30b-a3b,deepseek-v3] [--fused=off,on]
        [--batch=1] [--no-profiler] [--table] [--cpu-alone] [--threads=N] [--dense=bf16|fp8|int8|int4]

``--table`` prints the profiler's top kernels per variant; ``--cpu-alone`` re-runs the step's CPU jobs on the pool
alone (as bench e2e's time split does) and prints the CPU jobs' stage times. The last lines are one summary row per
(shape, fused): kernels per layer, kernel µs per layer (eager), nodes per layer of the captured graph of the GPU
part (by type: kernels, memcpy, ...; the driver's cuGraphGetNodes on a graph captured with keep_graph), graph ms of
the GPU part and of the whole step.
"""

import collections
import ctypes
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hetmoe.bench.decode_variants import _offloaded
from hetmoe.config.options import EngineOptions
from hetmoe.engine.cuda_graph import padded_size
from hetmoe.engine.runner import Runner
from hetmoe.load.random_weights import build_random_model


def opt(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


args = [a for a in sys.argv[1:] if not a.startswith("--")]
layers = int(args[0]) if args else 8
shapes = opt("shapes", "qwen3-30b-a3b,deepseek-v3").split(",")
fused_variants = opt("fused", "off,on").split(",")
batch = int(opt("batch", "1"))
threads = int(opt("threads", "0")) or None
dense = opt("dense", "bf16")  # the dense part's format (--dense-format); deepseek-v3's checkpoints hold fp8
use_profiler, table, cpu_alone_too = "--no-profiler" not in sys.argv, "--table" in sys.argv, "--cpu-alone" in sys.argv


def median_ms(fn, n: int = 30) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def cpu_alone(runner, cpu_experts) -> None:
    profs = [ex.profile() for ex in cpu_experts]
    jobs = sum(p["jobs"] for p in profs)
    stages = {st: sum(p["ms"][st] * p["jobs"] for p in profs) / max(jobs, 1) for st in profs[0]["ms"]}
    print(f"  CPU jobs in those steps: {jobs}, per job (ms): " + "  ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    jobs_now = list(runner.hybrid.last_jobs)

    def run():
        for pool, job in jobs_now:
            pool.submit(job)
        for pool in {p for p, _ in jobs_now}:
            pool.sync()

    print(f"  the step's {len(jobs_now)} CPU jobs alone on the pool: {median_ms(run):.3f} ms")


NODE_TYPES = ("kernel", "memcpy", "memset", "host", "graph", "empty", "wait_event", "event_record", "sema_signal",
              "sema_wait", "mem_alloc", "mem_free", "mem_op", "conditional")  # CUgraphNodeType, in its order


def graph_nodes(dec, batch: int, positions: list):
    """The nodes of the GPU part of one step (CPU left out) captured anew and never replayed: Counter by type, or
    a string saying why not."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=dec.mempool):
            dec._forward(padded_size(batch, dec.sizes), dec.kv_len(positions), cpu=False)
        raw, n = ctypes.c_void_p(int(graph.raw_cuda_graph())), ctypes.c_size_t(0)
        if cuda.cuGraphGetNodes(raw, None, ctypes.byref(n)) != 0:
            return "cuGraphGetNodes failed"
        nodes = (ctypes.c_void_p * n.value)()
        cuda.cuGraphGetNodes(raw, nodes, ctypes.byref(n))
        counts = collections.Counter()
        for node in nodes:
            kind = ctypes.c_int(-1)
            cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
            counts[NODE_TYPES[kind.value] if 0 <= kind.value < len(NODE_TYPES) else str(kind.value)] += 1
        del graph
        return counts
    except Exception as e:  # an older torch (no keep_graph), no driver library: the count is left out
        return f"unavailable ({type(e).__name__}: {e})"


summary = []
for shape in shapes:
    loaded = build_random_model(shape, layers, EngineOptions(device="cuda", experts_format="int4", max_context=1024,
                                                             max_batch=max(batch, 1), threads=threads,
                                                             dense_format=dense),
                                log=lambda m: None)
    cpu_experts = [off.experts for off in _offloaded(loaded.model)]
    for fused in fused_variants:
        row = {"shape": shape, "fused": fused}
        for graph in (False, True):
            runner = Runner(loaded, cuda_graph=graph, fused_decode=fused == "on")
            slots = list(range(batch))
            for s in slots:
                runner.prefill(list(range(1, 65)), slot=s)
            dec = runner.decoder
            positions = [runner.lengths[s] - 1 for s in slots]

            def step(cpu):
                dec.step([5] * batch, positions, slots, cpu=cpu)
                torch.cuda.synchronize()

            for _ in range(3):
                step(False), step(True)
            if not graph and use_profiler:
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        step(False)
                ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
                per, total = len(ev) / 5, sum(e.device_time for e in ev) / 5 / 1e3
                row.update(kernels_per_layer=per / layers, kernel_us_per_layer=total / layers * 1e3)
                print(f"{shape} fused={fused} eager, GPU part only: {per:.0f} kernels per step "
                      f"({per / layers:.1f} per layer), kernel time {total:.3f} ms per step "
                      f"({total / layers * 1e3:.1f} us per layer)")
                if table:
                    print(prof.key_averages().table(sort_by="device_time_total", row_limit=25,
                                                    max_name_column_width=60))
            if graph:
                nodes = graph_nodes(dec, batch, positions)
                if isinstance(nodes, str):
                    print(f"{shape} fused={fused} graph nodes: {nodes}")
                else:
                    row["nodes_per_layer"] = sum(nodes.values()) / layers
                    print(f"{shape} fused={fused} graph of the GPU part: {sum(nodes.values())} nodes "
                          f"({row['nodes_per_layer']:.1f} per layer): " + ", ".join(
                              f"{k} {v}" for k, v in nodes.most_common()))
            for cpu in (False, True):
                for ex in cpu_experts:
                    ex.set_profiling(cpu and cpu_alone_too)
                ms = median_ms(lambda: step(cpu))
                kind = "graph" if graph else "eager"
                row[f"{kind}_{'step' if cpu else 'gpu'}_ms"] = ms
                print(f"{shape} fused={fused} {kind} step, cpu={cpu}: {ms:.3f} ms ({ms / layers * 1e3:.1f} us per "
                      "layer)")
                if cpu and cpu_alone_too:
                    cpu_alone(runner, cpu_experts)
                for ex in cpu_experts:
                    ex.set_profiling(False)
            dec.close()
            del runner
        summary.append(row)
    del loaded, cpu_experts
    torch.cuda.empty_cache()

print(f"\nsummary: {layers} layers, batch {batch}, {dense} dense, int4 experts (kernels and kernel us from the eager "
      "profile; graph ms: the GPU part alone, then the whole step)")
print(f"{'shape':<16} {'fused':<5} {'kernels/layer':>13} {'kernel us/layer':>15} {'nodes/layer':>11} "
      f"{'graph GPU ms':>12} {'graph step ms':>13}")
for r in summary:
    print(f"{r['shape']:<16} {r['fused']:<5} {r.get('kernels_per_layer', float('nan')):>13.1f} "
          f"{r.get('kernel_us_per_layer', float('nan')):>15.1f} {r.get('nodes_per_layer', float('nan')):>11.1f} "
          f"{r['graph_gpu_ms']:>12.3f} {r['graph_step_ms']:>13.3f}")
