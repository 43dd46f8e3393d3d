"""Routed experts of Hugging Face checkpoints quantized as MXFP8, per-channel FP8 and DeepSeek-V4's FP4, held by the CPU
engine at the file's own bytes (hetmoe/load/fp8_formats.py, hetmoe/load/mxfp4.py, hetmoe/load/checkpoint.py).

Checkpoints are written by Transformers' own classes (a tiny Qwen3-MoE, hidden 256 and expert intermediate 128 so that
per-channel scales fill whole groups of 128; MiniMax-M3's MiniMaxM3SparseForConditionalGeneration; DeepSeek-V4's
DeepseekV4ForCausalLM), then quantized by the writers below as the real checkpoints name and store them:

* MXFP8: ``<m>.weight`` e4m3 and ``<m>.weight_scale_inv`` uint8 [N, K/32] (E8M0: 2^(b - 127)), quantization_config
  quant_method "fp8" + weight_block_size [1, 32] + scale_fmt "ue8m0", or "mxfp8" (MiniMax-M3's); experts and the
  attention projections quantized (the dense ones are dequantized on load).
* per-channel FP8: compressed-tensors float-quantized, strategy channel: ``<m>.weight_scale`` fp32 [N, 1].
* DeepSeek-V4 FP4 (expert_dtype "fp4"): ``<m>.weight`` int8 [N, K/2] (two E2M1 per byte, even column low) and
  ``<m>.scale`` F8_E8M0 [N, K/32], as DeepSeek releases them.

Checked: (a) the engine holds the experts in their own layout within 1.05x the file's expert bytes; (b) every expert's
values are bitwise the naive fp32 dequantization of the file, and the engine's MoE output matches an fp64 reference
on those values; (c) logits (and their greedy argmax) match Transformers' own model run on the dequantized
checkpoint; (d) a scale of the wrong shape or dtype, a scale byte 255, an unknown quant_method and an unsupported
compressed-tensors strategy are refused by name (shapes and settings before any weight is read).

Paths: the best row-block ISA and AVX2 (the fp8 kernels take fp32 activations on both; max |ours - ref| / max |ref|:
logits MEASURED <= 1.7e-6 (AVX-512 and AVX2 alike), bound 1e-5; experts vs fp64 ||.|| MEASURED <= 2.1e-7, bound 1e-5);
FP4 in lut4 reads int8 activations per group of 32: logits MEASURED 3.1e-3, bound 5e-2 as tests/models/test_gpt_oss.py's
MXFP4.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers_tiny import save_tiny  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.load.checkpoint import Checkpoint, CheckpointError  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from paths import BEST_ROW_PATH, PATHS  # noqa: E402
from reference import moe_reference  # noqa: E402

ROW_PATHS = [BEST_ROW_PATH] + ([PATHS["avx2"]] if "avx2" in PATHS and PATHS["avx2"] != BEST_ROW_PATH else [])
SIZES = dict(hidden_size=256, moe_intermediate_size=128)
PROMPT = [3, 17, 5, 42, 8, 11, 29, 2, 33, 60, 7]
DECODE = (19, 4, 250)
FP8_TOL, FP4_TOL = 1e-5, 5e-2
MX = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
      "scale_fmt": "ue8m0"}
MXFP8 = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32],
         "ignored_layers": ["lm_head"]}
CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
           "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                         "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                     "strategy": "channel", "dynamic": False, "observer": "minmax"},
                                         "input_activations": {"num_bits": 8, "type": "float", "symmetric": True,
                                                               "strategy": "token", "dynamic": True}}},
           "ignore": ["lm_head", "re:.*mlp.gate$"], "kv_cache_scheme": None}
V4_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "scale_fmt": "ue8m0"}
QUANTIZED = re.compile(r".*\.(?:mlp\.experts\.\d+\.\w+|block_sparse_moe\.experts\.\d+\.w[123]|self_attn\.[qkvo]_proj)"
                       r"\.weight")
V4_EXPERTS = re.compile(r"model\.layers\.\d+\.(?:ffn|mlp)\.experts\.\d+\.w[123]\.weight")  # (save_pretrained: ffn)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
SUFFIX = {"mx": "_scale_inv", "channel": "_scale", "fp4": "_scale_inv"}


# ---------------------------------------------------------------- writers and the naive reference


def quantize(kind: str, w: torch.Tensor) -> tuple:
    """fp32 [N, K] -> (stored codes, stored scale) of ``kind``."""
    N, K = w.shape
    if kind == "channel":
        amax = w.abs().amax(1, keepdim=True)
        s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        return (w / s).to(torch.float8_e4m3fn), s
    g = w.reshape(N, K // 32, 32)
    top = 448 if kind == "mx" else 6
    b = (torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(2.0 ** -100) / top)) + 127).clamp(1, 254)
    x = g / torch.exp2(b - 127)[..., None]
    if kind == "mx":
        return x.to(torch.float8_e4m3fn).reshape(N, K), b.to(torch.uint8)
    idx = (x.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8).reshape(N, K)  # nearest E2M1 (ties: +0 first)
    packed = (idx[:, 0::2] | (idx[:, 1::2] << 4)).view(torch.int8)
    return packed, b.to(torch.uint8).view(torch.float8_e8m0fnu)


def naive(kind: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The values [N, K] (fp32) stored codes and scales mean, computed here independently of hetmoe."""
    if kind == "channel":
        return q.float() * s.float()
    e = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(32, 1)
    if kind == "mx":
        return q.float() * e
    u = q.view(torch.uint8)
    vals = torch.stack((E2M1[(u & 15).long()], E2M1[(u >> 4).long()]), -1).reshape(q.shape[0], -1)
    return vals * e


