"""Decode speed of one Transformers model with the hetmoe experts backend against Transformers' own experts
implementations, in one run on the same machine and the same dense part (issue 22 item 5).

    python3 bench/transformers_backend.py                       # qwen3-30b-a3b shape, 4 layers, CPU only
    python3 bench/transformers_backend.py --layers 2 --format int8 --impls grouped_mm,eager --json out.json
    python3 bench/transformers_backend.py --device cuda          # hybrid: dense on the GPU, experts on the CPU
    python3 bench/transformers_backend.py --dense-format int4    # hetmoe's rows with the dense linears in int4

The model is Transformers' own Qwen3MoeForCausalLM (or the --shape's class) of a real shape with random weights
(hetmoe/load/random_weights.py's SHAPES): the dense part and Transformers' experts in --dtype (bf16), the hetmoe
engine's experts written straight into its packed --format (fill_random). Each configuration decodes the same
greedy loop (a --prompt-token prompt, then --tokens steps of one token, the model's own cache) --repeats times,
alternating configurations; the median step is reported, and beside it the same step with the routed experts
skipped ("none"): the difference is the experts' time, shown with the routed weight bytes each step reads.

--dense-format int8|int4 packs the dense linears (attention, lm_head) as ``from_pretrained(dense_format=...)`` does
(hetmoe/transformers/dense.py) and swaps them in for the hetmoe rows ("hetmoe+int4", "none+int4"); Transformers'
rows keep the bf16 dense part (the issue's baseline), and "hetmoe" (bf16 dense) shows what the experts alone give.
"""

from __future__ import annotations

