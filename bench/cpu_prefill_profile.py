"""Where a CPU-only prefill's time goes (issue 23): one prompt of T tokens through a random model of a real shape on
the CPU placement, timed whole, then again with a wall-clock timer around every module's forward, summed by module
class (inclusive: a class's time holds its children's) and by the leaf calls inside the attention and MoE blocks.
On the CPU every module runs synchronously, so a module's wall time is its cost.

    python3 bench/cpu_prefill_profile.py --layers 8 --tokens 512 --dense-format int4 [--threads 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

# as the hetmoe command does (hetmoe/cli/__init__.py): PyTorch's idle OpenMP threads would spin on the cores the
# engine's pool computes on, between the model's torch ops and the engine's calls (BENCHMARKS.md#omp-wait-policy)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.load.random_weights import build_random_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts-format", default="int4")
    ap.add_argument("--dense-format", default="int4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = EngineOptions(device="cpu", dtype="bf16", experts_format=args.experts_format,
                         dense_format=args.dense_format, max_context=args.tokens + 64, threads=args.threads)
    loaded = build_random_model(args.shape, args.layers, opts, log=lambda m: None)
    runner = Runner(loaded)
    ids = torch.randint(runner.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def once() -> float:
        runner.release(0)
        t0 = time.perf_counter()
        runner.prefill(ids)
        return time.perf_counter() - t0

    once()
    wall = min(once() for _ in range(args.repeats))
    print(f"{args.shape}, {args.layers} layers, experts {args.experts_format}, dense {args.dense_format}, "
          f"{args.tokens} tokens, CPU placement, {torch.get_num_threads()} torch threads: "
          f"{wall * 1e3:.1f} ms, {args.tokens / wall:.1f} tok/s, {wall / args.layers * 1e3:.2f} ms per layer")

    by_class = defaultdict(lambda: [0.0, 0])
    by_path = defaultdict(lambda: [0.0, 0])
    starts = {}
    hooks = []
    for name, mod in loaded.model.named_modules():
        if not name:
            continue
        short = ".".join(p for p in name.split(".") if not p.isdigit())  # model.layers.3.mlp -> model.layers.mlp

        def pre(m, inp, key=id(mod)):
            starts[key] = time.perf_counter()

        def post(m, inp, out, key=id(mod), cls=type(mod).__name__, path=short):
            dt = time.perf_counter() - starts.pop(key)
            by_class[cls][0] += dt
            by_class[cls][1] += 1
            by_path[path][0] += dt
            by_path[path][1] += 1

        hooks += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    timed = once()
    for h in hooks:
        h.remove()
    print(f"with a timer around every module: {timed * 1e3:.1f} ms")
    print("by module path (inclusive, summed over layers):")
    for path, (s, n) in sorted(by_path.items(), key=lambda kv: -kv[1][0]):
        print(f"  {s * 1e3:9.1f} ms {100 * s / timed:5.1f}% {n:5d}x  {path}")
    print("by module class (inclusive):")
    for cls, (s, n) in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
        print(f"  {s * 1e3:9.1f} ms {100 * s / timed:5.1f}% {n:5d}x  {cls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
