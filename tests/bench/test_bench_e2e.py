"""Random models of real shapes built in memory (synthetic.build_random_model) and ``hetmoe bench e2e``."""

import json
import subprocess
import sys

import pytest
import torch

from hetmoe import cli
from hetmoe.bench.e2e import placements, roofline_bytes
from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.cpu.layout import expert_bytes
from hetmoe.engine.runner import Runner
from hetmoe.layers.norm import RMSNorm
from hetmoe.load import random_weights as synthetic
from hetmoe.load.loader import moe_blocks
from hetmoe.load.random_weights import SHAPES, build_random_model

# Real configs shrunk: every feature kept (q/k norm, GQA; MLA with q LoRA, dense first layer, shared expert,
# groups, YaRN), E not a power of two.
TINY_QWEN3 = {**SHAPES["qwen3-30b-a3b"], "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 12,
              "num_experts_per_tok": 3, "vocab_size": 300}
TINY_DSV3 = {**SHAPES["deepseek-v3"], "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
             "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 24,
             "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
             "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "vocab_size": 256}


def _experts(loaded) -> list:
    return [b.experts for _, b in moe_blocks(loaded.model)]


def _run(loaded, prompt=7, steps=3) -> list:
    runner = Runner(loaded)
    gen = torch.Generator().manual_seed(1)
    out = [runner.prefill(torch.randint(loaded.config.vocab_size, (prompt,), generator=gen).tolist())]
    for tok in torch.randint(loaded.config.vocab_size, (steps,), generator=gen).tolist():
        out.append(runner.decode(tok))
    return out


def test_tiny_qwen3_shape_builds_places_and_runs():
    opts = EngineOptions(device="cpu", experts_format="int8", max_context=32)
    loaded = build_random_model(TINY_QWEN3, num_layers=3, options=opts, seed=4, log=lambda m: None)
    assert loaded.path is None and loaded.config.num_hidden_layers == 3 and loaded.plan.dtype == torch.float32
    for name, p in loaded.model.named_parameters():
        assert p.device.type == "cpu" and p.dtype == torch.float32, name
    for name, m in loaded.model.named_modules():
        if isinstance(m, RMSNorm):
            assert torch.equal(m.weight, torch.ones_like(m.weight)), name
    q = loaded.model.model.layers[1].self_attn.q_proj.weight
    assert abs(q.std().item() - 0.02) < 0.002 and abs(q.mean().item()) < 0.002
    assert loaded.model.model.inv_freq.device.type == "cpu"
    experts = _experts(loaded)
    assert len(experts) == 3 and all(isinstance(e, CPUExperts) for e in experts)
    assert all(e.info()["experts_loaded"] == 12 and e.weight_format == "int8" for e in experts)
    sums = [e.checksum() for e in experts]
    assert len(set(sums)) == 3  # fill_random(seed + layer): every layer different
    logits = _run(loaded)
    assert all(l.shape == (300,) and torch.isfinite(l).all() for l in logits)
    assert logits[0].std() > 0

    again = build_random_model(TINY_QWEN3, num_layers=3, options=opts, seed=4, log=lambda m: None)
    assert [e.checksum() for e in _experts(again)] == sums
    assert torch.equal(again.model.lm_head.weight, loaded.model.lm_head.weight)
    other = build_random_model(TINY_QWEN3, num_layers=3, options=opts, seed=5, log=lambda m: None)
    assert [e.checksum() for e in _experts(other)] != sums
    assert not torch.equal(other.model.lm_head.weight, loaded.model.lm_head.weight)


def test_each_decoder_layer_is_handed_over_as_soon_as_it_is_filled():
    """The builder packs a layer's dense weights before the next layer has storage (as the loader does), so at most
    one layer's dtype copies are alive besides the packed ones; the values are those of a whole-model fill."""
    from hetmoe.load.loader import build_meta

    cfg = synthetic.shape_config(TINY_QWEN3, 3)
    whole, layered = build_meta(cfg), build_meta(cfg)
    synthetic._fill_random(whole, torch.device("cpu"), torch.float32, 7, 0.02)
    seen = []

    def each_layer(layer):
        i = len(seen)
        seen.append(layer)
        assert layer is layered.model.layers[i]
        assert not any(p.is_meta for p in layer.parameters())
        later = list(layered.model.layers[i + 1:]) + [layered.lm_head]
        assert all(p.is_meta for m in later for p in m.parameters())

    synthetic._fill_random(layered, torch.device("cpu"), torch.float32, 7, 0.02, each_layer=each_layer)
    assert len(seen) == 3
    a, b = dict(whole.named_parameters()), dict(layered.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_tiny_deepseek_v3_shape_bf16():
    opts = EngineOptions(device="cpu", experts_format="int4", dtype="bf16", max_context=32)
    loaded = build_random_model(TINY_DSV3, num_layers=3, options=opts, log=lambda m: None)
    model = loaded.model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(24))
    assert model.model.inv_freq.dtype == torch.float32 and torch.isfinite(model.model.inv_freq).all()
    assert len(_experts(loaded)) == 2  # layer 0 is dense (first_k_dense_replace 1)
    assert all(torch.isfinite(l).all() for l in _run(loaded))


def test_real_qwen3_one_layer_and_roofline_bytes():
    opts = EngineOptions(device="cpu", experts_format="int4", dense_format="bf16", max_context=16)  # the dtype: fp32
    loaded = build_random_model("qwen3-30b-a3b", num_layers=1, options=opts, log=lambda m: None)
    cfg = loaded.config
    assert (cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.vocab_size) == (2048, 128, 768, 151936)
    assert all(torch.isfinite(l).all() for l in _run(loaded, prompt=5, steps=2))
    roof = roofline_bytes(loaded)
    bpe = expert_bytes("int4", 2048, 768, 64)
    assert roof["bytes_per_expert"] == bpe and roof["moe_layers"] == 1
    assert roof["expert_bytes_per_token"] == 8 * bpe
    params = sum(p.numel() for p in loaded.model.parameters())
    assert roof["dense_bytes_per_token"] == 4 * (params - 151936 * 2048)  # fp32, all but the embedding
    assert roof["bytes_per_token"] == roof["expert_bytes_per_token"] + roof["dense_bytes_per_token"]


def test_refuses_what_does_not_fit_before_allocating(monkeypatch):
    def never(*a, **k):
        raise AssertionError("allocated weights for a model that does not fit")

    monkeypatch.setattr(synthetic, "_fill_random", never)
    monkeypatch.setattr(synthetic, "new_experts", never)
    with pytest.raises(MemoryError, match="does not fit"):  # ~1.2 TB of bf16 experts
        build_random_model("deepseek-v3", options=EngineOptions(device="cpu", experts_format="bf16"),
                           log=lambda m: None)


def test_bad_shapes():
    with pytest.raises(ValueError, match="unknown shape 'nope'"):
        build_random_model("nope")
    with pytest.raises(ValueError, match="num_layers"):
        build_random_model("qwen3-30b-a3b", num_layers=0)
    with pytest.raises(ValueError, match="model_type"):
        build_random_model({"hidden_size": 64})


def test_cli_shape_names_match():
    assert cli.MODEL_SHAPES == tuple(SHAPES)
    assert placements("cpu") == ["cpu"]
    assert placements("auto") == (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])


