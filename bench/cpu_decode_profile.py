"""Where a CPU-only decode step's time goes (issue 23): the runner's lean step (hetmoe/engine/cpu_decode.py) taken
apart call by call, and the same calls submitted three ways. Random weights of a real shape, batch 1, after a
prompt; the ways alternate step by step (the order rotating), so a noisy machine loads them alike.

    python3 bench/cpu_decode_profile.py --layers 4 --dense-format int8 --steps 32

Ways (the inputs -- embedding row, RoPE table -- written by Python first, the logits copied out after, each time):
  one job    the runner's step: every call in one job list, one submit and one sync (runner.decode)
  queued     the calls submitted one by one, one sync at the end (the pool goes from job to job itself)
  synced     each call submitted and synced on its own (the Python thread wakes up between calls)
The breakdown is the synced way's, per call: ms per step, the weight bytes it streams, its GB/s, and the floor (its
bytes at the STREAM read measured alongside).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.engine.cpu_decode import _fp32_copy  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.load.random_weights import build_random_model  # noqa: E402


def step(runner: Runner, tok: int, way: str, times: dict) -> None:
    """One decode step of slot 0 submitted the ``way`` given; the synced way times each call into ``times``."""
    if way == "one job":
        runner.decode(tok)
        return
    runner.reserve(0, runner.lengths[0] + 1)
    clock = time.perf_counter
    with torch.inference_mode():
        t = clock()
        plan = runner.lean.inputs(torch.tensor([[tok]]), torch.tensor([[runner.lengths[0]]]), torch.tensor([0]))
        times["inputs"].append(clock() - t)
        x, pool = plan["x"], None
        for name, pool_i, job in plan["calls"]:
            t = clock()
            if pool_i is None:  # a layer whose MLP runs in PyTorch
                if pool is not None:
                    pool.sync()
                x += job.mlp(job.post_attention_layernorm(x)[:, None])[:, 0]
            else:
                pool = pool_i
                pool.submit(job)
                if way == "synced":
                    pool.sync()
            times[name].append(clock() - t)
        pool.sync()
        t = clock()
        if plan["logits"] is not None:
            _fp32_copy(plan["logits"])
        times["logits out"].append(clock() - t)
    runner.lengths[0] += 1


def weight_bytes(loaded) -> dict:
    """Weight bytes each call streams per step (batch 1): the packed linears and top_k experts per MoE layer."""
    model, cfg = loaded.model, loaded.config
    out = defaultdict(int)
    for layer in model.model.layers:
        out["qkv"] += layer.self_attn.qkv.nbytes
        out["o_proj"] += layer.self_attn.o_proj.nbytes
        mlp = layer.mlp
        if hasattr(mlp, "moe"):
            out["norm+router"] += getattr(mlp.gate, "nbytes", 0)
            out["experts"] += cfg.num_experts_per_tok * mlp.moe.experts.info()["bytes_per_expert"]
    out["norm+lm_head"] = getattr(model.lm_head, "nbytes", 0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts-format", default="int4")
    ap.add_argument("--dense-format", default="int8")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args(argv)
    opts = EngineOptions(device="cpu", experts_format=args.experts_format, group_size=64,
                         dense_format=args.dense_format, dtype=args.dtype, threads=args.threads,
                         max_context=args.prompt + 3 * args.steps + 8)
    loaded = build_random_model(args.shape, args.layers, opts, log=lambda m: None)
    runner = Runner(loaded)
    if runner.lean is None:
        print("the lean decode step does not cover this model", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(runner.vocab_size, (args.prompt,), generator=gen).tolist())
    toks = iter(torch.randint(runner.vocab_size, (3 * args.steps + 4,), generator=gen).tolist())
    for _ in range(4):
        runner.decode(next(toks))
    ways = ("one job", "queued", "synced")
    whole, parts = {w: [] for w in ways}, defaultdict(list)
    for r in range(args.steps):
        for way in ways[r % 3:] + ways[:r % 3]:
            t0 = time.perf_counter()
            step(runner, next(toks), way, parts if way == "synced" else defaultdict(list))
            whole[way].append(time.perf_counter() - t0)
    pool = runner.lean.layers[0][1].qkv.pool
    stream = pool.read_bandwidth(1 << 30, 5)
    nbytes = weight_bytes(loaded)
    per_step = {k: statistics.median(v) * 1e3 * (len(v) // args.steps) for k, v in parts.items()}
    all_mb = sum(nbytes.values()) / 1e6
    print(f"{args.shape}, {args.layers} layers, experts {args.experts_format}, dense {args.dense_format}, "
          f"{args.dtype}, {pool.threads} threads; {args.steps} steps of each way")
    for way, v in whole.items():
        med = statistics.median(v) * 1e3
        print(f"{way:<8s} median {med:7.2f} ms/step ({1e3 / med:5.1f} tok/s, {all_mb / med:5.1f} GB/s), fastest "
              f"{min(v) * 1e3:7.2f} ms")
    print(f"{'call':<16s} {'ms/step':>8s} {'calls':>5s} {'ms/call':>8s} {'MB/step':>8s} {'GB/s':>6s} {'floor ms':>8s}")
    for k, v in per_step.items():
        calls = len(parts[k]) // args.steps
        mb = nbytes.get(k, 0) / 1e6
        rate = f"{mb / v:6.1f} {mb / stream:8.2f}" if mb else ""
        print(f"{k:<16s} {v:8.2f} {calls:5d} {v / calls:8.3f} {mb:8.1f} {rate}")
    print(f"STREAM read (1 GB, the pool's threads, best of 5): {stream:.1f} GB/s; the step's {all_mb:.0f} MB at that "
          f"rate: {all_mb / stream:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
