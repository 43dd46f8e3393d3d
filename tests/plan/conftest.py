"""The planner tests' meta models: full shapes built on the meta device (no weight in memory)."""

from __future__ import annotations

import pytest

from hetmoe.load.loader import build_meta, moe_blocks
from hetmoe.load.random_weights import shape_config


def meta_shape(name: str) -> tuple:
    """(config, meta model, MoE blocks, expert intermediate size) of the shape ``name`` (random_weights.SHAPES)."""
    cfg = shape_config(name)
    model = build_meta(cfg)
    return cfg, model, moe_blocks(model), cfg.moe_intermediate_size


@pytest.fixture(scope="module")
def deepseek():
    """The full 61-layer DeepSeek-V3 shape."""
    return meta_shape("deepseek-v3")


@pytest.fixture(scope="module")
def qwen():
    """The full 48-layer Qwen3-30B-A3B shape."""
    return meta_shape("qwen3-30b-a3b")
