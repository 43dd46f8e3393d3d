"""DeepSeek-V4 (GGUF architecture deepseek4) and MiniMax-M3's language model (minimax-m3) as GGUF files written by
llama.cpp's own converter (convert_hf_to_gguf.py: conversion/deepseek.py DeepseekV4Model, conversion/minimax.py
MiniMaxM3Model), read by hetmoe/load/gguf/ into hetmoe's native models (hetmoe/models/deepseek_v4.py,
hetmoe/models/minimax_m3.py).

The checkpoints are written by Transformers' own classes, then handed to the converter in the form it reads, as the
published checkpoints have it:

* MiniMax-M3: MiniMaxM3SparseForConditionalGeneration's save_pretrained (the language model under language_model.,
  a one-layer vision tower beside it), laid out as llama.cpp builds the model: a dense layer of full attention, then
  MoE layers of block-sparse attention (4 heads over 2 kv heads of 16 dims, RoPE over 8; an indexer head per kv head,
  as llama.cpp requires, keeping the top 3 blocks of 4 plus the query's own); swiglu 1.702 / 7.0 (llama.cpp's
  constants). The converter reads the published config.json's sparse_attention_config, moe_layer_freq,
  n_shared_experts and scoring_func, which Transformers' config class folds into its own entries (and drops) when it
  loads: they are written beside them, and the converter runs with its pinned Transformers' view of the config
  (4.57.6 has no MiniMax-M3, so convert_hf_to_gguf.py reads config.json itself; with Transformers 5's AutoConfig
  those four keys are gone and MiniMaxM3Model raises KeyError).
* DeepSeek-V4: DeepseekV4ForCausalLM's save_pretrained (three layers: HCA compressed 128x, CSA compressed 4x with an
  indexer keeping 3, sliding window only; window 8, 2 hyper-connection streams, layer 0 hash-routed), its routed
  experts drawn as MXFP4 values (E2M1 codes times E8M0 scales per 32, as DeepSeek releases them). The converter reads
  DeepSeek's own names (layers.N.attn.kv_norm, embed.weight, hc_head_fn, experts' .weight + .scale) and packed FP4
  experts (it fails on unpacked ones: KeyError on the missing .scale), so its input is the same tensors renamed, the
  experts as their codes and scale bytes, config.json with compress_ratios and num_hash_layers; llama.cpp reads
  compress ratios 0, 4 and 128 only, hence HCA 128.

Prompts: M3 40 tokens (> block 4 x top 3 blocks: the selection matters), V4 140 tokens (> the window, the CSA rate x
its top-k and one HCA entry of 128), then DECODE_STEPS cached greedy steps. These tests run the real converter (the
llama.cpp source at $LLAMA_CPP_DIR or the llama-cpp-python source distribution unpacked under /tmp/lcp), so they
are in the slow tier, as tests/load/gguf/test_gguf_frontier.py's converter tests are.

Paths: the CPU engine's best row-block path (run under HETMOE_MAX_ISA=avx2 for the AVX2 one), fp32 dense weights,
experts as bf16 (the files' F32 experts are bf16 values, the MXFP4 ones E2M1 x 2^k: both held exactly). Bounds
(max |ours - hf| / max |hf| over the prefill and the steps): MEASURED 6.1e-7 (M3) and 9.9e-7 (V4) on AVX-512 and
AVX2 alike, bound 1e-4 as
tests/models/test_deepseek_v4.py's; the greedy tokens equal. The V4 file's MXFP4 experts loaded by default are held
at their bytes (lut4 e2m1, checked bit for bit against Transformers' weights); that kernel reads int8 activations,
so its logits are that format's, not compared here.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
if not (hasattr(transformers, "DeepseekV4Config") and hasattr(transformers, "MiniMaxM3VLConfig")):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4 or MiniMax-M3", allow_module_level=True)

from models.test_minimax_m3 import write_m3  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.load.gguf import GGUFError  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from parity import DECODE_STEPS, max_rel, trace_ours  # noqa: E402
from paths import BEST_ROW_PATH  # noqa: E402

BOUND = 1e-4
ROW = dict(device="cpu", dtype="fp32", threads=1, **BEST_ROW_PATH.options)
VOCAB = 320
M3_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
               dense_intermediate_size=48, shared_intermediate_size=32, rotary_dim=8,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
               index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
               layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
               mlp_layer_types=["dense", "sparse", "sparse"], max_position_embeddings=256, bos_token_id=None,
               eos_token_id=None, tie_word_embeddings=False)
M3_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
                 image_size=56)
M3_IMAGE, M3_VIDEO = 300, 301
V4_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
V4_EXPERT = re.compile(r"model\.layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")
PROMPT = {"minimax_m3": 40, "deepseek_v4": 140}


def _llama_cpp_source():
    found = [os.environ.get("LLAMA_CPP_DIR", "")] + sorted(glob.glob("/tmp/lcp/*/vendor/llama.cpp"))
    return next((Path(p) for p in found if p and (Path(p) / "convert_hf_to_gguf.py").is_file()), None)


def _with_tokenizer(path: Path) -> None:
    from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

    build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(256)))


def _convert(source: Path, model_dir: Path, out: Path, pinned_config: bool = False) -> Path:
    """llama.cpp's converter on ``model_dir`` (tests/llama_cpp_convert.py), --outtype f32. ``pinned_config``: the
    converter's Transformers (4.57.6, its requirements) does not know the model type, so it reads config.json
    itself; here Transformers' AutoConfig is made to fail the same way."""
    tests = Path(__file__).parents[2]
    code = "\n".join([
        "import sys",
        f"sys.path[:0] = [{str(tests)!r}, {str(source / 'gguf-py')!r}, {str(source)!r}]",
        "from conversion import base",
        "class PinnedAutoConfig:",
        "    @staticmethod",
        "    def from_pretrained(path, **kw):",
        "        raise ValueError('a model type Transformers 4.57.6 does not know')",
        "base.AutoConfig = PinnedAutoConfig" if pinned_config else "",
        "import llama_cpp_convert",
        f"sys.argv = ['llama_cpp_convert.py', {str(source)!r}, {str(model_dir)!r}, '--outfile', {str(out)!r},"
        " '--outtype', 'f32']",
        "llama_cpp_convert.main()"])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def _save_m3(path: Path) -> Path:
    return write_m3(path, M3_TEXT, M3_VISION, M3_IMAGE, M3_VIDEO)


