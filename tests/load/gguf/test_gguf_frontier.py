"""This year's MoE architectures as GGUF files: glm4moe (GLM-4.5/4.6/4.7), minimax-m2, qwen3next and qwen35moe
(Gated DeltaNet hybrids), glm-dsa (GLM-5) and deepseek32 (DeepSeek-V3.2), read by hetmoe/load/gguf/.

Each file is converted from a tiny random checkpoint written by Transformers' own class (tests/transformers_tiny.py)
by tests/gguf_files.py ``convert_frontier``, a converter in miniature that writes what llama.cpp's
convert_hf_to_gguf.py writes for these architectures (its keys, names and transforms: experts stacked, Qwen3-Next's
in_proj_qkvz cut into attn_qkv + attn_gate, Qwen3.5's value heads reordered, zero-centred norms stored as 1 + w,
A_log as -exp(A_log), MLA's kv_b cut into k_b / v_b). The slow tier checks the miniature against llama.cpp's own
converter (tests/llama_cpp_convert.py, on the vendored llama.cpp source at $LLAMA_CPP_DIR or the llama-cpp-python
source distribution unpacked under /tmp/lcp): the same metadata and bit-identical tensors.

Paths: the CPU engine's bf16 experts on the default ISA, fp32 dense weights. The GGUF model's logits equal the
Transformers checkpoint's through hetmoe (bitwise, measured) and Transformers' own within fp32 rounding; Q8_0
experts are held exactly (int8 group 32, bit for bit gguf's dequantization) and stay within the Q8_0 bound of those
logits. Bad files: a missing key or tensor, a gating function hetmoe does not run, each named.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf_files import FRONTIER_ARCH, convert_frontier  # noqa: E402
from llama_cpp_convert import llama_cpp_source  # noqa: E402
from transformers_tiny import save_tiny  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.engine.runner import Runner  # noqa: E402
from hetmoe.load.gguf import GGUFError, open_gguf  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from parity import hf_trace, max_rel, trace_ours  # noqa: E402
from paths import BEST_ROW_PATH  # noqa: E402

FAMILIES = ["glm4_moe", "minimax_m2", "qwen3_next", "qwen3_5_moe", "glm_moe_dsa", "deepseek_v32"]
# published config.json files name their routing; Transformers' config classes leave it out of the tiny ones
OVERRIDES = {"minimax_m2": dict(scoring_func="sigmoid"), "deepseek_v32": dict(scoring_func="sigmoid"),
             "glm_moe_dsa": dict(scoring_func="sigmoid")}
QWEN35 = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, tie_word_embeddings=False, head_dim=16, moe_intermediate_size=32,
              num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=32, linear_num_value_heads=4,
              linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=3,
              layer_types=["linear_attention"] * 3 + ["full_attention"], rms_norm_eps=1e-6)
# Max rel. logit error against Transformers (prefill of 11 tokens + 8 greedy steps), bf16 experts (the checkpoints'
# weights are bf16 values, so held exactly) and fp32 dense weights. MEASURED 3.7e-7 .. 3.7e-6 over the families
# (the Gated DeltaNet ones highest).
TRANSFORMERS_BOUND = 1e-4
# GGUF against the checkpoint, both through hetmoe on the same path: the weights differ at most by the fp32 round
# trips of 1 + w and -exp (Qwen3-Next, Qwen3.5). MEASURED 0 (bitwise) for every family.
SAME_PATH_BOUND = 1e-5
# Q8_0 experts (int8 groups of 32) against the bf16 checkpoint, through hetmoe. MEASURED 1.6e-3 (glm4moe) ..
# 2.6e-2 (qwen35moe).
Q8_BOUND = 5e-2


def _save_qwen35(path: Path) -> Path:
    from transformers.models import qwen3_5_moe as hf

    torch.manual_seed(0)
    model = hf.Qwen3_5MoeForCausalLM(hf.Qwen3_5MoeTextConfig(**QWEN35))
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = (torch.randn_like(p) * 0.08).to(torch.bfloat16).float()
            p.copy_(1 + noise if "norm" in name and p.dim() == 1 else noise)
    model.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> a tiny Transformers checkpoint directory (written once per module)."""
    root, made = tmp_path_factory.mktemp("frontier"), {}

    def get(family: str) -> Path:
        if family not in made:
            path = root / family
            if family == "qwen3_5_moe":
                made[family] = _save_qwen35(path)
            else:
                made[family] = save_tiny(family, path, overrides=OVERRIDES.get(family))
        return made[family]

    return get


