"""gpt-oss as GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py, conversion/gpt_oss.py), read by
hetmoe/load/gguf/ into hetmoe's native gpt-oss (hetmoe/models/gpt_oss.py): attention sinks (attn_sinks.weight),
sliding-window and full layers (attention.sliding_window, llama.cpp's pattern), the router with bias
(ffn_gate_inp), experts split out of gate_up_proj with their biases (ffn_*_exps.bias), and the clamped SwiGLU whose
alpha and limit llama.cpp hard-codes (1.702, 7.0).

Each file is converted from a tiny random checkpoint written by Transformers' GptOssForCausalLM (tests/models/
test_gpt_oss.py: sinks and biases nonzero, sliding window 4 under an 11-token prompt, YaRN), by the llama.cpp source
at $LLAMA_CPP_DIR or the llama-cpp-python source distribution unpacked under /tmp/lcp (tests/llama_cpp_convert.py):
so these tests are in the slow tier, as tests/load/gguf/test_gguf_frontier.py's converter tests are. Files: bf16
(experts BF16), q8_0 (every matrix Q8_0) from the bf16 checkpoint, and MXFP4 experts from an MXFP4 checkpoint (the
converter repacks Hugging Face's nibbles into ggml's blocks, losslessly).

Paths: the CPU engine's best row-block path (run under HETMOE_MAX_ISA=avx2 for the AVX2 one), fp32 dense weights.
Bounds, MEASURED on this machine (max |ours - hf| / max |hf| over a prefill and the greedy steps):
* bf16 experts vs Transformers: 2.5e-7 (bound 1e-4, the bf16 checkpoint's own through hetmoe);
* MXFP4 in lut4 e2m1 vs Transformers on Hugging Face's dequantization of the same codes: 3.8e-3 (lut4 kernels read
  int8 activations per group of 32; bound 5e-2, tests/models/test_gpt_oss.py's), and bitwise hetmoe's on the
  MXFP4 checkpoint itself (the same codes and scale bytes);
* Q8_0 (dense weights and experts alike) vs Transformers on the bf16 checkpoint: see Q8_BOUND.

The tokenizer: o200k's pre-tokenizer ("gpt-4o", what the converter writes for gpt-oss's tokenizer) rebuilt from the
file encodes as Transformers does (a per-commit test on a tokenizer trained here with that pre-tokenizer and harmony's
special tokens), <|end|> is no end of generation beside <|return|> and <|call|>, and the chat template and tokenizer
reach ``LLM``: greedy tokens from the GGUF file equal Transformers' generate.
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

from llama_cpp_convert import llama_cpp_source  # noqa: E402
from models.test_gpt_oss import CHAT_TEMPLATE, MXFP4_TOL, TINY, save_gpt_oss, write_mxfp4  # noqa: E402

from hetmoe.config.options import EngineOptions  # noqa: E402
from hetmoe.load.gguf import GGUFError, open_gguf  # noqa: E402
from hetmoe.load.gguf.metadata import config_from_gguf  # noqa: E402
from hetmoe.load.loader import load_model, moe_blocks  # noqa: E402
from parity import hf_trace, max_rel, trace_ours  # noqa: E402
from paths import BEST_ROW_PATH  # noqa: E402

ROW = dict(device="cpu", dtype="fp32", threads=1, **BEST_ROW_PATH.options)
BF16_BOUND = 1e-4
# Q8_0 everywhere (the converter's q8_0 quantizes every matrix, dense ones too) against the bf16 checkpoint.
# MEASURED 4.3e-3.
Q8_BOUND = 5e-2
# o200k's split regex as gpt-oss's (and GPT-4o's) tokenizer.json writes it: the reference the file's is checked by
O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
         "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*"
         "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
HARMONY = ["<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>", "<|call|>"]
CORPUS = ["Hello World, HTTPServer and XMLHttpRequest don't say I'M here.", "def f(x):\n    return x * 12345",
          "naïve café crème brûlée über Straße", "<|start|>user<|message|>hi there<|end|>", "path/to/file\n\n",
          "The quick brown fox jumps over the lazy dog 2024-01-31!", "we'll they've she'd you're it's"]
TEXTS = ["HTTPServerError isn't XMLHttp's", "Hello   world\n\n\tfoo/bar/\nbaz", "1234567 89 0",
         "e\u0301t\u00e9 \u00c9T\u00c9",
         "<|start|>assistant<|channel|>final<|message|>ok<|return|>", "CamelCase camelCase ALLCAPS'LL", "  ", "x\r\ny",
         "emoji \U0001f600 done", "I'M YOU'RE"]


def harmony_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with o200k's pre-tokenizer (a Split on O200K, then ByteLevel without its regex, as
    gpt-oss's tokenizer.json) and harmony's special tokens, trained here (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=HARMONY, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def with_harmony_tokenizer(path: Path, vocab_size: int = TINY["vocab_size"]) -> Path:
    """``path`` (a checkpoint directory) given the harmony tokenizer, its chat template, eos <|return|>."""
    harmony_tokenizer(vocab_size).save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "model_max_length": TINY["max_position_embeddings"], "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- the tokenizer (per-commit)


def _tokenizer_file(path: Path, tokenizer_dir: Path) -> Path:
    """A GGUF holding only the tokenizer keys the converter writes for a byte-level BPE tokenizer (_set_vocab_gpt2),
    with the pre-tokenizer it names gpt-oss's: "gpt-4o"."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in HARMONY else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|return|>"])
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.close()
    return path


