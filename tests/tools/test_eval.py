"""`hetmoe eval` and the demo-model training script: the evaluation math against hand-computed numbers,
dropping experts (MoELayer.set_drop), identical / quantized / dropped configurations on the built-in model, the
command's JSON and its errors, and tools/train_demo_moe.py --smoke end to end (train, save, load, generate, eval)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine.llm import LLM, default_model_path
from hetmoe.engine.runner import Runner
from hetmoe.engine.sampler import SamplingParams
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.moe import MoELayer, RouterSpec, drop_lowest
from hetmoe.tokenizer import Tokenizer
from hetmoe.tools.evaluation import evaluate, kl_and_agreement, perplexity, split_windows, token_nll
from paths import LOGIT_CROSS_PATH_BOUND

ROOT = Path(__file__).resolve().parents[2]
TEXT = '''import os


def read_lines(path):
    """Return the lines of a text file."""
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, n=1):
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]
'''
KEYS = {"model", "text", "window", "config", "reference", "tokens", "windows", "nll", "perplexity",
        "reference_perplexity", "perplexity_change", "kl", "kl_max", "top1_agreement", "seconds"}


# ---------------------------------------------------------------- the math, by hand

def test_math_against_a_hand_computed_case():
    ln = math.log
    f64 = torch.float64
    ref = torch.tensor([[ln(3), ln(2), 0.0], [ln(2), 0.0, 0.0]], dtype=f64)  # p = [1/2, 1/3, 1/6], [1/2, 1/4, 1/4]
    test = torch.tensor([[ln(2), 0.0, 0.0], [0.0, 0.0, ln(2)]], dtype=f64)  # q = [1/2, 1/4, 1/4], [1/4, 1/4, 1/2]
    targets = torch.tensor([0, 2])
    nll = token_nll(test, targets)
    assert nll.tolist() == pytest.approx([ln(2), ln(2)], abs=1e-12)  # -log(1/2) twice
    assert perplexity(nll) == pytest.approx(2.0, abs=1e-12)
    kl, agree = kl_and_agreement(ref, test)
    want = [1 / 2 * ln(1) + 1 / 3 * ln((1 / 3) / (1 / 4)) + 1 / 6 * ln((1 / 6) / (1 / 4)),
            1 / 2 * ln((1 / 2) / (1 / 4)) + 1 / 4 * ln(1) + 1 / 4 * ln((1 / 4) / (1 / 2))]
    assert kl.tolist() == pytest.approx(want, abs=1e-12)
    assert agree.tolist() == [True, False]  # argmax 0 / 0, then 0 / 2
    kl_self, agree_self = kl_and_agreement(ref, ref)
    assert kl_self.abs().max() == 0 and agree_self.all()


def test_math_errors_and_windows():
    with pytest.raises(ValueError, match=r"logits \[N, V\] and targets \[N\]"):
        token_nll(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="one shape"):
        kl_and_agreement(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="zero tokens"):
        perplexity(torch.zeros(0))
    assert split_windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert split_windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # a lone last token scores nothing
    with pytest.raises(ValueError, match="at least 2 tokens"):
        split_windows([1, 2, 3], 1)


# ---------------------------------------------------------------- dropping experts (MoELayer.set_drop)

class _Recorder:
    num_experts = 8

    def __call__(self, x, ids, weights):
        self.ids, self.weights = ids.clone(), weights.clone()
        return x


def _dropping(rec, d, ids, weights):
    """A MoE layer over ``rec`` that drops ``d`` experts per token, its route stage fixed to (weights, ids)."""
    layer = MoELayer(RouterSpec("softmax", ids.shape[1]), rec.num_experts)
    layer.attach(rec)
    layer.set_drop(d)
    layer.route = lambda logits, correction_bias=None: (weights, ids)
    return layer


def test_drop_lowest_experts_sets_the_lowest_weighted_ids_to_minus_one():
    ids = torch.tensor([[3, 1, 7, 5], [0, 2, 4, 6], [1, 2, 3, 4]])
    weights = torch.tensor([[0.4, 0.1, 0.3, 0.2], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    rec = _Recorder()
    for d, want in [(0, ids.tolist()),
                    (1, [[3, -1, 7, 5], [-1, 2, 4, 6], [-1, 2, 3, 4]]),  # ties: the earlier slot goes first
                    (3, [[3, -1, -1, -1], [-1, -1, -1, 6], [-1, -1, -1, 4]])]:
        _dropping(rec, d, ids, weights)(torch.zeros(3, 2), torch.zeros(3, 8))
        assert rec.ids.tolist() == want, d
        assert torch.equal(rec.weights, weights)  # not renormalised
        assert drop_lowest(ids, weights, d).tolist() == want, d
    assert ids[0, 1] == 1  # the router's tensor is untouched
    with pytest.raises(ValueError, match="cannot drop 4 of the top-4"):
        _dropping(rec, 4, ids, weights)(torch.zeros(3, 2), torch.zeros(3, 8))
    with pytest.raises(ValueError, match=">= 0"):
        MoELayer(RouterSpec("softmax", 4), 8).set_drop(-1)


# ---------------------------------------------------------------- configurations of the built-in model

def _runner(fmt="bf16", drop=None, path=None):
    opts = EngineOptions(device="cpu", experts_format=fmt, max_context=64)
    loaded = load_model(path or default_model_path(), opts, expert_cache=None, progress=False, log=lambda m: None)
    if drop is not None:
        for _, block in moe_blocks(loaded.model):
            block.set_drop(drop)
    return Runner(loaded)


@pytest.fixture(scope="module")
def ids():
    return Tokenizer.from_dir(default_model_path()).encode(TEXT)


@pytest.fixture(scope="module")
def reference():
    return _runner("bf16")


def test_identical_configurations_agree_exactly(ids, reference):
    res = evaluate(_runner("bf16"), ids, 48, reference).summary()
    assert res["tokens"] == len(ids) - res["windows"] and res["windows"] == -(-len(ids) // 48)
    assert abs(res["kl"]) <= 1e-6 and res["top1_agreement"] == 1.0
    assert res["perplexity"] == res["reference_perplexity"] and math.isfinite(res["perplexity"])


def test_int4_moves_the_distribution(ids, reference):
    res = evaluate(_runner("int4"), ids, 48, reference).summary()
    print(f"int4 vs bf16 (built-in random model): KL {res['kl']:.2e}, top-1 {res['top1_agreement']:.3f}")
    assert res["kl"] > 1e-7 and math.isfinite(res["perplexity"]) and res["kl_max"] >= res["kl"]


def test_dropping_experts(ids, reference):
    plain = reference.score(ids[:48])
    assert torch.equal(_runner(drop=0).score(ids[:48]), plain)  # D = 0 is no dropping, bit for bit
    res = evaluate(_runner(drop=1), ids, 48, reference).summary()
    assert res["kl"] > 1e-6 and math.isfinite(res["perplexity"])


# ---------------------------------------------------------------- the command

@pytest.fixture(scope="module")
def env(isolated_env):
    return isolated_env


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.py"
    path.write_text(TEXT)
    return path


def cli(capsys, *args):
    from hetmoe.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_eval_command_json(env, text_file):
    out = subprocess.run([sys.executable, "-m", "hetmoe", "eval", "--text", text_file, "--experts-format", "int8",
                          "--expert-cache", "off", "--window", "64", "--json", "-"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == KEYS
    assert result["config"]["experts_format"] == "int8" and result["reference"]["experts_format"] == "bf16"
    assert result["tokens"] > 0 and result["kl"] >= 0 and 0 <= result["top1_agreement"] <= 1


def test_eval_command_table_and_identical_configs(capsys, text_file, tmp_path):
    """A configuration that is the reference is loaded and scored once (said), and compared with itself."""
    code, stdout, stderr = cli(capsys, "eval", "--text", text_file, "--experts-format", "bf16", "--expert-cache",
                               "off", "--window", 32, "--max-tokens", 100, "--json", tmp_path / "r.json")
    assert code == 0 and "bf16 (reference)" in stdout and "KL(ref||test)" in stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["kl"] == 0 and result["top1_agreement"] == 1.0
    assert result["perplexity"] == result["reference_perplexity"] and result["reference"] == result["config"]
    assert result["tokens"] == 100 - 4  # 100 tokens in windows of 32, 32, 32, 4: one unscored token each
    assert stderr.count("hetmoe: loaded in") == 1 and "the configuration is the reference" in stderr, stderr
    # another configuration loads its reference beside it
    code, _, stderr = cli(capsys, "eval", "--text", text_file, "--experts-format", "int8", "--expert-cache", "off",
                          "--window", 32, "--max-tokens", 40, "--json", "-")
    assert code == 0 and stderr.count("hetmoe: loaded in") == 2 and "is the reference" not in stderr, stderr


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory):
    """The built-in model's files in another directory (another checkpoint of the same weights and tokenizer)."""
    import shutil

    path = tmp_path_factory.mktemp("copy") / "model"
    shutil.copytree(default_model_path(), path)
    return path