# the row path: the bounds below are fp32 accumulation's (AMX rounds activations to bf16: tests/paths.py)
ROW = dict(device="cpu", dtype="fp32", threads=1, **BEST_ROW_PATH.options)


def _load(path, **kw):
    opts = EngineOptions(experts_format="bf16", **ROW, **kw)
    return load_model(path, opts, expert_cache=None, progress=False, log=lambda m: None)


def _logits(loaded, ids: list, steps: list) -> list:
    runner = Runner(loaded)
    out = [runner.prefill(ids)]
    return out + [runner.decode(t) for t in steps]


IDS, STEPS = [(7 * i + 3) % 320 for i in range(11)], [5, 17, 101, 250]


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_the_checkpoint_and_transformers(checkpoints, family, tmp_path):
    src = checkpoints(family)
    path = tmp_path / "m.gguf"
    convert_frontier(src, path)
    with open_gguf(path) as f:
        assert f.arch == FRONTIER_ARCH[json.loads((src / "config.json").read_text())["model_type"]]
    ours = _load(path)
    same = max(max_rel(a, b) for a, b in zip(_logits(ours, IDS, STEPS), _logits(_load(src), IDS, STEPS)))
    ids, fed, want = hf_trace(transformers, src, 1, 11)
    hf = max(max_rel(a, b) for a, b in zip(trace_ours(ours.model, ids, fed), want))
    print(f"{family}: GGUF vs checkpoint {same:.1e}, vs Transformers {hf:.1e}")
    assert same < SAME_PATH_BOUND and hf < TRANSFORMERS_BOUND


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_experts_load_exactly(checkpoints, family, tmp_path):
    path = tmp_path / "q8.gguf"
    written = convert_frontier(checkpoints(family), path, expert_type="Q8_0")
    said = []
    loaded = load_model(path, EngineOptions(**ROW), expert_cache=None, progress=False, log=said.append)
    assert any("are Q8_0: packed as int8 (planned as int8 group 32), exactly" in s for s in said), said
    for name, layer in moe_blocks(loaded.model):
        bid = int(name.split(".")[2])
        want = [written[f"blk.{bid}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down")]
        for e in (0, layer.engine.num_experts - 1):
            for got, w in zip(layer.engine.dequantized(e), want):
                assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(w[e])))
    err = max(max_rel(a, b) for a, b in zip(_logits(loaded, IDS, STEPS), _logits(_load(checkpoints(family)), IDS,
                                                                                      STEPS)))
    print(f"{family} Q8_0: max rel. logit error {err:.1e}")
    assert err < Q8_BOUND


