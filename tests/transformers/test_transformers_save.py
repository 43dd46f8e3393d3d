"""``save_pretrained`` on a model loaded by ``hetmoe.transformers.from_pretrained`` (hetmoe/transformers/loading.py):
refused with the reason when weights left the model's parameters at load (experts packed into the CPU engine,
dense linears packed into an engine format), since Transformers would write a checkpoint without them; a model
whose every weight is still a parameter (all experts on Transformers' own implementation, bf16 dense) saves as
usual. Tiny random checkpoints (tests/transformers_tiny.py), experts on BEST_ROW_PATH, CPU."""

import warnings

import pytest
import torch
from transformers_tiny import save_tiny

import hetmoe.transformers as ht
from paths import BEST_ROW_PATH


def load(path, **kw):
    return ht.from_pretrained(path, experts_format="bf16", device="cpu", dtype="fp32", isa=BEST_ROW_PATH.isa, **kw)


@pytest.mark.parametrize("dense_format, reasons", [
    ("bf16", ["routed experts of 2 module(s)", "packed into hetmoe's CPU engine"]),
    ("int8", ["routed experts of 2 module(s)", "dense linears were packed into the engine's int8 format"]),
])
def test_save_pretrained_of_packed_experts_is_refused(tmp_path, dense_format, reasons):
    model = load(save_tiny("qwen3_moe", tmp_path / "src"), dense_format=dense_format)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="save_pretrained") as err:
        model.save_pretrained(out)
    assert all(r in str(err.value) for r in reasons), str(err.value)
    assert not out.exists()  # nothing half written
    with pytest.raises(ValueError, match="push_to_hub: the routed experts"):
        model.push_to_hub("someone/model")  # refused before any network access


def test_a_model_left_whole_still_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ht.backend.FallbackWarning)
        model = load(save_tiny("gpt_oss", tmp_path / "src"), dense_format="bf16")  # every experts module falls back
    assert model.hetmoe_info["engine_modules"] == [] and model.hetmoe_info["dense_format"] == "bf16"
    model.save_pretrained(tmp_path / "out")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager").eval()
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)
