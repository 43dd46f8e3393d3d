"""gpt-oss (gpt_oss): attention sinks, alternating sliding-window and full attention, YaRN RoPE, a router with bias,
routed experts with biases and the clamped SwiGLU (hetmoe/models/gpt_oss.py, layers/attention.py attend_sinks,
csrc/formats/activation.h clamped_swiglu), and its checkpoints, stacked bf16/fp32 or MXFP4 (hetmoe/load/mxfp4.py).

* kernels: the clamped SwiGLU row op on every ISA path of this machine (tests/paths.py) is the scalar one bit for bit,
  and the scalar one agrees with the fp64 formula; experts with the clamped SwiGLU and biases on every engine path
  (scalar, avx2, avx512, amx-emulated, amx where present; and NUMA-split) against a naive fp32 reference computing
  with the engine's own (dequantized) weights;
* parity: checkpoints written by Transformers' own GptOssForCausalLM (sliding window 4 < the 11-token prompt, sinks and
  biases nonzero, YaRN) loaded by hetmoe's loader onto the CPU engine, against transformers' logits over a prefill and
  cached greedy steps, batch 1 and 2, weights stored fp32 and bf16, each decode step on the CPU engine's decode
  attention with sinks and window (asserted per layer); the same decode in a batch of rows inside and past the window
  against SDPA; the GPU's path on CPU tensors (Triton's interpreter: the paged prefill and decode kernels with sinks
  and window, the fused epilogue and norm kernel) against transformers; on a GPU, the CUDA graph + fused decode against
  transformers and against the unfused and eager steps;
* MXFP4: a checkpoint whose experts the test quantizes into Hugging Face's MXFP4 layout loads from its own codes into
  lut4 e2m1 (values equal to transformers' integrations.mxfp4 dequantization, bit for bit; the packed experts take the
  file's block and scale bytes exactly), and its logits agree with transformers run on those dequantized values;
* end to end: ``LLM`` with a tiny tokenizer and a harmony-style chat template: greedy tokens equal transformers';
* bad input: an unknown activation, bad alpha/limit, biases on experts without them, a backend of another activation,
  the GPU experts paths, config.json entries, a missing bias, a non-finite MXFP4 scale: refused, naming what.

Tolerances (max |ours - hf| / max |hf| over every step), MEASURED: engine bf16 (best row path) <= 4.5e-7 (bound 1e-4);
MXFP4 in lut4 (int8 activations per group of 32: the row-block lut4 kernels) <= 2.9e-3 (bound 5e-2); the experts
against the fp32 reference on the engine's weights: row paths <= 3e-7 (bf16 weights, fp32 activations; bound 1e-5),
AMX paths (bf16 activations) <= 3.4e-3 (bound 2e-2).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hetmoe import _C
from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts, Glu
from hetmoe.load.checkpoint import CheckpointError
from hetmoe.load.loader import load_model
from hetmoe.moe import MoELayer, RouterSpec, TorchExperts
from parity import DECODE_STEPS, assert_refused_before_weights, hf_trace, max_rel, trace_ours
from paths import BEST_ROW_PATH, PATHS

transformers = pytest.importorskip("transformers")

GLU = Glu("clamped_swiglu", 1.702, 7.0)
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
            max_position_embeddings=256, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                           "original_max_position_embeddings": 64})
CPU = dict(device="cpu", dtype="fp32", experts_format="bf16", **BEST_ROW_PATH.options)
FP32_TOL, MXFP4_TOL = 1e-4, 5e-2
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def save_gpt_oss(path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, tokenizer: bool = False) -> Path:
    """A random gpt-oss checkpoint written by transformers' GptOssForCausalLM: weights N(0, 0.08), sinks and every
    bias N(0, 0.5), norms 1 + noise, all rounded to bf16 (the engine's bf16 experts hold them exactly)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**TINY))
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.5 if "sinks" in name or "bias" in name else 0.08
            noise = (torch.randn_like(p) * std).to(torch.bfloat16).float()
            p.copy_(1 + noise if "norm" in name else noise)
    model.to(dtype).save_pretrained(path)
    if tokenizer:
        from hetmoe.load.random_weights import build_tokenizer, tokenizer_config

        build_tokenizer(TINY["vocab_size"]).save(str(path / "tokenizer.json"))
        config = {**tokenizer_config(TINY["max_position_embeddings"]), "chat_template": CHAT_TEMPLATE}
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(kind: str = "fp32") -> Path:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"gpt_oss_{kind}")
            if kind == "mxfp4":
                made[kind] = write_mxfp4(get("fp32"), root / "mxfp4", root / "dequantized")
            else:
                made[kind] = save_gpt_oss(root / "ckpt", dtype=torch.bfloat16 if kind == "bf16" else torch.float32,
                                          tokenizer=kind == "tokenizer")
        return made[kind]

    return get


