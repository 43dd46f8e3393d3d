"""The memory plan's routed-expert bytes against what a load allocates, for checkpoints whose experts are held in
their own layout: Hugging Face FP8 (per-channel: an fp32 scale per row and group of 128, not one shared per 16 rows;
MXFP8), built by tests/load/test_hf_fp8_formats.py's helpers. (GGUF files: tests/load/gguf/test_gguf_plan_types.py.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "load"))  # the FP8 checkpoint writers

from test_hf_fp8_formats import CHANNEL, MX, SIZES, load, write  # noqa: E402
from transformers_tiny import save_tiny  # noqa: E402

from hetmoe.cpu.layout import FP8_LAYOUTS, expert_bytes, layout_bytes  # noqa: E402
from hetmoe.load.fp8_formats import layout  # noqa: E402
from hetmoe.load.loader import moe_blocks  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("held-bytes")
    plain = save_tiny("qwen3_moe", root / "plain", seed=5, overrides=SIZES)
    return {kind: write(plain, root / kind, kind, quant) for kind, quant in (("mx", MX), ("channel", CHANNEL))}


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "fp8"])
@pytest.mark.parametrize("kind", ["mx", "channel"])
def test_fp8_experts_are_planned_at_the_bytes_held(checkpoints, kind, explicit):
    loaded = load(checkpoints[kind], **({"experts_format": "fp8"} if explicit else {}))
    engines = [block.experts for _, block in moe_blocks(loaded.model)]
    assert engines and all(e.info()["weight_format"] == "fp8" for e in engines)
    assert [lp.ram for lp in loaded.plan.layers] == [e.nbytes for e in engines]
    assert loaded.plan.ram["routed experts"] == loaded.info["expert_bytes"] == sum(e.nbytes for e in engines)
    H, I = engines[0].hidden_size, engines[0].intermediate_size
    each = layout_bytes(layout(kind), H, I)
    if kind == "channel":  # a scale per (row, group), not per (16 rows, group): more than the block layout's
        assert not engines[0].info()["gate_up_shared_scales"]
        assert each > expert_bytes("fp8", H, I, 128) and FP8_LAYOUTS[128]["shared_scales"]
    assert engines[0].nbytes == engines[0].num_experts * each