def test_eval_against_another_checkpoint(capsys, text_file, tmp_path, model_copy):
    """--reference-model: the reference is loaded from the other checkpoint (not the configuration compared with
    itself): the same weights agree exactly, int8 experts against it move the distribution, both paths named."""
    common = ("eval", "--text", text_file, "--expert-cache", "off", "--window", 32, "--max-tokens", 70,
              "--reference-model", model_copy)
    code, stdout, stderr = cli(capsys, *common, "--experts-format", "bf16", "--json", tmp_path / "r.json")
    assert code == 0 and stderr.count("hetmoe: loaded in") == 2 and "is the reference" not in stderr, stderr
    assert f"reference: {model_copy}" in stdout
    same = json.loads((tmp_path / "r.json").read_text())
    assert same["kl"] == 0 and same["top1_agreement"] == 1.0 and same["reference"]["model"] == str(model_copy)
    code, stdout, stderr = cli(capsys, *common, "--experts-format", "int8", "--json", "-")
    assert code == 0, stderr
    moved = json.loads(stdout)
    assert moved["kl"] > 0 and moved["reference"]["experts_format"] == "bf16"


def test_eval_refuses_a_reference_that_tokenizes_otherwise(capsys, text_file, tmp_path, model_copy):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(model_copy, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][40:]  # the first merges gone: the text splits otherwise
    (other / "tokenizer.json").write_text(json.dumps(spec))
    code, stdout, stderr = cli(capsys, "eval", "--text", text_file, "--expert-cache", "off", "--window", 32,
                               "--reference-model", other)
    assert code not in (0, None) and stdout == ""
    assert f"--reference-model {other} splits the text into other tokens than --model" in stderr, stderr
    code, _, stderr = cli(capsys, "eval", "--text", text_file, "--expert-cache", "off", "--reference-model",
                          model_copy, "--reference-format", "none")
    assert code not in (0, None) and "--reference-model with --reference-format none" in stderr, stderr


