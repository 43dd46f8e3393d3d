"""Dense weights in the dense format of the placement (``--dense-format``; the table: hetmoe/layers/linear.py).

Which linears a dense format applies to, and the swap that packs them once their weights are loaded: attention
projections (q/k/v fused into one, MLA's q/kv_a fused, q_b, o), shared experts and dense MLPs (gate/up fused, down)
and lm_head. Routers (``gate``, ``shared_expert_gate``) stay in the model dtype: top-k choices flip on small errors.
MLA's ``kv_b_proj`` stays too: the absorbed decode form reads its per-head slices as weights (layers/attention.py).
The embedding stays: a token reads one row of it.

On the CPU a packed linear is the engine's matrix product (hetmoe/cpu/linear.py ``CPULinear``); on a GPU a
weight-only kernel that dequantizes in its K loop (hetmoe/layers/gpu_linear.py ``GPULinear``). Both take the same
list of ``nn.Linear`` (one fused matrix of their rows) and offer ``forward(x)`` and ``parts(x)``.
"""

from __future__ import annotations

from torch import nn

from hetmoe.layers.linear import FusedLinears

# Linears left in the model dtype whatever the dense format (see above).
KEEP = ("gate", "shared_expert_gate", "kv_b_proj")


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
