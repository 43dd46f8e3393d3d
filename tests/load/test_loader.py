"""Loading checkpoints: hetmoe/load/checkpoint.py (reader, FP8), loader.py (load_model), expert_cache.py. Every
checkpoint is written here by synthetic.write_checkpoint; every expert cache is a tmp dir (never ~/.cache)."""

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from rss import peak_rss
from safetensors.torch import load_file, save_file  # noqa: E402

from hetmoe.config.options import DEFAULT_GROUP, EngineOptions  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.layers.attention import Step  # noqa: E402
from hetmoe.load.checkpoint import Checkpoint, CheckpointError, dequantize_fp8  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from hetmoe.load.random_weights import ARCHITECTURES, write_checkpoint  # noqa: E402
from hetmoe.models import model_class  # noqa: E402
from parity import engine_bf16, load_ours, max_rel  # noqa: E402
from paths import BEST_ROW_PATH  # noqa: E402

PROMPT = [5, 17, 300, 42, 9, 260, 77, 3, 128, 64, 11]
STEPS = 4
CPU = dict(device="cpu", dtype="fp32", max_context=64)
# Big enough that converting experts costs real time and memory: 151 MB of bf16 routed experts in 6 layers.
BIG = dict(hidden_size=512, num_experts=32, moe_intermediate_size=256, num_hidden_layers=6)


def load(path, cache=None, log=None, **opts):
    log = [] if log is None else log
    return load_model(path, EngineOptions(**{**CPU, **opts}), expert_cache=cache, progress=False, log=log.append)


def run_logits(loaded, tokens=None, prompt=PROMPT, steps=STEPS):
    """Prefill, then ``steps`` decode steps fed ``tokens`` (default: greedy) -> (logits [steps + 1, V], tokens)."""
    runner = Runner(loaded)
    out, fed = [runner.prefill(prompt)], []
    for i in range(steps):
        fed.append(tokens[i] if tokens is not None else int(out[-1].argmax()))
        out.append(runner.decode(fed[-1]))
    return torch.stack(out), fed


@torch.no_grad()
def run_model(model, tokens, prompt=PROMPT):
    """The same calls on a bare model (tests/parity.load_ours) with its own cache."""
    cache, slot = model.make_cache(1, CPU["max_context"]), torch.tensor([0])
    out = [model.logits(model(torch.tensor([prompt]), Step(torch.arange(len(prompt))[None], slot), cache)[:, -1])]
    for i, t in enumerate(tokens):
        step = Step(torch.tensor([[len(prompt) + i]]), slot)
        out.append(model.logits(model(torch.tensor([[t]]), step, cache)[:, -1]))
    return torch.cat(out).float()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {a: write_checkpoint(root / a, a, seed=i, dtype="float32") for i, a in enumerate(ARCHITECTURES)}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("big"), "qwen3_moe", BIG, dtype="bfloat16", max_shard_size="40MB")


@pytest.fixture
def ckpt(tiny, tmp_path):
    """A private copy of the tiny Qwen3-MoE checkpoint, to damage."""
    return shutil.copytree(tiny["qwen3_moe"], tmp_path / "ckpt")


# ---------------------------------------------------------------- load_model vs the parity harness

# Measured: max rel. logit error 0 for every architecture (prefill + 4 decode steps) on every engine path: same
# engine path on both sides, same weights.
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_load_model_matches_parity_harness(tiny, arch, engine_path):
    loaded = load(tiny[arch], experts_format="bf16", **engine_path.options)
    assert loaded.plan.dtype == torch.float32 and loaded.plan.experts_format == "bf16"
    ours, tokens = run_logits(loaded)
    ref = run_model(load_ours(tiny[arch], model_class(loaded.config), engine_bf16(engine_path)), tokens)
    print(f"{arch}: max rel. error {max_rel(ours, ref):.1e}")
    assert torch.isfinite(ours).all() and max_rel(ours, ref) <= 1e-6