# ---------------------------------------------------------------- MXFP4 as Hugging Face stores it


def quantize_mxfp4(w: torch.Tensor) -> tuple:
    """w [.., N, K] -> (blocks uint8 [.., N, K/32, 16], scales uint8 [.., N, K/32]): per 32 values the smallest E8M0
    exponent s with |w| <= 6 * 2^(s - 127), each value the nearest E2M1 (byte j: value 2j low nibble, 2j+1 high)."""
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = g.abs().amax(-1).clamp(min=1e-30)
    s = (torch.ceil(torch.log2(amax / 6)) + 127).clamp(1, 254)
    idx = ((g / torch.exp2(s - 127).unsqueeze(-1)).unsqueeze(-1) - FP4).abs().argmin(-1).to(torch.uint8)
    return (idx[..., 0::2] | (idx[..., 1::2] << 4)), s.to(torch.uint8)


def write_mxfp4(source: Path, dest: Path, dequantized: Path) -> Path:
    """``source``'s experts quantized into HF's MXFP4 layout (gate_up_proj_blocks [E, 2I, H/32, 16] of gate_up_proj
    transposed, down_proj_blocks [E, H, I/32, 16]; biases as they are) at ``dest``, with quantization_config mxfp4;
    and at ``dequantized`` the same model with those experts' values, as transformers dequantizes them, in bf16."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(source / "model.safetensors")
    mx, deq = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))
        del mx[name]
        mx[name + "_blocks"], mx[name + "_scales"] = blocks.contiguous(), scales.contiguous()
        deq[name] = convert_moe_packed_tensors(blocks, scales).contiguous()  # [E, K, N] bf16: transformers' values
    cfg = json.loads((source / "config.json").read_text())
    quant = {"quantization_config": {"quant_method": "mxfp4"}}
    for path, weights, extra in ((dest, mx, quant), (dequantized, deq, {})):
        path.mkdir(parents=True)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**cfg, **extra}))
    return dest


# ---------------------------------------------------------------- kernels


def test_clamped_swiglu_row_op_every_isa():
    """The row op on every ISA path the machine runs gives the scalar path's bits (odd lengths: vector body and
    scalar tail), NaN passes through gate or up, the clamps hold at +inf (gate) and -inf (up), and the scalar path
    agrees with the fp64 formula within fast_exp's error."""
    gen = torch.Generator().manual_seed(3)
    for n in (1, 7, 16, 67, 1000):
        gate = (torch.randn(n, generator=gen) * 6).numpy()
        up = (torch.randn(n, generator=gen) * 6).numpy()
        if n > 20:
            gate[3], up[5], gate[7], up[7] = np.nan, np.nan, np.inf, 100.0
            gate[9], up[9], gate[11] = 1.5, -np.inf, -60.0
        ref = np.array(_C.row_clamped_swiglu("scalar", gate, up, 1.702, 7.0), np.float32)
        for isa in _C.cpu_features()["supported_isas"]:
            got = np.array(_C.row_clamped_swiglu(isa, gate, up, 1.702, 7.0), np.float32)
            assert np.array_equal(got.view(np.int32), ref.view(np.int32)), isa
        exact = GLU(torch.tensor(gate, dtype=torch.float64), torch.tensor(up, dtype=torch.float64)).numpy()
        assert np.array_equal(np.isnan(ref), np.isnan(exact))
        ok = ~np.isnan(exact)
        assert np.abs(ref[ok] - exact[ok]).max() <= 1e-6 * max(1.0, np.abs(exact[ok]).max())
        if n > 20:
            assert np.isnan(ref[3]) and np.isnan(ref[5]) and abs(ref[11]) < 1e-30
            assert ref[7] == pytest.approx(8 * 7 / (1 + np.exp(-1.702 * 7)), rel=1e-6)  # gate and up clamped to 7
            assert ref[9] == pytest.approx(-6 * 1.5 / (1 + np.exp(-1.702 * 1.5)), rel=1e-6)  # up clamped to -7


@pytest.mark.parametrize("alpha, offset", [(1.0, 0.0), (1.702, 0.5)])
def test_clamped_swiglu_offset_every_isa(alpha, offset):
    """The offset added to the clamped up (DeepSeek-V4: alpha 1, offset 0 is silu(min(gate, limit)) * clamp(up)):
    every ISA path gives the scalar path's bits, the scalar path the fp64 formula within fast_exp's error."""
    gen = torch.Generator().manual_seed(4)
    glu = Glu("clamped_swiglu", alpha, 0.3, offset)
    for n in (5, 67):
        gate, up = ((torch.randn(n, generator=gen) * 2).numpy() for _ in range(2))
        ref = np.array(_C.row_clamped_swiglu("scalar", gate, up, alpha, 0.3, offset), np.float32)
        for isa in _C.cpu_features()["supported_isas"]:
            got = np.array(_C.row_clamped_swiglu(isa, gate, up, alpha, 0.3, offset), np.float32)
            assert np.array_equal(got.view(np.int32), ref.view(np.int32)), isa
        exact = glu(torch.tensor(gate, dtype=torch.float64), torch.tensor(up, dtype=torch.float64)).numpy()
        assert np.abs(ref - exact).max() <= 1e-6
        if offset == 0.0:
            g, u = torch.tensor(gate).clamp(max=0.3), torch.tensor(up).clamp(-0.3, 0.3)
            assert np.allclose(exact, (torch.nn.functional.silu(g.double()) * u.double()).numpy(), atol=1e-12)


