"""What the tests of Hugging Face quantized checkpoints share (tests/load/test_hf_int4.py, test_hf_nvfp4.py): the
tiny Qwen3-MoE's sizes and which of its linears are quantized, loading one on the best row-block path, the experts'
bytes in the file, editing a written checkpoint's tensors and the loader's refusal of the edited copy. (The fixture
that fails any weight read, for errors that must come before it, is tests/load/conftest.py's ``no_weights``.)"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from hetmoe.config.options import EngineOptions
from hetmoe.load.checkpoint import CheckpointError
from hetmoe.load.loader import check_model_dir, load_model
from parity import DECODE_STEPS, hf_trace, max_rel, trace_ours
from paths import BEST_ROW_PATH

# Qwen3-MoE with every matrix a multiple of 128 wide: experts [128, 128], q/o [128, 128], k/v [64, 128]
SIZES = dict(hidden_size=128, moe_intermediate_size=128, head_dim=32, num_hidden_layers=2)
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)")
WEIGHTS = ("gate_proj", "up_proj", "down_proj")
ROUTER_SHARPNESS = 8.0


def load(path, log=None, **options):
    opts = EngineOptions(device="cpu", dtype="fp32", threads=1, **{**BEST_ROW_PATH.options, **options})
    return load_model(path, opts, expert_cache=None, progress=False, log=log or (lambda m: None))


def file_expert_bytes(path: Path) -> int:
    return sum(t.numel() * t.element_size() for n, t in load_file(path / "model.safetensors").items()
               if ".experts." in n)


def held_ratio(path: Path, label: str, log=None) -> tuple:
    """Load ``path`` -> (the loaded model, the routed experts' bytes held / their bytes in the file), the ratio
    printed under ``label``, after checking that the plan counted the layout the loader built."""
    loaded = load(path, log=log)
    held, file_bytes = loaded.info["expert_bytes"], file_expert_bytes(path)
    print(f"{label}: routed experts {held} bytes held, {file_bytes} in the file: {held / file_bytes:.4f}")
    assert loaded.plan.ram["routed experts"] == held  # the plan counted the layout the loader built
    return loaded, held / file_bytes


def logit_error(ckpt: Path, ref, path, label: str) -> float:
    """The largest relative logit error of checkpoint ``ckpt`` loaded on engine path ``path`` against Transformers'
    model ``ref`` (its dequantized weights), over a 2-row prompt of 11 and DECODE_STEPS steps; printed."""
    import transformers

    ids_, fed, want = hf_trace(transformers, ref, batch=2, prompt_len=11)
    got = trace_ours(load(ckpt, **path.options).model, ids_, fed)
    err = max(max_rel(a, b) for a, b in zip(got, want))
    print(f"{label} {path}: max rel. logit error {err:.2e} over {DECODE_STEPS} steps")
    return err


def edit_tensors(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_config(path: Path, change) -> None:
    """The checkpoint at ``path`` with its quantization_config changed in place by ``change(qc)``."""
    cfg = json.loads((path / "config.json").read_text())
    change(cfg["quantization_config"])
    (path / "config.json").write_text(json.dumps(cfg))


def assert_config_edit_refused(source: Path, dest: Path, change, message: str, check_dir: bool = True) -> None:
    """A copy of checkpoint ``source`` at ``dest`` with its quantization_config changed by ``change(qc)`` is refused
    by the loader with CheckpointError ``message`` (a regex), and (``check_dir``) by check_model_dir after
    config.json's path."""
    path = Path(shutil.copytree(source, dest))
    edit_config(path, change)
    with pytest.raises(CheckpointError, match=message):
        load(path)
    if check_dir:
        with pytest.raises(CheckpointError, match=f"^{re.escape(str(path / 'config.json'))}: .*{message}"):
            check_model_dir(path)


def assert_tensor_edit_refused(source: Path, dest: Path, change, message: str) -> None:
    """A copy of checkpoint ``source`` at ``dest`` with its tensors changed by ``change`` is refused by the loader with
    CheckpointError ``message`` (a regex) after the tensor file's name."""
    path = Path(shutil.copytree(source, dest))
    edit_tensors(path, change)
    with pytest.raises(CheckpointError, match=f"model.safetensors: {message}"):
        load(path)