# Measured: 1.9e-7 max rel. vs the parity harness (auto -> fp32 on the CPU); 5.2e-3 rel. with the dense part in bf16.
def test_bf16_checkpoint_with_dtype_auto(tmp_path):
    path = write_checkpoint(tmp_path / "bf16", "qwen3_moe", seed=3, dtype="bfloat16")
    loaded = load(path, experts_format="bf16", dtype="auto", **BEST_ROW_PATH.options)
    assert loaded.plan.dtype == torch.float32
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    ours, tokens = run_logits(loaded)
    err = max_rel(ours, run_model(load_ours(path, model_class(loaded.config), engine_bf16(BEST_ROW_PATH)), tokens))
    print(f"bf16 checkpoint, dtype auto: max rel. error vs the parity harness {err:.1e}")
    assert err <= 1e-6
    half = load(path, experts_format="bf16", dtype="bf16")
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    err = rel(run_logits(half, tokens)[0], ours)
    print(f"bf16 dense part: rel. error {err:.1e}")
    assert 0 < err <= 3e-2


# Measured ||logits - logits with bf16 experts|| / ||...||: qwen3_moe int8 6.8e-4 (g128 and per-row: equal, K <= 128),
# int4 1.1e-2 (g64, g32 and per-row); deepseek_v3 int4 2.8e-2.
@pytest.mark.parametrize("arch, fmt, group, tol", [
    ("qwen3_moe", "int8", None, 5e-3), ("qwen3_moe", "int8", 0, 5e-3), ("qwen3_moe", "int4", None, 0.06),
    ("qwen3_moe", "int4", 32, 0.06), ("qwen3_moe", "int4", 0, 0.06), ("deepseek_v3", "int4", None, 0.1)])
def test_quantized_experts_close_to_bf16(tiny, arch, fmt, group, tol):
    ref, tokens = run_logits(load(tiny[arch], experts_format="bf16"))
    loaded = load(tiny[arch], experts_format=fmt, group_size=group)
    info = moe_blocks(loaded.model)[0][1].experts.info()
    assert (info["weight_format"], info["group_size"]) == (fmt, DEFAULT_GROUP[fmt] if group is None else group)
    out, _ = run_logits(loaded, tokens)
    err = rel(out, ref)
    print(f"{arch} {fmt} g{group}: rel. error {err:.1e}")
    assert torch.isfinite(out).all() and 1e-5 < err <= tol  # > 1e-5: really quantized


# ---------------------------------------------------------------- converted-expert cache

def test_second_load_is_served_by_the_cache(big, tmp_path, monkeypatch):
    """The second load of a checkpoint reads every MoE layer from the converted-expert cache: hit counters, no
    conversion run (fill_experts counted), the same packed bytes (checksums) and logits. How much faster that is
    is a benchmark's business (``hetmoe bench e2e``), not this test's."""
    import hetmoe.load.loader as loader

    converted, real_fill = [], loader.fill_experts

    def counting_fill(ckpt, prefix, experts):
        converted.append(prefix)
        return real_fill(ckpt, prefix, experts)

    monkeypatch.setattr(loader, "fill_experts", counting_fill)
    n_layers, runs = BIG["num_hidden_layers"], []
    for _ in range(2):
        log, before = [], len(converted)
        loaded = load(big, tmp_path, log, experts_format="int4")
        checksums = [block.experts.checksum() for _, block in moe_blocks(loaded.model)]
        runs.append((loaded.info, len(converted) - before, checksums, log,
                     run_logits(loaded, prompt=PROMPT[:4], steps=1)[0]))
    (first, first_fills, first_sums, _, first_logits), (second, second_fills, second_sums, log, second_logits) = runs
    assert (first["cache_hits"], first["cache_misses"], first_fills) == (0, n_layers, n_layers)
    assert (second["cache_hits"], second["cache_misses"], second_fills) == (n_layers, 0, 0)
    assert any(f"expert cache {n_layers}/{n_layers} layers reused" in m for m in log), log
    assert len(first_sums) == n_layers and second_sums == first_sums
    assert torch.equal(first_logits, second_logits)