def reference(experts: CPUExperts, biases: tuple, x, ids, weights) -> torch.Tensor:
    """The naive fp32 MoE with the engine's own weights (dequantized) and the given biases."""
    E = experts.num_experts
    gate, up, down = (torch.stack(m) for m in zip(*(experts.dequantized(e) for e in range(E))))
    return TorchExperts(gate, up, down, glu=GLU, biases=biases)(x, ids, weights)


@pytest.mark.parametrize("path", list(PATHS.values()), ids=str)
def test_experts_with_biases_every_path(path):
    """Experts with the clamped SwiGLU and biases on each engine path, against the naive fp32 reference on the
    engine's weights: T in {1, 3, 7, 64}, E = 6 (not a power of two), top-k 2 and 4, -1 ids, experts with no token;
    the down bias counted once per routed slot (a token routed to an expert twice with -1 between); and the biases
    matter (the same experts without them differ)."""
    E, H, I = 6, 96, 48
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(E, I, H, generator=gen) * 0.3 for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) * 0.3
    biases = (torch.randn(E, I, generator=gen), torch.randn(E, I, generator=gen), torch.randn(E, H, generator=gen))
    ex = CPUExperts(E, H, I, "bf16", threads=2, glu=GLU, bias=True, **path.options)
    ex.load(gate, up, down)
    ex.load_biases(*biases)
    plain = CPUExperts(E, H, I, "bf16", threads=2, glu=GLU, **path.options)
    plain.load(gate, up, down)
    bound = 2e-2 if path.amx else 1e-5
    for T, k in ((1, 2), (3, 4), (7, 2), (64, 4)):
        x = torch.randn(T, H, generator=gen) * 2
        ids = torch.randint(0, E - 1, (T, k), generator=gen)  # expert E - 1: no token
        ids[0, -1] = -1
        w = torch.rand(T, k, generator=gen)
        got, ref = ex(x, ids, w), reference(ex, biases, x, ids, w)
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"{path} T={T} k={k}: {err:.2e}")
        assert err <= bound
        assert ((plain(x, ids, w) - ref).norm() / ref.norm()).item() > 10 * bound


def test_experts_with_biases_numa_split():
    """Two NUMA subpools (each expert's I cut in two): gate/up biases sliced, the down bias added once; the same
    result as the unsplit engine within fp32 summation order."""
    E, H, I = 5, 64, 128
    gen = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(E, I, H, generator=gen) * 0.2 for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) * 0.2
    biases = (torch.randn(E, I, generator=gen), torch.randn(E, I, generator=gen), torch.randn(E, H, generator=gen))
    outs = []
    x, ids, w = torch.randn(9, H, generator=gen), torch.randint(0, E, (9, 2), generator=gen), torch.rand(9, 2)
    for numa in ("off", 2):
        ex = CPUExperts(E, H, I, "bf16", threads=2, numa=numa, glu=GLU, bias=True, **BEST_ROW_PATH.options)
        ex.load(gate, up, down)
        ex.load_biases(*biases)
        assert ex.info()["numa_subpools"] == (1 if numa == "off" else 2)
        outs.append(ex(x, ids, w))
    ref = reference(ex, biases, x, ids, w)
    assert max_rel(outs[1], outs[0]) <= 1e-6 and max_rel(outs[0], ref) <= 1e-5


# ---------------------------------------------------------------- parity with transformers