def per_expert(name: str, t: torch.Tensor) -> dict:
    """DeepSeek-V4's stacked experts as save_pretrained writes them (``<block>.experts.gate_up_proj`` [E, 2I, H]: each
    expert's gate rows, then its up rows; ``down_proj`` [E, H, I]) under the release's per-expert names (w1 gate,
    w3 up, w2 down); any other tensor as it is."""
    if name.endswith(".experts.gate_up_proj"):
        block, inter = name[:-len(".gate_up_proj")], t.shape[1] // 2
        return {f"{block}.{e}.{w}.weight": t[e, rows].contiguous() for e in range(t.shape[0])
                for w, rows in (("w1", slice(0, inter)), ("w3", slice(inter, None)))}
    if name.endswith(".experts.down_proj"):
        block = name[:-len(".down_proj")]
        return {f"{block}.{e}.w2.weight": t[e].contiguous() for e in range(t.shape[0])}
    return {name: t}


def write(src: Path, dst: Path, kind: str, quant: dict, pattern=QUANTIZED, rewrite=None, top: dict | None = None):
    """``src`` with every weight matching ``pattern`` quantized as ``kind`` (``rewrite(name, q, s) -> (q, s)``
    changes what is written), ``quant`` as quantization_config (and ``top`` over config.json). Stacked experts are
    written per expert (``per_expert``)."""
    dst = Path(shutil.copytree(src, dst))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        tensors = {}
        for name, t in load_file(dst / shard).items():
            tensors.update(per_expert(name, t))
        for name, t in tensors.items():
            weight_map[name] = shard
            if not pattern.fullmatch(name):
                out[name] = t
                continue
            q, s = quantize(kind, t.float())
            if rewrite is not None:
                q, s = rewrite(name, q, s)
            scale = name[:-len("weight")] + "scale" if kind == "fp4" else name + SUFFIX[kind]
            out[name], out[scale] = q, s
            weight_map[scale] = shard
        save_file(out, dst / shard, metadata={"format": "pt"})
    (dst / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant, **(top or {})}))
    return dst


def stored(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def scale_of(files: dict, kind: str, name: str) -> torch.Tensor:
    return files[name[:-len("weight")] + "scale"] if kind == "fp4" else files[name + SUFFIX[kind]]


def dequantized_copy(src: Path, dst: Path, kind: str) -> Path:
    """``src`` with every quantized weight replaced by its naive fp32 values, no scales, no quantization_config."""
    dst = Path(shutil.copytree(src, dst))
    files = stored(src)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    scales = set()
    for shard in sorted(set(index["weight_map"].values())):
        out = {}
        for name, t in load_file(dst / shard).items():
            scale = name[:-len("weight")] + "scale" if kind == "fp4" else name + SUFFIX[kind]
            if name.endswith(".weight") and scale in files:
                s = scale_of(files, kind, name)
                out[name] = naive(kind, t, s)
                scales.add(name[:-len("weight")] + "scale" if kind == "fp4" else name + SUFFIX[kind])
            else:
                out[name] = t
        save_file({n: t for n, t in out.items() if n not in scales}, dst / shard, metadata={"format": "pt"})
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n not in scales}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((dst / "config.json").read_text())
    for key in ("quantization_config", "expert_dtype"):
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def load(path, log=None, **opts):
    options = EngineOptions(device="cpu", dtype="fp32", max_context=64, **opts)
    return load_model(path, options, expert_cache=None, progress=False, log=log or (lambda m: None))


