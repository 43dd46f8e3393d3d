"""Which experts stay on the GPU (``--gpu-experts N``): the N most often routed per MoE layer on a calibration text.

    calibration tokens (the built-in text below, or ``--calibration-file``, through the checkpoint's tokenizer)
    -> one prefill through the loaded model with a counter in front of every MoE block's dispatch stage
       (router choices, [E] per layer; the experts still all run on the CPU)
    -> per layer the N experts with the highest counts (ties: the lower id)
    -> GpuExperts built from the CPU engine's own values, attached (the CPU engine skips them from then on).

Without a tokenizer (models built in memory) no calibration is run: the first N experts of each layer are kept.
The choice and the fraction of routed (token, expert) pairs it covers on the calibration text, per layer and mean,
go to the log (stderr) and to ``LoadedModel.info["gpu_experts"]``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch
from torch import nn

from hetmoe.layers.attention import Step
from hetmoe.moe.gpu_resident.experts import GpuExperts, first_experts

MAX_CALIBRATION_TOKENS = 1024  # a prefill of this many tokens through the whole model; enough to rank experts

# Mixed prose, code and dialogue, so that routing sees the kinds of tokens a chat model meets.
DEFAULT_TEXT = """\
Mixture-of-Experts language models replace the dense feed-forward block of a transformer layer with many smaller
experts and a router. For every token the router scores all experts and keeps the best few; only those run, so a
model with hundreds of billions of parameters computes like a much smaller one. The catch is memory: every expert
must be resident somewhere, even though each token touches only a handful of them.

def moe_forward(x, router, experts, top_k=8):
    scores = router(x).softmax(dim=-1)
    weights, ids = scores.topk(top_k, dim=-1)
    out = torch.zeros_like(x)
    for j in range(top_k):
        for e in ids[:, j].unique().tolist():
            rows = ids[:, j] == e
            out[rows] += weights[rows, j, None] * experts[e](x[rows])
    return out

User: Can you explain why the sky is blue in two sentences?
Assistant: Sunlight is scattered by the molecules of the air, and short wavelengths are scattered much more
strongly than long ones (Rayleigh scattering). So wherever we look away from the sun, we mostly see scattered blue
light.

User: Write a haiku about autumn.
Assistant: Maple leaves let go / the river carries their red / farther than I can.