def spy_decode_attention(monkeypatch) -> list:
    """The window of every call of the CPU engine's decode attention (hetmoe/cpu/attention.py) that carried sinks,
    in call order: which layers' decode steps ran on the kernel."""
    from hetmoe.cpu import attention as cpu_attention

    seen, real = [], cpu_attention.decode_attention

    def spy(*args, **kwargs):
        if kwargs.get("sinks") is not None:
            seen.append(kwargs.get("window"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_attention, "decode_attention", spy)
    return seen


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
def test_parity_cpu_engine(checkpoints, kind, batch, monkeypatch):
    """hetmoe's loader (experts bf16 on the CPU engine's best row path, fp32 dense part) on the checkpoint
    transformers wrote (fp32 or bf16 tensors) against transformers' logits: prefill of 11 tokens (past the sliding
    window of 4; SDPA) and DECODE_STEPS cached greedy steps, each on the CPU engine's decode attention with the
    sinks, and the window in the sliding layers."""
    seen = spy_decode_attention(monkeypatch)
    path = checkpoints(kind)
    said = []
    loaded = load_model(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=said.append)
    layers = loaded.model.model.layers
    assert [layer.self_attn.sliding_window for layer in layers] == [4, None, 4]
    assert all(layer.self_attn.sinks.abs().max() > 0 for layer in layers)
    info = layers[0].mlp.moe.experts.info()
    assert (info["glu"], info["glu_limit"], info["bias"]) == ("clamped_swiglu", 7.0, True)
    assert info["glu_alpha"] == np.float32(1.702)  # held as fp32
    ids, fed, hf_logits = hf_trace(transformers, path, batch, 11)
    errors = [max_rel(a, b) for a, b in zip(trace_ours(loaded.model, ids, fed), hf_logits)]
    print(f"gpt_oss {kind} batch {batch}: max rel error per step {[f'{e:.1e}' for e in errors]}")
    assert len(errors) == DECODE_STEPS + 1 and max(errors) <= FP32_TOL
    assert seen == [4, None, 4] * DECODE_STEPS  # every decode step of every layer on the kernel, prefill not


def test_kernel_decode_matches_sdpa_in_a_mixed_batch(checkpoints, monkeypatch):
    """A batch of two rows at different positions (prompts of 3 and 17 tokens: one inside the window of 4, one
    far past it) decoded 12 steps on the CPU engine's decode attention, against the same steps through
    ``attend_sinks`` (SDPA, the kernel switched off): logits within fp32 rounding (bound 1e-5)."""
    from hetmoe.layers import attention
    from hetmoe.layers.attention import Step

    loaded = load_model(checkpoints("fp32"), EngineOptions(**CPU), expert_cache=None, progress=False,
                        log=lambda m: None)
    model, lengths = loaded.model, [3, 17]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY["vocab_size"], (1, n), generator=gen) for n in lengths]
    fed = torch.randint(0, TINY["vocab_size"], (12, 2, 1), generator=gen)

    def run() -> torch.Tensor:
        cache, out = model.make_cache(2, 40), []
        with torch.no_grad():
            for slot, ids in enumerate(prompts):
                model(ids, Step(positions=torch.arange(ids.shape[1])[None], slots=torch.tensor([slot])), cache)
            for i, ids in enumerate(fed):
                step = Step(positions=torch.tensor(lengths).view(2, 1) + i, slots=torch.arange(2))
                out.append(model.logits(model(ids, step, cache)))
        return torch.cat(out, dim=1)

    seen = spy_decode_attention(monkeypatch)
    kernel = run()
    assert seen == [4, None, 4] * 12
    monkeypatch.setattr(attention, "cpu_decode", lambda q, cache: None)
    sdpa = run()
    assert max_rel(kernel, sdpa) <= 1e-5


