"""bench/llama_cpp_peer.py's GGUF writer (the llama.cpp peer's file, hetmoe/load/gguf/random_file.py): the file gguf's
own reader reads back holds every tensor llama.cpp's qwen3moe model loads, with the asked GGML types and shapes (Q4_0
and K-quant experts), weights of a sensible size, and a byte-level vocabulary of the shape's size; the commands of a
--gpu run. llama.cpp itself is not run here."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from hetmoe.load.gguf.random_file import byte_level_vocab, random_tensor  # noqa: E402
from hetmoe.load.random_weights import SHAPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _peer():
    spec = importlib.util.spec_from_file_location("llama_cpp_peer", ROOT / "bench" / "llama_cpp_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The qwen3-30b-a3b config, shrunk: every size a multiple of 32 (Q4_0 / Q8_0 blocks along K).
TINY = dict(hidden_size=64, moe_intermediate_size=32, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, num_experts=6, num_experts_per_tok=2, vocab_size=600,
            bos_token_id=597, eos_token_id=598)


@pytest.mark.parametrize("dense", ["Q8_0", "Q4_0", "BF16", "F16"])
def test_writer_reads_back(tmp_path, dense):
    peer = _peer()
    cfg = {**copy.deepcopy(SHAPES["qwen3-30b-a3b"]), **TINY}
    path = tmp_path / "peer.gguf"
    info = peer.write_peer_gguf(path, cfg, 2, "Q4_0", dense, seed=3, log=lambda *_: None)
    r = gguf.GGUFReader(str(path))
    got = {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape)) for t in r.tensors}
    h, i, e, d, v = 64, 32, 6, 32, 600
    want = {"token_embd.weight": ("Q8_0", (h, v)), "output_norm.weight": ("F32", (h,)),
            "output.weight": (dense, (h, v))}
    for b in range(2):
        p = f"blk.{b}."
        want.update({
            p + "attn_norm.weight": ("F32", (h,)), p + "ffn_norm.weight": ("F32", (h,)),
            p + "attn_q_norm.weight": ("F32", (d,)), p + "attn_k_norm.weight": ("F32", (d,)),
            p + "attn_q.weight": (dense, (h, 4 * d)), p + "attn_k.weight": (dense, (h, 2 * d)),
            p + "attn_v.weight": (dense, (h, 2 * d)), p + "attn_output.weight": (dense, (4 * d, h)),
            p + "ffn_gate_inp.weight": ("F32", (h, e)),
            p + "ffn_gate_exps.weight": ("Q4_0", (h, i, e)), p + "ffn_up_exps.weight": ("Q4_0", (h, i, e)),
            p + "ffn_down_exps.weight": ("Q4_0", (i, h, e)),
        })
    assert got == want  # GGUF shapes are ggml's ne order: K first
    assert info["bytes"] == path.stat().st_size and info["layers"] == 2

    field = lambda key: r.fields[key]  # noqa: E731
    scalar = lambda key: field(key).parts[field(key).data[0]][0]  # noqa: E731
    assert bytes(field("general.architecture").parts[-1]).decode() == "qwen3moe"
    assert scalar("qwen3moe.block_count") == 2 and scalar("qwen3moe.expert_count") == e
    assert scalar("qwen3moe.expert_used_count") == 2 and scalar("qwen3moe.attention.key_length") == d
    assert scalar("qwen3moe.expert_feed_forward_length") == i
    tokens = [bytes(field("tokenizer.ggml.tokens").parts[k]).decode() for k in field("tokenizer.ggml.tokens").data]
    assert len(tokens) == v and len(set(tokens)) == v and tokens[598] == "<|im_end|>"
    assert len(field("tokenizer.ggml.merges").data) == v - 256

    tensors = {t.name: t for t in r.tensors}
    for name in ("blk.1.ffn_down_exps.weight", "blk.0.attn_q.weight", "output.weight", "token_embd.weight"):
        t = tensors[name]
        w = gguf.dequantize(t.data, t.tensor_type)
        # Quantized: random codes at scales around std 0.02 (measured 0.019-0.022); F16/BF16: |w| in [1/64, 1/32).
        assert np.isfinite(w).all() and 0.012 < float(w.std()) < 0.03, (name, float(w.std()))
    assert (gguf.dequantize(tensors["blk.0.attn_norm.weight"].data, gguf.GGMLQuantizationType.F32) == 1).all()


def test_bad_types_and_shapes(tmp_path):
    peer = _peer()
    with pytest.raises(ValueError, match="dense-type"):
        peer.write_peer_gguf(tmp_path / "x.gguf", "qwen3-30b-a3b", 1, "Q4_0", "Q5_K")
    with pytest.raises(ValueError, match="qwen3_moe shapes only"):
        peer.write_peer_gguf(tmp_path / "x.gguf", "mixtral-8x7b", 1, "Q4_0", "Q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        random_tensor("Q4_0", (4, 48), np.random.default_rng(0))
    with pytest.raises(ValueError, match="multiple of 256"):
        random_tensor("Q6_K", (4, 288), np.random.default_rng(0))
    with pytest.raises(ValueError, match="experts-type"):
        peer.write_peer_gguf(tmp_path / "x.gguf", "qwen3-30b-a3b", 1, "Q5_K", "Q8_0")
    with pytest.raises(ValueError, match="at least 256"):
        byte_level_vocab(100)


# K-quant blocks hold 256 weights along K: the shape's K dimensions (hidden, expert intermediate) grow to 256.
TINY_K = {**TINY, "hidden_size": 256, "moe_intermediate_size": 256}


@pytest.mark.parametrize("experts,gate_up,down", [("Q4_K_M", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"),
                                                  ("Q6_K", "Q6_K", "Q6_K")])
def test_kquant_experts(tmp_path, experts, gate_up, down):
    peer = _peer()
    cfg = {**copy.deepcopy(SHAPES["qwen3-30b-a3b"]), **TINY_K}
    path = tmp_path / "peer.gguf"
    peer.write_peer_gguf(path, cfg, 2, experts, "Q8_0", seed=4, log=lambda *_: None)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for b in range(2):
        p = f"blk.{b}."
        got = {k: (tensors[p + k].tensor_type.name, tuple(int(n) for n in tensors[p + k].shape))
               for k in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}
        assert got == {"ffn_gate_exps.weight": (gate_up, (256, 256, 6)), "ffn_up_exps.weight": (gate_up, (256, 256, 6)),
                       "ffn_down_exps.weight": (down, (256, 256, 6))}
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q8_0"
    for name in ("blk.0.ffn_up_exps.weight", "blk.1.ffn_down_exps.weight"):
        t = tensors[name]
        w = gguf.dequantize(t.data, t.tensor_type)
        # random codes and sub-block scales, d sized for std 0.02 and dmin for a mean near 0 (measured 0.020-0.022)
        assert np.isfinite(w).all() and 0.014 < float(w.std()) < 0.03 and abs(float(w.mean())) < 0.01, name


def test_gpu_dry_run_prints_both_commands(tmp_path, capsys):
    peer = _peer()
    exe = tmp_path / "llama-bench"
    rc = peer.main(["--gpu", "--dry-run", "--layers", "48", "--experts-type", "Q4_K_M", "--dense-type", "Q8_0",
                    "--llama-bench", str(exe), "--llama-env", "LD_LIBRARY_PATH=/x/nvidia/cu13/lib", "--threads", "30",
                    "--gguf", str(tmp_path / "m.gguf"), "--prompt-tokens", "512", "--decode-tokens", "32"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and not (tmp_path / "m.gguf").exists()
    llama = next(line for line in lines if str(exe) in line)
    assert llama.startswith("LD_LIBRARY_PATH=/x/nvidia/cu13/lib ")
    assert f"-m {tmp_path / 'm.gguf'} -p 512 -n 32 -t 30 -ngl 99 -ot exps=CPU -fa 1 -o json" in llama
    het = next(line for line in lines if "bench e2e" in line)
    for part in (f"--model {tmp_path / 'm.gguf'}", "--expert-cache off", "--device cuda", "--threads 30",
                 "--variants graph", "--dense-format int8", "--prompt-tokens 512", "--decode-tokens 32"):
        assert part in het, part
    assert "--shape" not in het and "--layers" not in het


def test_bad_llama_env():
    with pytest.raises(SystemExit):
        _peer().main(["--dry-run", "--llama-bench", "x", "--llama-env", "NOEQUALS"])