def test_gpt4o_pre_tokenizer_and_harmony_ends(tmp_path):
    """The "gpt-4o" pre-tokenizer rebuilt from the file splits as o200k's tokenizer.json does (Transformers' own
    tokenizer on the same vocabulary): cased runs, contractions, digits by three, newlines, marks, specials; the
    end-of-generation ids are <|return|> and <|call|> (and <|endoftext|>), not <|end|>; the chat template is the
    file's."""
    from hetmoe.load.gguf.checkpoint import tokenizer_of

    tok_dir = with_harmony_tokenizer(tmp_path, vocab_size=1000)  # enough merges for the splits to tell
    ours = tokenizer_of(_tokenizer_file(tmp_path / "tok.gguf", tok_dir))
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text, add_special_tokens=False),
                                                           skip_special_tokens=True)
    vocab = hf.get_vocab()
    assert ours.eos_ids == {vocab[t] for t in ("<|return|>", "<|call|>", "<|endoftext|>")}
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False)


# ---------------------------------------------------------------- files from llama.cpp's converter (slow tier)


def _convert(src: Path, dest: Path, outtype: str) -> Path:
    source = llama_cpp_source()
    if source is None:
        pytest.skip("llama.cpp's source (convert_hf_to_gguf.py) not found: set LLAMA_CPP_DIR")
    run = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "llama_cpp_convert.py"), str(source),
                          str(src), "--outfile", str(dest), "--outtype", outtype],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return dest


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """kind -> (GGUF file, the Transformers checkpoint it came from, the one Transformers runs for it): "bf16" and
    "q8_0" from the bf16 checkpoint (with the harmony tokenizer), "mxfp4" from its MXFP4 quantization (Transformers
    runs Hugging Face's dequantization of it)."""
    root, made = tmp_path_factory.mktemp("gpt_oss_gguf"), {}

    def get(kind: str) -> tuple:
        if kind not in made:
            if kind == "mxfp4":
                src = write_mxfp4(get("bf16")[1], root / "mxfp4", root / "dequantized")
                for name in ("tokenizer.json", "tokenizer_config.json"):
                    (src / name).write_bytes((get("bf16")[1] / name).read_bytes())
                made[kind] = (_convert(src, root / "mxfp4.gguf", "bf16"), src, root / "dequantized")
            else:
                src = root / "bf16"
                if not src.exists():
                    with_harmony_tokenizer(save_gpt_oss(src, dtype=torch.bfloat16))
                made[kind] = (_convert(src, root / f"{kind}.gguf", kind), src, src)
        return made[kind]

    return get


def _load(path, **kw):
    return load_model(path, EngineOptions(**{**ROW, **kw}), expert_cache=None, progress=False, log=lambda m: None)