def test_fused_paged_decode_matches_transformers(checkpoints, monkeypatch):
    """The GPU attention path on CPU tensors (Triton's interpreter): a paged cache of 8-position pages, the prompt
    of 11 prefilled by the paged prefill kernel with the sinks and the window, then DECODE_STEPS fused steps: the
    q/k/v epilogue (RoPE, the cache write), the paged decode kernel with the sinks and the window, gpt-oss's norms in
    the fused add + norm kernel, against transformers' logits (bound FP32_TOL). Paths: interpreter + CPU engine."""
    from triton_interp import triton_module

    fused = triton_module("hetmoe.ops.triton.fused", on_cpu=True)
    kernels = triton_module("hetmoe.ops.triton.attention", on_cpu=True)
    from hetmoe.layers.attention import Step

    ran = []  # (kernel, window) of each call: which path each layer's decode took

    def spy(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            ran.append((name, kwargs.get("window") if kwargs.get("sinks") is not None else "no sinks"))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    spy(kernels, "decode")
    spy(kernels, "prefill")
    spy(fused, "qkv_epilogue")

    path = checkpoints("fp32")
    loaded = load_model(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=lambda m: None)
    model = loaded.model
    ids, fed, hf_logits = hf_trace(transformers, path, 2, 11)
    cache = model.make_cache(2, 32, page_size=8, initial_tokens=64)
    assert cache.paged
    slots, out = torch.arange(2), []
    for row in range(2):
        cache.reserve(row, 11 + DECODE_STEPS)
    with torch.no_grad():
        out.append(model.logits(model(ids, Step(positions=torch.arange(11).expand(2, 11), slots=slots), cache)))
        for i, nxt in enumerate(fed):
            step = Step(positions=torch.full((2, 1), 11 + i), slots=slots, fused=True)
            out.append(model.logits(model(nxt, step, cache)))
    errors = [max_rel(a, b) for a, b in zip(out, hf_logits)]
    print(f"gpt_oss fused paged decode: max rel error per step {[f'{e:.1e}' for e in errors]}")
    assert max(errors) <= FP32_TOL
    layer = [("qkv_epilogue", "no sinks"), ("decode", 4), ("qkv_epilogue", "no sinks"), ("decode", None),
             ("qkv_epilogue", "no sinks"), ("decode", 4)]
    assert ran == [("prefill", 4), ("prefill", None), ("prefill", 4)] + layer * DECODE_STEPS


def test_sinks_and_window_matter(checkpoints):
    """The parity above could not pass without the sinks or the window: each left out moves the logits far past
    the bound."""
    path = checkpoints("fp32")
    loaded = load_model(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=lambda m: None)
    ids, fed, hf_logits = hf_trace(transformers, path, 1, 11)
    layers = loaded.model.model.layers
    for layer in layers:
        layer.self_attn.sliding_window = None
    assert max_rel(trace_ours(loaded.model, ids, fed)[0], hf_logits[0]) > 100 * FP32_TOL
    layers[0].self_attn.sliding_window = layers[2].self_attn.sliding_window = 4
    for layer in layers:
        layer.self_attn.sinks.data.zero_()
    assert max_rel(trace_ours(loaded.model, ids, fed)[0], hf_logits[0]) > 100 * FP32_TOL


def test_attention_paths_agree(checkpoints, monkeypatch):
    """The ways attend_sinks reads the cache give the same logits within fp32 rounding: a prompt prefilled whole
    with a mask from positions (no ``start``), one sequence with ``start`` (the keys of each chunk's window only),
    the prompt prefilled in chunks of 3 after a cached prefix, and queries cut into chunks of a few rows
    (SINK_CHUNK_ELEMS small)."""
    from hetmoe.layers import attention
    from hetmoe.layers.attention import Step

    loaded = load_model(checkpoints("fp32"), EngineOptions(**CPU), expert_cache=None, progress=False,
                        log=lambda m: None)
    model, S = loaded.model, 13
    ids = torch.randint(0, TINY["vocab_size"], (1, S), generator=torch.Generator().manual_seed(4))

    def run(chunks, start: bool):
        cache, out, at = model.make_cache(1, 32), [], 0
        with torch.no_grad():
            for n in chunks:
                step = Step(positions=torch.arange(at, at + n)[None], slots=torch.arange(1),
                            start=at if start else None)
                out.append(model.logits(model(ids[:, at:at + n], step, cache)))
                at += n
        return torch.cat(out, dim=1)

    whole = run([S], start=False)
    for got in (run([S], start=True), run([3] * 4 + [1], start=True), run([5, 1, 7], start=False)):
        assert max_rel(got, whole) <= 1e-5
    monkeypatch.setattr(attention, "SINK_CHUNK_ELEMS", 40)  # one query row per SDPA call here
    assert max_rel(run([S], start=True), whole) <= 1e-5 and max_rel(run([S], start=False), whole) <= 1e-5


@pytest.mark.parametrize("rope", ["published", "no-entry", "rope_scaling"])
def test_yarn_table_at_long_positions(rope):
    """The RoPE table the model gives its layers equals transformers' GptOssRotaryEmbedding at positions past 32K up to
    the context limit (131,071), for gpt-oss's published YaRN (factor 32 over 4096, theta 150000, truncate false,
    head size 64) given as rope_parameters, left out of config.json (GptOssConfig's default), or in the older
    rope_scaling + rope_theta form; and differs from the unscaled table there."""
    from hetmoe.layers.attention import Step
    from hetmoe.layers.rope import inv_frequencies
    from hetmoe.models import context_limit
    from hetmoe.models.config import ModelConfig
    from hetmoe.models.gpt_oss import GptOssForCausalLM

    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
            "original_max_position_embeddings": 4096}
    base = {**TINY, "head_dim": 64, "max_position_embeddings": 131072}
    del base["rope_parameters"]
    entries = {"published": {"rope_parameters": {**yarn, "rope_theta": 150000.0}}, "no-entry": {},
               "rope_scaling": {"rope_scaling": yarn, "rope_theta": 150000}}[rope]
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**base, **entries)).eval()
    ours = GptOssForCausalLM(ModelConfig({**base, **entries, "model_type": "gpt_oss"}))
    limit, _ = context_limit(ours.config)
    assert limit == 131072
    positions = torch.tensor([[32_767, 32_768, 40_000, 65_535, 100_000, limit - 1]])
    seen = []

    def grab(module, args):
        seen.append(args[1])
        raise StopIteration

    hook = ours.model.layers[0].register_forward_pre_hook(grab)
    with torch.no_grad(), pytest.raises(StopIteration):
        ours(torch.zeros_like(positions), Step(positions=positions, slots=torch.tensor([0])), None)
    hook.remove()
    cos, signed_sin = (t[:, :, 0] for t in seen[0])  # [1, S, D]: each half the same frequencies; sin signed
    with torch.no_grad():
        hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1), positions)  # [1, S, D / 2]
    assert torch.equal(cos, torch.cat((hf_cos, hf_cos), dim=-1))
    assert torch.equal(signed_sin, torch.cat((-hf_sin, hf_sin), dim=-1))
    freqs = positions.float().unsqueeze(-1) * inv_frequencies(64, 150000.0)
    assert (hf_cos - freqs.cos()).abs().max() > 0.1