def _patch(f, at, new):
    data = bytearray(f.read_bytes())
    data[at] = new(data[at])
    if isinstance(at, slice):  # a new start of the header: blank out the rest of it
        (n,) = struct.unpack("<I", data[8:12])
        data[at.stop:12 + n] = b" " * (12 + n - at.stop)
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, why", [
    (lambda f: _patch(f, -10, lambda b: b ^ 0x55), "checksum"),  # one byte of the packed data
    (lambda f: os.truncate(f, f.stat().st_size - 7), "truncated"),
    (lambda f: _patch(f, 20, lambda b: ord("}")), "other files or settings"),  # inside the checkpoint path
    (lambda f: _patch(f, slice(12, 15), lambda b: b"[1]"), "header")],  # valid JSON, not an object
    ids=["flipped-byte", "truncated", "header-mismatch", "header-not-an-object"])
def test_cache_reused_and_damaged_file_rebuilt(tiny, tmp_path, damage, why):
    path = tiny["deepseek_v3"]
    fresh, tokens = run_logits(load(path, None, experts_format="int4"))
    first = load(path, tmp_path, experts_format="int4")
    # layer 0 is dense
    assert sorted(os.listdir(first.info["cache_dir"])) == ["key.json", "layer0001.bin", "layer0002.bin"]
    assert (first.info["cache_hits"], first.info["cache_misses"]) == (0, 2)
    second = load(path, tmp_path, experts_format="int4")
    assert (second.info["cache_hits"], second.info["cache_misses"]) == (2, 0)
    assert torch.equal(run_logits(first, tokens)[0], fresh) and torch.equal(run_logits(second, tokens)[0], fresh)
    bad = Path(first.info["cache_dir"]) / "layer0002.bin"
    size = bad.stat().st_size
    damage(bad)
    log = []
    again = load(path, tmp_path, log, experts_format="int4")
    warnings = [m for m in log if "unusable" in m]
    assert len(warnings) == 1 and "layer0002.bin" in warnings[0] and why in warnings[0], log
    assert again.info["cache_hits"] == 1
    assert torch.equal(run_logits(again, tokens)[0], fresh)
    assert bad.stat().st_size == size  # rewritten whole
    assert load(path, tmp_path, experts_format="int4").info["cache_hits"] == 2
    assert not list(tmp_path.rglob("*.tmp*"))


def test_cache_keyed_by_format_group_and_files(ckpt, tmp_path):
    cache = tmp_path / "cache"
    dirs = set()
    for fmt, group in (("int4", 64), ("int4", 32), ("int8", None), ("bf16", None)):
        loaded = load(ckpt, cache, experts_format=fmt, group_size=group)
        assert loaded.info["cache_hits"] == 0
        dirs.add(loaded.info["cache_dir"])
    assert len(dirs) == 4
    ref, tokens = run_logits(load(ckpt, cache, experts_format="int4", group_size=32))
    shard = _shard(ckpt)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same bytes, newer mtime
    touched = load(ckpt, cache, experts_format="int4", group_size=32)
    assert (touched.info["cache_hits"], touched.info["cache_misses"]) == (0, 2)
    assert touched.info["cache_dir"] not in dirs
    assert torch.equal(run_logits(touched, tokens)[0], ref)
    # the four directories made from the older shard are gone; only the new one is left
    assert [p.name for p in cache.iterdir()] == [Path(touched.info["cache_dir"]).name]


def test_cache_write_failure_is_not_fatal(ckpt, tmp_path):
    ref, tokens = run_logits(load(ckpt, None, experts_format="int4"))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    log = []
    loaded = load(ckpt, blocker, log, experts_format="int4")
    # said once per load, not once per MoE layer (this model has 2); the summary counts the layers
    assert sum("could not write the expert cache" in m for m in log) == 1, log
    assert any("2 layers not written to the cache" in m for m in log), log
    assert torch.equal(run_logits(loaded, tokens)[0], ref)
    # The directory exists but a layer's file name is taken by a directory: the rename fails, no .tmp remains.
    cache = tmp_path / "cache"
    cache_dir = load(ckpt, cache, experts_format="int4").info["cache_dir"]
    os.remove(os.path.join(cache_dir, "layer0000.bin"))
    os.mkdir(os.path.join(cache_dir, "layer0000.bin"))
    log = []
    loaded = load(ckpt, cache, log, experts_format="int4")
    assert loaded.info["cache_hits"] == 1 and any("could not write" in m for m in log), log
    assert torch.equal(run_logits(loaded, tokens)[0], ref)
    assert not list(tmp_path.rglob("*.tmp*"))