def engine_logits(loaded) -> torch.Tensor:
    from hetmoe.engine.runner import Runner

    runner = Runner(loaded)
    out = [runner.prefill(list(PROMPT)).reshape(-1).float()]
    return torch.stack(out + [runner.decode(t).reshape(-1).float() for t in DECODE])


def reference_logits(model) -> torch.Tensor:
    """Transformers' model (fp32): the last position's logits after the prompt and after each decode token."""
    ids, out = list(PROMPT), []
    with torch.no_grad():
        for nxt in (None,) + DECODE:
            if nxt is not None:
                ids.append(nxt)
            out.append(model(input_ids=torch.tensor([ids])).logits[0, -1].float())
    return torch.stack(out)


def max_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


# ---------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-fp8-formats")
    plain = save_tiny("qwen3_moe", root / "plain", seed=5, overrides=SIZES)
    out = {"plain": plain}
    for kind, quant in (("mx", MX), ("channel", CHANNEL)):
        out[kind] = write(plain, root / kind, kind, quant)
        out[kind + "-deq"] = dequantized_copy(out[kind], root / f"{kind}-deq", kind)
    return out


M3_TEXT = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=32, num_local_experts=6, num_experts_per_tok=2,
               dense_intermediate_size=64, shared_intermediate_size=32, rotary_dim=8,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
               index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=3, index_local_blocks=1,
               layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["sparse", "sparse"],
               swiglu_limit=0.3, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
               tie_word_embeddings=False)


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    if not hasattr(transformers, "MiniMaxM3VLConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no MiniMax-M3")
    root = tmp_path_factory.mktemp("m3-mxfp8")
    torch.manual_seed(7)
    cfg = transformers.MiniMaxM3VLConfig(text_config=M3_TEXT, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
        image_size=56), projector_hidden_size=64, image_token_index=300, video_token_index=301)
    model = transformers.MiniMaxM3SparseForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((torch.randn_like(p) * 0.08).to(torch.bfloat16).float())
    model.save_pretrained(root / "plain", max_shard_size="100KB")
    mx = write(root / "plain", root / "mx", "mx", MXFP8, pattern=re.compile(
        r"language_model\.model\.layers\.\d+\.(?:block_sparse_moe\.experts\.\d+\.w[123]|self_attn\.[qkvo]_proj)"
        r"\.weight"))
    return {"mx": mx, "deq": dequantized_copy(mx, root / "deq", "mx")}


@pytest.fixture(scope="module")
def v4(hf_checkpoints, tmp_path_factory):
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4")
    root = tmp_path_factory.mktemp("v4-fp4")
    plain = hf_checkpoints("deepseek_v4", {"swiglu_limit": 0.3}, seed=3)
    fp4 = write(plain, root / "fp4", "fp4", V4_QUANT, pattern=V4_EXPERTS, top={"expert_dtype": "fp4"})
    return {"fp4": fp4, "deq": dequantized_copy(fp4, root / "deq", "fp4")}