@pytest.mark.slow  # the command end to end (~11 s on 2 cores); its pieces have per-commit tests in this file
def test_bench_e2e_quick_json():
    run = subprocess.run([sys.executable, "-m", "hetmoe", "bench", "e2e", "--quick", "--device", "cpu", "--json", "-"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)  # the JSON alone on stdout; the table went to stderr
    assert "placement" in run.stderr and "roofline" in run.stderr
    assert doc["threads"] >= 1
    assert {"cpu_model", "commit", "cpu_flags", "gpu"} <= doc["machine"].keys()
    (rec,) = doc["records"]
    assert rec["placement"] == "cpu" and rec["layers"] == 2 and rec["experts_format"] == "int4"
    assert [p["tokens"] for p in rec["prefill"]] == [16, 64] and all(p["tok_s"] > 0 for p in rec["prefill"])
    for key in ("stream_gbps", "stream_gbps_after", "decode_tok_s", "roofline_tok_s", "pct_roofline", "ms_per_token",
                "gbps_effective",
                "expert_bytes_per_token", "dense_bytes_per_token"):
        assert rec[key] > 0, key
    assert rec["bytes_per_token"] == rec["expert_bytes_per_token"] + rec["dense_bytes_per_token"]
    assert rec["moe_layers"] == 2 and rec["top_k"] == 8
    assert rec["roofline_tok_s"] == pytest.approx(rec["stream_gbps"] * 1e9 / rec["bytes_per_token"])
    assert rec["ms_per_token"] == pytest.approx(1e3 / rec["decode_tok_s"])


@pytest.mark.gpu
def test_bench_e2e_quick_variants_on_the_gpu():
    """The hybrid placement's decode variants, each with the roofline of the STREAM probed around its own runs."""
    run = subprocess.run([sys.executable, "-m", "hetmoe", "bench", "e2e", "--quick", "--device", "cuda", "--json", "-"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    (rec,) = json.loads(run.stdout)["records"]
    names = [v["variant"] for v in rec["variants"]]
    assert names[:3] == ["eager", "graph", "graph+d1"]
    for v in rec["variants"]:
        assert v["decode_tok_s"] > 0 and len(v["stream_gbps_adjacent"]) == 2
        assert v["roofline_adjacent_tok_s"] == pytest.approx(
            sum(v["stream_gbps_adjacent"]) / 2 * 1e9 / rec["bytes_per_token"])
        assert v["pct_roofline_adjacent"] == pytest.approx(100 * v["decode_tok_s"] / v["roofline_adjacent_tok_s"])
        assert 0 < v["decode_step_median_ms"] <= v["decode_step_max_ms"]
        assert 0 <= v["decode_slow_steps"] <= 4  # of the quick run's 8 timed steps: at most half exceed the median
    assert "adj.roof" in run.stderr and "over twice the median" in run.stderr


@pytest.mark.parametrize("argv, needle", [
    (["--shape", "nope"], "invalid choice"),
    (["--layers", "0"], "positive integer"),
    (["--prompt-tokens", "0,5"], "positive integers"),
    (["--model", "/nonexistent", "--layers", "2"], "--layers applies to --shape"),
    (["--shape", "qwen3-30b-a3b", "--model", "/x"], "not allowed with"),
    (["--quick", "--device", "cpu", "--max-context", "8"], "--max-context 8 is too small"),
])
def test_bench_e2e_bad_options(argv, needle, capsys):
    try:
        code = cli.main(["bench", "e2e", *argv])
    except SystemExit as e:  # argparse
        code = e.code
    assert code != 0
    err = capsys.readouterr().err
    assert "error" in err and needle in err


@pytest.mark.gpu
@pytest.mark.gpu
def test_tiny_shape_hybrid():
    kw = dict(num_layers=3, seed=2, log=lambda m: None)
    hybrid = build_random_model(TINY_QWEN3, options=EngineOptions(device="cuda", dtype="fp32", experts_format="bf16",
                                                                  max_context=32), **kw)
    assert all(p.device.type == "cuda" for p in hybrid.model.parameters())
    blocks = moe_blocks(hybrid.model)
    assert all(isinstance(b.engine, CPUExperts) and b.staging is not None for _, b in blocks)
    assert len({id(b.staging) for _, b in blocks}) == 1  # one HostStaging for every layer
    out = _run(hybrid)
    assert all(l.device.type == "cuda" and torch.isfinite(l).all() for l in out)
    assert roofline_bytes(hybrid)["dense_bytes_per_token"] == 0


def test_shape_tokenizer_decodes_every_id():
    from hetmoe.load.random_weights import shape_tokenizer

    tok = shape_tokenizer(5000)
    assert tok.vocab_size == 5000 and len(tok.eos_ids) == 1 and max(tok.eos_ids) < 5000
    words = tok.decode(list(range(300, 5000)))
    assert "\ufffd" not in words and len(words.split()) == 5000 - 300 - 3  # one word per id, specials skipped
    assert tok.decode(tok.encode("héllo, wörld")) == "héllo, wörld"
    with pytest.raises(ValueError, match="too small"):
        shape_tokenizer(100)


def test_serve_shape_and_model_are_exclusive(tmp_path):
    from hetmoe import cli

    assert cli.main(["serve", "--shape", "qwen3-30b-a3b", "--model", str(tmp_path), "--device", "cpu"]) == 1
    assert cli.main(["serve", "--layers", "2", "--device", "cpu"]) == 1


def test_expert_pool_is_the_models_own():
    from hetmoe import cpu
    from hetmoe.bench.e2e import expert_pool

    opts = EngineOptions(device="cpu", experts_format="int4", threads=1)
    loaded = build_random_model(TINY_QWEN3, num_layers=2, options=opts, log=lambda m: None)
    fallback = cpu.shared_pool(2)
    pool = expert_pool(loaded, fallback)
    assert pool is not fallback and pool.threads == 1


def test_bench_kernel_profile_covers_the_timed_calls_only(tmp_path):
    """--profile reports the stages of the timed calls, not of the warm-up ones (a first call also faults its
    scratch memory in)."""
    out = tmp_path / "k.json"
    assert cli.main(["bench", "kernel", "--shapes", "qwen3-30b-a3b", "--experts", "8", "--formats", "int4",
                     "--tokens", "2", "--threads", "2", "--no-baseline", "--random-packed", "--repeats", "3",
                     "--warmup", "2", "--profile", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["records"][0]
    assert rec["stages_jobs"] == 3
    assert set(rec["stages_ms"]) == {"route", "quantize_x", "experts", "combine"} and rec["stages_ms"]["experts"] > 0


def test_experts_layout_names_mixed_and_affine_layouts(monkeypatch):
    """The e2e report names how the experts are held where the plan's one format does not say it (a GGUF's
    K-quants: int4 affine gate/up beside int8 down), and stays quiet for one symmetric format."""
    from types import SimpleNamespace

    from hetmoe.bench import e2e

    def layers(info):
        return lambda model: [("m.0", SimpleNamespace(engine=SimpleNamespace(info=lambda: info))),
                              ("m.1", SimpleNamespace(engine=None))]

    base = dict(weight_format="int4", group_size=64, gate_up_scaling="symmetric", down_weight_format="int4",
                down_group_size=64, down_scaling="symmetric")
    monkeypatch.setattr(e2e, "moe_blocks", layers(base))
    assert e2e.experts_layout(SimpleNamespace(model=None)) is None
    q4_k_m = dict(base, group_size=32, gate_up_scaling="affine", down_weight_format="int8", down_group_size=16)
    monkeypatch.setattr(e2e, "moe_blocks", layers(q4_k_m))
    assert e2e.experts_layout(SimpleNamespace(model=None)) == "gate/up int4 affine g32, down int8 g16"
    monkeypatch.setattr(e2e, "moe_blocks", lambda model: [("m.0", SimpleNamespace(engine=None))])
    assert e2e.experts_layout(SimpleNamespace(model=None)) is None  # no CPU experts (all on the GPU)