Les modeles de langage sont entraines sur de grandes quantites de texte. Die Ubersetzung in andere Sprachen
gelingt ihnen oft erstaunlich gut. 1 + 1 = 2, 2 * 3 = 6, and the derivative of x**2 is 2*x.
SELECT name, count(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC LIMIT 10;
"""


def check_gpu_experts(experts_per_layer: Sequence[int], n: int) -> None:
    """Refuse, before any weight is read, an N the model cannot have: 0 <= N <= E of every MoE layer."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"--gpu-experts must be an integer >= 0, got {n!r}")
    if not n:
        return
    if not experts_per_layer:
        raise ValueError(f"--gpu-experts {n}: this model has no routed experts")
    if n > min(experts_per_layer):
        raise ValueError(f"--gpu-experts {n}: the MoE layers have {min(experts_per_layer)} routed experts each; "
                         f"at most {min(experts_per_layer)} can stay on the GPU")


def calibration_text(path: Optional[str]) -> tuple:
    """(text, name): the contents of ``path`` (UTF-8), or the built-in text when None."""
    if path is None:
        return DEFAULT_TEXT, "built-in text"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--calibration-file {path}: cannot read it as UTF-8 text ({err})") from None
    if not text.strip():
        raise ValueError(f"--calibration-file {path} is empty")
    return text, str(path)


@torch.inference_mode()
def count_routing(model: nn.Module, blocks: list, token_ids: Sequence[int], device, dtype,
                  chunk: int = 512) -> list:
    """Prefill ``token_ids`` (one sequence, in chunks) through ``model`` and return, per block of ``blocks`` (the
    (name, module) pairs of loader.moe_blocks, in forward order), how often each expert was chosen: int64 [E]."""
    if not token_ids:
        raise ValueError("no calibration tokens")
    counts = [torch.zeros(layer.num_experts, dtype=torch.int64) for _, layer in blocks]  # [E] per layer

    def counter(c: torch.Tensor, E: int):
        def count(topk_ids: torch.Tensor) -> None:
            c.add_(torch.bincount(topk_ids[topk_ids >= 0].flatten().cpu(), minlength=E)[:E])
        return count

    for (_, layer), c in zip(blocks, counts):
        layer.route_observer = counter(c, layer.num_experts)
    try:
        n = len(token_ids)
        cache = model.make_cache(1, n, dtype, device)
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        slots = torch.zeros(1, dtype=torch.int64, device=device)
        for i in range(0, n, chunk):
            part = ids[i:i + chunk]
            positions = torch.arange(i, i + len(part), device=device)[None]
            model(part[None].to(device), Step(positions, slots, kv_len=i + len(part), first_slot=0, start=i), cache)
    finally:
        for _, layer in blocks:
            layer.route_observer = None
    return counts


def choose_experts(counts: torch.Tensor, n: int) -> list:
    """The ``n`` most often chosen experts of a layer (ties: the lower id first), sorted by id."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return sorted(order[:n].tolist())


def coverage(counts: torch.Tensor, expert_ids: Sequence[int]) -> float:
    """Fraction of a layer's routed (token, expert) pairs that went to ``expert_ids``."""
    total = int(counts.sum())
    return float(counts[list(expert_ids)].sum()) / total if total else 0.0


def place_gpu_experts(model: nn.Module, blocks: list, n: Union[int, Sequence[int]], dtype: torch.dtype, device,
                      token_ids: Optional[Sequence[int]] = None, source: str = "",
                      log: Callable[[str], None] = print, storage: Union[str, Sequence[str]] = "auto") -> dict:
    """Keep ``n`` experts of every MoE block on ``device`` (or ``n[i]`` of block i: placement rules; 0 keeps none):
    the most routed on ``token_ids`` (a calibration run), or the first ``n`` when ``token_ids`` is None, stored as
    ``storage`` (or ``storage[i]``): auto (the CPU engine's format), bf16, int8, int4 (GpuExperts.from_cpu). Each
    MoE layer must have the CPU engine behind a GPU model (a hybrid placement). Returns the report kept in
    ``LoadedModel.info``."""
    storages = [storage] * len(blocks) if isinstance(storage, str) else list(storage)
    per_layer = [n] * len(blocks) if isinstance(n, int) else list(n)
    if not any(per_layer):
        return {}
    n = per_layer[0] if len(set(per_layer)) == 1 else per_layer
    counts = None
    if token_ids is not None:
        token_ids = list(token_ids)[:MAX_CALIBRATION_TOKENS]
        counts = count_routing(model, blocks, token_ids, device, dtype)
    layers = []
    for i, ((name, layer), k) in enumerate(zip(blocks, per_layer)):
        engine = layer.engine
        if engine is None:
            raise TypeError(f"{name}: GPU experts need the CPU expert engine behind the MoE layer")
        if not k:
            continue
        ids = choose_experts(counts[i], k) if counts is not None else first_experts(engine.num_experts, k)
        layer.set_gpu_experts(GpuExperts.from_cpu(engine, ids, dtype, device, storages[i]))
        layers.append({"block": name, "experts": ids, "format": layer.gpu.storage.name,
                       "coverage": coverage(counts[i], ids) if counts is not None else None})
    report = {"n": n, "chosen_by": "calibration" if counts is not None else "first",
              "calibration": source if counts is not None else None,
              "calibration_tokens": len(token_ids) if counts is not None else 0, "layers": layers,
              "bytes": sum(layer.gpu.nbytes for _, layer in blocks if layer.gpu is not None)}
    what = f"{n} per MoE layer" if isinstance(n, int) else f"{','.join(map(str, n))} in the MoE layers"
    what += f", {'/'.join(sorted({layer['format'] for layer in layers}))}"
    if counts is not None:
        cov = [layer["coverage"] for layer in layers]
        report["mean_coverage"] = sum(cov) / len(cov)
        log(f"hetmoe: GPU experts: {what} ({report['bytes'] / 2**20:.1f} MiB), the most routed on "
            f"{len(token_ids)} tokens of the {source}: they cover {100 * report['mean_coverage']:.1f}% of the routed "
            f"(token, expert) pairs (mean over {len(cov)} layers, min {100 * min(cov):.1f}%, max "
            f"{100 * max(cov):.1f}%)")
        log("hetmoe: GPU experts per layer (coverage: ids): " + "; ".join(
            f"{_layer_name(layer['block'])} {100 * layer['coverage']:.0f}%: {','.join(map(str, layer['experts']))}"
            for layer in layers))
    else:
        report["mean_coverage"] = None
        first = f"{n} of every MoE layer" if isinstance(n, int) else f"{','.join(map(str, n))} of the MoE layers"
        log(f"hetmoe: GPU experts: the first {first} ({report['bytes'] / 2**20:.1f} MiB; "
            f"no calibration: {source or 'no tokenizer'})")
    return report


def _layer_name(block: str) -> str:
    parts = block.split(".")
    return f"L{parts[2]}" if len(parts) > 2 and parts[1] == "layers" else block


def keep_gpu_experts(model: nn.Module, blocks: list, plan, options, tokenize: Optional[Callable[[str], list]],
                     log: Callable[[str], None]) -> dict:
    """``options.gpu_experts`` experts per MoE block on the plan's GPU (per block: ``plan.layers``, where the
    placement rules may set other counts), after loading: chosen on the calibration text through ``tokenize``
    (text -> token ids), or the first N when ``tokenize`` is None or fails. On a CPU-only placement N is ignored,
    with a note. Returns the report for ``LoadedModel.info["gpu_experts"]``."""
    n = [lp.gpu_experts for lp in plan.layers] if plan.layers else options.gpu_experts
    if plan.device.type != "cuda":
        if options.gpu_experts:
            log(f"hetmoe: note: --gpu-experts {options.gpu_experts} ignored: the placement is CPU-only (every "
                "expert runs on the CPU)")
        return {}
    if not (any(n) if isinstance(n, list) else n):
        return {}
    odd = [block for _, block in blocks if not block.plain_swiglu]
    if odd:  # GpuExperts' kernels compute plain SwiGLU without biases: these experts stay on the CPU engine
        log(f"hetmoe: GPU-resident experts off: the routed experts are {odd[0].glu.kind}"
            f"{' with biases' if odd[0].bias else ''}, which only the CPU engine computes; every expert runs there")
        return {}
    text, name = calibration_text(options.calibration_file)
    token_ids, source = None, "the model has no tokenizer"
    if tokenize is not None:
        try:
            token_ids, source = tokenize(text), name
        except (OSError, ValueError) as err:
            source = f"its tokenizer could not be read: {err}"
    if token_ids is not None and not token_ids:
        token_ids, source = None, f"the {name} gives no tokens"
    if token_ids is None and options.calibration_file is not None:
        raise ValueError(f"--calibration-file {options.calibration_file}: cannot calibrate ({source})")
    storage = [lp.gpu_format for lp in plan.layers] if plan.layers else options.gpu_experts_format
    return place_gpu_experts(model, blocks, n, plan.dtype, plan.device, token_ids, source, log, storage)
