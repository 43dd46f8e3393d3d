"""Decode attention on the CPU engine's threads (hetmoe/cpu/attention.py, csrc/dense/attention.h) against SDPA's math
backend in fp32 on the same cache values: GQA groups 1/4/8 and one of 40 heads (head blocks of 32 + 8), odd lengths
in one batch, rows out of order, fp32 and bf16 caches and queries, MLA's two-part keys with the latent as the value;
bitwise the same for 1 and 2 threads; bad inputs raise ValueError. Then whole models (tiny qwen3_moe and deepseek_v3,
fp32 and bf16, fp32 TorchExperts) decoding on this op against the torch path it replaces.

Paths: the loops this machine runs (``attention_kernel()``: avx2 here, portable where AVX2 is missing or capped by
HETMOE_MAX_ISA; ``test_portable_build_matches_reference`` runs the portable one in a capped subprocess).
Measured (AVX2 build, max |out - ref| / max |ref|): fp32 caches <= 4e-7 (bound 1e-5); bf16 caches with fp32 queries
<= 4e-7 (the same bound: the reference reads the same bf16 values); bf16 queries and output <= 3.9e-3 (bound 1e-2:
the output's rounding to bf16). Whole models: see the bounds beside those tests.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cases import generator
from hetmoe.cpu import WorkerPool
from hetmoe.cpu.attention import attention_kernel, decode_attention
from hetmoe.layers import attention as attention_layer

LENGTHS = [1, 2, 63, 64, 65, 1000]
CAP = 1024


def reference(q, k, v, rows, lens, scale, q2=None, k2=None):
    """SDPA math in fp32: q [B, H, D1] (+ q2) over the cache rows k [R, cap, KV, D1] (+ k2), v [R, cap, KV, Dv],
    positions < lens[b] of row rows[b] -> [B, H, Dv]."""
    kk, vv = k[rows].float(), v[rows].float()  # [B, cap, KV, D]
    qq = q.float()
    if q2 is not None:
        qq, kk = torch.cat((qq, q2.float()), -1), torch.cat((kk, k2[rows].float()), -1)
    B, H, _ = q.shape
    allowed = (torch.arange(kk.shape[1])[None] < lens[:, None]).view(B, 1, 1, -1)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qq.unsqueeze(2), kk.transpose(1, 2), vv.transpose(1, 2),
                                             attn_mask=allowed, scale=scale, enable_gqa=H != k.shape[2])
    return out[:, :, 0]


def rel(a, b) -> float:
    return ((a.float() - b).abs().max() / b.abs().max()).item()


def make_case(H, KV, D, Dv, lengths, cache_dtype, q_dtype, *key):
    gen = generator("cpu_attention", H, KV, D, Dv, tuple(lengths), str(cache_dtype), str(q_dtype), *key)
    B = len(lengths)
    n_rows = B + 2
    k = torch.randn(n_rows, CAP, KV, D, generator=gen).to(cache_dtype)
    v = torch.randn(n_rows, CAP, KV, Dv, generator=gen).to(cache_dtype)
    q = torch.randn(B, H, D, generator=gen).to(q_dtype)
    rows = torch.randperm(n_rows, generator=gen)[:B]  # not in order, some rows unused
    return q, k, v, rows, torch.tensor(lengths)


def bound(q_dtype) -> float:
    return 1e-5 if q_dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["q32", "q16"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["cache32", "cache16"])
@pytest.mark.parametrize("H, KV, D, Dv", [(4, 4, 64, 64), (8, 2, 128, 128), (16, 2, 40, 24), (40, 1, 32, 32)],
                         ids=["g1", "g4", "g8-odd-dims", "g40"])
def test_gqa_matches_sdpa_math(H, KV, D, Dv, cache_dtype, q_dtype):
    q, k, v, rows, lens = make_case(H, KV, D, Dv, LENGTHS, cache_dtype, q_dtype)
    scale = D**-0.5
    out = decode_attention(q, k, v, rows, lens, scale)
    assert out.shape == (len(LENGTHS), H, Dv) and out.dtype == q_dtype
    err = rel(out, reference(q, k, v, rows, lens, scale))
    print(f"{attention_kernel()} H {H} KV {KV} D {D}/{Dv} cache {cache_dtype} q {q_dtype}: {err:.2e}")
    assert err <= bound(q_dtype), err


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["cache32", "cache16"])
@pytest.mark.parametrize("H", [16, 40])
def test_mla_matches_sdpa_math(H, cache_dtype):
    # the latent c [rows, cap, 1, r] is key part 1 and the value; the rope keys pe [rows, cap, 1, rope] part 2
    r, rope = 64, 16
    gen = generator("cpu_attention_mla", H, str(cache_dtype))
    lengths = [65, 1, 1000, 256, 257]
    c = torch.randn(7, CAP, 1, r, generator=gen).to(cache_dtype)
    pe = torch.randn(7, CAP, 1, rope, generator=gen).to(cache_dtype)
    q_lat, q_pe = torch.randn(len(lengths), H, r, generator=gen), torch.randn(len(lengths), H, rope, generator=gen)
    rows, lens = torch.tensor([6, 0, 3, 2, 5]), torch.tensor(lengths)
    scale = (128 + rope) ** -0.5
    out = decode_attention(q_lat, c, None, rows, lens, scale, q2=q_pe, k2=pe, v_is_k1=True)
    err = rel(out, reference(q_lat, c, c, rows, lens, scale, q_pe, pe))
    print(f"{attention_kernel()} MLA H {H} cache {cache_dtype}: {err:.2e}")
    assert err <= 1e-5, err


def test_mla_odd_dims_bf16_cache():
    # latent and rope dims that are not whole blocks of 16 (rows copied and zero-padded before the loops read them),
    # bf16 cache, fp32 queries: the same bound as the fp32 cases
    r, rope, H = 40, 12, 12
    gen = generator("cpu_attention_mla_odd", H)
    lengths = [3, 300, 17]
    c = torch.randn(4, CAP, 1, r, generator=gen).bfloat16()
    pe = torch.randn(4, CAP, 1, rope, generator=gen).bfloat16()
    q_lat, q_pe = torch.randn(len(lengths), H, r, generator=gen), torch.randn(len(lengths), H, rope, generator=gen)
    rows, lens = torch.tensor([1, 3, 0]), torch.tensor(lengths)
    scale = (r + rope) ** -0.5
    out = decode_attention(q_lat, c, None, rows, lens, scale, q2=q_pe, k2=pe, v_is_k1=True)
    err = rel(out, reference(q_lat, c, c, rows, lens, scale, q_pe, pe))
    print(f"{attention_kernel()} MLA odd dims H {H}: {err:.2e}")
    assert err <= 1e-5, err


def test_strided_query_and_fp32_out():
    # q a view with a head stride of its own (as attend_cache passes q[:, 0]); a given fp32 out buffer
    q, k, v, rows, lens = make_case(8, 2, 32, 32, [5, 300], torch.bfloat16, torch.bfloat16, "strided")
    wide = torch.zeros(2, 3, 8, 48, dtype=torch.bfloat16)
    wide[:, 1, :, :32] = q
    out = torch.empty(2, 8, 32)
    got = decode_attention(wide[:, 1, :, :32], k, v, rows, lens, 0.2, out=out)
    assert got is out
    assert rel(out, reference(q, k, v, rows, lens, 0.2)) <= 1e-5


def test_bitwise_across_thread_counts():
    # the split of the keys and the merge order do not depend on the threads: 1 and 2 threads, the same bits
    q, k, v, rows, lens = make_case(32, 4, 128, 128, LENGTHS, torch.bfloat16, torch.float32, "threads")
    one, two = WorkerPool(1), WorkerPool(2)
    a = decode_attention(q, k, v, rows, lens, 0.1, pool=one)
    b = decode_attention(q, k, v, rows, lens, 0.1, pool=two)
    c = decode_attention(q, k, v, rows, lens, 0.1, pool=two)
    assert torch.equal(a, b) and torch.equal(b, c)


def test_mla_bitwise_across_thread_counts():
    # one latent head: short contexts give 2 threads tasks of fewer query heads than 1 thread; the same bits
    gen = generator("cpu_attention_mla_threads")
    lengths = [200, 1000]
    c, pe = torch.randn(2, CAP, 1, 64, generator=gen).bfloat16(), torch.randn(2, CAP, 1, 16, generator=gen).bfloat16()
    q_lat, q_pe = torch.randn(2, 16, 64, generator=gen), torch.randn(2, 16, 16, generator=gen)
    rows, lens = torch.tensor([1, 0]), torch.tensor(lengths)
    outs = [decode_attention(q_lat[:n], c, None, rows[:n], lens[:n], 0.1, q2=q_pe[:n], k2=pe, v_is_k1=True, pool=p)
            for n in (1, 2) for p in (WorkerPool(1), WorkerPool(2))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])


def test_portable_build_matches_reference():
    # HETMOE_MAX_ISA=scalar: the portable build of the loops, against the same reference
    code = ("import sys; sys.path[:0] = sys.argv[1:]; import torch; from test_cpu_attention import *; "
            "from hetmoe.cpu.attention import attention_kernel; assert attention_kernel() == 'portable'; "
            "test_gqa_matches_sdpa_math(8, 2, 40, 40, torch.bfloat16, torch.float32); "
            "test_mla_matches_sdpa_math(40, torch.float32); print('ok')")
    here = os.path.dirname(__file__)
    env = {**os.environ, "HETMOE_MAX_ISA": "scalar"}
    proc = subprocess.run([sys.executable, "-c", code, here, os.path.dirname(here)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def bad_cases():
    q, k, v, rows, lens = make_case(8, 2, 16, 16, [3, 9], torch.float32, torch.float32, "bad")
    ok = dict(q=q, k=k, v=v, rows=rows, lens=lens, scale=0.25)
    return [
        ("head dim", {**ok, "q": torch.randn(2, 8, 24)}, "head dim"),
        ("heads", {**ok, "q": torch.randn(2, 7, 16)}, "multiple"),
        ("len > cap", {**ok, "lens": torch.tensor([3, CAP + 1])}, "capacity"),
        ("len 0", {**ok, "lens": torch.tensor([0, 9])}, "must be in 1.."),
        ("row", {**ok, "rows": torch.tensor([0, 99])}, "outside the cache"),
        ("rows shape", {**ok, "rows": torch.tensor([0])}, "rows must be"),
        ("fp16 q", {**ok, "q": q.half()}, "must be float32, bfloat16"),
        ("int cache", {**ok, "k": k.int(), "v": v.int()}, "must be float32, bfloat16"),
        ("mixed cache", {**ok, "v": v.bfloat16()}, "v must be float32"),
        ("v shape", {**ok, "v": v[:1]}, "share"),
        ("no v", {**ok, "v": None}, "v_is_k1"),
        ("q2 alone", {**ok, "q2": torch.randn(2, 8, 4)}, "come together"),
        ("out shape", {**ok, "out": torch.empty(2, 8, 8)}, "out must have shape"),
        ("strided last dim", {**ok, "q": torch.randn(2, 8, 32)[..., ::2]}, "contiguous"),
    ]


@pytest.mark.parametrize("name, kwargs, message", bad_cases(), ids=[c[0] for c in bad_cases()])
def test_bad_inputs_raise(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        decode_attention(**kwargs)


# ---------------------------------------------------------------- whole models


def decode_logits(model, use_engine: bool, monkeypatch, dtype) -> list:
    """Prefill two sequences of different lengths (one call each), then 6 batched decode steps of given random
    tokens (the same in every run, whatever the logits): the logits of every decode step."""
    if not use_engine:  # the torch path
        monkeypatch.setattr(attention_layer, "cpu_decode", lambda q, cache: None)
    vocab, gen = model.config.vocab_size, torch.Generator().manual_seed(5)
    cache = model.make_cache(2, 64, dtype=dtype)
    lengths = [7, 20]
    out = []
    with torch.no_grad():
        for slot, n in enumerate(lengths):
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            model(ids, attention_layer.Step(positions=torch.arange(n).unsqueeze(0), slots=torch.tensor([slot])), cache)
        for i in range(6):
            ids = torch.randint(0, vocab, (2, 1), generator=gen)
            positions = torch.tensor([[n + i] for n in lengths])
            out.append(model.logits(model(ids, attention_layer.Step(positions, torch.arange(2)), cache))[:, -1].float())
    return out


# Measured (TorchExperts fp32; max |new - old| / max |old| over 6 decode steps of a batch of 2): fp32 model and cache
# qwen3_moe 3.4e-7, deepseek_v3 (absorbed MLA) 2.3e-7, bound 1e-5; bf16 model and cache 6.6e-3 and 8.6e-3, bound 3e-2
# (both bf16 paths are 7e-3 to 9e-3 from the fp32 model's logits: the rounding of bf16 activations, not this op).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_model_decode_matches_torch_path(checkpoints, arch, dtype, monkeypatch):
    from hetmoe.models.deepseek_v2 import DeepseekV3ForCausalLM
    from hetmoe.models.qwen3_moe import Qwen3MoeForCausalLM
    from parity import load_ours, torch_fp32

    cls = {"qwen3_moe": Qwen3MoeForCausalLM, "deepseek_v3": DeepseekV3ForCausalLM}[arch]
    path = checkpoints(arch, {"num_hidden_layers": 3} if arch == "deepseek_v3" else {}, seed=7, dtype="float32")
    model = load_ours(path, cls, torch_fp32).to(dtype)
    calls = []
    real = attention_layer.cpu_decode

    def counting(q, cache):
        fn = real(q, cache)
        calls.append(fn is not None)
        return fn

    monkeypatch.setattr(attention_layer, "cpu_decode", counting)
    new = decode_logits(copy.deepcopy(model), True, monkeypatch, dtype)
    assert any(calls), "the decode steps did not reach the engine's op"
    old = decode_logits(model, False, monkeypatch, dtype)
    err = max(rel(a, b) for a, b in zip(new, old))
    print(f"{arch} {dtype}: engine decode attention vs torch path, max rel. logit difference {err:.2e}")
    assert err <= (1e-5 if dtype == torch.float32 else 3e-2), err
