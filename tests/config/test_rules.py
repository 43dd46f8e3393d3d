"""Placement rules (hetmoe/config/rules.py, docs/rules.md): parsing with the file's line in every error, first match
wins, and the native runner's per-MoE-layer experts formats, deferral and GPU-resident experts (hetmoe/engine/
loader.py, placement.py). The CPU tests run the CPU engine on the best ISA of the machine (one path: bitwise
comparisons); the GPU test compares the hybrid placement with the CPU one within the bf16 tolerance."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hetmoe.config import rules
from hetmoe.config.options import DEFAULT_GROUP, EngineOptions
from hetmoe.config.rules import RulesError
from hetmoe.cpu.layout import expert_bytes
from hetmoe.engine.runner import Runner
from hetmoe.load import rules as native_rules
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.load.rules import layerwise_layers
from hetmoe.plan.memory import LayerPlan
from parity import max_rel

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "rules-example.yaml"
PROMPT = [5, 17, 300, 42, 9, 260, 77, 3]
CPU = dict(device="cpu", dtype="fp32", max_context=32, threads=1)
L0, L1, L2 = (f"model\\.layers\\.{i}\\.mlp\\.experts" for i in range(3))


def write(tmp_path, text: str, name: str = "rules.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(path, log=None, cache=None, **opts):
    return load_model(path, EngineOptions(**{**CPU, **opts}), expert_cache=cache, progress=False,
                      log=(log if log is not None else []).append)


def logits(loaded, steps: int = 3, tokens=None) -> torch.Tensor:
    """Prefill, then decode steps fed ``tokens`` (default: greedy) -> [steps + 1, V] on the CPU, fp32."""
    runner = Runner(loaded)
    out = [runner.prefill(PROMPT)]
    for i in range(steps):
        out.append(runner.decode(tokens[i] if tokens is not None else int(out[-1].argmax())))
    return torch.stack(out).float().cpu()


# ---------------------------------------------------------------------------------------------- parsing


def test_example_parses_and_first_match_wins():
    r = rules.load(EXAMPLE)
    assert len(r) == 3
    early, late, head = (r.for_module(n) for n in ("model.layers.3.mlp.experts", "model.layers.4.mlp.experts",
                                                   "lm_head"))
    assert early.settings() == {"device": "cuda", "experts_format": "bf16"}  # rule 1, though rule 2 matches too
    assert late.settings() == {"device": "cpu", "experts_format": "int4", "group_size": 64, "defer_experts": 1}
    assert head.settings() == {"device": "cuda"}
    assert (early.rule.index, late.rule.index, head.rule.index) == (1, 2, 3)
    assert r.for_module("model.layers.4.mlp") == rules.Placement()  # full match: a prefix is not a match
    assert r.for_module("model.layers.4.mlp").rule is None


def test_class_is_a_second_condition():
    r = rules.parse("- match: '.*experts'\n  class: 'Qwen3.*'\n  experts_format: int8\n"
                    "- match: '.*experts'\n  experts_format: int4\n")
    assert r.for_module("model.layers.0.mlp.experts", "Qwen3MoeExperts").experts_format == "int8"
    assert r.for_module("model.layers.0.mlp.experts", "MixtralExperts").experts_format == "int4"
    assert r.for_module("model.layers.0.mlp.experts").experts_format == "int4"  # no class: the class rule skips
    assert native_rules.experts_class("Qwen3MoeSparseMoeBlock") == "Qwen3MoeExperts"
    assert native_rules.experts_class("DeepseekV3MoE") == "DeepseekV3Experts"


@pytest.mark.parametrize("text, line, message", [
    ("- match: x\n  device: cpu\n  colour: red\n", 3, "unknown key 'colour'"),
    ("- match: x\n  experts_format: int5\n", 2,
     "experts_format: expected bf16, int8, int4, fp8, int3, int2, got 'int5'"),
    ("- match: x\n\n  group_size: 48\n", 3, "group_size: expected 32, 64 or 128"),
    ("- match: x\n  experts_format: bf16\n  group_size: 32\n", 3, "bf16 experts have no scale groups"),
    ("- match: x\n  gpu_experts: -1\n", 2, "gpu_experts: expected an integer >= 0"),
    ("- match: x\n  defer_experts: yes\n", 2, "defer_experts: expected an integer, got True"),
    ("- match: x\n  device: gpu\n", 2, "device: expected cpu, cuda or cuda:N, got 'gpu'"),
    ("- match: x\n  device: cuda\n  gpu_experts: 2\n", 3, "every expert of the layer is on the GPU already"),
    ("- match: x\n  dtype: fp16\n", 2, "dtype: expected bf16, fp32"),
    ("- match: x\n- match: 'layers\\.(['\n", 2, "is not a valid regular expression"),
    ("- match: x\n- device: cpu\n", 2, "has no match:"),
    ("- match: x\n  match: y\n", 2, "match is given twice"),
    ("- match: x\n  device: [cpu]\n", 2, "expected a single value"),
    ("- match: x\n   device: cpu\n", 2, "not valid YAML"),
    ("match: x\n", 1, "expected a list of rules"),
])
def test_bad_files_name_the_line(text, line, message):
    with pytest.raises(RulesError) as err:
        rules.parse(text, "r.yaml")
    assert err.value.line == line and str(err.value).startswith(f"r.yaml:{line}: ") and message in str(err.value)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(RulesError, match="is empty"):
        rules.parse("# nothing\n", "r.yaml")
    with pytest.raises(RulesError, match="cannot read the rules file"):
        rules.load(tmp_path / "absent.yaml")


def test_assign_refuses_rules_that_take_nothing():
    modules = [("lm_head", "Linear", rules.DENSE), ("model.layers.0.mlp.experts", "Qwen3MoeExperts", rules.EXPERTS)]
    ok = rules.parse("- match: lm_head\n  device: cpu\n- match: '.*experts'\n  experts_format: int4\n")
    assert set(ok.assign(modules)) == {"lm_head", "model.layers.0.mlp.experts"}
    cases = [
        ("- match: lm_head\n- match: 'model\\.layers\\.9\\..*'\n", 2, "it matches no module"),
        ("- match: '.*'\n- match: lm_head\n", 2, "taken by an earlier rule"),
        ("- match: lm_head\n  experts_format: int4\n", 2, "experts_format applies to routed experts"),
        ("- match: '.*experts'\n\n  dtype: bf16\n", 3, "dtype applies to dense modules"),
    ]
    for text, line, message in cases:
        with pytest.raises(RulesError) as err:
            rules.parse(text, "r.yaml").assign(modules)
        assert str(err.value).startswith(f"r.yaml:{line}: ") and message in str(err.value), str(err.value)


# ---------------------------------------------------------------------------------------------- the native runner


@pytest.fixture(scope="module")
def qwen3(checkpoints):
    return checkpoints("qwen3_moe", seed=3)


def test_mixed_formats_per_layer(qwen3, tmp_path):
    # Layer 0 bf16, layer 1 int4 g32: each layer's CPUExperts in its format, the plan's RAM the engine's bytes, and
    # the logits those of a model whose layers were each built in that format (bitwise: the same kernels).
    path = write(tmp_path, f"- match: '{L0}'\n  experts_format: bf16\n"
                           f"- match: '{L1}'\n  experts_format: int4\n  group_size: 32\n")
    log = []
    mixed = load(qwen3, log, experts_format="int8", rules=str(path))
    engines = [layer.engine for _, layer in moe_blocks(mixed.model)]
    assert [(e.info()["weight_format"], e.info()["group_size"] or 0) for e in engines] == [("bf16", 0), ("int4", 32)]
    assert [(lp.experts_format, lp.group_size) for lp in mixed.plan.layers] == [("bf16", 0), ("int4", 32)]
    assert [lp.ram for lp in mixed.plan.layers] == [e.nbytes for e in engines]
    H, I = engines[0].hidden_size, engines[0].intermediate_size
    assert mixed.plan.layers[1].ram == 8 * expert_bytes("int4", H, I, 32)
    assert mixed.plan.ram["routed experts"] == mixed.info["expert_bytes"] == sum(e.nbytes for e in engines)
    assert any("experts bf16 in 1 layer + int4 (group 32) in 1 layer" in line for line in log), log
    from hetmoe.bench.e2e import roofline_bytes  # `hetmoe bench e2e`: the bytes a token reads, per layer's format

    k = mixed.config.num_experts_per_tok
    assert roofline_bytes(mixed)["expert_bytes_per_token"] == k * sum(e.info()["bytes_per_expert"] for e in engines)
    assert engines[0].info()["bytes_per_expert"] == 3 * H * I * 2  # bf16: no padding at these sizes
    bf16 = load(qwen3, experts_format="bf16")
    int4 = load(qwen3, experts_format="int4", group_size=32)
    reference = bf16
    reference.model.model.layers[1].mlp.moe.attach(moe_blocks(int4.model)[1][1].engine)
    got, want = logits(mixed), logits(reference)
    assert torch.equal(got, want)
    assert max_rel(got, logits(load(qwen3, experts_format="bf16"))) > 0  # layer 1's format did change the output


def test_expert_cache_keyed_per_layer_format(qwen3, tmp_path):
    path = write(tmp_path, f"- match: '{L1}'\n  experts_format: int4\n")
    cache = tmp_path / "cache"
    first = load(qwen3, cache=cache, experts_format="bf16", rules=str(path))
    assert (first.info["cache_hits"], first.info["cache_misses"]) == (0, 2) and len(first.info["cache_dirs"]) == 2
    again = load(qwen3, cache=cache, experts_format="bf16", rules=str(path))
    assert (again.info["cache_hits"], again.info["cache_misses"]) == (2, 0)
    assert torch.equal(logits(first, 1), logits(again, 1))
    uniform = load(qwen3, cache=cache, experts_format="bf16")  # shares layer 0's file, converts layer 1
    assert (uniform.info["cache_hits"], uniform.info["cache_misses"]) == (1, 1)
    shutil.rmtree(cache)


def test_auto_format_leaves_ruled_layers(qwen3, tmp_path):
    path = write(tmp_path, f"- match: '{L0}'\n  experts_format: int4\n")
    loaded = load(qwen3, rules=str(path))  # auto: the most precise that fits, for the layers no rule sets
    assert [lp.experts_format for lp in loaded.plan.layers] == ["int4", "bf16"]
    assert loaded.plan.layers[0].group_size == DEFAULT_GROUP["int4"]


@pytest.fixture(scope="module")
def deep(checkpoints):
    """Four MoE layers, top-4 of 8: room for per-layer deferral of 1 to 3 experts."""
    return checkpoints("qwen3_moe", {"num_hidden_layers": 4, "num_experts_per_tok": 4}, seed=4)


def _chain_shape(loaded):
    return [(layer.defer, layer.position) for _, layer in moe_blocks(loaded.model)]


def test_per_layer_deferral(deep, tmp_path):
    # d per layer: each run of deferring layers and the layer after it share a chain; the last defers nothing.
    uniform = load(deep, defer_experts=1)
    same = load(deep, rules=str(write(tmp_path, "- match: '.*experts'\n  defer_experts: 1\n")))
    assert _chain_shape(same) == _chain_shape(uniform) == [(1, "first"), (1, "middle"), (1, "middle"), (1, "last")]
    assert torch.equal(logits(same), logits(uniform))
    path = write(tmp_path, f"- match: '{L0}'\n  defer_experts: 1\n- match: '{L1}'\n  defer_experts: 3\n"
                           "- match: 'model\\.layers\\.3\\.mlp\\.experts'\n  defer_experts: 2\n", "mixed.yaml")
    mixed = load(deep, rules=str(path))
    assert [lp.defer_experts for lp in mixed.plan.layers] == [1, 3, 0, 2]
    assert _chain_shape(mixed) == [(1, "first"), (3, "middle"), (3, "last"), (0, "only")]
    out, plain = logits(mixed), logits(load(deep))
    assert torch.isfinite(out).all() and not torch.equal(out, plain)
    # an inner layer without deferral splits the chain; a layer alone defers nothing
    gap = load(deep, rules=str(write(tmp_path, f"- match: '{L0}'\n  defer_experts: 2\n"
                                               f"- match: '{L2}'\n  defer_experts: 1\n", "gap.yaml")))
    assert _chain_shape(gap) == [(2, "first"), (2, "last"), (1, "first"), (1, "last")]
    assert torch.isfinite(logits(gap)).all()


@pytest.mark.parametrize("text, line, message", [  # the rule starts on line 3, its second key is on line 4
    ("- match: lm_head\n  device: cuda\n", 4, "keeps every dense module on the placement's device"),
    (f"- match: '{L0}'\n  device: cuda\n", 4, "the placement is CPU-only"),
    ("- match: lm_head\n  dtype: bf16\n", 4, "runs every dense module in one dtype"),
    (f"- match: '{L0}'\n  gpu_experts: 9\n", 4, "has 8 routed experts"),
    (f"- match: '{L0}'\n  defer_experts: 2\n", 4, "at most 1 can be deferred"),
    ("- match: 'model\\.layers\\.7\\..*'\n  device: cpu\n", 3, "it matches no module"),
])
def test_load_refuses_before_reading_weights(qwen3, tmp_path, text, line, message):
    path = write(tmp_path, "- match: 'model\\.embed_tokens'\n  device: cpu\n" + text)
    log = []
    with pytest.raises(RulesError) as err:
        load(qwen3, log, rules=str(path))
    assert str(err.value).startswith(f"{path}:{line}: rule 2 ") and message in str(err.value), str(err.value)
    assert not any("loaded in" in m for m in log)


def test_example_plans_a_hybrid_placement():
    # docs/rules-example.yaml on a 6-layer model placed on a GPU (the plan is made from shapes alone: no GPU needed):
    # layers 0-3 all resident and bf16, 4-5 int4 g64 deferring 1, lm_head on the GPU; the plan's bytes per layer.
    from hetmoe.load.loader import build_meta
    from hetmoe.load.random_weights import TINY
    from hetmoe.load.shapes import model_shapes
    from hetmoe.models.config import ModelConfig
    from hetmoe.plan.placement import plan_memory

    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=256, **{**TINY["qwen3_moe"], "num_hidden_layers": 6})
    model = build_meta(cfg)
    blocks = moe_blocks(model)
    cuda = torch.device("cuda")
    layers = native_rules.apply_native(rules.load(EXAMPLE), model, blocks, cuda, torch.bfloat16, 2)
    opts = EngineOptions(gpu_experts=2, experts_format="int8")  # the flags, where no rule decides
    plan = plan_memory(model_shapes(model, cfg, 32), opts, cuda, "int8", layers)
    assert [(lp.experts_format, lp.group_size, lp.gpu_experts, lp.defer_experts) for lp in plan.layers] == \
        [("bf16", 0, 8, 0)] * 4 + [("int4", 64, 0, 1)] * 2  # device: cpu keeps none on the GPU despite the flag
    assert [lp.ram for lp in plan.layers] == [8 * expert_bytes("bf16", 64, 32, 0)] * 4 + \
        [8 * expert_bytes("int4", 64, 32, 64)] * 2
    assert plan.vram["GPU experts"] == 4 * 8 * 3 * 64 * 32 * 2 and plan.ram["routed experts"] == sum(
        lp.ram for lp in plan.layers)
    cpu_only = plan_memory(model_shapes(model, cfg, 32), opts, torch.device("cpu"), "int8", None)
    assert {(lp.experts_format, lp.group_size) for lp in cpu_only.layers} == {("int8", 128)}
    assert [lp.gpu_experts for lp in cpu_only.layers] == [0] * 6  # CPU-only: every expert on the CPU


def test_layerwise_prefill_layers():
    # fully resident layers are not streamed; a bf16 layer does not share slots sized for int4 ones (or back)
    blocks = [("b0", SimpleNamespace(num_experts=8)), ("b1", SimpleNamespace(num_experts=8)),
              ("b2", SimpleNamespace(num_experts=8))]
    lp = [LayerPlan("b0", "bf16", 0, 8, 0, 300, 1), LayerPlan("b1", "int4", 64, 0, 0, 100, 0),
          LayerPlan("b2", "int4", 64, 2, 0, 100, 0)]
    plan = SimpleNamespace(layers=lp)
    assert layerwise_layers(blocks, plan) == [blocks[1][1], blocks[2][1]]
    lp[0].defer_experts = 1  # layers 0 and 1 now share a deferral chain: the chain is not split
    assert layerwise_layers(blocks, plan) == []
    lp[0].experts_format, lp[0].defer_experts, lp[1].defer_experts = "int4", 0, 1
    assert layerwise_layers(blocks, plan) == [blocks[1][1], blocks[2][1]]  # layer 0 resident, not in the chain
    lp[0].defer_experts = 1
    assert layerwise_layers(blocks, plan) == [b for _, b in blocks]  # resident but chained: streamed too
    lp[0].experts_format, lp[0].gpu_experts, lp[0].defer_experts, lp[1].defer_experts = "bf16", 0, 0, 0
    assert layerwise_layers(blocks, plan) == [blocks[0][1]]  # the largest layer's kind


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_random_model_takes_rules(tmp_path, fmt):
    from hetmoe.load.random_weights import TINY, build_random_model

    shape = {**TINY["qwen3_moe"], "model_type": "qwen3_moe", "vocab_size": 256, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}
    path = write(tmp_path, f"- match: '{L1}'\n  experts_format: {fmt}\n  group_size: 0\n")  # per-row scales
    loaded = build_random_model(shape, options=EngineOptions(**CPU, experts_format="bf16", rules=str(path)),
                                log=lambda m: None)
    assert [(layer.engine.info()["weight_format"]) for _, layer in moe_blocks(loaded.model)] == ["bf16", fmt]
    assert loaded.plan.layers[1].group_size == 0


# ---------------------------------------------------------------------------------------------- command line


def test_cli_bad_rules_file(qwen3, tmp_path, capsys):
    from hetmoe.cli import main

    bad = write(tmp_path, "- match: lm_head\n  device: tpu\n")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", str(qwen3), "--device", "cpu", "--rules", str(bad)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"--rules: {bad}:2: rule 1: device: expected cpu, cuda or cuda:N" in err, err
    nothing = write(tmp_path, "- match: 'model\\.layers\\.9\\..*'\n  device: cpu\n", "nothing.yaml")
    code = main(["generate", "--model", str(qwen3), "--device", "cpu", "--max-tokens", "1", "--expert-cache",
                 "off", "--rules", str(nothing)])
    err = capsys.readouterr().err
    assert code == 1 and f"hetmoe generate: error: {nothing}:1: rule 1" in err and "matches no module" in err, err


def test_resident_experts_per_layer_on_cpu_tensors(qwen3):
    # The per-layer counts of calibration.place_gpu_experts (what plan.layers gives keep_gpu_experts), with the
    # hybrid dispatch stage run on CPU tensors: layer 0 all 8 resident, layer 1 none; the output stays the model's
    # (the resident copy holds the engine's bf16 values; bound: bf16 activation rounding, which AMX experts do).
    from hetmoe.load.calibration import place_gpu_experts
    from hetmoe.moe import HostStaging

    loaded = load(qwen3, experts_format="bf16")
    blocks = moe_blocks(loaded.model)
    for _, block in blocks:
        block.attach(block.experts, HostStaging(block.engine.hidden_size, block.router.top_k, torch.float32))
    fed = [7, 300, 42]
    before = logits(loaded, 3, fed)
    report = place_gpu_experts(loaded.model, blocks, [8, 0], torch.float32, "cpu", None, "", lambda m: None)
    assert report["n"] == [8, 0] and [r["block"] for r in report["layers"]] == [blocks[0][0]]
    assert blocks[0][1].gpu.n == 8 and blocks[1][1].gpu is None and bool(blocks[0][1].engine.skip_mask.all())
    assert report["bytes"] == blocks[0][1].gpu.nbytes == 8 * 3 * 64 * 32 * 4
    assert max_rel(logits(loaded, 3, fed), before) < 2e-2


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_resident_experts_per_layer(qwen3, tmp_path):
    # Hybrid: layer 0's experts all resident on the GPU (device: cuda), layer 1 keeps 2 there; the plan's VRAM holds
    # exactly those; logits agree with the CPU-only placement within the bf16 tolerance (both fp32 dense).
    path = write(tmp_path, f"- match: '{L0}'\n  device: cuda\n- match: '{L1}'\n  gpu_experts: 2\n")
    hybrid = load(qwen3, rules=str(path), device="cuda", experts_format="bf16", threads=None)
    layers = [layer for _, layer in moe_blocks(hybrid.model)]
    assert [layer.gpu.n for layer in layers] == [8, 2]
    assert [lp.gpu_experts for lp in hybrid.plan.layers] == [8, 2]
    assert hybrid.plan.vram["GPU experts"] == sum(lp.vram for lp in hybrid.plan.layers)
    assert hybrid.plan.vram["GPU experts"] == sum(layer.gpu.nbytes for layer in layers)
    assert bool(layers[0].engine.skip_mask.all()) and int(layers[1].engine.skip_mask.sum()) == 2
    assert hybrid.info["gpu_experts"]["n"] == [8, 2]
    cpu = load(qwen3, experts_format="bf16")
    fed = [7, 300, 42]  # the same tokens into both: a greedy near-tie cannot make them decode different text
    assert max_rel(logits(hybrid, 3, fed), logits(cpu, 3, fed)) < 2e-2


@pytest.mark.gpu
def test_example_file_on_a_gpu(checkpoints, tmp_path):
    # docs/rules-example.yaml as shipped, on 6 MoE layers: 0-3 resident (bf16 values), 4-5 int4 g64 on the CPU
    # deferring 1 (one chain: 4 -> 5), lm_head on the GPU; the same per-layer formats and deferral on the CPU alone
    # give the same logits within the bf16 tolerance (same tokens fed to both).
    ckpt = checkpoints("qwen3_moe", {"num_hidden_layers": 6}, seed=5)
    hybrid = load(ckpt, rules=str(EXAMPLE), device="cuda", threads=None)
    layers = [layer for _, layer in moe_blocks(hybrid.model)]
    assert [layer.gpu.n if layer.gpu is not None else 0 for layer in layers] == [8] * 4 + [0] * 2
    assert [(e.info()["weight_format"]) for e in (layer.engine for layer in layers)] == ["bf16"] * 4 + ["int4"] * 2
    assert [(layer.defer, layer.position) for layer in layers][4:] == [(1, "first"), (1, "last")]
    assert hybrid.model.lm_head.weight.device.type == "cuda"
    same = write(tmp_path, "- match: 'model\\.layers\\.[0-3]\\.mlp\\.experts'\n  experts_format: bf16\n"
                           "- match: '.*experts'\n  experts_format: int4\n  group_size: 64\n  defer_experts: 1\n")
    cpu = load(ckpt, rules=str(same))
    fed = [7, 300, 42]
    assert max_rel(logits(hybrid, 3, fed), logits(cpu, 3, fed)) < 2e-2
