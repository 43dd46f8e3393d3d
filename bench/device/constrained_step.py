"""Where a constrained row's cost goes in a batched decode step: one LLM, 16 sequences decoded together with
``ignore_eos``, first all plain greedy, then with 4 of them under the serve bench's JSON schema (the same
grammar machinery as the server's response_format). Prints ms per step of the whole step and of its parts
(the runner's decode call, the constraint masks' host fill, the sampling) and, with the torch profiler on for a
few constrained steps, the ops that took the engine thread's time. From the repo root:

    python3 bench/device/constrained_step.py [cuda|cpu, default cuda] [shape, default: the built-in model] [layers]
"""

import sys
import time
from collections import defaultdict

import torch

from hetmoe.bench.serve import CONSTRAINED_SCHEMA
from hetmoe.config.options import EngineOptions
from hetmoe.engine import grammar, scheduler
from hetmoe.engine.llm import LLM
from hetmoe.engine.sampler import SamplingParams

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
shape = sys.argv[2] if len(sys.argv) > 2 else None
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 8
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
opts = EngineOptions(device=device, max_batch=16, max_context=1024,
                     **({"experts_format": "int4"} if shape else {}))
if shape:
    from hetmoe.load.random_weights import build_random_model, shape_tokenizer

    loaded = build_random_model(shape, layers, opts)
    llm = LLM(loaded=loaded, tokenizer=shape_tokenizer(loaded.config.vocab_size), log=lambda m: None)
else:
    llm = LLM(None, opts, expert_cache="off", progress=False, log=lambda m: None)
V = llm.runner.vocab_size
grammars = grammar.Grammars(llm.tokenizer, V)
schema = grammars.json_schema(CONSTRAINED_SCHEMA)

times: dict = defaultdict(float)
counts: dict = defaultdict(int)


def timed(owner, name, key):
    inner = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            times[key] += time.perf_counter() - t
            counts[key] += 1
    setattr(owner, name, wrapper)


sched = llm.scheduler
timed(sched.runner, "decode_batch", "runner.decode_batch")
timed(sched, "_decode", "step (_decode)")
timed(sched, "_sample", "_sample")
timed(grammar.GrammarConstraint, "prepare", "mask fill (xgrammar, host)")
timed(scheduler, "apply_bitmasks", "mask apply (all rows)")
prompts = [{"prompt_token_ids": [10 + (7 * i + j) % 200 for j in range(32)]} for i in range(16)]


def run(constrained: int, tokens: int = 96, profile: bool = False):
    times.clear()
    counts.clear()
    params = [SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                             constraint=schema if i < constrained else None) for i in range(16)]
    sync()
    t = time.perf_counter()
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    else:
        llm.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t
    steps = counts["step (_decode)"] or 1
    print(f"{constrained} of 16 constrained: {wall * 1e3:.0f} ms for {tokens} tokens a sequence; per decode step:")
    for key in sorted(times, key=lambda k: -times[k]):
        print(f"  {key:<28} {times[key] * 1e3 / steps:8.3f} ms  ({counts[key]} calls)")


for rep in range(2):
    run(0)
    run(4)
run(4, tokens=32, profile=True)
