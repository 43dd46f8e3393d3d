"""A/B of where a hybrid decode step routes (qwen3-30b-a3b shape, all 48 layers unless given, int4 experts, batch 1,
CUDA graph): the CPU jobs routing from the logits (``StreamDecode.route_on_host``, the default) against the top-k on
the GPU, alternating in one process, each for graph decoding with deferral d in DEFERS. Prints tok/s, the step's
split (GPU / CPU / overlap, as bench e2e) and the roofline from a STREAM probe before and after. Run on the GPU
machine from the repo root:

    python3 bench/device/host_routing_ab.py [layers] [--rounds=N] [--defers=0,4,5,6] [--json=PATH]
"""

import json
import statistics
import sys

import torch

from hetmoe.bench.decode_variants import _decode_times, set_deferral, time_split
from hetmoe.bench.e2e import _expert_pool, roofline_bytes
from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.random_weights import build_random_model

args = [a for a in sys.argv[1:] if not a.startswith("--")]
opts = dict(a[2:].split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
layers = int(args[0]) if args else 48
rounds = int(opts.get("rounds", 2))
defers = [int(d) for d in opts.get("defers", "0,4,5,6").split(",")]
loaded = build_random_model("qwen3-30b-a3b", layers, EngineOptions(device="cuda", experts_format="int4",
                                                                   max_context=1024), log=lambda m: None)
pool = _expert_pool(loaded, None)
nbytes = roofline_bytes(loaded)["bytes_per_token"]
stream_before = pool.read_bandwidth(2 << 30, 5)
print(f"{layers} layers, {pool.threads} expert threads, {nbytes / 1e6:.1f} MB of experts per token; "
      f"STREAM {stream_before:.1f} GB/s -> roofline {stream_before * 1e9 / nbytes:.1f} tok/s", flush=True)
gen = torch.Generator().manual_seed(0)
records = []
for r in range(rounds):
    for host in (True, False):
        for d in defers:
            set_deferral(loaded.model, d)
            runner = Runner(loaded, cuda_graph=True)
            runner.hybrid.route_on_host = host
            try:
                prompt = torch.randint(runner.vocab_size, (128,), generator=gen).tolist()
                times = _decode_times(runner, prompt, 32, 2, gen)
                rec = {"round": r, "route_on_host": host, "defer": d, "tok_s": len(times) / sum(times),
                       "step_ms_median": 1e3 * statistics.median(times), **time_split(runner)}
            finally:
                runner.decoder.close()
                del runner
            records.append(rec)
            print(f"round {r} {'host' if host else 'gpu '} routing d{d}: {rec['tok_s']:6.2f} tok/s  step "
                  f"{rec['step_ms']:6.2f} = GPU {rec['gpu_ms']:5.2f} + CPU {rec['cpu_ms']:5.2f} - overlap "
                  f"{rec['overlap_ms']:5.2f}", flush=True)
set_deferral(loaded.model, 0)
stream_after = pool.read_bandwidth(2 << 30, 5)
print(f"STREAM after: {stream_after:.1f} GB/s -> roofline {stream_after * 1e9 / nbytes:.1f} tok/s")
if "json" in opts:
    with open(opts["json"], "w") as f:
        json.dump({"layers": layers, "threads": pool.threads, "bytes_per_token": nbytes,
                   "stream_gbps": [stream_before, stream_after], "records": records}, f, indent=1)