def test_a_mix_of_formats_is_labelled_as_one():
    """--cpu-memory's per-layer / per-projection mixes are named as such (not by the plan's nominal format)."""
    from types import SimpleNamespace

    from hetmoe.cli.eval import _describe

    def layer(fmt, down=None):
        return SimpleNamespace(experts_format=fmt, down_format=down, group_size=32)

    def plan(*layers):
        return SimpleNamespace(experts_format="int4", group_size=64, dense_format="bf16", layers=list(layers),
                               device=torch.device("cpu"), dtype=torch.float32)

    assert _describe(plan(layer("int4"), layer("int4")))["label"] == "int4 g64"
    mixed = _describe(plan(layer("int4"), layer("int3", "int4")))
    assert mixed["label"] == "int3/int4 mix"
    assert mixed["layers"] == "gate+up/down per MoE layer: 0 int4/int4, 1 int3/int4"
    assert _describe(plan(layer("int2", "int3"), layer("int2", "int3")))["label"] == "int2/int3 mix"


def test_same_as_reference_reads_the_plan():
    from types import SimpleNamespace

    from hetmoe.cli.eval import same_as_reference

    def plan(dense="bf16", **layer):
        lp = SimpleNamespace(**{"experts_format": "bf16", "group_size": 0, "defer_experts": 0, "gpu_experts": 0,
                                **layer})
        return SimpleNamespace(dense_format=dense, experts_format=lp.experts_format, layers=[lp, lp])

    assert same_as_reference(plan(), "bf16", 0)
    assert not same_as_reference(plan(), "bf16", 1)  # experts dropped
    assert not same_as_reference(plan("int8"), "bf16", 0)
    for change in (dict(experts_format="int8", group_size=128), dict(defer_experts=1), dict(gpu_experts=2)):
        assert not same_as_reference(plan(**change), "bf16", 0), change
    assert same_as_reference(plan(experts_format="int8", group_size=128), "int8", 0)  # int8's default group
    assert not same_as_reference(plan(experts_format="int8", group_size=32), "int8", 0)


def test_eval_scores_the_builtin_models_heldout_text_by_default(capsys):
    code, stdout, stderr = cli(capsys, "eval", "--device", "cpu", "--expert-cache", "off", "--window", 32,
                               "--max-tokens", 60, "--reference-format", "none", "--json", "-")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["text"] == str(default_model_path() / "heldout.txt") and result["tokens"] == 60 - 2
    assert "held-out text" in stderr


def test_eval_with_a_model_requires_text(capsys):
    code, stdout, stderr = cli(capsys, "eval", "--model", default_model_path(), "--expert-cache", "off")
    assert code == 2 and stdout == ""
    assert stderr.splitlines()[-1] == ("hetmoe eval: error: --text FILE is required with --model: the text to score "
                                       "(only the built-in model, without --model, has a default: its held-out "
                                       "text)"), stderr


