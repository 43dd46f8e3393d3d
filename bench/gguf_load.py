"""How fast a GGUF file loads, and what it holds resident meanwhile (issue 21: >= 1 GB/s of file once in the page
cache, peak RSS <= 1.3x the resident size).

    TMPDIR=/dev/shm python3 bench/gguf_load.py --layers 4               # Q4_K_M experts, Q4_K_M-like dense part
    python3 bench/gguf_load.py --layers 8 --gguf /dev/shm/q.gguf --reuse --repeats 3 --json out.json

It writes a random-weight GGUF of a qwen3_moe shape (hetmoe/load/random_weights.py SHAPES, default qwen3-30b-a3b) cut
to ``--layers`` decoder layers, typed as llama.cpp's Q4_K_M is: routed experts Q4_K gate/up and Q6_K down (the mix
hetmoe holds exactly: int4 affine g32 + int8 g16), attention Q4_K (attn_v Q6_K), the embedding Q4_K, the output
Q6_K, norms and router F32. Blocks are random bytes with finite fp16 scales (hetmoe/load/gguf/random_file.py: no
float copy, GBs in seconds).
Then, ``--repeats`` times, a fresh process loads it (``load_model``, CPU placement, no expert cache, the dense part
as the whole 48-layer model places it on the CPU: bf16, int8 linears) and reports
the wall time from open to a runnable model, GB/s of file, and its RSS: before, after, and at its peak (VmHWM reset
before the load); ``ratio`` = (peak - before) / (after - before), the loaders' "never two copies" bound. The file
is read once before the first load, so every load reads it from the page cache (/dev/shm: it is memory itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hetmoe.bench.machine import cpu_model, git_commit  # noqa: E402
from hetmoe.load.gguf.random_file import DENSE_Q4_K_M, EXPERT_MIXES, qwen3moe_plan, write_random_gguf  # noqa: E402
from hetmoe.load.random_weights import shape_config  # noqa: E402


def write_gguf(path, shape: str, layers: int, experts: str, seed: int = 0, log=print) -> dict:
    """The random-weight GGUF file (hetmoe/load/gguf/random_file.py); what was written."""
    import gguf

    cfg = shape_config(shape, layers)
    info = write_random_gguf(path, cfg, qwen3moe_plan(cfg, experts, DENSE_Q4_K_M),
                             f"hetmoe random {shape} ({layers} layers, {experts})", gguf.LlamaFileType.MOSTLY_Q4_K_M,
                             seed)
    log(f"wrote {path}: {info['bytes'] / 1e9:.2f} GB, {layers} layers of {shape}, experts {experts} "
        f"in {info['write_s']:.1f} s")
    return {"path": str(path), "bytes": info["bytes"], "layers": layers, "experts": experts}


_CHILD = r"""
import json, resource, sys, time
if sys.argv[4]:  # another checkout's hetmoe (an A/B): ahead of this one's editable install
    sys.meta_path[:] = [f for f in sys.meta_path if "ditable" not in type(f).__name__ + str(f)]
    sys.path.insert(0, sys.argv[4])
import torch, tqdm, hetmoe.models.qwen3_moe
from hetmoe.load.loader import load_model
from hetmoe.config.options import EngineOptions
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := the current RSS
t0, c0, f0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
options = EngineOptions(device="cpu", dtype=sys.argv[2], dense_format=sys.argv[3])
loaded = load_model(sys.argv[1], options, expert_cache=None, progress=False, log=lambda m: None)
secs, cpu = time.perf_counter() - t0, time.process_time() - c0
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0  # first touches of fresh memory, mostly
print(json.dumps(dict(load_s=secs, cpu_s=cpu, page_faults=faults, before=before, after=status("VmRSS"),
                      peak=status("VmHWM"),
                      expert_bytes=loaded.info["expert_bytes"], plan_expert_bytes=loaded.plan.ram["routed experts"])))
