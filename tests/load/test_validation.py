"""Errors come before the load: a bad config.json, a missing or broken tokenizer, and engine options the model or
machine cannot honour are reported (or normalised) before any weight is read.

"No weight read" is asserted by ``no_weights``: ``Checkpoint.get`` — the one way to a tensor's bytes — raises an
AssertionError (which no loader code catches) if it is called.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from hetmoe.cli import main
from hetmoe.config.options import EngineOptions
from hetmoe.config.units import gib
from hetmoe.cpu import default_threads
from hetmoe.engine.llm import LLM
from hetmoe.load.checkpoint import CheckpointError
from hetmoe.load.loader import load_model
from hetmoe.load.random_weights import SHAPES, write_checkpoint
from hetmoe.models import context_limit
from hetmoe.models.config import ModelConfig
from hetmoe.models.config import context_limit as scaled_limit
from hetmoe.plan.memory import MemoryPlan
from hetmoe.plan.placement import normalize_options

CPU = dict(device="cpu", dtype="fp32", experts_format="bf16")


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    return {arch: write_checkpoint(root / arch, arch, seed=i, dtype="float32")
            for i, arch in enumerate(("qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral", "qwen2_moe"))}


@pytest.fixture
def copy(originals, tmp_path):
    """copy(arch) -> a private copy of the tiny checkpoint of ``arch``, to damage."""
    return lambda arch="qwen3_moe": Path(shutil.copytree(originals[arch], tmp_path / arch))


def edit_config(path: Path, drop=(), **changes) -> None:
    cfg = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k not in drop}
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def rope(path: Path, **params) -> None:
    """The same RoPE entry under both spellings transformers writes (rope_parameters wins where both are)."""
    theta = json.loads((path / "config.json").read_text()).get("rope_theta", 10000.0)
    edit_config(path, rope_parameters={"rope_theta": theta, **params}, rope_scaling={"rope_theta": theta, **params})


def load(path, log=None, cache=None, **opts):
    return load_model(path, EngineOptions(**{**CPU, **opts}), expert_cache=cache, progress=False,
                      log=(log if log is not None else []).append)


# ---------------------------------------------------------------- config.json

# case -> (arch, config changes, the message after "<dir>/config.json: ")
CONFIGS = {
    "top-k-above-experts": ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok is 9; with 8 routed "
                            r"experts \(num_(local_)?experts\) it must be between 1 and 8"),
    "top-k-zero": ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok is 0; with 8 routed "
                   r"experts \(num_(local_)?experts\) it must be between 1 and 8"),
    "top-k-mixtral": ("mixtral", dict(num_experts_per_tok=5),
                      r"num_experts_per_tok is 5; with 4 routed experts \(num_local_experts\) it must be "
                      "between 1 and 4"),
    "top-k-deepseek": ("deepseek_v3", dict(num_experts_per_tok=9),
                       r"num_experts_per_tok is 9; with 8 routed experts \(n_routed_experts\) it must be "
                       "between 1 and 8"),
    "negative-positions": ("qwen3_moe", dict(max_position_embeddings=-1),
                           "max_position_embeddings is -1; it must be an integer >= 1"),
    "zero-hidden": ("qwen3_moe", dict(hidden_size=0), "hidden_size is 0; it must be an integer >= 1"),
    "zero-layers": ("mixtral", dict(num_hidden_layers=0), "num_hidden_layers is 0; it must be an integer >= 1"),
    "vocab-a-string": ("qwen3_moe", dict(vocab_size="512"), "vocab_size is '512'; it must be an integer >= 1"),
    "float-size": ("qwen2_moe", dict(moe_intermediate_size=32.5), "moe_intermediate_size is 32.5; it must be"),
    "kv-heads": ("qwen3_moe", dict(num_key_value_heads=3),
                 "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    "odd-head-dim": ("qwen3_moe", dict(head_dim=15), r"the head size is 15 \(head_dim\); RoPE needs an even size"),
    "heads-do-not-divide": ("qwen2_moe", dict(hidden_size=66),
                            r"hidden_size 66 is not a multiple of num_attention_heads 4 \(and there is no head_dim\)"),
    "eps-zero": ("qwen3_moe", dict(rms_norm_eps=0), "rms_norm_eps is 0; it must be a number > 0"),
    "sparse-step-zero": ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step is 0; it must be"),
    "mlp-only-layer-out-of-range": ("qwen3_moe", dict(mlp_only_layers=[5]),
                                    r"mlp_only_layers lists layer\(s\) \[5\]; the model has 2 \(num_hidden_layers\)"),
    "shared-expert-size": ("qwen2_moe", dict(shared_expert_intermediate_size=0),
                           "shared_expert_intermediate_size is 0"),
    "n-group-does-not-divide": ("deepseek_v3", dict(n_group=3),
                                r"n_group is 3; it must divide the 8 routed experts \(n_routed_experts\)"),
    "groups-of-one": ("deepseek_v3", dict(n_group=8, topk_group=4),
                      "n_group is 8: groups of 1 expert.*n_group can be at most 4"),
    "topk-group-above-n-group": ("deepseek_v3", dict(topk_group=3),
                                 r"topk_group is 3; it must be between 1 and n_group \(2\)"),
    "top-k-beyond-groups": ("deepseek_v3", dict(num_experts_per_tok=5),
                            "num_experts_per_tok is 5, but topk_group 1 groups of 4 experts offer only 4"),
    "v2-groups": ("deepseek_v2", dict(n_group=3), "n_group is 3; it must divide the 8 routed experts"),
    "v2-topk-method": ("deepseek_v2", dict(topk_method="noaux"),
                       "topk_method is 'noaux'; DeepSeek-V2 routes with greedy or group_limited_greedy"),
    "kv-lora-rank": ("deepseek_v3", dict(kv_lora_rank=0), "kv_lora_rank is 0; it must be an integer >= 1"),
    "odd-rope-dim": ("deepseek_v3", dict(qk_rope_head_dim=7), "qk_rope_head_dim is 7; RoPE needs an even size"),
    "missing-size": ("deepseek_v3", dict(v_head_dim=None),
                     "does not describe a deepseek_v3 model: it has no v_head_dim"),
    "no-expert-count": ("mixtral", dict(num_local_experts=None, num_experts=None),
                        "does not describe a mixtral model: it has none of num_local_experts, num_experts"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_is_refused_before_any_weight(copy, no_weights, case):
    arch, changes, message = CONFIGS[case]
    path = copy(arch)
    edit_config(path, **changes)
    where = re.escape(str(path / "config.json"))
    with pytest.raises(CheckpointError, match=f"^{where}(: | ){message}"):
        load(path)
    with pytest.raises(CheckpointError, match=message):  # LLM: also before the tokenizer is read
        LLM(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=lambda m: None)


def test_bad_rope_scaling_is_refused(copy, no_weights):
    path = copy("deepseek_v3")
    rope(path, rope_type="yarn", factor=4)
    with pytest.raises(CheckpointError, match="rope_parameters .yarn. has no original_max_position_embeddings"):
        load(path)
    rope(path, rope_type="linear", factor=4)
    with pytest.raises(CheckpointError, match="rope_type 'linear'; DeepSeek models run default or yarn RoPE"):
        load(path)
    rope(path, rope_type="yarn", factor=-2, original_max_position_embeddings=1024)
    with pytest.raises(CheckpointError, match=r"rope_parameters.factor is -2; it must be a number > 0"):
        load(path)


def test_cli_prints_the_config_error_as_one_line(copy, no_weights, capsys):
    path = copy()
    edit_config(path, num_experts_per_tok=9)
    assert main(["generate", "--model", str(path), "--device", "cpu", "--expert-cache", "off"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    field = "num_experts" if "num_experts" in json.loads((path / "config.json").read_text()) else "num_local_experts"
    assert err[-1] == (f"hetmoe generate: error: {path / 'config.json'}: num_experts_per_tok is 9; with 8 routed "
                       f"experts ({field}) it must be between 1 and 8"), err


def test_every_tiny_architecture_passes_the_checks(originals):
    for arch, path in originals.items():
        assert load(path).config["model_type"] == arch


def test_every_real_shape_passes_the_checks():
    from hetmoe.models import check_config

    for name, shape in SHAPES.items():
        check_config(ModelConfig(shape), name)


# ---------------------------------------------------------------- the tokenizer

def _break_template(path):
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% for m in messages %}{{ m"}))


TOKENIZERS = {
    "missing": (lambda p: (p / "tokenizer.json").unlink(), FileNotFoundError,
                "no tokenizer.json in DIR"),
    "not-json": (lambda p: (p / "tokenizer.json").write_text("{oops"), ValueError, "cannot read DIR/tokenizer.json"),
    "not-a-tokenizer": (lambda p: (p / "tokenizer.json").write_text('{"model": 3}'), ValueError,
                        "cannot read DIR/tokenizer.json"),
    "config-not-json": (lambda p: (p / "tokenizer_config.json").write_text("[1, "), ValueError,
                        "cannot read DIR/tokenizer_config.json"),
    "template-does-not-compile": (_break_template, ValueError,
                                  r"DIR/tokenizer_config.json: the chat template does not compile \("),
    "jinja-file-does-not-compile": (lambda p: (p / "chat_template.jinja").write_text("{% if x %}never closed"),
                                    ValueError, r"DIR/chat_template.jinja: the chat template does not compile"),
    "jinja-file-not-utf8": (lambda p: (p / "chat_template.jinja").write_bytes(b"\xff\xfe{{"), ValueError,
                            "DIR: a tokenizer file is not UTF-8"),
}


@pytest.mark.parametrize("case", list(TOKENIZERS))
def test_bad_tokenizer_is_refused_before_any_weight(copy, no_weights, case, tmp_path):
    damage, exc, message = TOKENIZERS[case]
    path = copy()
    damage(path)
    message = message.replace("DIR", re.escape(str(path)))
    with pytest.raises(exc, match=message):
        LLM(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=lambda m: None)
    text = tmp_path / "text.txt"
    text.write_text("some text to score " * 20)
    assert main(["eval", "--model", str(path), "--text", str(text), "--device", "cpu", "--expert-cache", "off",
                 "--reference-format", "none", "--window", "16"]) == 1


def test_tokenizer_larger_than_the_vocab_is_noted(copy):
    path = copy()
    from hetmoe.load.loader import load_tokenizer

    vocab = load_tokenizer(path).vocab_size

    notes = []
    load_tokenizer(path, ModelConfig(vocab_size=vocab - 8), notes.append)
    assert len(notes) == 1 and f"config.json's vocab_size is {vocab - 8}" in notes[0], notes
    load_tokenizer(path, ModelConfig(vocab_size=vocab), notes.append)
    assert len(notes) == 1


# ---------------------------------------------------------------- --model given a hub id

def test_hub_id_gets_the_download_hint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    hint = ("model directory Qwen/Qwen3-30B-A3B does not exist. It looks like a Hugging Face hub id: hetmoe does not "
            "download models; run `huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir DIR`, then pass --model DIR")
    with pytest.raises(FileNotFoundError) as err:
        LLM("Qwen/Qwen3-30B-A3B", EngineOptions(**CPU), expert_cache=None, progress=False)
    assert str(err.value) == hint
    assert main(["generate", "--model", "Qwen/Qwen3-30B-A3B", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"hetmoe generate: error: {hint}"
    for not_an_id in ("missing-dir", "a/b/c", "/abs/path"):
        with pytest.raises(FileNotFoundError) as err:
            load(not_an_id)
        assert str(err.value) == f"model directory {not_an_id} does not exist"


@pytest.mark.parametrize("name, what", [
    ("model.bin", "is a file (.bin), not a model"),
    ("weights", "is a file (no suffix), not a model"),
    ("config.json", "is a file of a Hugging Face checkpoint: pass its directory"),
    ("model-00001-of-00002.safetensors", "is a file of a Hugging Face checkpoint: pass its directory"),
])
def test_a_file_that_is_not_a_model_says_what_it_is(tmp_path, capsys, name, what):
    """--model FILE of an unknown kind: not "directory does not exist", but what it is and what --model takes."""
    path = tmp_path / name
    path.write_text("{}")
    accepted = "--model takes a Hugging Face checkpoint directory (config.json, tokenizer and *.safetensors) or a " \
               "GGUF file (.gguf)"
    for call in (lambda: load(path), lambda: LLM(str(path), EngineOptions(**CPU), expert_cache=None, progress=False)):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value).startswith(f"{path} {what}") and accepted in str(err.value)
    for command in ("generate", "eval"):
        assert main([command, "--model", str(path), "--device", "cpu", "--text", str(path)]
                    if command == "eval" else [command, "--model", str(path), "--device", "cpu"]) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"hetmoe {command}: error: {path} {what}") and "does not exist" not in err, err
    with pytest.raises(FileNotFoundError, match="GGUF file .* does not exist"):
        load(tmp_path / "missing.gguf")


# ---------------------------------------------------------------- options that cannot apply

def test_threads_above_the_cores_are_capped_once(originals):
    cores = default_threads()
    log = []
    opts = normalize_options(EngineOptions(threads=cores + 62), log.append)
    assert opts.threads == cores and log == [f"hetmoe: --threads {cores + 62} is more than the {cores} physical "
                                             f"cores this process may use; using {cores}"]
    assert normalize_options(opts, log.append) is opts and len(log) == 1  # already within: silent
    log = []
    loaded = load(originals["qwen3_moe"], log, threads=cores + 62)
    assert loaded.options.threads == cores
    assert sum("physical cores" in m for m in log) == 1, log
    log = []
    assert load(originals["qwen3_moe"], log, threads=cores).options.threads == cores
    assert not any("physical cores" in m for m in log), log


def test_max_context_beyond_the_model_is_refused(copy, no_weights):
    path = copy()
    edit_config(path, max_position_embeddings=1024)
    with pytest.raises(ValueError, match=r"^--max-context 99999 is beyond the 1024 positions this model was trained "
                                         r"for \(max_position_embeddings 1024 in config.json\); use --max-context "
                                         r"1024 or less$"):
        load(path, max_context=99999)
    with pytest.raises(ValueError, match="--max-context 1025 is beyond the 1024 positions"):
        LLM(path, EngineOptions(**CPU, max_context=1025), expert_cache=None, progress=False, log=lambda m: None)


def test_max_context_at_the_limit_loads(copy):
    path = copy()
    edit_config(path, max_position_embeddings=128)
    assert load(path, max_context=128).plan.max_context == 128
    assert load(path).plan.max_context == 128  # the default: min(4096, the limit)


def test_rope_scaling_extends_the_context_where_the_model_applies_it(copy):
    path = copy("deepseek_v3")
    edit_config(path, max_position_embeddings=1024)
    rope(path, rope_type="yarn", factor=4, original_max_position_embeddings=1024)
    assert load(path, max_context=4096).plan.max_context == 4096
    with pytest.raises(ValueError, match=r"--max-context 4097 is beyond the 4096 positions this model was trained for "
                                         r"\(yarn RoPE scaling: original_max_position_embeddings 1024 x factor 4 in "
                                         r"config.json\); use --max-context 4096 or less"):
        load(path, max_context=4097)


def test_rope_scaling_the_model_does_not_apply_is_noted(copy):
    path = copy()
    edit_config(path, max_position_embeddings=1024)
    rope(path, rope_type="yarn", factor=4, original_max_position_embeddings=1024)
    with pytest.raises(ValueError, match=r"beyond the 1024 positions .*\(max_position_embeddings 1024 in"):
        load(path, max_context=2048)
    log = []
    load(path, log)
    text = " ".join(m.removeprefix("hetmoe:").strip() for m in log)
    assert ("note: config.json asks for yarn RoPE scaling, which hetmoe's qwen3_moe model does not apply: it runs "
            "default RoPE, over at most max_position_embeddings positions") in text, log


def test_context_limit_of_real_configs():
    assert context_limit(ModelConfig(SHAPES["deepseek-v3"])) == (163840, "max_position_embeddings 163840")
    assert context_limit(ModelConfig(SHAPES["qwen3-30b-a3b"])) == (40960, "max_position_embeddings 40960")
    # Qwen3's documented YaRN switch (factor 4 over 32768): the limit where a model applies it, not in hetmoe's qwen3
    yarn = ModelConfig(SHAPES["qwen3-30b-a3b"], rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 32768})
    assert scaled_limit(yarn) == (131072, "yarn RoPE scaling: original_max_position_embeddings 32768 x factor 4")
    assert context_limit(yarn)[0] == 40960
    no_original = ModelConfig(SHAPES["deepseek-v3"], max_position_embeddings=2048,
                              rope_scaling={"type": "yarn", "factor": 2})
    assert context_limit(no_original)[0] == 4096
    assert context_limit(ModelConfig(model_type="qwen3_moe")) == (None, "")


def test_group_size_with_bf16_is_noted_and_keeps_the_cache_key(originals, tmp_path):
    cache = tmp_path / "cache"
    log = []
    first = load(originals["qwen3_moe"], log, cache, group_size=64)
    assert first.plan.group_size == 0 and (first.info["cache_hits"], first.info["cache_misses"]) == (0, 2)
    text = " ".join(m.removeprefix("hetmoe:").strip() for m in log)
    assert "note: --group-size 64 does not apply to bf16 experts (they have no scale groups); ignored" in text, log
    log = []
    second = load(originals["qwen3_moe"], log, cache)
    assert (second.info["cache_hits"], second.info["cache_misses"]) == (2, 0)
    assert second.info["cache_dir"] == first.info["cache_dir"] and "-bf16-g0-" in second.info["cache_dir"]
    assert not any("group-size" in m for m in log), log
    assert load(originals["qwen3_moe"], None, cache, group_size=128).info["cache_hits"] == 2
    assert [p.name for p in cache.iterdir()] == [Path(first.info["cache_dir"]).name]
    # an int8 load still keys by its group
    assert "-int8-g64-" in load(originals["qwen3_moe"], None, cache, experts_format="int8", group_size=64
                                ).info["cache_dir"]


def test_old_bf16_cache_keyed_by_a_group_is_pruned(originals, tmp_path):
    """bf16 directories written with a group in their key (before it was normalised) are the same bytes as the
    group-0 one: removed when the group-0 directory is made."""
    path = Path(originals["qwen3_moe"])
    cache = tmp_path / "cache"
    ref = load(path, None, cache)
    key = json.loads((Path(ref.info["cache_dir"]) / "key.json").read_text())
    shutil.rmtree(ref.info["cache_dir"])
    old = cache / f"{path.name}-bf16-g64-0123456789abcdef0123"
    old.mkdir()
    (old / "key.json").write_text(json.dumps({**key, "group_size": 64}))
    (old / "layer0000.bin").write_bytes(b"x" * 100)
    other = cache / "another-model-bf16-g64-0123456789abcdef0123"
    other.mkdir()
    (other / "key.json").write_text(json.dumps({**key, "checkpoint": "/another/model", "group_size": 64}))
    log = []
    load(path, log, cache)
    assert not old.exists() and other.exists()
    assert any("removed the expert cache" in m and old.name in m for m in log), log


# ---------------------------------------------------------------- the load summary

UNIT = re.compile(r"\b(\d+\.\d+) (GiB|MiB|KiB|GB|MB|B)\b")


def _check_units(lines):
    for line in lines:
        for value, unit in UNIT.findall(line):
            # one style: MiB with one decimal below 1 GiB, GiB with two from there
            assert (unit == "MiB" and re.fullmatch(r"\d+\.\d", value) and float(value) < 1024) or \
                   (unit == "GiB" and re.fullmatch(r"\d+\.\d\d", value) and float(value) >= 1.0), line


def test_load_summary_fits_100_columns(originals):
    log = []
    load(originals["deepseek_v3"], log, defer_experts=1, threads=1)
    start = [m for m in log if not m.startswith("hetmoe: loaded in")]
    assert start[0] == f"hetmoe: deepseek_v3 from {originals['deepseek_v3']}"
    assert any("RAM" in m for m in log) and any(m.startswith("hetmoe: loaded in") for m in log), log
    assert all(len(m) <= 100 for m in log[1:]), log
    _check_units(log)


def test_plan_summary_wraps_and_keeps_one_unit_style():
    import torch

    plan = MemoryPlan(torch.device("cuda"), torch.bfloat16, "int4", 64, 4096)
    plan.ram = {"routed experts": 371 * 2**30, "runtime": 400 * 2**20 + 12345}
    plan.vram = {"dense weights": 12 * 2**30 + 7, "KV cache": 2**29, "activations": 123 * 2**20,
                 "CUDA context": 600 * 2**20, "GPU experts": 3 * 2**30 + 2**29}
    lines = plan.summary_lines(60)
    assert all(len(m) <= 60 for m in lines) and len(lines) >= 4, lines
    assert lines[0] == "hetmoe:   RAM 371.39 GiB: routed experts 371.00 GiB,"
    assert lines[1] == "hetmoe:     runtime 400.0 MiB"
    assert any(m.startswith("hetmoe:   VRAM 16.71 GiB:") for m in lines), lines
    _check_units(lines)
    assert [gib(n) for n in (2**20, 2**30 - 2**20, 2**30, 57 * 2**30)] == ["1.0 MiB", "1023.0 MiB", "1.00 GiB",
                                                                            "57.00 GiB"]