def _trace(model, reference: Path, batch: int = 1) -> tuple:
    """(max rel. error over the prefill of 11 tokens and the greedy steps, whether our greedy tokens are
    Transformers') against Transformers on ``reference``."""
    ids, fed, want = hf_trace(transformers, reference, batch, 11)
    ours = trace_ours(model, ids, fed)
    same = all(torch.equal(a[:, -1].argmax(-1), b[:, -1].argmax(-1)) for a, b in zip(ours, want))
    return max(max_rel(a, b) for a, b in zip(ours, want)), same


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2])
def test_bf16_file_matches_transformers(files, batch):
    """The bf16 file: the config is the checkpoint's (sliding window 4 on layers 0 and 2, sinks, YaRN, the clamped
    SwiGLU with biases); greedy tokens and logits equal Transformers' over a prompt longer than the window."""
    path, src, _ = files("bf16")
    with open_gguf(path) as f:
        assert f.arch == "gpt-oss"
        cfg = config_from_gguf(f)
    hf_cfg = json.loads((src / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "swiglu_alpha", "swiglu_limit", "intermediate_size", "head_dim",
                "num_local_experts", "num_experts_per_tok", "attention_bias"):
        assert cfg[key] == hf_cfg[key], key
    assert {k: v for k, v in cfg["rope_scaling"].items() if k != "rope_type"} == {
        k: v for k, v in hf_cfg["rope_parameters"].items() if k not in ("rope_type", "rope_theta")}
    said = []
    loaded = load_model(path, EngineOptions(experts_format="bf16", **ROW), expert_cache=None, progress=False,
                        log=said.append)
    layers = loaded.model.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [4, None, 4]
    assert all(layer.self_attn.sinks.abs().min() > 0 for layer in layers)
    info = layers[0].mlp.moe.experts.info()
    assert (info["glu"], info["glu_limit"], info["bias"]) == ("clamped_swiglu", 7.0, True)
    err, same = _trace(loaded.model, src, batch)
    print(f"gpt-oss bf16 GGUF batch {batch}: max rel. error vs Transformers {err:.1e}")
    assert same and err <= BF16_BOUND


@pytest.mark.slow
def test_mxfp4_file_held_at_its_bytes(files):
    """The MXFP4 file's experts are packed from their own blocks into lut4 e2m1 with e8m0 scales: each expert's
    values are Hugging Face's dequantization of the checkpoint's codes bit for bit, the engine holds no more than
    the file's expert bytes (blocks, scale bytes, fp32 biases; bound 1.05x), the logits are bitwise hetmoe's on the
    MXFP4 checkpoint, and within the MXFP4 bound of Transformers' with the same greedy tokens."""
    from safetensors.torch import load_file

    path, src, dequantized = files("mxfp4")
    said = []
    loaded = load_model(path, EngineOptions(**ROW), expert_cache=None, progress=False, log=said.append)
    assert any("are MXFP4: packed as" in s and "exactly" in s for s in said), said
    hf_values = load_file(dequantized / "model.safetensors")
    reader = gguf.GGUFReader(str(path))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    held = 0
    for name, layer in moe_blocks(loaded.model):
        ex = layer.engine
        info = ex.info()
        assert (info["weight_format"], info["gate_up_codebook"], info["gate_up_scale_dtype"]) == ("lut4", "e2m1",
                                                                                                  "e8m0")
        gate_up = hf_values[f"{name}.experts.gate_up_proj"].float()
        down = hf_values[f"{name}.experts.down_proj"].float()
        for e in range(ex.num_experts):
            g, u, d = ex.dequantized(e)
            assert torch.equal(g, gate_up[e, :, 0::2].T) and torch.equal(u, gate_up[e, :, 1::2].T)
            assert torch.equal(d, down[e].T)
        held += sum(m.nbytes for m in ex.storage())
    print(f"MXFP4 experts: held {held} bytes, the file's {file_bytes} ({held / file_bytes:.3f}x)")
    assert held <= 1.05 * file_bytes
    ids, fed, _ = hf_trace(transformers, dequantized, 1, 11)
    same_path = trace_ours(_load(src).model, ids, fed)
    assert all(torch.equal(a, b) for a, b in zip(trace_ours(loaded.model, ids, fed), same_path))
    err, same = _trace(loaded.model, dequantized)
    print(f"gpt-oss MXFP4 GGUF: max rel. error vs Transformers {err:.1e}")
    assert same and err <= MXFP4_TOL


@pytest.mark.slow
def test_q8_0_file(files):
    """The q8_0 file: the experts are held exactly (int8 group 32, gguf's dequantization bit for bit) and the logits
    stay within the Q8_0 bound of Transformers' on the bf16 checkpoint."""
    path, src, _ = files("q8_0")
    said = []
    loaded = load_model(path, EngineOptions(**ROW), expert_cache=None, progress=False, log=said.append)
    assert any("are Q8_0: packed as int8 (planned as int8 group 32), exactly" in s for s in said), said
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name, layer in moe_blocks(loaded.model):
        bid = int(name.split(".")[2])
        want = [gguf.quants.dequantize(tensors[f"blk.{bid}.ffn_{w}_exps.weight"].data, gguf.GGMLQuantizationType.Q8_0)
                for w in ("gate", "up", "down")]
        for e in (0, layer.engine.num_experts - 1):
            for got, w in zip(layer.engine.dequantized(e), want):
                assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(w[e])))
    err, _ = _trace(loaded.model, src)
    print(f"gpt-oss Q8_0 GGUF: max rel. error vs Transformers {err:.1e}")
    assert err <= Q8_BOUND