def check_held(loaded, path: Path, kind: str, layout: tuple, bound: float = 1.05) -> None:
    """(a) and (b): each MoE layer's experts in ``layout`` (format, group, scale dtype), within ``bound`` x the file's
    expert bytes, every expert's values bitwise the naive dequantization; and the engine's output on them matches
    an fp64 reference."""
    files = stored(path)
    blocks = moe_blocks(loaded.model)
    assert blocks
    for prefix, block in blocks:
        ex = block.experts
        info = ex.info()
        assert (info["weight_format"], info["group_size"], info["gate_up_scale_dtype"]) == layout
        names = [n for n in ("gate_proj", "up_proj", "down_proj", "w1", "w3", "w2")
                 if f"{prefix}.experts.0.{n}.weight" in Checkpoint(path).names()]
        stems = (prefix, "language_model." + prefix, prefix.replace(".mlp", ".ffn"))  # the file's names of the block
        raw = {n: t for n, t in files.items() if n.startswith(stems)}
        file_bytes = sum(t.numel() * t.element_size() for n, t in raw.items() if ".experts." in n)
        assert ex.nbytes <= bound * file_bytes, (prefix, ex.nbytes, file_bytes)
        gate, up, down = [], [], []
        for e in range(ex.num_experts):
            for got, which, acc in zip(ex.dequantized(e), names, (gate, up, down)):
                key = next(k for k in (f"{stem}.experts.{e}.{which}.weight" for stem in stems) if k in files)
                want = naive(kind, files[key], scale_of(files, kind, key))
                assert torch.equal(got, want), key
                acc.append(want)
        if not block.plain_swiglu:
            continue
        gen = torch.Generator().manual_seed(1)
        T, k = 7, 2
        x = torch.randn(T, ex.hidden_size, generator=gen)
        ids = torch.stack([torch.randperm(ex.num_experts, generator=gen)[:k] for _ in range(T)])
        ids[3, 1] = -1
        w = torch.rand(T, k, generator=gen)
        ref = moe_reference(x, torch.stack(gate), torch.stack(up), torch.stack(down), ids, w)
        err = ((ex(x, ids, w) - ref).norm() / ref.norm()).item()
        print(f"{prefix} experts vs fp64: {err:.1e}")
        assert err <= 1e-5, (prefix, err)


# ---------------------------------------------------------------- MXFP8 and per-channel FP8 (Qwen3-MoE)


@pytest.mark.parametrize("kind", ["mx", "channel"])
def test_auto_holds_the_experts_at_their_bytes(qwen, kind):
    said = []
    loaded = load(qwen[kind], log=said.append)
    assert loaded.plan.experts_format == "fp8"
    assert loaded.plan.group_size == (32 if kind == "mx" else 128)
    assert loaded.plan.why["routed experts"].startswith("auto: the checkpoint's own FP8 experts")
    layout = ("fp8", 32, "e8m0") if kind == "mx" else ("fp8", 128, "fp32")
    check_held(loaded, qwen[kind], kind, layout)
    if kind == "channel":  # the row's scale in each group: not shared per 16 rows
        assert not moe_blocks(loaded.model)[0][1].experts.info()["gate_up_shared_scales"]