def test_progress_into_a_log_is_no_bar(tiny, capsys):
    """progress=True (LLM's default) with stderr not a terminal (a log, a pipe): no tqdm bar, no carriage return."""
    log = []
    load_model(tiny["qwen3_moe"], EngineOptions(**CPU), expert_cache=None, progress=True, log=log.append)
    err = capsys.readouterr().err
    assert "\r" not in err and "layer/s" not in err and "%|" not in err, err
    assert not any("\r" in m for m in log)


def test_damaged_files_are_reported_once_per_load(tiny, tmp_path):
    path = tiny["deepseek_v3"]
    cache_dir = Path(load(path, tmp_path, experts_format="int4").info["cache_dir"])
    for name in ("layer0001.bin", "layer0002.bin"):
        _patch(cache_dir / name, -10, lambda b: b ^ 0x55)
    log = []
    again = load(path, tmp_path, log, experts_format="int4")
    assert sum("unusable" in m for m in log) == 1, log
    assert any("2 bad cache files rebuilt" in m for m in log), log
    assert again.info["cache_hits"] == 0
    assert load(path, tmp_path, experts_format="int4").info["cache_hits"] == 2


class _Experts:
    """What ExpertCache reads of a CPUExperts: shapes, storage views, a checksum. While the data is written (the
    second walk over ``storage``; the first reads the sizes) it raises ``fail`` after the first view, as an
    interrupt in the middle of a write would."""

    num_experts, hidden_size, intermediate_size = 4, 8, 16

    def __init__(self, fail=None):
        self.views = [memoryview(bytearray(range(64))), memoryview(bytearray(100))]
        self.fail, self.walks = fail, 0

    def info(self):
        return {"numa_slices": [(0, 4)]}

    def checksum(self):
        return 1234

    def mark_loaded(self):
        pass

    def storage(self):
        self.walks += 1
        yield self.views[0]
        if self.fail is not None and self.walks == 2:
            raise self.fail
        yield self.views[1]


class _Checkpoint:
    def __init__(self, path):
        self.path = path

    def fingerprint(self):
        return [["config.json", 10, 1]]


def _dead_pid():
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt(), RuntimeError("a bug"), OSError(28, "No space left")])
def test_an_interrupted_write_leaves_no_file(tmp_path, interrupt):
    from hetmoe.load.expert_cache import ExpertCache

    log = []
    cache = ExpertCache(tmp_path, _Checkpoint(tmp_path / "model"), "int4", 64, warn=log.append)
    if isinstance(interrupt, OSError):  # reported, not raised
        assert cache.save(1, _Experts(interrupt)) is None and len(log) == 1
    else:
        with pytest.raises(type(interrupt)):
            cache.save(1, _Experts(interrupt))
    assert sorted(p.name for p in cache.dir.iterdir()) == ["key.json"]
    if not isinstance(interrupt, OSError):
        assert cache.save(1, _Experts()) is not None and cache.load(1, _Experts())


def test_opening_a_cache_removes_a_dead_writers_temp_file(tmp_path):
    from hetmoe.load.expert_cache import ExpertCache

    def open_cache(log):
        return ExpertCache(tmp_path, _Checkpoint(tmp_path / "model"), "int4", 64, warn=log.append)

    cache = open_cache([])
    assert cache.save(1, _Experts()) is not None
    dead = cache.dir / f"layer0002.bin.tmp{_dead_pid()}"
    live = cache.dir / f"layer0003.bin.tmp{os.getpid()}"  # a writer that is still running: this process
    other = cache.dir / "notes.tmp1"  # not a cache file name: never touched
    for f in (dead, live, other):
        f.write_bytes(b"half a layer")
    log = []
    reopened = open_cache(log)
    assert not dead.exists() and live.exists() and other.exists()
    assert len(log) == 1 and "interrupted" in log[0], log
    assert reopened.load(1, _Experts())  # the finished file is kept and still valid