def _m3_for_converter(src: Path, dest: Path) -> Path:
    """``src`` with config.json's text_config also holding the published checkpoint's entries the converter reads."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "config.json").read_text())
    t = cfg["text_config"]
    t["sparse_attention_config"] = {
        "sparse_num_index_heads": t["index_n_heads"], "sparse_index_dim": t["index_head_dim"],
        "sparse_block_size": t["index_block_size"], "sparse_topk_blocks": t["index_topk_blocks"],
        "sparse_local_block": t["index_local_blocks"],
        "sparse_attention_freq": [int(k == "minimax_m3_sparse") for k in t["layer_types"]]}
    t["moe_layer_freq"] = [int(k == "sparse") for k in t["mlp_layer_types"]]
    t["n_shared_experts"], t["scoring_func"] = t["shared_intermediate_size"] // t["intermediate_size"], "sigmoid"
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    _with_tokenizer(dest)
    return dest


def _save_v4(path: Path) -> tuple:
    """Transformers' DeepSeek-V4 checkpoint whose routed experts are MXFP4 values, and per expert matrix its
    (E2M1 codes [rows, cols], E8M0 scale bytes [rows, cols / 32])."""
    from safetensors.torch import load_file, save_file
    from transformers_tiny import save_tiny

    save_tiny("deepseek_v4", path, seed=3, overrides=dict(compress_rates=V4_RATES))
    g = torch.Generator().manual_seed(5)
    codes = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors = load_file(shard)
        experts = [name for name in tensors if V4_EXPERT.fullmatch(name)]
        for name in experts:
            rows, cols = tensors[name].shape
            c = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
            e = torch.randint(120, 123, (rows, cols // 32), generator=g, dtype=torch.uint8)  # 2^-7 .. 2^-5
            tensors[name] = E2M1[c.long()] * torch.exp2(e.float() - 127).repeat_interleave(32, 1)
            codes[name] = (c, e)
        if experts:
            save_file(tensors, shard, metadata={"format": "pt"})
    return path, codes


def _v4_for_converter(src: Path, codes: dict, dest: Path) -> Path:
    """``src`` under DeepSeek's own names, its experts as packed FP4 (two codes a byte, the first in the low
    nibble) with their scale bytes, config.json with compress_ratios and num_hash_layers."""
    from safetensors.torch import load_file, save_file

    dest.mkdir()
    out = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            short = name.removeprefix("model.")
            if name in codes:
                c, e = codes[name]
                base = short.removesuffix(".weight")
                out[base + ".weight"] = (c[:, 0::2] | (c[:, 1::2] << 4)).view(torch.int8).contiguous()
                out[base + ".scale"] = e.contiguous()
                continue
            short = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                     "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(short, short)
            out[re.sub(r"\.attn\.norm\.", ".attn.kv_norm.", short)] = t
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    ratio = {"sliding_attention": 0, **cfg["compress_rates"]}
    cfg.update(compress_ratios=[ratio[k] for k in cfg["layer_types"]],
               num_hash_layers=cfg["mlp_layer_types"].count("hash_moe"))
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    _with_tokenizer(dest)
    return dest


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (Transformers checkpoint, GGUF file from llama.cpp's converter[, V4: expert codes]), made once."""
    source = _llama_cpp_source()
    if source is None:
        pytest.skip("llama.cpp's source (convert_hf_to_gguf.py) not found: set LLAMA_CPP_DIR")
    root, made = tmp_path_factory.mktemp("v4-m3"), {}

    def get(family: str) -> tuple:
        if family not in made:
            if family == "minimax_m3":
                hf = _save_m3(root / "m3-hf")
                made[family] = (hf, _convert(source, _m3_for_converter(hf, root / "m3-conv"), root / "m3.gguf",
                                             pinned_config=True), None)
            else:
                hf, codes = _save_v4(root / "v4-hf")
                made[family] = (hf, _convert(source, _v4_for_converter(hf, codes, root / "v4-conv"),
                                             root / "v4.gguf"), codes)
        return made[family]

    return get