# ---------------------------------------------------------------- MXFP4


def test_mxfp4_checkpoint_exact(checkpoints):
    """MXFP4 experts load from their own nibbles and scale bytes into lut4 e2m1 with e8m0 scales: every expert's
    values equal transformers' dequantization bit for bit (gate = columns 0::2 of its gate_up_proj, up = 1::2), the
    packed weights take exactly the file's block and scale bytes (biases apart), and the logits agree with
    transformers on the dequantized checkpoint."""
    path = checkpoints("mxfp4")
    dequantized = path.parent / "dequantized"
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", **BEST_ROW_PATH.options), expert_cache=None,
                        progress=False, log=said.append)
    assert any("MXFP4" in m and "exactly" in m for m in said)
    stored, hf_values = load_file(path / "model.safetensors"), load_file(dequantized / "model.safetensors")
    for i, layer in enumerate(loaded.model.model.layers):
        ex = layer.mlp.moe.experts
        info = ex.info()
        assert (info["weight_format"], info["gate_up_codebook"], info["gate_up_scale_dtype"]) == ("lut4", "e2m1",
                                                                                                  "e8m0")
        prefix = f"model.layers.{i}.mlp.experts."
        gate_up, down = hf_values[prefix + "gate_up_proj"].float(), hf_values[prefix + "down_proj"].float()
        for e in range(ex.num_experts):
            g, u, d = ex.dequantized(e)
            assert torch.equal(g, gate_up[e, :, 0::2].T) and torch.equal(u, gate_up[e, :, 1::2].T)
            assert torch.equal(d, down[e].T)
        file_bytes = sum(stored[prefix + n].nbytes for n in ("gate_up_proj_blocks", "gate_up_proj_scales",
                                                             "down_proj_blocks", "down_proj_scales"))
        weights = ex.storage()[:4]  # then the fp32 biases
        assert sum(m.nbytes for m in weights) == file_bytes
    ids, fed, hf_logits = hf_trace(transformers, dequantized, 1, 11)
    errors = [max_rel(a, b) for a, b in zip(trace_ours(loaded.model, ids, fed), hf_logits)]
    print(f"gpt_oss mxfp4 (lut4, int8 activations): max rel error per step {[f'{e:.1e}' for e in errors]}")
    assert max(errors) <= MXFP4_TOL


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_mxfp4_other_formats(checkpoints, fmt):
    """Asked for int8 experts, the MXFP4 codes go in as their codebook values (int8 codes, e8m0 scales), exactly;
    asked for bf16, the experts are read as their dequantized values (a note says so), which bf16 holds: the same
    values as transformers' dequantization either way."""
    path = checkpoints("mxfp4")
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", experts_format=fmt), expert_cache=None,
                        progress=False, log=said.append)
    note = "packed as int8 from their codes, exactly" if fmt == "int8" else "re-quantized into bf16"
    assert any(note in m for m in said)
    hf_values = load_file(path.parent / "dequantized" / "model.safetensors")
    ex = loaded.model.model.layers[1].mlp.moe.experts
    assert ex.info()["weight_format"] == fmt
    for e in range(ex.num_experts):
        g, u, d = ex.dequantized(e)
        assert torch.equal(g, hf_values["model.layers.1.mlp.experts.gate_up_proj"][e, :, 0::2].float().T)
        assert torch.equal(u, hf_values["model.layers.1.mlp.experts.gate_up_proj"][e, :, 1::2].float().T)
        assert torch.equal(d, hf_values["model.layers.1.mlp.experts.down_proj"][e].float().T)


def test_mxfp4_bad_scale_refused(checkpoints, tmp_path):
    """An E8M0 scale byte of 255 (2^128, not finite) is refused naming the tensor."""
    path = Path(shutil.copytree(checkpoints("mxfp4"), tmp_path / "bad"))
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.2.mlp.experts.down_proj_scales"][3, 5, 0] = 255
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.down_proj .*scale byte 255"):
        load_model(path, EngineOptions(device="cpu", dtype="fp32"), expert_cache=None, progress=False,
                   log=lambda m: None)


# ---------------------------------------------------------------- end to end


