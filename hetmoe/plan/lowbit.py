"""--experts-format auto below int4: where the routed experts do not fit the RAM budget at int4, each MoE layer's
gate/up and down projections are stepped down to hetmoe's own int3 and int2 (hetmoe/cpu/lowbit.py) one at a time,
cheapest damage per byte saved first, until the plan fits.

The damage of a step is a prior, not a measurement: the plan is made from shapes alone, before any weight is read
(``hetmoe plan --shape``), and measuring every projection's output error would mean quantizing the whole model
twice at load. It is the mean squared weight error each format leaves on N(0, 1) weights with its own scale search
(int4 group 64: 0.0081, int3: 0.026, int2: 0.095 of the weights' power; tests/cpu/test_lowbit.py measures them)
times a sensitivity: down_proj twice gate/up (its input, the gated product, is heavy-tailed, and its error lands on
the residual stream unscaled by the gate) and the first tenth of the MoE layers twice the rest (their error is
carried through every later layer). Within those, later layers step down first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from hetmoe.config.options import DEFAULT_GROUP
from hetmoe.config.units import gib
from hetmoe.plan.memory import MemoryPlan, PlanError

if TYPE_CHECKING:
    from hetmoe.plan.memory import ModelShapes

LADDER = ("int4", "int3", "int2")  # what the chooser steps through, the most precise first
ERROR = {"int4": 0.0081, "int3": 0.026, "int2": 0.095}  # mean squared weight error per unit weight power (above)
DOWN_SENSITIVITY = 2.0
FIRST_LAYERS = 0.1  # the fraction of MoE layers counted twice
FIRST_SENSITIVITY = 2.0


@dataclass
class LayerChoice:
    """One MoE layer as the chooser placed it, with what the placement rules said of it (plan_layers reads it as a
    rules.Placement)."""

    experts_format: Optional[str] = None
    down_format: Optional[str] = None
    group_size: Optional[int] = None
    gpu_experts: Optional[int] = None
    defer_experts: Optional[int] = None
    gpu_experts_format: Optional[str] = None


def sensitivity(layer: int, n_layers: int, down: bool) -> float:
    first = layer < max(1, round(FIRST_LAYERS * n_layers))
    return (DOWN_SENSITIVITY if down else 1.0) * (FIRST_SENSITIVITY if first else 1.0)


def choose_mix(shapes: "ModelShapes", layers: Optional[list], ram: int, make: Callable[[list], MemoryPlan],
               ram_src: str) -> tuple:
    """(choices, plan): the LayerChoice of every MoE layer and ``make(choices)``'s plan within ``ram``, gate/up and
    down of layers the rules leave to auto stepped down from int4 as the module says. PlanError naming the least
    RAM the plan needs (every such projection int2) when even that does not fit."""
    n = shapes.n_moe_layers
    given = list(layers) if layers is not None else [None] * n
    choices = [LayerChoice(**{k: getattr(p, k, None) for k in ("experts_format", "group_size", "gpu_experts",
                                                                "defer_experts", "gpu_experts_format")})
               for p in given]
    free = [i for i, c in enumerate(choices) if c.experts_format is None and c.group_size is None]
    for i in free:
        choices[i].experts_format = choices[i].down_format = "int4"
    floor = [LayerChoice(**{**vars(c), **({"experts_format": "int2", "down_format": "int2"} if i in free else {})})
             for i, c in enumerate(choices)]
    least = make(floor)
    if least.ram_bytes > ram:
        raise PlanError(f"the model does not fit in RAM even with every routed expert in int2: the plan needs at least "
                        f"{gib(least.ram_bytes)} (routed experts {gib(least.ram['routed experts'])}), {ram_src}\n"
                        + "\n".join(least.table()), least)
    plan = make(choices)
    weights = 3 * shapes.hidden * shapes.expert_inter * max(1, shapes.n_routed // max(n, 1))
    steps = []  # (damage per byte saved, layer, down?) of every next step, recomputed as projections step down
    while plan.ram_bytes > ram:
        steps.clear()
        for i in free:
            for down in (False, True):
                fmt = choices[i].down_format if down else choices[i].experts_format
                if fmt == LADDER[-1]:
                    continue
                nxt = LADDER[LADDER.index(fmt) + 1]
                share = (1 if down else 2) / 3  # of the layer's weights
                saved = _saved(shapes, choices[i], down, nxt, i)
                damage = sensitivity(i, n, down) * (ERROR[nxt] - ERROR[fmt]) * share * weights
                steps.append((damage / max(saved, 1), -i, down, nxt))
        _, neg_i, down, nxt = min(steps)
        setattr(choices[-neg_i], "down_format" if down else "experts_format", nxt)
        plan = make(choices)
    return choices, plan


def _saved(shapes: "ModelShapes", c: LayerChoice, down: bool, nxt: str, i: int) -> int:
    """Bytes of one expert of layer ``i`` that stepping its gate/up (or down) to ``nxt`` saves."""
    g = DEFAULT_GROUP
    now = shapes.layer_expert_bytes(i, c.experts_format, g[c.experts_format], c.down_format)
    after = (shapes.layer_expert_bytes(i, c.experts_format, g[c.experts_format], nxt) if down else
             shapes.layer_expert_bytes(i, nxt, g[nxt], c.down_format))
    return now - after


def describe(plan: MemoryPlan) -> str:
    """The per-layer choice as runs of layers: ``layers 0-5 int4/int4, 6-57 int3/int4`` (gate+up / down)."""
    runs = []
    for i, lp in enumerate(plan.layers):
        f = f"{lp.experts_format}/{lp.down_format or lp.experts_format}"
        if runs and runs[-1][2] == f:
            runs[-1][1] = i
        else:
            runs.append([i, i, f])
    return "gate+up/down per MoE layer: " + ", ".join(f"{a}{'' if a == b else f'-{b}'} {f}" for a, b, f in runs)
