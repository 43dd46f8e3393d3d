"""A DeepSeek FP8 checkpoint in the fp8 dense format on a GPU keeps its own bytes (hetmoe/load/dense.py FP8Source,
the loader's Materializer, hetmoe/layers/gpu_linear.py GPULinear.from_fp8), and --dense-format auto prefers them.

CPU tests (CI): the loader's fill and pack_dense on CPU tensors; GPULinear on the CPU holds the packed bytes and runs
its fp32 reference path, so no GPU kernel is launched. The GPU-marked test loads the checkpoint on CUDA.
"""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.layers.gpu_linear import GPULinear, quantize_fp8  # noqa: E402
from hetmoe.load import dense  # noqa: E402
from hetmoe.load.checkpoint import Checkpoint, CheckpointError, block_fp8, dequantize_fp8  # noqa: E402
from hetmoe.load.dense import KEEP, FP8Source, PackedPart, fp8_parts_why, pack_dense  # noqa: E402
from hetmoe.load.loader import build_meta, moe_blocks, plan_model
from hetmoe.load.materialize import Materializer  # noqa: E402
from hetmoe.load.random_weights import shape_config, write_checkpoint  # noqa: E402
from hetmoe.plan.memory import PlanError

CPU = torch.device("cpu")
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Every fused group's parts but the last in whole 128-row blocks (q_a 128 | kv_a 96: a partial last block, as in
# DeepSeek-V3's 1536 | 576; gate/up 256 and 128), K = 192 (a partial K block): packed modules are the file's bytes.
# q_lora_rank 96: q_a | kv_a straddle a block and take the round trip.
EXACT = dict(hidden_size=192, intermediate_size=256, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=88,
             qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32, num_attention_heads=4, num_key_value_heads=4)
STRADDLE = {**EXACT, "q_lora_rank": 96}


