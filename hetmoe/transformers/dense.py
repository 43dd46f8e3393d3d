"""The dense part of a Transformers model in a dense format (``from_pretrained(..., dense_format=...)``,
``--dense-format``; the formats: docs/dense-formats.md).

The model's own ``nn.Linear`` modules of the dense part (attention projections, shared experts, dense MLPs,
lm_head) are replaced by the engine's packed linears, by the native loader's code (hetmoe/engine/dense.py
``pack_dense``: the same choice of what is packed and what stays, the same ``CPULinear`` / ``GPULinear``): one
decoder layer right after it loads, so at most one layer's float copy is alive. Transformers' modules call them as
they called the linears. Unlike the native model files, q/k/v (and gate/up) stay separate matrices, one call each:
Transformers' attention calls them one by one.

Which format ``auto`` is, is the native plan's rule (hetmoe/engine/placement.py ``default_dense``): on the CPU int8,
or the dtype for a dense part of at most 1 G parameters; on a GPU bf16 (the Transformers path has no VRAM plan to
step down from). ``bf16`` leaves the model exactly as Transformers computes it.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from hetmoe.engine.dense import pack_dense
from hetmoe.layers.linear import DENSE_FORMAT_CHOICES, dense_format

_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")


def choose(name: str, dev: torch.device, dtype: torch.dtype, dense_params: int) -> tuple:
    """(format, why) of ``dense_format`` ``name`` for a dense part of ``dense_params`` parameters in ``dtype`` on
    ``dev``; a ValueError for a name that is not a format, or one that does not run there."""
    from hetmoe.engine.placement import default_dense, fp8_runs

    if name not in DENSE_FORMAT_CHOICES:
        raise ValueError(f"dense_format must be one of {', '.join(DENSE_FORMAT_CHOICES)}, got {name!r}")
    where = "cuda" if dev.type == "cuda" else "cpu"
    if name == "auto":
        fmt, why = default_dense(SimpleNamespace(dense_params=dense_params), dev)
    else:
        dense_format(name, where)  # ValueError: fp8 on the CPU
        if name == "fp8" and (reason := fp8_runs(dev, True)):
            raise ValueError(f"dense_format fp8: this GPU cannot run it ({reason}); use int8 or int4")
        fmt, why = name, f"dense_format={name}"
    if where == "cuda" and fmt != "bf16" and dtype != torch.bfloat16:
        raise ValueError(f"dense_format {fmt} on a GPU takes bf16 activations; the model's dtype is "
                         f"{str(dtype).replace('torch.', '')}: load it with dtype='bf16' (or dense_format='bf16')")
    return fmt, why


def layer_prefix(name: str) -> str:
    """``model.layers.3`` of ``model.layers.3.self_attn.q_proj.weight`` ("" outside the decoder layers)."""
    m = _LAYER_PREFIX.match("." + name)
    return m.group(1)[1:] if m else ""


def _loaded(module: nn.Module) -> bool:
    """Whether every linear under ``module`` holds its weights."""
    return all(not p.is_meta for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters())


def pack_layer(model: nn.Module, prefix: str, fmt: str, dev: torch.device, dtype: torch.dtype, options) -> int:
    """Packs the dense linears of the decoder layer ``prefix`` once all its weights are loaded; returns the bytes
    made (0: ``bf16``, or a layer not yet loaded, left to ``pack_rest``)."""
    if fmt == "bf16":
        return 0
    layer = model.get_submodule(prefix)
    if not _loaded(layer):
        return 0
    return pack_dense(layer, fmt, dev, options, dtype)


def pack_outside_layers(model: nn.Module, fmt: str, dev: torch.device, dtype: torch.dtype, options) -> int:
    """Packs the loaded linears outside the decoder layers (lm_head) one at a time, so an untied lm_head's float
    copy is freed before the layers load. A tied one is still on meta: ``pack_rest`` packs it."""
    if fmt == "bf16":
        return 0
    made = 0
    for name, parent in list(model.named_modules()):
        if ".layers." in f".{name}.":
            continue
        for leaf, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and _loaded(child):
                holder = nn.Module()  # pack_dense packs a root's children: one holder, the linear under its name
                holder.add_module(leaf, child)
                made += pack_dense(holder, fmt, dev, options, dtype)
                setattr(parent, leaf, getattr(holder, leaf))
    return made


def pack_rest(model: nn.Module, fmt: str, dev: torch.device, dtype: torch.dtype, options) -> int:
    """Packs every dense linear not packed yet (tied lm_head, a layer loaded in pieces); all weights are loaded."""
    if fmt == "bf16":
        return 0
    return pack_dense(model, fmt, dev, options, dtype)


def linear_options(dev: torch.device, isa: str, threads, numa):
    """What ``pack_dense`` reads to build a ``CPULinear``: the ISA, and the experts' pool (one set of pinned
    threads for the experts and the dense linears); None on a GPU."""
    if dev.type != "cpu":
        return None
    from hetmoe.cpu.pool import shared_pool

    return SimpleNamespace(isa=isa, amx_min_tokens=None, pool=shared_pool(threads, "auto" if numa is None else numa))