# ---------------------------------------------------------------- checkpoint errors

INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.1.mlp.experts.5.up_proj.weight"
ATTN = "model.layers.1.self_attn.k_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def _index(path):
    return json.loads((path / INDEX).read_text())


def _shard(path, name=EXPERT):
    return path / _index(path)["weight_map"][name]


def _rewrite(path, name, edit):
    """Apply ``edit(tensors)`` to the shard holding tensor ``name`` (safetensors.save_file); the index follows."""
    index, shard = _index(path), _shard(path, name)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name or k in tensors}
    index["weight_map"].update({k: shard.name for k in tensors})
    (path / INDEX).write_text(json.dumps(index))


def _edit_config(path, drop=(), **changes):
    cfg = {k: v for k, v in json.loads((path / "config.json").read_text()).items() if k not in drop}
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def _edit_header(path, edit):
    """Rewrite the JSON header of EXPERT's shard in place (same length): ``edit(header)`` -> dict or raw bytes."""
    shard = _shard(path)
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = edit(json.loads(data[8:8 + n]))
    text = text if isinstance(text, bytes) else json.dumps(text, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])


def _nan(tensors):
    tensors[EXPERT][3, 7] = float("nan")


# case -> (damage, exception, message regex: SHARD = EXPERT's shard file, CKPT = the directory; experts format)
ERRORS = {
    "no-dir": (shutil.rmtree, FileNotFoundError, "model directory CKPT does not exist"),
    "no-config": (lambda c: (c / "config.json").unlink(), FileNotFoundError, "CKPT/config.json is missing"),
    "config-not-json": (lambda c: (c / "config.json").write_text("{oops"), CheckpointError,
                        "CKPT/config.json is not valid JSON"),
    "config-a-list": (lambda c: (c / "config.json").write_text("[1]"), CheckpointError, "not hold a JSON object"),
    "unknown-model-type": (lambda c: _edit_config(c, model_type="llama9_moe"), ValueError,
                           r"model_type 'llama9_moe', which hetmoe does not support \(supported: .*qwen3_moe"),
    "config-lacks-entry": (lambda c: _edit_config(c, drop=["num_attention_heads"]), CheckpointError,
                           "CKPT/config.json does not describe a qwen3_moe model.*num_attention_heads"),
    "missing-tensor": (lambda c: _rewrite(c, ATTN, lambda t: t.pop(ATTN)), CheckpointError,
                       f"tensor {ATTN} is missing from the checkpoint in CKPT"),
    "missing-expert": (lambda c: _rewrite(c, EXPERT, lambda t: t.pop(EXPERT)), CheckpointError,
                       f"tensor {EXPERT} is missing"),
    "config-hidden-too-big": (lambda c: _edit_config(c, hidden_size=96), CheckpointError,
                              r"tensor model.embed_tokens.weight has shape \[512, 64\] in CKPT; "
                              r"the config implies \[512, 96\]"),
    "expert-shape": (lambda c: _rewrite(c, EXPERT, lambda t: t.update({EXPERT: torch.zeros(32, 60)})),
                     CheckpointError, rf"tensor {EXPERT} has shape \[32, 60\]; expected \[32, 64\]"),
    "truncated-data": (lambda c: os.truncate(_shard(c), _shard(c).stat().st_size - 100), CheckpointError,
                       "SHARD is truncated: tensor .* ends at byte"),
    "truncated-header": (lambda c: os.truncate(_shard(c), 20), CheckpointError,
                         "SHARD is truncated or not a safetensors file"),
    "dtype-I4": (lambda c: _edit_header(c, lambda h: h[EXPERT].update(dtype="I4") or h), CheckpointError,
                 rf"SHARD: tensor {EXPERT} has dtype 'I4', which hetmoe cannot read \(supported: F64"),
    "no-offsets": (lambda c: _edit_header(c, lambda h: h[EXPERT].pop("data_offsets") and h), CheckpointError,
                   f"SHARD: tensor {EXPERT} has a malformed header entry"),
    "corrupt-header": (lambda c: _edit_header(c, lambda h: b"{'bad': json"), CheckpointError,
                       "SHARD: corrupt safetensors header"),
    "integer-weight": (lambda c: _rewrite(c, NORM, lambda t: t.update({NORM: torch.ones(64, dtype=torch.int32)})),
                       CheckpointError, f"tensor {NORM} has dtype torch.int32; a floating-point weight was expected"),
    "index-names-missing-shard": (lambda c: _shard(c).unlink(), CheckpointError,
                                  rf"{INDEX} lists shard\(s\) that are missing: SHARD"),
    "corrupt-index": (lambda c: (c / INDEX).write_text('{"weight_map": '), CheckpointError,
                      f"CKPT/{INDEX} is not a safetensors index"),
    "nan-expert": (lambda c: _rewrite(c, EXPERT, _nan), CheckpointError,
                   r"model.layers.1.mlp.experts.5: up\[0\] contains NaN or Inf \(expert 5"),
    "nan-expert-int4": (lambda c: _rewrite(c, EXPERT, _nan), CheckpointError, "model.layers.1.mlp.experts.5: .*NaN",
                        "int4"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_checkpoint_is_a_clear_error(ckpt, case):
    damage, exc, match, *fmt = ERRORS[case]
    match = match.replace("SHARD", re.escape(_shard(ckpt).name)).replace("CKPT", re.escape(str(ckpt)))
    damage(ckpt)
    with pytest.raises(exc, match=match):
        load(ckpt, experts_format=fmt[0] if fmt else "bf16")


# ---------------------------------------------------------------- FP8 (DeepSeek-V3 block scales)

def _blocks(n, k):
    B = 128
    return [(slice(i, i + B), slice(j, j + B), i // B, j // B) for i in range(0, n, B) for j in range(0, k, B)]


def _to_fp8(w):
    """w [N, K] fp32 -> e4m3 weight and its weight_scale_inv [ceil(N/128), ceil(K/128)] (w ~ w_fp8 * scale_inv)."""
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    for r, c, i, j in _blocks(*w.shape):
        scale[i, j] = w[r, c].abs().max().clamp_min(1e-12) / 448
        q[r, c] = (w[r, c] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _naive_dequant(q, scale):
    out = torch.empty(q.shape)
    for r, c, i, j in _blocks(*q.shape):
        out[r, c] = q[r, c].float() * scale[i, j]
    return out


def _quantized(name, t):
    return t.dim() == 2 and not any(s in name for s in ("norm", "embed_tokens", "lm_head", "mlp.gate.weight"))


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """A DeepSeek-V3 checkpoint in FP8 (every linear but the router, 160 x 256 experts: partial 128-blocks) and
    the same checkpoint with the dequantized weights in fp32."""
    root = tmp_path_factory.mktemp("fp8")
    fp8 = write_checkpoint(root / "fp8", "deepseek_v3", {"hidden_size": 256, "moe_intermediate_size": 160}, seed=4,
                           dtype="float32", max_shard_size="1MB")
    deq = shutil.copytree(fp8, root / "deq")
    index = _index(fp8)
    for shard in sorted(set(index["weight_map"].values())):
        q_tensors, d_tensors = {}, {}
        for name, t in load_file(fp8 / shard).items():
            if _quantized(name, t):
                q, scale = _to_fp8(t)
                q_tensors[name], q_tensors[name + "_scale_inv"] = q, scale
                d_tensors[name] = _naive_dequant(q, scale)
                index["weight_map"][name + "_scale_inv"] = shard
            else:
                q_tensors[name] = d_tensors[name] = t
        save_file(q_tensors, fp8 / shard, metadata={"format": "pt"})
        save_file(d_tensors, deq / shard, metadata={"format": "pt"})
    (fp8 / "model.safetensors.index.json").write_text(json.dumps(index))
    _edit_config(fp8, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [128, 128]})
    return fp8, deq


def test_fp8_checkpoint_equals_its_dequantized_weights(fp8_pair):
    fp8, deq = fp8_pair
    name = "model.layers.1.mlp.experts.0.down_proj.weight"  # [256, 160]: a partial block in each row of blocks
    reader = Checkpoint(fp8)
    assert reader.get(name).dtype == torch.float8_e4m3fn and reader.shape(name + "_scale_inv") == (2, 2)
    for fmt in ("bf16", "int4"):
        ref, tokens = run_logits(load(deq, experts_format=fmt))
        out, _ = run_logits(load(fp8, experts_format=fmt), tokens)
        assert torch.isfinite(out).all() and torch.equal(out, ref), (fmt, max_rel(out, ref))


@pytest.mark.parametrize("shape", [(160, 256), (256, 160), (300, 129), (128, 128), (1, 3)])
def test_dequantize_fp8_matches_a_per_block_loop(shape):
    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=g) * torch.rand(shape, generator=g) * 5
    q, scale = _to_fp8(w)
    out = dequantize_fp8(q, scale, torch.float32, "w")
    assert torch.equal(out, _naive_dequant(q, scale))
    assert rel(out, w) < 0.05  # e4m3 keeps 3 mantissa bits: measured 2.3e-2
    assert dequantize_fp8(q, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match=r"w_scale_inv has shape .*needs \["):
        dequantize_fp8(q, scale[:, :1].contiguous() if scale.shape[1] > 1 else torch.ones(9, 9), torch.float32, "w")


@pytest.mark.parametrize("name", ["model.layers.2.mlp.experts.3.up_proj.weight",
                                  "model.layers.0.self_attn.q_a_proj.weight"])
def test_fp8_without_scale_is_an_error(fp8_pair, tmp_path, name):
    ckpt = shutil.copytree(fp8_pair[0], tmp_path / "fp8")
    _rewrite(ckpt, name, lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=rf"FP8 tensor {name} has no {name}_scale_inv"):
        load(ckpt, experts_format="bf16")


# ---------------------------------------------------------------- peak memory while loading

def test_peak_rss_while_loading(big):
    m = peak_rss("import torch, tqdm, hetmoe.models.qwen3_moe\nfrom hetmoe.load.loader import load_model\n"
                 "from hetmoe.config.options import EngineOptions",
                 'loaded = load_model(sys.argv[1], EngineOptions(device="cpu", experts_format="bf16"), '
                 "expert_cache=None, progress=False)", 'loaded.info["expert_bytes"]', big)
    # Measured: 1.15 (baseline 220 MiB, final +163 MiB, peak +187 MiB; VmHWM reset by clear_refs, sampling agrees).
    assert m["final"] - m["baseline"] >= m["expert_bytes"] * 0.95  # the experts really are resident
    assert m["ratio"] <= 1.3


def test_loader_numa_end_to_end(tmp_path):
    """Experts split over 2 NUMA subpools (tests/cpu/test_numa.py tests the split itself): the same logits as
    unsplit, and the split layout's own cache entries."""
    path = write_checkpoint(tmp_path / "m", "qwen3_moe", {"moe_intermediate_size": 96}, seed=4, dtype="float32")
    ref, tokens = run_logits(load(path, experts_format="int8", threads=2, numa="off"))
    cache = tmp_path / "cache"
    for attempt in range(2):  # converted, then from the cache
        loaded = load(path, cache, experts_format="int8", threads=2, numa=2)
        assert loaded.info["cache_hits"] == (0 if attempt == 0 else 2)
        assert "-numa2-" in loaded.info["cache_dir"]
        ours, _ = run_logits(loaded, tokens)
        assert rel(ours, ref) <= 1e-5, rel(ours, ref)


def test_expert_cache_off_writes_nothing(ckpt, tmp_path, monkeypatch):
    # "off" means no cache in the Python API as on the command line, not a directory named "off"
    monkeypatch.chdir(tmp_path)
    loaded = load(ckpt, "off", experts_format="int4")
    assert "cache_dir" not in loaded.info or loaded.info["cache_dir"] is None
    assert not (tmp_path / "off").exists()