def _quantized(name: str, t: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3 stores in FP8: every linear of the layers but the router (kv_b_proj and experts too)."""
    return t.dim() == 2 and name.startswith("model.layers.") and "norm" not in name and ".mlp.gate.weight" not in name


def write_fp8_checkpoint(path, overrides: dict, seed: int = 3):
    """A tiny DeepSeek-V3 checkpoint as DeepSeek ships it: e4m3 weights and fp32 weight_scale_inv per 128x128 block,
    quantization_config fp8 in config.json."""
    write_checkpoint(path, "deepseek_v3", overrides, seed=seed, dtype="float32", max_shard_size="1MB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        for name, t in load_file(path / shard).items():
            if _quantized(name, t):
                q, scale = quantize_fp8(t * 4)  # (x 4: a spread of block scales)
                tensors[name], tensors[name + "_scale_inv"] = q[:, :t.shape[1]].contiguous(), scale
                index["weight_map"][name + "_scale_inv"] = shard
            else:
                tensors[name] = t
        save_file(tensors, path / shard, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT}))
    return path


@pytest.fixture(scope="module")
def fp8_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-ckpt")
    return {"exact": write_fp8_checkpoint(root / "exact", EXACT), "straddle": write_fp8_checkpoint(root / "straddle",
                                                                                                   STRADDLE)}


def file_tensors(path) -> dict:
    """Every tensor of the checkpoint, read with safetensors itself (not hetmoe's reader)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def fill_and_pack(path, layer: int, monkeypatch=None):
    """The loader's steps for one decoder layer with an fp8 placement, on CPU tensors: globals and the layer filled
    (FP8 weights taken as stored), then pack_dense. Round-trip groups (if any) go to GPULinear.from_linears on the
    CPU (its reference path) in place of the loader's factory, which would pick the CPU engine."""
    ckpt = Checkpoint(path)
    model = build_meta(ckpt.config)
    plan = type("Plan", (), {"device": CPU, "dtype": torch.bfloat16, "dense_format": "fp8"})()
    src = FP8Source(ckpt, plan.dtype, plan.device)
    filler = Materializer(ckpt, plan, src)
    filler.fill(model, f"model.layers.{layer}")
    if monkeypatch is not None:
        monkeypatch.setattr(dense, "_linear_factory",
                            lambda device, options: lambda linears, fmt: GPULinear.from_linears(linears, fmt, device))
    pack_dense(model.model.layers[layer], "fp8", CPU, None, plan.dtype, src)
    return model.model.layers[layer], src


def packed_sources(root: nn.Module) -> dict:
    """GPULinear name -> the names of the linears it holds, in order (a fused group: its PackedParts' names)."""
    parts = {}
    for name, m in root.named_modules():
        if isinstance(m, PackedPart):
            parts.setdefault(id(m._group[0]), []).append((m.index, name))
    return {name: [n for _, n in sorted(parts.get(id(m), [(0, name)]))]
            for name, m in root.named_modules() if isinstance(m, GPULinear)}


@pytest.mark.parametrize("layer", [0, 1])  # a dense MLP layer, a MoE layer (its shared expert)
def test_fp8_packed_modules_hold_the_checkpoint_bytes(fp8_ckpts, layer):
    path = fp8_ckpts["exact"]
    packed, src = fill_and_pack(path, layer)
    files = file_tensors(path)
    prefix = f"model.layers.{layer}."
    sources = packed_sources(packed)
    fused = [names for names in sources.values() if len(names) > 1]
    assert len(sources) == 5 and len(fused) == 2, sources  # q_a|kv_a, q_b, o, gate|up, down
    for name, names in sources.items():
        m = packed.get_submodule(name)
        ws = [files[prefix + n + ".weight"] for n in names]
        ss = [files[prefix + n + ".weight_scale_inv"] for n in names]
        K = ws[0].shape[1]
        kp = -(-K // 128) * 128
        want = torch.cat([F.pad(w.view(torch.uint8), (0, kp - K)) for w in ws])
        assert m.format.name == "fp8" and m.sizes == [w.shape[0] for w in ws] and m.in_features == K
        assert m.weight.dtype == torch.float8_e4m3fn and torch.equal(m.weight.view(torch.uint8), want), name
        assert m.scale.dtype == torch.float32 and torch.equal(m.scale, torch.cat(ss)), name
        # the fp8 format's blocks are DeepSeek's: the same numbers, bit for bit
        assert torch.equal(m.dequantized_weight(), torch.cat([dequantize_fp8(w, s) for w, s in zip(ws, ss)])), name
    assert src.kept == sum(len(n) for n in sources.values()) and not src.round_trips and not src.weights
    assert src.note() is None
    # what stays: the router and MLA's kv_b_proj, in the dtype (kv_b_proj dequantized: w = code * scale, in bf16)
    kept = {n: m for n, m in packed.named_modules() if isinstance(m, nn.Linear)}
    assert kept and all(n.rsplit(".", 1)[-1] in KEEP for n in kept), list(kept)
    kv_b = packed.self_attn.kv_b_proj.weight
    want = dequantize_fp8(files[prefix + "self_attn.kv_b_proj.weight"],
                          files[prefix + "self_attn.kv_b_proj.weight_scale_inv"], torch.bfloat16)
    assert kv_b.dtype == torch.bfloat16 and torch.equal(kv_b, want)


def test_load_model_keeps_the_bytes(fp8_ckpts, monkeypatch):
    """load_model's wiring (FP8Source.of, the fill, both pack_dense calls, done) on a CPU that stands in for the GPU:
    the plan's fp8 forced, GPULinear built on the CPU (its fp32 reference path) instead of the CPU engine."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load import loader
    from hetmoe.plan import placement

    path = fp8_ckpts["exact"]
    opts = EngineOptions(device="cpu", dtype="bf16", experts_format="bf16", max_context=64, dense_format="bf16")

    def logits(loaded):
        runner = Runner(loaded)
        out = [runner.prefill([3, 17, 5, 42, 8, 11, 29, 2, 33]).reshape(1, -1).float()]
        return torch.cat(out + [runner.decode(t).reshape(1, -1).float() for t in (7, 19, 4)])

    ref = logits(loader.load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None))
    monkeypatch.setattr(placement, "choose_dense", lambda *a, **k: ("fp8", "forced"))
    monkeypatch.setattr(FP8Source, "of", classmethod(lambda cls, ckpt, plan: cls(ckpt, plan.dtype, plan.device)))
    monkeypatch.setattr(dense, "_linear_factory",
                        lambda device, options: lambda linears, fmt: GPULinear.from_linears(linears, fmt, device))
    notes = []
    loaded = loader.load_model(path, opts, expert_cache=None, progress=False, log=notes.append)
    assert loaded.plan.dense_format == "fp8" and not [n for n in notes if "note:" in n]
    files = file_tensors(path)
    sources = packed_sources(loaded.model.model.layers)
    assert len(sources) == 15
    for name, names in sources.items():
        m = loaded.model.model.layers.get_submodule(name)
        layer = name.split(".")[0]
        keys = [f"model.layers.{layer}.{n.split('.', 1)[1]}.weight" for n in names]
        codes = torch.cat([files[k].view(torch.uint8) for k in keys])
        assert torch.equal(m.weight.view(torch.uint8)[:, :codes.shape[1]], codes), name
        assert torch.equal(m.scale, torch.cat([files[k + "_scale_inv"] for k in keys])), name
    # the same weights as the bf16 model but lm_head (quantized from bf16): MEASURED 3.6e-2 on these logits
    err = ((logits(loaded) - ref).abs().max() / ref.abs().max()).item()
    assert err <= 0.1, err


def test_a_fused_group_straddling_a_block_takes_the_round_trip(fp8_ckpts, monkeypatch):
    path = fp8_ckpts["straddle"]
    packed, src = fill_and_pack(path, 0, monkeypatch)
    files = file_tensors(path)
    qkv_a = packed.self_attn.q_kv_a
    # q_a (96 rows) | kv_a: dequantized in bf16 as the round trip always was, then re-quantized into fp8 blocks
    ws = [dequantize_fp8(files[f"model.layers.0.self_attn.{n}.weight"],
                         files[f"model.layers.0.self_attn.{n}.weight_scale_inv"], torch.bfloat16)
          for n in ("q_a_proj", "kv_a_proj_with_mqa")]
    q, scale = quantize_fp8(torch.cat(ws).float())
    assert torch.equal(qkv_a.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(qkv_a.scale, scale)
    assert src.round_trips == {"a fused group's parts have [96, 96] rows, not whole 128-row blocks": 2}
    assert src.kept == 5 and not src.weights  # q_b, o_proj, gate|up, down: as stored
    note = src.note()
    assert "2 FP8 linears were dequantized" in note and "5 kept" in note and "[96, 96]" in note
    logged = []
    src.done(logged.append)
    assert logged == [f"hetmoe: note: {note}"]


def test_fp8_parts_why():
    assert fp8_parts_why([1536, 576], [True, True]) == ""  # DeepSeek-V3's q_a | kv_a: the last part may be partial
    assert fp8_parts_why([18432, 18432], [True, True]) == ""
    assert fp8_parts_why([300], [True]) == ""
    assert "not whole 128-row blocks" in fp8_parts_why([96, 24], [True, True])
    assert "mixes FP8 and unquantized" in fp8_parts_why([128, 128], [True, False])


def test_a_weight_kept_but_never_packed_is_an_error(fp8_ckpts):
    ckpt = Checkpoint(fp8_ckpts["exact"])
    model = build_meta(ckpt.config)
    src = FP8Source(ckpt, torch.bfloat16, CPU)
    lin = model.model.layers[0].self_attn.o_proj
    assert src.take(lin, "model.layers.0.self_attn.o_proj.weight")
    assert not src.take(model.model.layers[0].self_attn.kv_b_proj, "model.layers.0.self_attn.kv_b_proj.weight")
    assert not src.take(model.model.layers[1].mlp.gate, "model.layers.1.mlp.gate.weight")  # bf16 and a router
    with pytest.raises(RuntimeError, match="never packed: model.layers.0.self_attn.o_proj.weight"):
        src.done(print)


def test_get_fp8_reads_the_stored_tensors(fp8_ckpts, tmp_path):
    ckpt = Checkpoint(fp8_ckpts["exact"])
    files = file_tensors(fp8_ckpts["exact"])
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    w, s = ckpt.get_fp8(name)
    assert torch.equal(w.view(torch.uint8), files[name].view(torch.uint8))
    assert torch.equal(s, files[name + "_scale_inv"])
    assert ckpt.get_fp8("model.layers.1.mlp.gate.weight") is None and ckpt.get_fp8("lm_head.weight") is None
    assert block_fp8(ckpt.config) and not block_fp8({"quantization_config": {**QUANT, "weight_block_size": [1, 128]}})
    # a scale of the wrong shape is named
    bad = shutil.copytree(fp8_ckpts["exact"], tmp_path / "bad")
    shard = next(f for f in bad.glob("*.safetensors") if name in load_file(f))
    tensors = load_file(shard)
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:1].contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}_scale_inv has shape \(1, 1\); .* needs \[2, 1\]"):
        Checkpoint(bad).get_fp8(name)


def _plan(cfg, **opts):
    model = build_meta(cfg)
    options = EngineOptions(**{"cpu_memory": "4TiB", "max_context": 32768, **opts})
    return plan_model(model, cfg, moe_blocks(model), options, cfg.moe_intermediate_size, torch.device("cuda"))


def test_auto_dense_prefers_the_checkpoint_fp8():
    plain = shape_config("deepseek-v3")
    fp8 = type(plain)({**plain, "quantization_config": QUANT})
    assert _plan(plain, gpu_memory="80GiB").dense_format == "bf16"
    plan = _plan(fp8, gpu_memory="80GiB")
    assert plan.dense_format == "fp8" and plan.why["dense weights"].startswith("auto: the checkpoint's own FP8")
    assert _plan(fp8, gpu_memory="80GiB", dense_format="int8").dense_format == "int8"  # asked for: as asked
    # fp8 that does not fit: the auto choice below it, or its refusal
    small = _plan(fp8, gpu_memory="15GiB", max_context=4096)
    assert small.dense_format == "int4" and "fp8" in small.why["dense weights"]
    with pytest.raises(PlanError, match=r"the dense weights alone \(int4\)"):
        _plan(fp8, gpu_memory="8GiB", max_context=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["exact", "straddle"])
def test_fp8_checkpoint_on_cuda(fp8_ckpts, which):
    """The FP8 checkpoint loaded on CUDA with dense_format fp8 holds its bytes on the GPU and gives the logits of the
    bf16 model dequantized from it, within the fp8 kernels' error (bf16 activations x the same weights); the CUDA
    graph decode equals eager."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import load_model

    def logits(loaded):  # a prefill and 3 decode steps
        runner = Runner(loaded)
        out = [runner.prefill([3, 17, 5, 42, 8, 11, 29, 2, 33]).reshape(1, -1).float()]
        return torch.cat(out + [runner.decode(t).reshape(1, -1).float() for t in (7, 19, 4)])

    path = fp8_ckpts[which]

    notes = []

    def run(fmt, graph):
        opts = EngineOptions(device="cuda", dtype="bf16", experts_format="bf16", max_context=64, dense_format=fmt,
                             cuda_graph=graph)
        loaded = load_model(path, opts, expert_cache=None, progress=False, log=notes.append)
        return loaded, logits(loaded)

    packed, eager = run("fp8", False)
    round_trip = [n for n in notes if "FP8 linears were dequantized" in n]
    assert len(round_trip) == (which == "straddle"), notes
    o_proj = packed.model.model.layers[1].self_attn.o_proj
    files = file_tensors(path)
    assert isinstance(o_proj, GPULinear) and o_proj.weight.is_cuda
    assert torch.equal(o_proj.weight.view(torch.uint8).cpu()[:, :128],
                       files["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))
    auto = load_model(path, EngineOptions(device="cuda", dtype="bf16", experts_format="bf16", max_context=64),
                      expert_cache=None, progress=False, log=lambda m: None)
    assert auto.plan.dense_format == "fp8" and isinstance(auto.model.lm_head, GPULinear)
    _, graph = run("fp8", True)
    _, ref = run("bf16", False)
    assert ((graph - eager).abs().max() / eager.abs().max()).item() <= 1e-2  # bf16 rounding of graph vs eager
    if which == "exact":  # (the round trip's 0.2% weight change flips a top-k choice of this tiny model on the CPU)
        # Kept weights equal the reference's up to its bf16 rounding; lm_head (bf16 in the checkpoint) is quantized.
        # MEASURED on the CPU with GPULinear's fp32 reference path: 3.6e-2; on the GPU: not yet. Bound as
        # tests/load/test_dense_format.py's whole-model fp8 bound.
        err = ((eager - ref).abs().max() / ref.abs().max()).item()
        assert err <= 0.2, err