@pytest.mark.slow
def test_generate_through_llm(files, tmp_path):
    """``LLM`` on the bf16 file: the file's tokenizer and chat template render and encode as Transformers' on the
    checkpoint; greedy tokens equal Transformers' generate. The file's pre-tokenizer is set to "gpt-4o", what the
    converter writes for gpt-oss's own tokenizer (it knows o200k's splits by their hash, not the tests' tokenizer's:
    tests/llama_cpp_convert.py names that one "gpt-2")."""
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.sampler import SamplingParams

    path, src, _ = files("bf16")
    path = _rewrite(path, tmp_path / "o200k.gguf", keys={"tokenizer.ggml.pre": ("gpt-4o", gguf.GGUFValueType.STRING)})
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(src)
    llm = LLM(path, EngineOptions(max_context=64, max_batch=2, prefill_chunk=3, experts_format="bf16",
                                  **{k: v for k, v in ROW.items() if k != "threads"}),
              expert_cache=None, progress=False, log=lambda m: None)
    msgs = [{"role": "user", "content": "hi"}]
    rendered = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert rendered == hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for prompt in ("def f(x):\n    return", rendered):
        ids = llm.tokenizer.encode(prompt)
        assert ids == hf_tok.encode(prompt, add_special_tokens=False)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):]
        out = llm.generate(prompt, params, chat=False)
        assert out.token_ids == ref.tolist()


def _rewrite(src: Path, dest: Path, drop_tensor: str = "", drop_key: str = "", keys: dict = None) -> Path:
    """``src`` written again without one tensor or key, or with ``keys`` (name -> (value, GGUFValueType))."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dest), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in (drop_key, "general.architecture", *(keys or {})):
            continue
        kind = field.types[0]
        extra = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
        w.add_key_value(key, field.contents(), kind, **extra)
    for key, (value, kind) in (keys or {}).items():
        w.add_key_value(key, value, kind, **({"sub_type": gguf.GGUFValueType.BOOL} if isinstance(value, list)
                                             else {}))
    for t in r.tensors:
        if t.name != drop_tensor:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # block types: the bytes' shape
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dest


MISSING = {"blk.1.attn_sinks.weight": r"model\.layers\.1\.self_attn\.sinks",
           "blk.2.ffn_up_exps.bias": r"model\.layers\.2\.mlp\.experts\.0\.up_proj\.bias",
           "blk.0.ffn_gate_exps.weight": r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight",
           "blk.0.ffn_gate_inp.bias": r"model\.layers\.0\.mlp\.router\.bias"}


@pytest.mark.slow
@pytest.mark.parametrize("tensor", list(MISSING))
def test_a_missing_tensor_is_named(files, tensor, tmp_path):
    bad = _rewrite(files("mxfp4")[0], tmp_path / "bad.gguf", drop_tensor=tensor)
    with pytest.raises(ValueError, match=MISSING[tensor]):
        _load(bad)


@pytest.mark.slow
def test_keys(files, tmp_path):
    """attention.sliding_window is required (llama.cpp reads it so); attention.sliding_window_pattern, a period or a
    per-layer list, decides which layers slide as llama.cpp's load_swa_pattern reads it."""
    path = files("bf16")[0]
    bad = _rewrite(path, tmp_path / "bad.gguf", drop_key="gpt-oss.attention.sliding_window")
    with pytest.raises(GGUFError, match=r"bad\.gguf: the gpt-oss GGUF has no gpt-oss\.attention\.sliding_window "
                                        r"\(needed for config.json sliding_window\)"):
        _load(bad)
    key = "gpt-oss.attention.sliding_window_pattern"
    for value, kind, want in ((3, gguf.GGUFValueType.UINT32, ["s", "s", "f"]), (1, gguf.GGUFValueType.UINT32,
                                                                                 ["f", "f", "f"]),
                              ([False, True, True], gguf.GGUFValueType.ARRAY, ["f", "s", "s"])):
        with open_gguf(_rewrite(path, tmp_path / f"p{value}.gguf", keys={key: (value, kind)})) as f:
            kinds = config_from_gguf(f)["layer_types"]
        assert [k[0] for k in kinds] == want