def test_generate_through_llm(checkpoints):
    """``LLM`` on the checkpoint directory with a tokenizer and a harmony-style chat template: the template renders,
    greedy tokens equal transformers' generate (prompts prefilled in chunks of 3), two requests at once equal each
    alone."""
    from hetmoe.engine.llm import LLM
    from hetmoe.engine.sampler import SamplingParams

    path = checkpoints("tokenizer")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, EngineOptions(max_context=64, max_batch=2, prefill_chunk=3, **CPU), expert_cache=None,
              progress=False, log=lambda m: None)
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == "<|start|>user<|message|>hi<|end|><|start|>assistant"
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = ["def f(x):\n    return", "Hello there, how"]
    alone = [llm.generate(p, params, chat=False) for p in prompts]
    for prompt, out in zip(prompts, alone):
        ids = llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):]
        assert out.completion_tokens == 8 and out.token_ids == ref.tolist()
    both = llm.generate(prompts, params, chat=False)
    assert [r.token_ids for r in both] == [r.token_ids for r in alone]


# ---------------------------------------------------------------- bad input


def test_bad_activation_refused():
    with pytest.raises(ValueError, match="unknown activation 'gelu'; expected one of swiglu, clamped_swiglu"):
        Glu("gelu")
    for bad in (dict(alpha=0.0), dict(limit=float("inf")), dict(limit=-1.0), dict(alpha=True),
                dict(offset=float("nan")), dict(offset=False)):
        with pytest.raises(ValueError, match="clamped_swiglu needs a finite"):
            Glu("clamped_swiglu", **{"alpha": 1.702, "limit": 7.0, **bad})
    with pytest.raises(TypeError, match="glu must be a Glu"):
        CPUExperts(4, 32, 32, "bf16", glu="clamped_swiglu")
    pool = CPUExperts(4, 32, 32, "bf16").pool._pool
    with pytest.raises(ValueError, match="unknown activation 'silu'"):
        _C.MoeExperts(pool, 4, 32, 32, "bf16", 128, "scalar", activation="silu")
    with pytest.raises(ValueError, match="clamped_swiglu needs a finite alpha > 0, limit > 0 and offset"):
        _C.MoeExperts(pool, 4, 32, 32, "bf16", 128, "scalar", activation="clamped_swiglu", alpha=1.0, limit=0.0)
    with pytest.raises(ValueError, match="clamped_swiglu needs a finite alpha > 0, limit > 0 and offset"):
        _C.MoeExperts(pool, 4, 32, 32, "bf16", 128, "scalar", activation="clamped_swiglu", alpha=1.0, limit=1.0,
                      offset=float("inf"))


def test_bad_biases_refused():
    ex = CPUExperts(4, 32, 16, "bf16", glu=GLU)
    with pytest.raises(ValueError, match="made without biases"):
        ex.load_biases(torch.zeros(4, 16), torch.zeros(4, 16), torch.zeros(4, 32))
    ex = CPUExperts(4, 32, 16, "bf16", glu=GLU, bias=True)
    with pytest.raises(ValueError, match=r"down bias must be floating point \[n, 32\]"):
        ex.load_biases(torch.zeros(4, 16), torch.zeros(4, 16), torch.zeros(4, 16))
    nan = torch.zeros(4, 16)
    nan[2, 3] = float("nan")
    with pytest.raises(ValueError, match="up bias of expert 2 contains NaN or Inf"):
        ex.load_biases(torch.zeros(4, 16), nan, torch.zeros(4, 32))


def test_backend_of_another_activation_refused():
    """A layer never runs its experts as plain SwiGLU: a backend without its activation or biases is refused, and so
    are the GPU experts paths (GPU-resident experts, the layerwise prefill), which compute plain SwiGLU only."""
    from hetmoe.moe.gpu_resident.experts import GpuExperts
    from hetmoe.moe.streamed.layerwise import LayerwisePrefill

    layer = MoELayer(RouterSpec("softmax", 2, norm_topk_prob=True), 4, glu=GLU, bias=True)
    w = torch.randn(4, 16, 32)
    for backend in (TorchExperts(w, w, w.transpose(1, 2)), CPUExperts(4, 32, 16, "bf16", glu=GLU),
                    CPUExperts(4, 32, 16, "bf16", bias=True)):
        with pytest.raises(ValueError, match="this layer's experts are clamped_swiglu with biases"):
            layer.attach(backend)
    engine = CPUExperts(4, 32, 16, "bf16", glu=GLU, bias=True)
    engine.load(w, w, w.transpose(1, 2))
    layer.attach(engine)
    with pytest.raises(ValueError, match="GPU-resident experts compute plain SwiGLU without biases"):
        GpuExperts.from_cpu(engine, [0, 1], torch.float32, "cpu")
    with pytest.raises(ValueError, match="layerwise GPU prefill computes plain SwiGLU"):
        LayerwisePrefill([layer], "cpu", torch.float32, 1)
    from hetmoe.moe.streamed import choice

    said = []

    class Plan:
        gpu_prefill, device, dtype, prefill_chunk = True, torch.device("cpu"), torch.float32, 64

    assert choice.setup([layer], Plan(), EngineOptions(), said.append)[0] is None
    assert said == ["hetmoe: GPU prefill off: the routed experts are clamped_swiglu with biases, which only the CPU "
                    "engine computes"]