"""


def load_once(path: str, threads, dtype: str, dense_format: str, source: str = "") -> dict:
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    out = subprocess.run([sys.executable, "-c", _CHILD, path, dtype, dense_format, source], capture_output=True,
                         text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"the load failed:\n{out.stderr[-3000:]}")
    m = json.loads(out.stdout.splitlines()[-1])
    m["ratio"] = (m["peak"] - m["before"]) / (m["after"] - m["before"])
    return m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a qwen3_moe shape of SHAPES (default: qwen3-30b-a3b)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default: 4)")
    ap.add_argument("--experts", default="Q4_K_M", choices=sorted(EXPERT_MIXES),
                    help="routed experts' types: Q4_K_M = Q4_K gate/up + Q6_K down (default)")
    ap.add_argument("--gguf", metavar="PATH", help="the file (default: a temporary one under $TMPDIR, deleted)")
    ap.add_argument("--reuse", action="store_true", help="load the --gguf file as it is when it exists")
    ap.add_argument("--repeats", type=int, default=2, help="loads, each in a fresh process (default: 2)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the loads (default: unset)")
    # a few layers alone keep fp32 dense weights (a small model); the whole 48-layer model gets bf16 and int8 linears
    ap.add_argument("--dtype", default="bf16", help="--dtype of the loads (default: bf16, as the full model)")
    ap.add_argument("--dense-format", default="int8", help="--dense-format (default: int8, as the full model)")
    ap.add_argument("--source", metavar="DIR", help="load with the hetmoe of another checkout (a git worktree of an "
                                                    "older commit with its hetmoe/_C*.so): before/after")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    if args.reuse and not args.gguf:
        ap.error("--reuse needs --gguf PATH")
    tmp = None if args.gguf else tempfile.mkdtemp(prefix="hetmoe-load-", dir=os.environ.get("TMPDIR", "/tmp"))
    path = args.gguf or os.path.join(tmp, f"{args.shape}-{args.layers}l-{args.experts}.gguf")
    try:
        if args.reuse and os.path.isfile(path):
            written = {"path": path, "bytes": os.path.getsize(path), "reused": True}
        else:
            written = write_gguf(path, args.shape, args.layers, args.experts, args.seed)
        with open(path, "rb") as f:  # into the page cache
            while f.read(1 << 24):
                pass
        runs = []
        for r in range(args.repeats):
            m = load_once(path, args.threads, args.dtype, args.dense_format, args.source or "")
            runs.append(m)
            m["loadavg"] = os.getloadavg()[0]  # other work on the machine: the load shares its cores with it
            print(f"load {r + 1}: {m['load_s']:.2f} s = {written['bytes'] / m['load_s'] / 1e9:.2f} GB/s of file "
                  f"({m['cpu_s']:.1f} CPU-s, {m['page_faults'] / 1e3:.0f} k page faults, load average "
                  f"{m['loadavg']:.1f}); "
                  f"RSS before {m['before'] / 2**20:.0f} MiB, after +{(m['after'] - m['before']) / 2**20:.0f} MiB, "
                  f"peak +{(m['peak'] - m['before']) / 2**20:.0f} MiB (ratio {m['ratio']:.3f}); experts "
                  f"{m['expert_bytes'] / 2**20:.1f} MiB, planned {m['plan_expert_bytes'] / 2**20:.1f} MiB", flush=True)
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    secs = statistics.median(m["load_s"] for m in runs)
    rate = written["bytes"] / secs / 1e9
    ratio = max(m["ratio"] for m in runs)
    print(f"{args.shape}, {args.layers} layers, experts {args.experts}, dense {args.dtype}/{args.dense_format}, "
          f"{written['bytes'] / 1e9:.2f} GB: median load "
          f"{secs:.2f} s = {rate:.2f} GB/s of file; peak RSS / resident {ratio:.3f} (bound 1.3); {cpu_model()}, "
          f"{os.cpu_count()} cpus, commit {git_commit()}")
    if args.json:
        doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
               "commit": git_commit(), "config": vars(args), "gguf": written, "runs": runs, "median_load_s": secs,
               "gb_per_s": rate, "max_ratio": ratio}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