def _rewrite(src: Path, dest: Path, drop_key: str = "", drop_tensor: str = "", extra: dict = None,
             keys: dict = None) -> Path:
    """``src`` GGUF rewritten without one key or tensor, or with ``extra`` tensors, or ``keys`` (name -> (value,
    GGUFValueType)) added."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dest), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in (drop_key, "general.architecture"):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
    for key, (value, kind) in (keys or {}).items():
        w.add_key_value(key, value, kind)
    for t in r.tensors:
        if t.name != drop_tensor:
            w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed([int(x) for x in t.shape])),
                         raw_dtype=t.tensor_type)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dest


BAD = [("glm4_moe", "glm4moe.expert_shared_count", "n_shared_experts"),
       ("minimax_m2", "minimax-m2.expert_used_count", "num_experts_per_tok"),
       ("qwen3_next", "qwen3next.ssm.group_count", "linear_num_key_heads"),
       ("qwen3_5_moe", "qwen35moe.ssm.time_step_rank", "linear_num_value_heads"),
       ("glm_moe_dsa", "glm-dsa.attention.indexer.top_k", "index_topk"),
       ("deepseek_v32", "deepseek32.expert_gating_func", "scoring_func")]


@pytest.mark.parametrize("family, key, hf", BAD, ids=[b[0] for b in BAD])
def test_a_missing_key_is_named(checkpoints, family, key, hf, tmp_path):
    full = tmp_path / "full.gguf"
    convert_frontier(checkpoints(family), full)
    bad = _rewrite(full, tmp_path / "bad.gguf", drop_key=key)
    with pytest.raises(GGUFError, match=rf"bad\.gguf: the .* GGUF has no {key} \(needed for config.json {hf}\)"):
        _load(bad)


MISSING = {"glm4_moe": "blk.1.exp_probs_b.bias", "minimax_m2": "blk.1.attn_q_norm.weight",
           "qwen3_next": "blk.0.attn_gate.weight", "qwen3_5_moe": "blk.2.ssm_a",
           "glm_moe_dsa": "blk.1.indexer.proj.weight", "deepseek_v32": "blk.0.attn_v_b.weight"}


@pytest.mark.parametrize("family", list(MISSING))
def test_a_missing_tensor_is_named(checkpoints, family, tmp_path):
    full = tmp_path / "full.gguf"
    convert_frontier(checkpoints(family), full)
    bad = _rewrite(full, tmp_path / "bad.gguf", drop_tensor=MISSING[family])
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        _load(bad)


def test_softmax_gating_is_refused_by_name(checkpoints, tmp_path):
    """A glm4moe file with softmax gating (hetmoe's GLM-4.5 routes by sigmoid only) is refused by the key's name,
    before any weight is read."""
    full = tmp_path / "full.gguf"
    convert_frontier(checkpoints("glm4_moe"), full)
    bad = _rewrite(full, tmp_path / "softmax.gguf", drop_key="glm4moe.expert_gating_func",
                   keys={"glm4moe.expert_gating_func": (1, gguf.GGUFValueType.UINT32)})
    with pytest.raises(GGUFError, match=r"softmax\.gguf: the glm4moe GGUF has expert_gating_func 1; hetmoe's "
                                        r"glm4moe runs 2 \(sigmoid\) only"):
        _load(bad)


def test_multi_token_prediction_layers_are_skipped(checkpoints, tmp_path):
    """A GLM file with its MTP block (blk.<num_hidden_layers>.*, counted in block_count): the block's tensors are
    left unread, with a note, and the logits are the main layers' (equal to the file without them)."""
    full = tmp_path / "full.gguf"
    convert_frontier(checkpoints("glm4_moe"), full)  # nextn_predict_layers 1 (Glm4MoeConfig), block_count 3
    rng = np.random.default_rng(0)
    extra = {"blk.2.nextn.eh_proj.weight": rng.standard_normal((64, 128)).astype(np.float32),
             "blk.2.nextn.enorm.weight": np.ones(64, np.float32), "blk.2.attn_norm.weight": np.ones(64, np.float32)}
    mtp = _rewrite(full, tmp_path / "mtp.gguf", extra=extra)
    said = []
    loaded = load_model(mtp, EngineOptions(device="cpu", dtype="fp32", threads=1, experts_format="bf16"),
                        expert_cache=None, progress=False, log=said.append)
    assert any("multi-token-prediction" in s for s in said), said
    assert len(loaded.model.model.layers) == 2
    assert torch.equal(_logits(loaded, IDS, STEPS[:1])[-1], _logits(_load(full), IDS, STEPS[:1])[-1])


# ---------------------------------------------------------------- llama.cpp's own converter (slow tier)

# DeepSeek-V3.2's converter asserts tokenizer.add_bos_token, which Transformers 5's fast tokenizer class of the tests'
# tokenizer does not expose: converted by the miniature only.
REAL = [f for f in FAMILIES if f != "deepseek_v32"]


@pytest.mark.slow
@pytest.mark.parametrize("family", REAL)
def test_llama_cpp_converter_writes_what_the_miniature_writes(checkpoints, family, tmp_path):
    """The same metadata keys and values (tokenizer and general.* aside) and bit-identical tensors; so the
    per-commit tests above hold for the files users convert."""
    source = llama_cpp_source()
    if source is None:
        pytest.skip("llama.cpp's source (convert_hf_to_gguf.py) not found: set LLAMA_CPP_DIR")
    src = checkpoints(family)
    tok = tmp_path / "with-tokenizer"
    tok.mkdir()
    for p in src.iterdir():
        (tok / p.name).symlink_to(p)
    from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

    build_tokenizer(320).save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(256)))
    real = tmp_path / "real.gguf"
    extra = ["--no-mtp"] if family.startswith("qwen") else []  # Qwen's classes expect MTP weights unless told
    run = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "llama_cpp_convert.py"), str(source),
                          str(tok), "--outfile", str(real), "--outtype", "f32", *extra],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    mini = tmp_path / "mini.gguf"
    convert_frontier(src, mini)
    a, b = gguf.GGUFReader(str(real)), gguf.GGUFReader(str(mini))
    keys = [{k: f.contents() for k, f in r.fields.items() if not k.startswith(("GGUF.", "general.", "tokenizer."))}
            for r in (a, b)]
    assert keys[0] == keys[1]
    ta, tb = ({t.name: t for t in r.tensors} for r in (a, b))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert np.array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data)), name
    ids, fed, want = hf_trace(transformers, src, 1, 11)
    err = max(max_rel(x, y) for x, y in zip(trace_ours(_load(real).model, ids, fed), want))
    assert err < TRANSFORMERS_BOUND
