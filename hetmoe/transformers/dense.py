"""The dense part of a Transformers model in a dense format (``from_pretrained(..., dense_format=...)``,
``--dense-format``; the formats: docs/dense-formats.md).

The model's own ``nn.Linear`` modules of the dense part (attention projections, shared experts, dense MLPs,
lm_head) are replaced by the engine's packed linears, by the native loader's code (hetmoe/load/dense.py
``pack_dense``: the same choice of what is packed and what stays, the same ``CPULinear`` / ``GPULinear``): one
decoder layer right after it loads, so at most one layer's float copy is alive. Transformers' modules call them as
they called the linears. On the CPU, linears that read one input (``SAME_INPUT``: q/k/v, MLA's q_a/kv_a, gate/up)
are packed as one matrix, as natively; Transformers calls them one by one, so the first call computes them all and
the others take their parts (``SharedInputPart``: only for an input equal to the one computed, else it computes
again: never a stale part). One engine call instead of three: a decode step's calls each pay a wake-up of the pool.

Which format ``auto`` is, is the native plan's rule (hetmoe/plan/placement.py ``default_dense``): on the CPU int8,
or the dtype for a dense part of at most 1 G parameters; on a GPU bf16 (the Transformers path has no VRAM plan to
step down from). ``bf16`` leaves the model exactly as Transformers computes it.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch
from torch import nn

from hetmoe.config.formats import DENSE_FORMAT_CHOICES, DENSE_FORMATS, dense_format
from hetmoe.layers.linear import FusedLinears
from hetmoe.load.dense import KEEP, PackedPart, pack_dense

_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")
# Linears of one Transformers module that read the same input: the packed matrix's name -> theirs, in row order.
SAME_INPUT = {"packed_qkv": ("q_proj", "k_proj", "v_proj"), "packed_q_kv_a": ("q_a_proj", "kv_a_proj_with_mqa"),
              "packed_gate_up": ("gate_proj", "up_proj"), "packed_w13": ("w1", "w3"),
              "packed_in_proj": ("in_proj_qkvz", "in_proj_ba")}


def choose(name: str, dev: torch.device, dtype: torch.dtype, dense_params: int) -> tuple:
    """(format, why) of ``dense_format`` ``name`` for a dense part of ``dense_params`` parameters in ``dtype`` on
    ``dev``; a ValueError for a name that is not a format, or one that does not run there."""
    from hetmoe.plan.placement import default_dense, fp8_runs

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


def dense_bytes(model: nn.Module, dense_params: int, fmt: str, itemsize: int) -> int:
    """Bytes of a dense part of ``dense_params`` parameters (``itemsize`` each) once its linears are packed in
    ``fmt`` (the model may be on meta: shapes only). The RAM left for the experts (``experts_format="auto"``)."""
    if fmt == "bf16":
        return dense_params * itemsize
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and
               name.rsplit(".", 1)[-1] not in KEEP]
    packed = sum(DENSE_FORMATS[fmt].nbytes(m.out_features, m.in_features) for m in linears)
    return (dense_params - sum(m.weight.numel() for m in linears)) * itemsize + packed


def layer_prefix(name: str) -> str:
    """``model.layers.3`` of ``model.layers.3.self_attn.q_proj.weight`` ("" outside the decoder layers)."""
    m = _LAYER_PREFIX.match("." + name)
    return m.group(1)[1:] if m else ""


def _loaded(module: nn.Module) -> bool:
    """Whether every linear under ``module`` holds its weights."""
    return all(not p.is_meta for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters())


class SharedInputPart(PackedPart):
    """Stands where one linear of a packed group was (``k_proj`` of ``packed_qkv``): the first call computes the whole
    group and keeps the other parts, served once each to calls with an equal input (compared by value: a changed or
    other input computes again). Parts are contiguous: Transformers ``view``s them."""

    def __init__(self, group: nn.Module, index: int, shared: dict):
        super().__init__(group, index)
        self._shared = shared  # one per group: the input computed ("x"), its parts, the indices not served yet

    def forward(self, x):
        s = self._shared
        if not (self.index in s.get("left", ()) and _equal(s["x"], x)):
            s.update(x=x.detach().clone(), parts=self._group[0].parts(x), left=set(range(len(self._group[0].sizes))))
        s["left"].discard(self.index)
        out = s["parts"][self.index].contiguous()
        if not s["left"]:
            s.clear()
        return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def _pack(root: nn.Module, fmt: str, dev: torch.device, dtype: torch.dtype, options) -> int:
    """``pack_dense`` on ``root``, the ``SAME_INPUT`` groups of its modules fused first on the CPU."""
    if dev.type == "cpu":
        for module in root.modules():
            for fused, names in SAME_INPUT.items():
                lins = [module._modules.get(n) for n in names]
                if hasattr(module, fused) or not all(isinstance(lin, nn.Linear) for lin in lins):
                    continue
                if len({lin.in_features for lin in lins}) == 1 and len({lin.bias is None for lin in lins}) == 1:
                    module.__dict__[fused] = FusedLinears(*lins)  # pack_dense packs it as one matrix
    made = pack_dense(root, fmt, dev, options, dtype)
    shared: dict = {}
    for module in root.modules():
        for name, child in list(module.named_children()):
            if type(child) is PackedPart:  # computes its whole group per call: share one computation instead
                group = child._group[0]
                setattr(module, name, SharedInputPart(group, child.index, shared.setdefault(id(group), {})))
    return made


def pack_layer(model: nn.Module, prefix: str, fmt: str, dev: torch.device, dtype: torch.dtype, options) -> int:
    """Packs the dense linears of the decoder layer ``prefix`` once all its weights are loaded; returns the bytes
    made (0: ``bf16``, or a layer not yet loaded, left to ``pack_rest``)."""
    if fmt == "bf16":
        return 0
    layer = model.get_submodule(prefix)
    if not _loaded(layer):
        return 0
    return _pack(layer, fmt, dev, dtype, options)


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
                made += _pack(holder, fmt, dev, dtype, options)
                setattr(parent, leaf, getattr(holder, leaf))
    return made


def pack_rest(model: nn.Module, fmt: str, dev: torch.device, dtype: torch.dtype, options) -> int:
    """Packs every dense linear not packed yet (tied lm_head, a layer loaded in pieces); all weights are loaded."""
    if fmt == "bf16":
        return 0
    return _pack(model, fmt, dev, dtype, options)


def linear_options(dev: torch.device, isa: str, threads, numa):
    """What ``pack_dense`` reads to build a ``CPULinear``: the ISA, and the experts' pool (one set of pinned
    threads for the experts and the dense linears); None on a GPU."""
    if dev.type != "cpu":
        return None
    from hetmoe.cpu.pool import shared_pool

    return SimpleNamespace(isa=isa, amx_min_tokens=None, pool=shared_pool(threads, "auto" if numa is None else numa))