@pytest.mark.parametrize("args, message", [
    (("--text", "/nonexistent/text.txt"), "text file /nonexistent/text.txt does not exist"),
    (("--text", "EMPTY"), "is empty"),
    (("--drop-experts", 4), "--drop-experts 4: each token has 4 experts; at most 3 can be dropped"),
    (("--window", 0), "--window must be at least 2 tokens, got 0"),
    (("--window", 8192), "--window 8192 is beyond the model's 1024 positions"),
], ids=["missing-text", "empty-text", "drop-too-many", "window-0", "window-too-long"])
def test_eval_errors_are_one_line(capsys, text_file, tmp_path, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    args = [empty if a == "EMPTY" else a for a in args]
    if "--text" not in args:
        args = ["--text", text_file, *args]
    code, stdout, stderr = cli(capsys, "eval", "--expert-cache", "off", *args)
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert code not in (0, None) and stdout == ""
    assert len(errors) == 1 and errors[0].startswith("hetmoe eval: error:") and message in errors[0], stderr


# ---------------------------------------------------------------- the training script

@pytest.fixture(scope="module")
def smoke_checkpoint(tmp_path_factory, env):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("demo") / "ckpt"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "train_demo_moe.py"), "--smoke", "--device", "cpu",
                          "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


@pytest.mark.slow  # a training run of the demo script (~15 s on 2 cores)
def test_training_smoke_run_writes_a_checkpoint(smoke_checkpoint):
    names = {p.name for p in smoke_checkpoint.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "training.json", "heldout.txt"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    record = json.loads((smoke_checkpoint / "training.json").read_text())
    assert record["steps"] == 2 and math.isfinite(record["train_loss"]) and math.isfinite(record["heldout_loss"])
    assert record["corpus"]["heldout_files"] == 2 and len(record["corpus"]["heldout_list_sha256"]) == 64
    load = record["expert_load_heldout"]["layer 1"]
    assert len(load) == 8 and sum(load) == pytest.approx(1, abs=1e-3)
    # The saved layout is what the engine reads (a wrong layout gives errors of order 1). The weights are bf16, so
    # on the row-block class only fp32 order differs (measured 1e-5..3e-5); on AMX (isa auto there) the experts'
    # activations are rounded to bf16 (measured 3.2e-4): the cross-path bound (tests/paths.py).
    amx = record["hetmoe_isa"] == "amx"
    bound = LOGIT_CROSS_PATH_BOUND["bf16"] if amx else 1e-4
    assert record["hetmoe_vs_transformers_rel_logit_error"] < bound, record["hetmoe_isa"]
    assert (smoke_checkpoint / "heldout.txt").stat().st_size > 0


@pytest.mark.slow  # a training run of the demo script (~15 s on 2 cores)
def test_trained_checkpoint_loads_and_generates_deterministically(smoke_checkpoint):
    llm = LLM(smoke_checkpoint, EngineOptions(device="cpu", max_context=64), expert_cache=None, progress=False,
              log=lambda m: None)
    assert llm.loaded.config.model_type == "deepseek_v3"

    def run(seed):
        return llm.generate("def main():", SamplingParams(max_tokens=12, temperature=1.0, seed=seed,
                                                            ignore_eos=True), chat=False).token_ids

    assert run(5) == run(5) and len(run(5)) == 12


@pytest.mark.slow  # a training run of the demo script (~15 s on 2 cores)
def test_eval_on_the_trained_checkpoint(capsys, smoke_checkpoint):
    code, stdout, stderr = cli(capsys, "eval", "--model", smoke_checkpoint, "--text", smoke_checkpoint / "heldout.txt",
                               "--experts-format", "int4", "--group-size", 32, "--window", 64, "--max-tokens", 300,
                               "--expert-cache", "off", "--json", "-")
    assert code == 0, stderr
    result = json.loads(stdout)
    assert math.isfinite(result["perplexity"]) and result["tokens"] == 300 - 5 and result["kl"] >= 0


def test_eval_measures_the_dense_format(capsys, text_file, tmp_path):
    """--dense-format int8 against the reference's bf16 dense weights: the label names it, and it moves the
    distribution (what the format costs)."""
    code, stdout, _ = cli(capsys, "eval", "--text", text_file, "--experts-format", "bf16", "--dense-format", "int8",
                          "--device", "cpu", "--expert-cache", "off", "--window", 32, "--max-tokens", 100,
                          "--json", tmp_path / "r.json")
    assert code == 0 and "dense int8" in stdout, stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["config"]["dense_format"] == "int8" and result["reference"]["dense_format"] == "bf16"
    assert result["kl"] > 0