@pytest.mark.parametrize("path", ROW_PATHS, ids=str)
@pytest.mark.parametrize("kind", ["mx", "channel"])
def test_logits_match_transformers_on_the_dequantized_weights(qwen, kind, path):
    """Experts and attention projections quantized: ours (experts fp8 at their bytes, the dense part dequantized)
    against Transformers' Qwen3MoeForCausalLM on the naive dequantization."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen[kind + "-deq"], dtype=torch.float32).eval()
    ref = reference_logits(hf)
    ours = engine_logits(load(qwen[kind], **path.options))
    print(f"{kind} {path}: logits {max_rel(ours, ref):.1e}")
    assert max_rel(ours, ref) <= FP8_TOL, (path, max_rel(ours, ref))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    plain = reference_logits(transformers.AutoModelForCausalLM.from_pretrained(qwen["plain"], dtype=torch.float32))
    assert max_rel(plain, ref) > 100 * FP8_TOL  # the quantization is seen: the comparison can fail


def test_mxfp8_method_name_and_other_formats(qwen, tmp_path):
    """quant_method "mxfp8" reads as fp8 + [1, 32]; an explicit other format is dequantized and re-quantized (said)."""
    cfg = json.loads((qwen["mx"] / "config.json").read_text())
    path = Path(shutil.copytree(qwen["mx"], tmp_path / "mxfp8"))
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": MXFP8}))
    loaded = load(path)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == ("fp8", 32)
    said = []
    loaded = load(qwen["mx"], log=said.append, experts_format="int8")
    assert loaded.plan.experts_format == "int8"
    assert any("dequantized and re-quantized into int8 as asked" in m for m in said), said
    said.clear()
    loaded = load(qwen["mx"], log=said.append, experts_format="fp8")
    assert moe_blocks(loaded.model)[0][1].experts.info()["group_size"] == 32
    assert any("held as fp8 at their own bytes, as asked" in m for m in said), said


# ---------------------------------------------------------------- MiniMax-M3 (MXFP8) and DeepSeek-V4 (FP4)


@pytest.mark.parametrize("path", ROW_PATHS, ids=str)
def test_minimax_m3_mxfp8(m3, path):
    loaded = load(m3["mx"], **path.options)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == ("fp8", 32)
    check_held(loaded, m3["mx"], "mx", ("fp8", 32, "e8m0"))
    hf = transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(m3["deq"], dtype=torch.float32).eval()
    ref, ours = reference_logits(hf), engine_logits(loaded)
    print(f"minimax_m3 mxfp8 {path}: logits {max_rel(ours, ref):.1e}")
    assert max_rel(ours, ref) <= FP8_TOL, (path, max_rel(ours, ref))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("path", ROW_PATHS, ids=str)
def test_deepseek_v4_fp4(v4, path):
    said = []
    loaded = load(v4["fp4"], log=said.append, **path.options)
    assert any("MXFP4" in m and "lut4 (e2m1), exactly" in m for m in said), said
    check_held(loaded, v4["fp4"], "fp4", ("lut4", 32, "e8m0"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(v4["deq"], dtype=torch.float32).eval()
    ref, ours = reference_logits(hf), engine_logits(loaded)
    print(f"deepseek_v4 fp4 {path}: logits {max_rel(ours, ref):.1e}")
    assert max_rel(ours, ref) <= FP4_TOL, (path, max_rel(ours, ref))
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    if path == BEST_ROW_PATH:  # an int8 layer takes the codebook's values as int8 codes: still exact
        loaded = load(v4["fp4"], experts_format="int8", **path.options)
        check_held(loaded, v4["fp4"], "fp4", ("int8", 32, "e8m0"), bound=2.05)  # a byte per code, not a nibble
    ckpt = Checkpoint(v4["fp4"])  # read as floats: the same values
    name, file_name = "model.layers.1.mlp.experts.2.w2.weight", "model.layers.1.ffn.experts.2.w2.weight"
    files = stored(v4["fp4"])
    assert ckpt.shape(name) == (64, 32)
    want = naive("fp4", files[file_name], files[file_name[:-len("weight")] + "scale"])
    assert torch.equal(ckpt.get_float(name), want)


# ---------------------------------------------------------------- refused


def no_weights(monkeypatch):
    def refuse(self, *args):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(Checkpoint, "get", refuse)
    monkeypatch.setattr(Checkpoint, "_read", refuse)


def test_bad_scales_are_refused_by_name(qwen, tmp_path, monkeypatch):
    target = "model.layers.1.mlp.experts.3.up_proj.weight"

    def half_scale(name, q, s):
        return (q, s[:, ::2].contiguous()) if name == target else (q, s)

    def nan_byte(name, q, s):
        if name == target:
            s = s.clone()
            s[5, 2] = 255
        return q, s

    def fp32_scale(name, q, s):
        return (q, s.float()) if name == target else (q, s)

    plain = qwen["plain"]
    short = write(plain, tmp_path / "short", "mx", MX, rewrite=half_scale)
    wrong = write(plain, tmp_path / "dtype", "mx", MX, rewrite=fp32_scale)
    nan = write(plain, tmp_path / "nan", "mx", MX, rewrite=nan_byte)
    with monkeypatch.context() as m:
        no_weights(m)
        with pytest.raises(CheckpointError, match=rf"{target}_scale_inv has shape \(128, 4\); MXFP8 .* of a \[128, "
                                                  r"256\] weight needs \[128, 8\]"):
            load(short)
        with pytest.raises(CheckpointError, match=rf"{target}_scale_inv has dtype float32; MXFP8 .* scales are uint8"):
            load(wrong)
    with pytest.raises(CheckpointError, match=rf"{target} has the E8M0 scale byte 255 \(NaN: not a scale\) at "
                                              r"\[5, 2\]"):
        load(nan)


def test_bad_fp4_scales_are_refused_by_name(v4, tmp_path, monkeypatch):
    target, stored_as = "model.layers.2.mlp.experts.5.w1.weight", "model.layers.2.ffn.experts.5.w1.weight"

    def nan_byte(name, q, s):
        if name == stored_as:
            s = s.view(torch.uint8).clone()
            s[3, 1] = 255
            s = s.view(torch.float8_e8m0fnu)
        return q, s

    def short(name, q, s):
        return (q, s[:, :1].contiguous()) if name == stored_as else (q, s)

    plain = v4["deq"]  # a V4 checkpoint of floats: the writer quantizes it again
    pattern, top = V4_EXPERTS, {"expert_dtype": "fp4"}
    bad = write(plain, tmp_path / "nan", "fp4", V4_QUANT, pattern=pattern, rewrite=nan_byte, top=top)
    with pytest.raises(CheckpointError, match=rf"{target} \(expert 5\) has the E8M0 scale byte 255"):
        load(bad)
    bad = write(plain, tmp_path / "short", "fp4", V4_QUANT, pattern=pattern, rewrite=short,
                top=top)
    with monkeypatch.context() as m:
        no_weights(m)
        with pytest.raises(CheckpointError, match=rf"{stored_as} \[32, 32\] and its scale \[32, 1\] are not FP4"):
            load(bad)


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "fp6"}, r"quantization_config.quant_method is 'fp6', which hetmoe does not read"),
    ({**MX, "scale_fmt": "e5m3"}, r"quantization_config scale_fmt is 'e5m3'"),
    ({**MX, "weight_block_size": [1, 64]}, r"quantization_config fp8 with weight_block_size \[1, 64\]"),
    ({"quant_method": "mxfp8", "weight_block_size": [32, 32]}, r"quantization_config mxfp8 with weight_block_size"),
    ({**MX, "activation_scheme": "static"}, r"activation_scheme is 'static'"),
    ({**CHANNEL, "config_groups": {"group_0": {**CHANNEL["config_groups"]["group_0"], "weights": {
        **CHANNEL["config_groups"]["group_0"]["weights"], "strategy": "tensor"}}}},
     r"quantization_config.config_groups.group_0.weights.strategy is 'tensor'"),
    ({**CHANNEL, "config_groups": {"group_0": {**CHANNEL["config_groups"]["group_0"], "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     r"config_groups.group_0.input_activations is .*static activation scales are not read"),
], ids=["method", "scale-fmt", "block", "mxfp8-block", "static", "strategy", "static-input"])
def test_bad_quantization_config_is_refused_before_weights(qwen, tmp_path, monkeypatch, quant, message):
    path = Path(shutil.copytree(qwen["mx"], tmp_path / "bad"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    no_weights(monkeypatch)
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_fp4_experts_of_another_model_are_refused(qwen, tmp_path, monkeypatch):
    path = Path(shutil.copytree(qwen["plain"], tmp_path / "fp4"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": V4_QUANT, "expert_dtype": "fp4"}))
    no_weights(monkeypatch)
    with pytest.raises(CheckpointError, match=r"expert_dtype 'fp4' on a qwen3_moe model: hetmoe reads FP4 experts"):
        load(path)


def test_every_e8m0_byte_but_nan_is_held_exactly():
    """The engine's e8m0 byte is 2^(e - 128) (E2M1's 1/2 folded in): an MXFP8 file byte b (2^(b - 127)) is held as
    b + 1, so b = 0 (2^-127, an fp32 subnormal) .. 254 (2^127) all come back exactly; 255 (NaN) is refused."""
    from hetmoe.cpu import CPUExperts
    from hetmoe.cpu.codes import load_fp8
    from hetmoe.load import fp8_formats

    H, I = 64, 256  # gate/up rows of 8 groups of 32: every byte 0..254 appears among the 3 matrices' scales
    gen = torch.Generator().manual_seed(3)
    ex = CPUExperts(1, H, I, "fp8", 32, scale_dtype="e8m0", threads=1)
    codes, raw, scales = [], [], []
    for i, (rows, cols) in enumerate(((I, H), (I, H), (H, I))):
        q = torch.randn(1, rows, cols, generator=gen).clamp(-1.5, 1.5).to(torch.float8_e4m3fn)
        b = (torch.arange(rows * cols // 32).reshape(1, rows, cols // 32) + 85 * i) % 255
        codes.append(q)
        raw.append(b.to(torch.uint8))
        scales.append(fp8_formats.row_scales("mx", raw[-1][0], rows, cols, "w").unsqueeze(0))
    assert set(torch.cat([b.flatten() for b in raw]).tolist()) == set(range(255))
    load_fp8(ex, codes, scales)
    for got, q, b in zip(ex.dequantized(0), codes, raw):
        assert torch.equal(got, naive("mx", q[0], b[0]))
    with pytest.raises(ValueError, match=r"w has the E8M0 scale byte 255 \(NaN: not a scale\) at \[0, 1\]"):
        fp8_formats.row_scales("mx", torch.tensor([[3, 255]], dtype=torch.uint8), 1, 64, "w")