def _load(path: Path, log=lambda m: None, **kw):
    return load_model(path, EngineOptions(**{**ROW, "experts_format": "bf16", **kw}), expert_cache=None,
                      progress=False, log=log)


_HF = {}


def _hf_trace(family: str, hf_dir: Path, batch: int) -> tuple:
    """(prompt ids, the tokens Transformers fed back, its logits per call) over PROMPT[family] tokens and
    DECODE_STEPS cached greedy steps."""
    key = (family, batch)
    if key not in _HF:
        cls = (transformers.MiniMaxM3SparseForConditionalGeneration if family == "minimax_m3"
               else transformers.DeepseekV4ForCausalLM)
        model = cls.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ids = torch.randint(0, M3_IMAGE, (batch, PROMPT[family]), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            logits, fed = [out.logits], []
            for _ in range(DECODE_STEPS):
                fed.append(out.logits[:, -1:].argmax(-1))
                out = model(input_ids=fed[-1], cache=out.cache, use_cache=True)
                logits.append(out.logits)
        _HF[key] = (ids, fed, logits)
    return _HF[key]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("family", ["minimax_m3", "deepseek_v4"])
def test_gguf_matches_transformers(files, family, batch):
    """The GGUF file through hetmoe: the model Transformers' config describes, its logits over the prompt and the
    cached greedy steps within BOUND of Transformers' on the checkpoint, the same greedy tokens."""
    hf_dir, path, _ = files(family)
    loaded = _load(path)
    cfg = loaded.model.config
    if family == "minimax_m3":
        assert cfg.layer_types == M3_TEXT["layer_types"] and cfg.mlp_layer_types == M3_TEXT["mlp_layer_types"]
        assert (cfg.index_n_heads, cfg.index_block_size, cfg.index_topk_blocks, cfg.swiglu_limit) == (2, 4, 3, 7.0)
    else:
        want = json.loads((hf_dir / "config.json").read_text())
        assert cfg.layer_types == want["layer_types"] and cfg.mlp_layer_types == want["mlp_layer_types"]
        assert (cfg.sliding_window, cfg.hc_mult, cfg.index_topk, cfg.o_groups) == (8, 2, 3, 2)
    ids, fed, want = _hf_trace(family, hf_dir, batch)
    mine = trace_ours(loaded.model, ids, fed)
    errors = [max_rel(a, b) for a, b in zip(mine, want)]
    print(f"{family} batch {batch}: " + " ".join(f"{e:.1e}" for e in errors))
    assert len(errors) == DECODE_STEPS + 1 and max(errors) < BOUND, errors
    for a, b in zip(mine, want):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.slow
def test_v4_mxfp4_experts_are_held_at_their_bytes(files):
    """Loaded with the default experts format, the V4 file's MXFP4 experts are packed from their codes (lut4 e2m1,
    E8M0 scales), nothing re-quantized: every expert's weights equal Transformers' bit for bit."""
    hf_dir, path, codes = files("deepseek_v4")
    said = []
    loaded = load_model(path, EngineOptions(**ROW), expert_cache=None, progress=False, log=said.append)
    assert any("experts are MXFP4" in s and "exactly" in s for s in said), said
    seen = 0
    for name, block in moe_blocks(loaded.model):
        bid = int(name.split(".")[2])
        assert block.engine.info()["gate_up_codebook"] == "e2m1"
        for e in range(block.engine.num_experts):
            for got, w in zip(block.engine.dequantized(e), ("w1", "w3", "w2")):
                c, s = codes[f"model.layers.{bid}.ffn.experts.{e}.{w}.weight"]
                want = E2M1[c.long()] * torch.exp2(s.float() - 127).repeat_interleave(32, 1)
                assert torch.equal(got.float(), want), (bid, e, w)
                seen += 1
    assert seen == 3 * 8 * 3


def _rewrite(src: Path, dest: Path, drop: tuple = (), keys: dict = None, extra: dict = None) -> Path:
    """``src`` without the tensors or keys named in ``drop``, with ``keys`` (name -> (value, GGUFValueType[,
    sub type])) set and ``extra`` tensors added."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dest), r.fields["general.architecture"].contents())
    keys = keys or {}
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in drop or key in keys or key == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), kind)
    for key, (value, kind, *sub) in keys.items():
        w.add_key_value(key, value, kind, sub_type=sub[0] if sub else None)
    for t in r.tensors:
        if t.name not in drop:
            data = np.asarray(t.data)  # element rows, or rows of bytes of a block type (MXFP4)
            w.add_tensor(t.name, data, raw_shape=list(data.shape), raw_dtype=t.tensor_type)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dest


MISSING = [("minimax_m3", "blk.1.indexer.k_proj.weight", "model.layers.1.self_attn.index_k_proj.weight"),
           ("minimax_m3", "blk.2.exp_probs_b.bias", "model.layers.2.block_sparse_moe.e_score_correction_bias"),
           ("deepseek_v4", "blk.0.ffn_gate_tid2eid.weight", "model.layers.0.mlp.gate.tid2eid"),
           ("deepseek_v4", "blk.1.indexer_compressor_ape.weight",
            "model.layers.1.self_attn.compressor.indexer.position_bias"),
           ("deepseek_v4", "output_hc_fn.weight", "model.hc_head.hc_fn")]


@pytest.mark.slow
@pytest.mark.parametrize("family, tensor, hf", MISSING, ids=[m[1] for m in MISSING])
def test_a_missing_tensor_is_named(files, family, tensor, hf, tmp_path):
    bad = _rewrite(files(family)[1], tmp_path / "bad.gguf", drop=(tensor,))
    with pytest.raises(ValueError, match=rf"bad\.gguf.*{re.escape(hf)}|{re.escape(hf)}.*bad\.gguf"):
        _load(bad)


BAD_KEYS = [  # family, key dropped (or changed: key -> (value, type[, sub type])), the message
    ("minimax_m3", "minimax-m3.expert_gating_func", None,
     r"the minimax-m3 GGUF has no minimax-m3.expert_gating_func \(needed for config.json scoring_func\)"),
    ("minimax_m3", "minimax-m3.attention.indexer.block_size", None,
     r"has no minimax-m3.attention.indexer.block_size \(needed for config.json index_block_size\)"),
    ("minimax_m3", "minimax-m3.expert_weights_norm", (False, gguf.GGUFValueType.BOOL),
     r"does not renormalise the chosen experts' weights"),
    ("deepseek_v4", "deepseek4.attention.compress_ratios", None,
     r"has no deepseek4.attention.compress_ratios \(needed for config.json layer_types\)"),
    ("deepseek_v4", "deepseek4.attention.compress_ratios",
     ([8, 4, 0], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32),
     r"has attention.compress_ratios \[8, 4, 0\]; llama.cpp and hetmoe read 0, 4 and 128 only"),
    ("deepseek_v4", "deepseek4.expert_gating_func", (2, gguf.GGUFValueType.UINT32),
     r"has expert_gating_func 2; DeepSeek-V4 GGUFs score experts with 4 \(sqrtsoftplus\)"),
    ("deepseek_v4", "deepseek4.swiglu_clamp_exp",
     ([10.0, 7.0, 10.0], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32),
     r"has deepseek4.swiglu_clamp_exp = \[10.0, 7.0, 10.0\]; hetmoe's model takes one swiglu_limit"),
    ("deepseek_v4", "deepseek4.swiglu_clamp_shexp",
     ([7.0, 7.0, 7.0], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32),
     r"clamps the shared expert \(swiglu_clamp_shexp\) otherwise than the routed ones"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, key, value, message", BAD_KEYS,
                         ids=[f"{b[1]}-{'changed' if b[2] else 'missing'}" for b in BAD_KEYS])
def test_a_bad_key_is_refused_by_name(files, family, key, value, message, tmp_path):
    path = files(family)[1]
    bad = _rewrite(path, tmp_path / "bad.gguf", drop=(key,), keys={key: value} if value else None)
    with pytest.raises(GGUFError, match=rf"bad\.gguf: .*{message}"):
        _load(bad)


@pytest.mark.slow
def test_v4_image_routing_bias_is_refused_by_name(files, tmp_path):
    """DeepSeek-V4's vision variant routes image tokens with exp_probs_b_vl: a text-only model has no use for it, so
    the file is refused naming the tensor rather than run with it ignored."""
    bad = _rewrite(files("deepseek_v4")[1], tmp_path / "vl.gguf",
                   extra={"blk.1.exp_probs_b_vl.bias": np.zeros(8, np.float32)})
    with pytest.raises(GGUFError, match=r"blk\.1\.exp_probs_b_vl\.bias \(FFN_EXP_PROBS_B_VL\) of a deepseek4 file is "
                                        r"the routing bias of image tokens"):
        _load(bad)


@pytest.mark.slow
def test_v4_multi_token_prediction_block_is_skipped(files, tmp_path):
    """The V4 file with an MTP block appended as llama.cpp's converter writes one (block_count and compress_ratios
    counting it, nextn_predict_layers 1, blk.3.* with its nextn.* tensors): the block is left unread, with a note,
    and the logits are the main layers' (equal to the file without it)."""
    hf_dir, path, _ = files("deepseek_v4")
    r = gguf.GGUFReader(str(path))
    arrays = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    rng = np.random.default_rng(0)
    extra = {"blk.3.nextn.eh_proj.weight": rng.standard_normal((64, 128)).astype(np.float32),
             "blk.3.nextn.enorm.weight": np.ones(64, np.float32), "blk.3.nextn.hnorm.weight": np.ones(64, np.float32),
             **{t.name.replace("blk.2.", "blk.3."): np.asarray(t.data) for t in r.tensors
                if t.name.startswith("blk.2.") and t.tensor_type == gguf.GGMLQuantizationType.F32}}
    mtp = _rewrite(path, tmp_path / "mtp.gguf", extra=extra, keys={
        "deepseek4.block_count": (4, gguf.GGUFValueType.UINT32),
        "deepseek4.nextn_predict_layers": (1, gguf.GGUFValueType.UINT32),
        "deepseek4.attention.compress_ratios": ([128, 4, 0, 0], *arrays)})
    said = []
    loaded = _load(mtp, log=said.append)
    assert any("multi-token-prediction" in s for s in said), said
    assert len(loaded.model.model.layers) == 3
    ids, fed, _ = _hf_trace("deepseek_v4", hf_dir, 1)
    a, b = trace_ours(loaded.model, ids, fed[:2]), trace_ours(_load(path).model, ids, fed[:2])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