import argparse
import inspect
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

    from hetmoe.load.random_weights import shape_config
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
        self.swapped = []  # (parent, name, float linear, packed linear) once pack_dense() ran
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

    def pack_dense(self, fmt: str, threads) -> int:
        """The dense linears packed in ``fmt`` by the loader's code, kept beside the float ones (``use``'s
        ``dense``); returns the packed bytes."""
        from hetmoe.transformers import dense

        before = [(parent, name, child) for parent in self.model.modules() for name, child in parent.named_children()]
        dev = self.model.get_input_embeddings().weight.device
        options = dense.linear_options(dev, "auto", threads, "auto")
        made = dense.pack_rest(self.model, fmt, dev, self.model.dtype, options)
        self.swapped = [(p, n, c, getattr(p, n)) for p, n, c in before if getattr(p, n) is not c]
        return made

    def use(self, impl: str, packed_dense: bool = False) -> None:
        for parent, name, linear, packed in self.swapped:
            setattr(parent, name, packed if packed_dense else linear)
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
    # the cache's name changed within Transformers 5.x (past_key_values, then cache): take the one this version has
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    cache, nxt = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(tokens):
        t0 = time.perf_counter()
        out = model(input_ids=nxt, **{name: cache}, use_cache=True, logits_to_keep=1)
        cache, nxt = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
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
    p.add_argument("--dense-format", default="bf16", choices=("bf16", "int8", "int4"),
                   help="hetmoe's dense linears (Transformers' rows keep --dtype)")
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
    from hetmoe.config.options import DEFAULT_GROUP
    from hetmoe.cpu import cpu_info
    from hetmoe.cpu.layout import expert_bytes

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    fmt, packed = args.dense_format, args.dense_format != "bf16"
    if packed and args.device == "cuda" and dtype != torch.bfloat16:
        p.error(f"--dense-format {fmt} on the GPU takes bf16 activations: use --dtype bf16")
    group = DEFAULT_GROUP[args.format] if args.group_size is None else args.group_size
    t0 = time.perf_counter()
    model = build(args.shape, args.layers, dtype)
    switch = Switch(model, args.format, group, args.threads)
    E, H, I = hetmoe.transformers.backend.expert_shape(switch.modules[0])  # before to_gpu takes the weights out
    if args.device == "cuda":
        switch.to_gpu()
    dense_packed = switch.pack_dense(fmt, args.threads) if packed else 0
    dense_float = sum(lin.weight.nbytes for _, _, lin, _ in switch.swapped)
    build_s = time.perf_counter() - t0
    cfg = model.config
    k, n_moe = cfg.num_experts_per_tok, len(switch.modules)
    # row -> (experts implementation, hetmoe's packed dense linears or the float ones)
    rows = {i.strip(): (i.strip(), False) for i in args.impls.split(",") if i.strip()}
    rows.update({"hetmoe": ("hetmoe", False), NONE: (NONE, False)})
    if packed:
        rows.update({f"hetmoe+{fmt}": ("hetmoe", True), f"none+{fmt}": (NONE, True)})
    ours = f"hetmoe+{fmt}" if packed else "hetmoe"
    steps = {r: [] for r in rows}
    for r, (impl, dense) in rows.items():  # warm-up: the first call of each pays one-time initialisation
        switch.use(impl, dense)
        decode_steps(model, args.prompt, 2)
    for _ in range(args.repeats):
        for r, (impl, dense) in rows.items():
            switch.use(impl, dense)
            steps[r] += decode_steps(model, args.prompt, args.tokens)
    info = switch.engines[0].info()
    ours_bytes = expert_bytes(args.format, H, I, group)
    routed = {r: n_moe * k * (ours_bytes if impl == "hetmoe" else 3 * H * I * dtype.itemsize)
              for r, (impl, _) in rows.items() if impl != NONE}
    results = {r: {"ms_per_token": 1e3 * statistics.median(steps[r])} for r in rows}
    for r in routed:
        res = results[r]
        rest = results[f"none+{fmt}" if rows[r][1] else NONE]["ms_per_token"]
        res["tok_s"] = 1e3 / res["ms_per_token"]
        diff = res["ms_per_token"] - rest  # the step minus the same step without experts (noise can make it <= 0)
        res["experts_ms"] = diff if diff > 0 else None
        res["routed_MB_per_token"] = routed[r] / 1e6
        res["experts_GB_s"] = routed[r] / diff / 1e6 if diff > 0 else None
    best = min((r for r in routed if rows[r][0] != "hetmoe"), key=lambda r: results[r]["ms_per_token"])
    speedup = results[best]["ms_per_token"] / results[ours]["ms_per_token"]
    mine, theirs = results[ours]["experts_ms"], results[best]["experts_ms"]
    experts_speedup = theirs / mine if mine and theirs else None
    print(f"{args.shape}, {args.layers} layers ({n_moe} MoE, E={E} k={k} H={H} I={I}), dense {args.dtype} on "
          f"{args.device}, "
          f"torch threads {torch.get_num_threads()}, hetmoe {args.format} g{group} on {info.get('isa')} "
          f"({info.get('threads')} threads), OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; "
          f"built in {build_s:.0f} s; median of {args.repeats}x{args.tokens} steps")
    if packed:
        print(f"dense linears read per token: {dense_float / 1e6:.0f} MB in {args.dtype}, {dense_packed / 1e6:.0f} MB "
              f"in {fmt} (rows +{fmt})")
    print(f"{'experts':<12} {'ms/token':>9} {'tok/s':>7} {'experts ms':>11} {'routed MB/tok':>14} {'GB/s':>6}")
    for r in routed:
        res = results[r]
        ms, gbs = (f"{res['experts_ms']:>11.1f}", f"{res['experts_GB_s']:>6.2f}") if res["experts_ms"] else \
            ("n/a", "n/a")
        print(f"{r:<12} {res['ms_per_token']:>9.1f} {res['tok_s']:>7.2f} {ms:>11} {res['routed_MB_per_token']:>14.1f} "
              f"{gbs:>6}")
    for r in (r for r in rows if rows[r][0] == NONE):
        rest = results[r]["ms_per_token"]
        print(f"({r}){'':<{10 - len(r)}} {rest:>9.1f} {1e3 / rest:>7.2f}   the same step with the routed experts "
              f"skipped{f', dense {fmt}' if rows[r][1] else ''}")
    share = (f"{experts_speedup:.2f}x in the routed experts" if experts_speedup else
             "the experts' share not measurable (the step without experts was no faster: a noisy machine)")
    dense_note = f", dense {fmt}" if packed else ""
    print(f"hetmoe ({args.format}{dense_note}) vs Transformers' best ({best}, {args.dtype}): {speedup:.2f}x per decode "
          f"step, {share}")
    if args.json:
        report = {"args": vars(args), "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                  "cpu": {k_: v for k_, v in cpu_info().items() if isinstance(v, (str, int))},
                  "engine": {k_: v for k_, v in info.items() if isinstance(v, (str, int, float))},
                  "results": results, "best_transformers": best, "hetmoe_row": ours, "speedup": speedup,
                  "dense_bytes": {args.dtype: dense_float, fmt: dense_packed} if packed else None,
                  "experts_speedup": experts_speedup}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
