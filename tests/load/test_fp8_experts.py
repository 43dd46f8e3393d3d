"""Block FP8 routed experts held at the checkpoint's own bytes (the CPU engine's fp8 format; hetmoe/load/checkpoint.py
load_exact_experts, hetmoe/cpu/codes.py load_fp8): a tiny Qwen3-MoE written with Transformers' own class, its routed
experts then stored as FP8 checkpoints store them (e4m3 and an fp32 weight_scale_inv per 128 x 128 block; hidden 192:
a partial block along K and along N).

* --experts-format auto takes fp8 for an FP8 checkpoint (the plan says why); every expert's values are bitwise the
  file's e4m3 x scale.
* Logits match Transformers' own model on the dequantized weights (fp32): on the row-block path within fp32 summation,
  on the AMX class (every expert on the GEMM) within its bf16 activation rounding.
* A NaN code, a block size other than 128 and a missing scale are refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers_tiny import save_tiny  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.load.checkpoint import CheckpointError, dequantize_fp8  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from paths import BEST_AMX_PATH, BEST_ROW_PATH  # noqa: E402

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
SIZES = dict(hidden_size=192, moe_intermediate_size=128)
PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 33, 60, 7]
DECODE = (19, 4)


def quantize_blocks(w: torch.Tensor) -> tuple:
    """fp32 [N, K] -> (e4m3 [N, K], fp32 scale_inv [ceil(N/128), ceil(K/128)]): each block's largest |w| to 448."""
    N, K = w.shape
    pad = torch.nn.functional.pad(w, (0, -K % 128, 0, -N % 128))
    blocks = pad.view(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view_as(pad)[:N, :K].contiguous()
    return q, scale


def write_fp8(src, dst, rewrite=None, quant=QUANT):
    """``src`` (a saved fp32 checkpoint) with its routed experts in block FP8, into ``dst``; ``rewrite``: a function
    (name, codes, scale_inv) -> (codes, scale_inv or None) changing what is written. Returns dst."""
    dst = shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, t in load_file(dst / shard).items():
            if ".mlp.experts." in name:
                q, s = quantize_blocks(t.float())
                if rewrite is not None:
                    q, s = rewrite(name, q, s)
                tensors[name] = q
                if s is not None:
                    tensors[name + "_scale_inv"] = s
                    index["weight_map"][name + "_scale_inv"] = shard
            else:
                tensors[name] = t
        save_file(tensors, dst / shard, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    return dst


def dequantized_copy(fp8, dst):
    """``fp8``'s checkpoint with every expert dequantized (e4m3 x scale, fp32) and no quantization_config: what the
    reference model reads."""
    dst = shutil.copytree(fp8, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(dst / shard)
        out = {n: (dequantize_fp8(t, tensors[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t)
               for n, t in tensors.items() if not n.endswith("_scale_inv")}
        save_file(out, dst / shard, metadata={"format": "pt"})
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if not n.endswith("_scale_inv")}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-experts")
    plain = save_tiny("qwen3_moe", root / "plain", seed=5, overrides=SIZES)
    fp8 = write_fp8(plain, root / "fp8")
    return {"plain": plain, "fp8": fp8, "deq": dequantized_copy(fp8, root / "deq")}


def reference_logits(path) -> torch.Tensor:
    """Transformers' own Qwen3MoeForCausalLM (fp32) on the dequantized checkpoint: the last position's logits after
    the prompt and after each decode token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, out = list(PROMPT), []
    with torch.no_grad():
        for nxt in (None,) + DECODE:
            if nxt is not None:
                ids.append(nxt)
            out.append(model(torch.tensor([ids])).logits[0, -1].float())
    return torch.stack(out)


def engine_logits(loaded) -> torch.Tensor:
    from hetmoe.engine.runner import Runner

    runner = Runner(loaded)
    out = [runner.prefill(list(PROMPT)).reshape(-1).float()]
    return torch.stack(out + [runner.decode(t).reshape(-1).float() for t in DECODE])


def load(path, log=None, **opts):
    options = EngineOptions(device="cpu", dtype="fp32", max_context=64, **opts)
    return load_model(path, options, expert_cache=None, progress=False, log=log or (lambda m: None))


def file_experts(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_auto_holds_the_checkpoints_fp8_experts(ckpts):
    said = []
    loaded = load(ckpts["fp8"], log=said.append)
    plan = loaded.plan
    assert plan.experts_format == "fp8" and plan.group_size == 128
    assert plan.why["routed experts"].startswith("auto: the checkpoint's own FP8 experts")
    assert any("fp8" in line and "routed experts" in line for line in said), said
    files = file_experts(ckpts["fp8"])
    blocks = moe_blocks(loaded.model)
    assert len(blocks) == 2
    for name, block in blocks:
        ex = block.experts
        info = ex.info()
        assert (info["weight_format"], info["group_size"], info["gate_up_shared_scales"]) == ("fp8", 128, True)
        for e in range(ex.num_experts):
            for got, which in zip(ex.dequantized(e), ("gate_proj", "up_proj", "down_proj")):
                key = f"{name}.experts.{e}.{which}.weight"
                assert torch.equal(got, dequantize_fp8(files[key], files[key + "_scale_inv"])), key
    assert loaded.info["expert_bytes"] == sum(b.experts.nbytes for _, b in blocks)


@pytest.mark.parametrize("path", [BEST_ROW_PATH, BEST_AMX_PATH], ids=str)
def test_logits_match_transformers_on_the_dequantized_weights(ckpts, path):
    ref = reference_logits(ckpts["deq"])
    ours = engine_logits(load(ckpts["fp8"], **path.options))
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    # max |a - b| / max |b|, MEASURED on this model: row blocks 1.1e-6 (fp32 products of the exact weights, the dense
    # part's fp32 summation order); the AMX class 3.4e-3, its bf16 activations' rounding (bf16 experts of the plain
    # checkpoint on the same class: 3.2e-3; this model's weights, std 0.08, are steeper than tests/paths.py's)
    bound = 1e-5 if not path.amx else 1e-2
    assert err <= bound, f"{path}: {err:.3g}"


def test_other_formats_are_dequantized_as_asked(ckpts):
    said = []
    loaded = load(ckpts["fp8"], log=said.append, experts_format="int8")
    assert loaded.plan.experts_format == "int8"
    assert any("dequantized and re-quantized into int8 as asked" in line for line in said), said
    said.clear()
    loaded = load(ckpts["fp8"], log=said.append, experts_format="fp8")
    assert any("held as fp8 at their own bytes, as asked" in line for line in said), said
    assert moe_blocks(loaded.model)[0][1].experts.info()["gate_up_shared_scales"]


def test_a_bf16_checkpoint_loads_into_fp8(ckpts):
    """--experts-format fp8 on a checkpoint of floats: rounded to E4M3 with block scales (auto never takes it)."""
    assert load(ckpts["plain"]).plan.experts_format == "bf16"
    loaded = load(ckpts["plain"], experts_format="fp8")
    name, block = moe_blocks(loaded.model)[0]
    files = file_experts(ckpts["plain"])
    got = block.experts.dequantized(0)[0]
    want = files[f"{name}.experts.0.gate_proj.weight"].float()
    assert ((got - want).norm() / want.norm()).item() <= 0.04  # E4M3's 3 mantissa bits


def test_bad_checkpoints_are_refused_by_name(ckpts, tmp_path):
    target = "model.layers.1.mlp.experts.3.up_proj.weight"

    def nan_code(name, q, s):
        if name == target:
            q = q.clone()
            q.view(torch.uint8)[5, 7] = 0xFF
        return q, s

    bad = write_fp8(ckpts["plain"], tmp_path / "nan", nan_code)
    with pytest.raises(CheckpointError, match=r"mlp\.experts: up of expert 3 holds the E4M3 NaN code 0xFF at \[5, 7\]"):
        load(bad)
    missing = write_fp8(ckpts["plain"], tmp_path / "missing", lambda n, q, s: (q, None if n == target else s))
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {target} has no {target}_scale_inv"):
        load(missing)
    blocks64 = write_fp8(ckpts["plain"], tmp_path / "b64", quant={**QUANT, "weight_block_size": [64, 64]})
    with pytest.raises(CheckpointError, match=r"weight_block_size \[64, 64\]"):
        load(blocks64)
    with pytest.raises(ValueError, match="fp8 experts need a group size of 128 .* or 32"):
        EngineOptions(experts_format="fp8", group_size=64)
