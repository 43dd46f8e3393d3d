"""--experts-format auto below int4 (hetmoe/plan/lowbit.py) and --experts-format int3 / int2 in the plan."""

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.load.loader import build_meta, moe_blocks, plan_model
from hetmoe.load.random_weights import shape_config
from hetmoe.plan.memory import PlanError


def _plan(name="deepseek-v3", **opts):
    cfg = shape_config(name)
    model = build_meta(cfg)
    options = EngineOptions(**{"device": "cpu", **opts})
    inter = cfg.get("moe_intermediate_size") or cfg.intermediate_size
    return plan_model(model, cfg, moe_blocks(model), options, inter, torch.device("cpu"))


def test_deepseek_v3_fits_256_gb_with_a_mix():
    plan = _plan(cpu_memory="256GB")
    assert plan.ram_bytes <= 256e9
    fmts = {(lp.experts_format, lp.down_format or lp.experts_format) for lp in plan.layers}
    assert len(fmts) > 1 and {f for pair in fmts for f in pair} <= {"int4", "int3", "int2"}
    assert "gate+up/down per MoE layer: 0-" in plan.why["routed experts"]
    first, last = plan.layers[0], plan.layers[-1]
    rank = {"int4": 0, "int3": 1, "int2": 2}
    assert rank[first.experts_format] <= rank[last.experts_format]  # the first layers keep more bits
    assert all(rank[lp.down_format or lp.experts_format] <= rank[lp.experts_format] for lp in plan.layers)


def test_auto_keeps_int4_where_it_fits_and_steps_down_only_as_needed():
    int4 = _plan(cpu_memory="4TiB", experts_format="int4")
    plan = _plan(cpu_memory=int4.ram_bytes + (1 << 20))
    assert {lp.formats for lp in plan.layers} == {"int4"}
    tight = _plan(cpu_memory=int(int4.ram_bytes * 0.93), max_context=4096)
    assert tight.ram_bytes <= int(int4.ram_bytes * 0.93)
    assert "int2" not in "/".join(lp.formats for lp in tight.layers)


def test_a_budget_below_int2_is_refused_naming_the_minimum():
    floor = _plan(cpu_memory="4TiB", experts_format="int2", max_context=4096)
    with pytest.raises(PlanError, match="even with every routed expert in int2: the plan needs at least"):
        _plan(cpu_memory=int(floor.ram_bytes * 0.9), max_context=4096)


@pytest.mark.parametrize("fmt, bpw", [("int3", 3.3125), ("int2", 2.625)])
def test_own_formats_are_counted_with_their_scales(fmt, bpw):
    plan = _plan(cpu_memory="4TiB", experts_format=fmt)
    routed = 653.91e9
    assert plan.ram["routed experts"] * 8 / routed == pytest.approx(bpw, rel=0.01)


def test_own_formats_refuse_another_group():
    with pytest.raises(ValueError, match="group size of 32"):
        EngineOptions(experts_format="int2", group_size=64)
