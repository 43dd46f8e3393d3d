"""Decode speed of one Transformers model with the hetmoe experts backend against Transformers' own experts
implementations, in one run on the same machine and the same dense part (issue 22 item 5).

    python3 bench/transformers_backend.py                       # qwen3-30b-a3b shape, 4 layers, CPU only
    python3 bench/transformers_backend.py --layers 2 --format int8 --impls grouped_mm,eager --json out.json
    python3 bench/transformers_backend.py --device cuda          # hybrid: dense on the GPU, experts on the CPU

The model is Transformers' own Qwen3MoeForCausalLM (or the --shape's class) of a real shape with random weights
(hetmoe/testing/synthetic.py's SHAPES): the dense part and Transformers' experts in --dtype (bf16), the hetmoe
engine's experts written straight into its packed --format (fill_random). Each configuration decodes the same
greedy loop (a --prompt-token prompt, then --tokens steps of one token, the model's own cache) --repeats times,
alternating configurations; the median step is reported, and beside it the same step with the routed experts
skipped ("none"): the difference is the experts' time, shown with the routed weight bytes each step reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# As the hetmoe command does (hetmoe/cli/__init__.py), before torch loads OpenMP: idle PyTorch threads must not
# spin on the cores the expert engine computes on (BENCHMARKS.md#omp-wait-policy). OMP_WAIT_POLICY=ACTIVE in the
# environment measures the other policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(shape: str, layers: int, dtype: torch.dtype, seed: int = 0):
    """Transformers' model of ``shape`` with ``layers`` decoder layers, random N(0, 0.02) weights in ``dtype``."""
    from transformers import AutoConfig

    from hetmoe.testing.synthetic import shape_config
    from hetmoe.transformers.loading import build_model

    cfg = dict(shape_config(shape, layers))
    model_type = cfg.pop("model_type")
    for k in ("architectures", "torch_dtype"):
        cfg.pop(k, None)
    config = AutoConfig.for_model(model_type, **cfg)
    model = build_model(config, dtype)  # meta parameters: filled below, one tensor at a time
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        for leaf, p in list(mod._parameters.items()):
            if p is None:
                continue
            t = torch.empty(p.shape, dtype=dtype)
            if "norm" in leaf or (p.dim() == 1 and "bias" not in leaf):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
            mod._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
    return model.eval()


NONE = "none"  # routed experts skipped (zeros): what the rest of a decode step costs


class Switch:
    """Moves every experts module between Transformers' weights and a hetmoe CPUExperts."""

    def __init__(self, model, fmt: str, group: int, threads):
        from hetmoe.cpu import CPUExperts
        from hetmoe.transformers import backend

        self.model, self.backend = model, backend
        self.modules = [m for m in model.modules() if backend.is_experts_module(m)]
        self.params, self.engines = [], []
        for i, m in enumerate(self.modules):
            E, H, I = backend.expert_shape(m)
            ex = CPUExperts(E, H, I, fmt, group, threads=threads)
            ex.fill_random(seed=i)
            self.engines.append(ex)
            self.params.append({n: m._parameters[n] for n in ("gate_up_proj", "down_proj")})

    def to_gpu(self) -> None:
        """Hybrid placement: every module but the routed experts on the GPU; Transformers' experts then run on
        their CPU weights, the activations copied over and back as hetmoe's are (``on_cpu``)."""
        self.use("hetmoe")  # the expert weights leave the modules: .to() does not move them
        self.model.to("cuda")
        self.hybrid = True

    hybrid = False

    def use(self, impl: str) -> None:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

        if impl == NONE:
            ExpertsInterface.register(NONE, lambda module, x, ids, w: torch.zeros_like(x))
        name = impl
        if self.hybrid and impl not in ("hetmoe", NONE):
            name = f"cpu-{impl}"
            ExpertsInterface.register(name, on_cpu(ALL_EXPERTS_FUNCTIONS.get(impl)))
        for m, params, ex in zip(self.modules, self.params, self.engines):
            if impl == "hetmoe":
                self.backend.attach(m, ex)
            else:
                m.__dict__.pop(self.backend.ENGINE_ATTR, None)
                m._parameters.update(params)
        self.model.set_experts_implementation(name)


def on_cpu(fn):
    """An experts implementation run on the CPU for activations on another device (``fn`` None: eager)."""
    import inspect

    def run(module, x, ids, w):
        f = fn or inspect.unwrap(type(module).forward)
        return f(module, x.cpu(), ids.cpu(), w.cpu()).to(x.device)

    return run


