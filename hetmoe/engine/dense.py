"""Dense weights in the dense format of the placement (``--dense-format``; the table: hetmoe/layers/linear.py).

Which linears a dense format applies to, and the swap that packs them once their weights are loaded: attention
projections (q/k/v fused into one, MLA's q/kv_a fused, q_b, o), shared experts and dense MLPs (gate/up fused, down)
and lm_head. Routers (``gate``, ``shared_expert_gate``) stay in the model dtype: top-k choices flip on small errors
(on a bf16 CPU placement they run on the engine in its bf16 format, the same weights: see ``pack_dense``).
MLA's ``kv_b_proj`` stays too: the absorbed decode form reads its per-head slices as weights (layers/attention.py).
The embedding stays: a token reads one row of it.

On the CPU a packed linear is the engine's matrix product (hetmoe/cpu/linear.py ``CPULinear``); on a GPU a
weight-only kernel that dequantizes in its K loop (hetmoe/layers/gpu_linear.py ``GPULinear``). Both take the same
list of ``nn.Linear`` (one fused matrix of their rows) and offer ``forward(x)`` and ``parts(x)``.
"""

from __future__ import annotations

import torch
from torch import nn

from hetmoe.layers.linear import DENSE_FORMATS, DenseFormat, FusedLinears

# Linears left in the model dtype whatever the dense format (see above).
ROUTERS = ("gate", "shared_expert_gate")
KEEP = ROUTERS + ("kv_b_proj",)


def _fused_groups(module: nn.Module) -> list:
    """(attribute, FusedLinears) of ``module``'s fused projections (qkv, gate_up, q_kv_a)."""
    return [(name, v) for name, v in vars(module).items() if isinstance(v, FusedLinears)]


def dense_linears(model: nn.Module) -> list:
    """The linears a dense format packs, as (name, out_features, in_features): one entry per fused group (its rows
    side by side, named by its first linear) and per other linear. Works on a meta-device model (the plan)."""
    out, fused = [], set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for _, group in _fused_groups(module):
            fused.update(id(lin) for lin in group.linears)
            first = next(n for n, c in module.named_children() if c is group.linears[0])
            out.append((prefix + first, sum(group.sizes), group.linears[0].in_features))
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and id(module) not in fused and leaf not in KEEP:
            out.append((name, module.out_features, module.in_features))
    return out


class PackedPart(nn.Module):
    """Stands where one linear of a packed fused group was (``q_proj`` of a packed ``qkv``): computes the group and
    returns its own part, so a path that calls the linears one by one stays correct. Holds no weight."""

    def __init__(self, group: nn.Module, index: int):
        super().__init__()
        self.index = index
        self._group = (group,)  # not a child: the group's bytes belong to the module that owns it

    def forward(self, x):
        return self._group[0].parts(x)[self.index]


def _linear_factory(device, options):
    """(list of nn.Linear, format) -> a packed linear module on ``device``."""
    if device.type == "cpu":
        from hetmoe.cpu import CPULinear

        kw = {"isa": options.isa, "amx_min_tokens": options.amx_min_tokens} if options is not None else {}
        return lambda linears, fmt: CPULinear.from_linear(linears, fmt, DENSE_FORMATS[fmt].group, **kw)
    from hetmoe.layers.gpu_linear import GPULinear

    return lambda linears, fmt: GPULinear.from_linears(linears, fmt, device)


def pack_dense(root: nn.Module, fmt: str, device, options=None, dtype=None) -> int:
    """Packs the dense linears under ``root`` (a decoder layer, or the whole model; see the module docstring) into
    ``fmt`` on ``device``, fusing the layer's projections first (idempotent: packed modules are left alone), and
    frees their source weights. Returns the bytes of the packed weights made.

    bf16 on a GPU packs nothing (cuBLAS reads bf16). On the CPU with a bf16 ``dtype`` everything goes to the engine,
    bf16 included, and the routers too in bf16: the weights exactly as given, multiplied in fp32, every product of
    a decode step on the engine's threads (docs/dense-formats.md); with fp32 weights (small models) bf16 packs
    nothing."""
    engine_bf16 = device.type == "cpu" and dtype == torch.bfloat16
    if fmt == "bf16" and not engine_bf16:
        return 0
    for module in root.modules():
        if hasattr(module, "fuse_projections") and not hasattr(module, "model"):  # not a CausalLM: its layers
            module.fuse_projections()
    make = _linear_factory(device, options)
    made = 0
    for module in list(root.modules()):
        for attr, group in _fused_groups(module):
            packed = make(list(group.linears), fmt)
            setattr(module, attr, packed)
            names = {id(c): n for n, c in module.named_children()}
            for i, lin in enumerate(group.linears):
                setattr(module, names[id(lin)], PackedPart(packed, i))
            made += packed.nbytes
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or name == "kv_b_proj":
                continue
            if name not in ROUTERS or engine_bf16:
                packed = make([child], "bf16" if name in ROUTERS else fmt)
                setattr(module, name, packed)
                made += packed.nbytes
    return made


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed dense weights in ``model`` (the modules ``pack_dense`` made: CPULinear and GPULinear carry
    their ``format`` from the dense format table)."""
    return sum(m.nbytes for m in model.modules() if isinstance(getattr(m, "format", None), DenseFormat))
