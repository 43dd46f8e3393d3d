"""Where the GPU time of a long prefill goes on the layerwise GPU path (issue 19): one prompt of T tokens through N
layers of a model shape with the routed experts streamed to the GPU, then the same prompt under torch.profiler with
the CUDA kernels summed by name (top rows by GPU time) and the per-layer copy / expert-compute split. Run on the GPU
machine from the repo root (8 layers, 8,192 tokens: about a minute):

    python3 bench/device/prefill_profile.py [layers] [--shape=qwen3-30b-a3b] [--tokens=8192] [--format=int4]
        [--rows=25]
"""

import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.random_weights import build_random_model


def opt(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)


args = [a for a in sys.argv[1:] if not a.startswith("--")]
layers = int(args[0]) if args else 8
shape, tokens, fmt, rows = opt("shape", "qwen3-30b-a3b"), int(opt("tokens", "8192")), opt("format", "int4"), int(
    opt("rows", "25"))
loaded = build_random_model(shape, layers, EngineOptions(device="cuda", experts_format=fmt, gpu_prefill=1,
                                                         max_context=tokens + 64), log=lambda m: None)
runner = Runner(loaded)
lw = loaded.layerwise
ids = torch.randint(runner.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


def once() -> float:
    runner.synchronize()
    t0 = time.perf_counter()
    runner.prefill(ids)
    runner.synchronize()
    return time.perf_counter() - t0


once()
wall = min(once() for _ in range(2))
print(f"{shape} {layers} layers {fmt}, {tokens} tokens, chunk {runner.prefill_chunk}: {wall * 1e3:.1f} ms, "
      f"{tokens / wall:.0f} tok/s, {wall / layers * 1e3:.2f} ms per layer")
lw.profiling = True
once()
split = lw.profile()
lw.profiling = False
print(f"per MoE layer (events): copy {split['copy_ms']:.2f} ms, experts {split['compute_ms']:.2f} ms")
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    once()
by_name: dict = defaultdict(lambda: [0.0, 0])
for e in prof.events():
    if e.device_type.name == "CUDA":
        by_name[e.name][0] += e.device_time / 1e3
        by_name[e.name][1] += 1
total = sum(v[0] for v in by_name.values())
print(f"GPU kernel+copy time {total:.1f} ms over {sum(v[1] for v in by_name.values())} launches "
      f"(wall {wall * 1e3:.1f} ms)")
for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:rows]:
    print(f"{ms:9.2f} ms {100 * ms / max(total, 1e-9):5.1f}% {n:6d}x  {name[:110]}")