@torch.inference_mode()
def decode_steps(model, prompt: int, tokens: int, seed: int = 1) -> list:
    """Seconds of each greedy one-token step after a ``prompt``-token prefill."""
    g = torch.Generator().manual_seed(seed)
    device = model.get_input_embeddings().weight.device
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g).to(device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--format", default="int4", choices=("bf16", "int8", "int4"), help="hetmoe experts format")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="dense part and Transformers' experts")
    p.add_argument("--impls", default="grouped_mm,batched_mm,eager",
                   help="Transformers' experts implementations to compare with")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--tokens", type=int, default=16, help="decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="hetmoe expert threads (default: physical cores)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: hybrid, everything but the routed experts on the GPU (both sides' experts on the CPU)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    import hetmoe.transformers  # noqa: F401  registers "hetmoe"
    from hetmoe.cpu import cpu_info
    from hetmoe.engine.placement import DEFAULT_GROUP, expert_bytes

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    group = DEFAULT_GROUP[args.format] if args.group_size is None else args.group_size
    t0 = time.perf_counter()
    model = build(args.shape, args.layers, dtype)
    switch = Switch(model, args.format, group, args.threads)
    if args.device == "cuda":
        switch.to_gpu()
    build_s = time.perf_counter() - t0
    cfg = model.config
    E, H, I = hetmoe.transformers.backend.expert_shape(switch.modules[0])
    k, n_moe = cfg.num_experts_per_tok, len(switch.modules)
    impls = [i.strip() for i in args.impls.split(",") if i.strip()] + ["hetmoe", NONE]
    steps = {i: [] for i in impls}
    for i in impls:  # warm-up: the first call of each pays one-time initialisation
        switch.use(i)
        decode_steps(model, args.prompt, 2)
    for _ in range(args.repeats):
        for i in impls:
            switch.use(i)
            steps[i] += decode_steps(model, args.prompt, args.tokens)
    info = switch.engines[0].info()
    routed = {i: n_moe * k * (3 * H * I * dtype.itemsize if i != "hetmoe" else expert_bytes(args.format, H, I, group))
              for i in impls if i != NONE}
    results = {i: {"ms_per_token": 1e3 * statistics.median(steps[i])} for i in impls}
    rest = results[NONE]["ms_per_token"]
    for i in routed:
        r = results[i]
        r["tok_s"] = 1e3 / r["ms_per_token"]
        diff = r["ms_per_token"] - rest  # the step minus the same step without experts (noise can make it <= 0)
        r["experts_ms"] = diff if diff > 0 else None
        r["routed_MB_per_token"] = routed[i] / 1e6
        r["experts_GB_s"] = routed[i] / diff / 1e6 if diff > 0 else None
    best = min((i for i in routed if i != "hetmoe"), key=lambda i: results[i]["ms_per_token"])
    speedup = results[best]["ms_per_token"] / results["hetmoe"]["ms_per_token"]
    ours, theirs = results["hetmoe"]["experts_ms"], results[best]["experts_ms"]
    experts_speedup = theirs / ours if ours and theirs else None
    print(f"{args.shape}, {args.layers} layers ({n_moe} MoE, E={E} k={k} H={H} I={I}), dense {args.dtype} on "
          f"{args.device}, "
          f"torch threads {torch.get_num_threads()}, hetmoe {args.format} g{group} on {info.get('isa')} "
          f"({info.get('threads')} threads), OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"built in {build_s:.0f} s; median of {args.repeats}x{args.tokens} steps")
    print(f"{'experts':<12} {'ms/token':>9} {'tok/s':>7} {'experts ms':>11} {'routed MB/tok':>14} {'GB/s':>6}")
    for i in routed:
        r = results[i]
        ms, gbs = (f"{r['experts_ms']:>11.1f}", f"{r['experts_GB_s']:>6.2f}") if r["experts_ms"] else ("n/a", "n/a")
        print(f"{i:<12} {r['ms_per_token']:>9.1f} {r['tok_s']:>7.2f} {ms:>11} {r['routed_MB_per_token']:>14.1f} "
              f"{gbs:>6}")
    print(f"{'(none)':<12} {rest:>9.1f} {1e3 / rest:>7.2f}   the same step with the routed experts skipped")
    share = (f"{experts_speedup:.2f}x in the routed experts" if experts_speedup else
             "the experts' share not measurable (the step without experts was no faster: a noisy machine)")
    print(f"hetmoe ({args.format}) vs Transformers' best ({best}, {args.dtype}): {speedup:.2f}x per decode step, "
          f"{share}")
    if args.json:
        report = {"args": vars(args), "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                  "cpu": {k_: v for k_, v in cpu_info().items() if isinstance(v, (str, int))},
                  "engine": {k_: v for k_, v in info.items() if isinstance(v, (str, int, float))},
                  "results": results, "best_transformers": best, "speedup": speedup,
                  "experts_speedup": experts_speedup}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
