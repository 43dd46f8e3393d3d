"""Placement rules applied to a built native model: the modules as rules see them, each MoE block's Placement, and
the deferral chains and streamed layers the plan's layers ask for. Parsing the rules file is hetmoe/config/rules.py."""

from __future__ import annotations

import dataclasses
import re

from hetmoe.config.rules import DENSE, EXPERTS, Placement, Rules
from hetmoe.moe import set_deferrals


def experts_class(block_class: str) -> str:
    """The class name Transformers gives the routed experts of a MoE block class: ``Qwen3MoeSparseMoeBlock`` ->
    ``Qwen3MoeExperts``, ``DeepseekV3MoE`` -> ``DeepseekV3Experts`` (so that ``class:`` reads the same in both)."""
    return re.sub(r"(SparseMoeBlock|MoE|Moe)$", "", block_class) + "Experts"


def native_modules(model, blocks: list) -> list:
    """(name, class name, kind) of the native model's modules, as rules see them: every module (DENSE), and for each
    MoE block ``B`` of ``blocks`` its routed experts as the module ``B.experts`` (EXPERTS; Transformers' name)."""
    out = [(n, type(m).__name__, DENSE) for n, m in model.named_modules() if n]
    kinds = {n: type(model.get_submodule(n)).__name__ for n, _ in blocks}
    out += [(f"{n}.experts", experts_class(kinds[n]), EXPERTS) for n, _ in blocks]
    return out


def apply_native(rules: Rules, model, blocks: list, device, dtype, top_k: int) -> list:
    """The rules of the native runner for a model placed on ``device`` with dense ``dtype`` (torch objects) and
    ``top_k`` experts per token: one Placement per MoE block of ``blocks`` (in order; empty where no rule takes
    it), with ``device: cuda`` made ``gpu_experts`` = every expert (``device: cpu``: none, unless it sets
    ``gpu_experts``). Refuses, at the rule's line, what the native
    runner cannot do: a device other than the placement's for dense modules, routed experts on a GPU without a
    GPU placement (or on another GPU), a dtype other than the placement's, more GPU experts than the layer has,
    a deferral of top-k or more."""
    taken = rules.assign(native_modules(model, blocks))
    where = "cuda" if device.type == "cuda" else "cpu"
    dt = "bf16" if str(dtype) == "torch.bfloat16" else "fp32"
    experts = {f"{b}.experts" for b, _ in blocks}
    for name, p in taken.items():
        r = p.rule
        if name in experts:
            continue
        if p.device is not None and _device(p.device, device) != where:
            raise rules.error(r, f"{name} on {p.device}: the native runner keeps every dense module on the "
                                 f"placement's device ({device}); set --device instead", "device")
        if p.dtype is not None and p.dtype != dt:
            raise rules.error(r, f"{name} in {p.dtype}: the native runner runs every dense module in one dtype "
                                 f"({dt} here); set --dtype instead", "dtype")
    out = []
    for name, layer in blocks:
        p = taken.get(f"{name}.experts", Placement())
        r = p.rule
        if p.device is not None and p.device != "cpu":
            if device.type != "cuda":
                raise rules.error(r, f"{name}.experts on {p.device}: the placement is CPU-only (--device cpu or no "
                                     "GPU)", "device")
            if _device(p.device, device) != "cuda":
                raise rules.error(r, f"{name}.experts on {p.device}: the model runs on {device}", "device")
            p = dataclasses.replace(p, gpu_experts=layer.num_experts)
        elif p.device == "cpu" and p.gpu_experts is None:  # all on the CPU engine, whatever --gpu-experts says
            p = dataclasses.replace(p, gpu_experts=0)
        elif p.gpu_experts is not None and p.gpu_experts > layer.num_experts:
            raise rules.error(r, f"gpu_experts {p.gpu_experts}: {name} has {layer.num_experts} routed experts",
                              "gpu_experts")
        if p.defer_experts is not None and p.defer_experts >= top_k:
            raise rules.error(r, f"defer_experts {p.defer_experts}: each token has {top_k} routed experts (top-"
                                 f"{top_k}); at most {top_k - 1} can be deferred", "defer_experts")
        out.append(p)
    return out


def _device(text: str, device) -> str:
    """"cpu" or "cuda" when ``text`` names ``device``'s kind (cuda:N only the placement's own GPU), else "other"."""
    if text == "cpu" or text == "cuda":
        return text
    index = device.index if device.index is not None else 0
    return "cuda" if device.type == "cuda" and text == f"cuda:{index}" else "other"


def defer_layers(blocks: list, plan) -> list:
    """Expert Deferral as the plan's layers ask (each its own d; ``--defer-experts`` or the rules): the chains of
    ``hetmoe.moe.set_deferrals``."""
    return set_deferrals([layer for _, layer in blocks], [lp.defer_experts for lp in plan.layers])


def layerwise_layers(blocks: list, plan) -> list:
    """The MoE layers the layerwise GPU prefill streams: not those whose experts are all on the GPU already (the
    rules' ``device: cuda``), and, when the rules mix bf16 with int8/int4 layers, only the kind of the largest
    layer (the slots hold one storage layout: bf16 has no scale ranges); the others prefill as usual. A layer of
    a deferral chain is never left out (a chain split between the two paths would lose a deferred part): a
    resident one is streamed too, one of the other kind turns the layerwise prefill off (no layer)."""
    n, ds = len(blocks), [lp.defer_experts for lp in plan.layers]
    chained = [bool(ds[i] and i < n - 1) or bool(i and ds[i - 1]) for i in range(n)]
    kind = [lp.experts_format == "bf16" for lp in plan.layers]
    streamed = [i for i, ((_, b), lp) in enumerate(zip(blocks, plan.layers)) if lp.gpu_experts < b.num_experts]
    big = kind[max(streamed or range(n), key=lambda i: plan.layers[i].ram)] if n else False
    out = []
    for i, (_, b) in enumerate(blocks):
        if kind[i] != big and chained[i]:
            return []
        if kind[i] == big and (i in streamed or chained[i]):
            out.append(b)
    return out