BAD = {  # case -> (config.json changes, the message after the file name)
    "layer-types": ({"layer_types": ["sliding_attention", "full_attention"]},
                    r"layer_types is \['sliding_attention', 'full_attention'\]; it must list 'sliding_attention' or "
                    r"'full_attention' for each of the 3 layers"),
    "layer-kind": ({"layer_types": ["sliding_attention", "linear_attention", "full_attention"]},
                   r"layer_types is .*; it must list"),
    "window": ({"sliding_window": 0}, r"sliding_window is 0; it must be an integer >= 1"),
    "limit": ({"swiglu_limit": -7.0}, r"swiglu_limit is -7\.0; it must be a number > 0"),
    "rope": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
             r"the RoPE's rope_type is 'linear'; hetmoe's gpt_oss runs default or yarn RoPE"),
    "quant": ({"quantization_config": {"quant_method": "bitsandbytes"}},
              r"quantization_config\.quant_method is 'bitsandbytes'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_refused_before_weights(checkpoints, tmp_path, monkeypatch, case):
    changes, message = BAD[case]
    assert_refused_before_weights(checkpoints("fp32"), tmp_path / "bad", monkeypatch, changes, message, CPU)


def test_missing_bias_refused(checkpoints, tmp_path):
    path = Path(shutil.copytree(checkpoints("fp32"), tmp_path / "nobias"))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape("tensor model.layers.1.mlp.experts.down_proj_bias is missing")):
        load_model(path, EngineOptions(**CPU), expert_cache=None, progress=False, log=lambda m: None)


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_parity_gpu_dense(checkpoints):
    """The dense part on the GPU (fp32), experts on the CPU engine: the prompt of 11 (past the window of 4) prefilled
    by the paged Triton prefill kernel, then DECODE_STEPS greedy steps through the CUDA graph with the fused path (the
    epilogue, the paged Triton decode kernel with the sinks and the window), against transformers' logits (no
    GPU-resident experts: a clamped SwiGLU refuses --gpu-experts N). Bound 1e-3 (fp32 GPU kernels in another order;
    measured values printed)."""
    from hetmoe.engine.runner import Runner

    path = checkpoints("fp32")
    loaded = load_model(path, EngineOptions(device="cuda", dtype="fp32", experts_format="bf16", max_context=64),
                        expert_cache=None, progress=False, log=lambda m: None)
    runner = Runner(loaded)
    assert runner.cache.paged and runner.decoder is not None
    assert runner.decoder.cuda_graph and runner.decoder.fused  # the decode path: graph + fused, not eager
    ids, fed, hf_logits = hf_trace(transformers, path, 1, 11)
    errs = [max_rel(runner.prefill(ids[0].tolist()).view(-1).cpu(), hf_logits[0][0, -1])]
    for i, nxt in enumerate(fed):
        errs.append(max_rel(runner.decode(int(nxt[0, 0])).view(-1).cpu(), hf_logits[i + 1][0, -1]))
    print(f"gpt_oss GPU graph decode ~ transformers: {[f'{e:.1e}' for e in errs]}")
    assert runner.decoder.stats()["graphs"] >= 1 and max(errs) <= 1e-3, errs
    runner.decoder.close()


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["triton", "sdpa"])
def test_graph_decode_on_gpu(checkpoints, attention):
    """bf16 on the GPU, experts on the CPU engine: the CUDA graph decode with the fused path on against off and
    against the same steps eager, batch 1, 3 and 8 (prompts of 14..21 tokens, past the window of 4), over the paged
    cache (the Triton decode kernel with sinks and window) and the contiguous one (``attend_sinks`` in the graph).
    Bound 5e-2 relative max logit error, the bf16 graph tests' (tests/ops/test_fused_decode.py)."""
    pytest.importorskip("triton")
    from decode_steps import graph_decode

    loaded = load_model(checkpoints("bf16"), EngineOptions(device="cuda", dtype="bf16", experts_format="bf16",
                                                           max_context=64, max_batch=8, attention=attention),
                        expert_cache=None, progress=False, log=lambda m: None)
    for batch in (1, 3, 8):
        on, off = graph_decode(loaded, batch, True), graph_decode(loaded, batch, False)
        eager = graph_decode(loaded, batch, True, graph=False)
        errs = {"fused~unfused": max_rel(on, off), "graph~eager": max_rel(on, eager)}
        print(f"gpt_oss {attention} batch {batch}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
        assert torch.isfinite(on).all() and all(v < 5e-2 for v in errs.values()), errs
