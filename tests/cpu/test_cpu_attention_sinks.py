"""Decode attention on the CPU engine's threads with attention sinks and a sliding window (hetmoe/cpu/attention.py
``sinks`` / ``window``, csrc/dense/attention.cpp) against the naive fp32 reference of gpt-oss's eager attention
(tests/reference.py ``sink_attention_reference``: softmax over the scores and the sink column, the window mask
p - W < j <= p): windows shorter and longer than the context, a window of 1, contexts of one split and of several
(the merge of 256-key splits with the sink), sinks of either sign, very large (the sink takes nearly all the
probability: the output tends to 0) and very small (-1e4: plain softmax), fp32 and bf16; without sinks or window the
output is bitwise the call without those arguments; bitwise across thread counts; bad values refused.

Paths: the loops this machine runs (``attention_kernel()``: avx2 here) and the portable build, run in a subprocess
with HETMOE_MAX_ISA=scalar (``test_portable_build``). Measured (AVX2 and portable, max |out - ref| / max |ref|):
fp32 caches <= 2.5e-7 (bound 1e-5), bf16 queries and output <= 3.1e-3 (bound 1e-2: the output's rounding). A sink of
+30 shrinks the output to ~e^-30 of the values: compared by absolute error (bound 1e-6), not relative.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from cases import generator
from hetmoe.cpu import WorkerPool
from hetmoe.cpu.attention import attention_kernel, decode_attention
from reference import sink_attention_reference

CAP = 1100
# each row's position + 1: one key, a page of keys, one split (256) and one past it, several splits
LENGTHS = [1, 7, 256, 257, 1000]


def case(H, KV, D, dtype, *key):
    gen = generator("cpu_attention_sinks", H, KV, D, str(dtype), *key)
    B = len(LENGTHS)
    k = torch.randn(B + 1, CAP, KV, D, generator=gen).to(dtype)
    v = torch.randn(B + 1, CAP, KV, D, generator=gen).to(dtype)
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    rows = torch.randperm(B + 1, generator=gen)[:B]
    sinks = torch.randn(H, generator=gen) * 2
    return q, k, v, rows, torch.tensor(LENGTHS), sinks


def reference(q, k, v, rows, lens, scale, sinks, window):
    return sink_attention_reference(q, k[rows], v[rows], lens - 1, scale, sinks, window)


def rel(a, b) -> float:
    return ((a.float() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 1, 5, 128, 300, 4096], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("H, KV, D", [(8, 2, 64), (12, 3, 40), (4, 4, 32)], ids=["g4", "g4-odd-dims", "g1"])
def test_sinks_and_window_match_reference(H, KV, D, window, dtype, tol):
    q, k, v, rows, lens, sinks = case(H, KV, D, dtype)
    scale = D**-0.5
    out = decode_attention(q, k, v, rows, lens, scale, sinks=sinks, window=window)
    assert out.shape == (len(LENGTHS), H, D) and out.dtype == dtype
    err = rel(out, reference(q, k, v, rows, lens, scale, sinks, window))
    print(f"{attention_kernel()} H {H} KV {KV} D {D} window {window} {dtype}: {err:.2e}")
    assert err <= tol, err


@pytest.mark.parametrize("window", [None, 128], ids=["full", "window128"])
def test_window_alone_matches_reference(window):
    q, k, v, rows, lens, _ = case(8, 2, 64, torch.float32, "no-sinks")
    out = decode_attention(q, k, v, rows, lens, 0.125, window=window)
    assert rel(out, reference(q, k, v, rows, lens, 0.125, None, window)) <= 1e-5


@pytest.mark.parametrize("window", [None, 3, 128], ids=["full", "window3", "window128"])
def test_extreme_sinks(window):
    """A sink far above every score takes almost all the probability (output ~0: absolute error), one far below
    takes none (the output is the plain softmax's), and a mix of both across heads."""
    q, k, v, rows, lens, _ = case(8, 2, 64, torch.float32, "extreme")
    H = q.shape[1]
    plain = decode_attention(q, k, v, rows, lens, 0.125, window=window)
    low = decode_attention(q, k, v, rows, lens, 0.125, sinks=torch.full((H,), -1e4), window=window)
    assert rel(low, plain) <= 1e-6
    high_sinks = torch.full((H,), 30.0)
    high = decode_attention(q, k, v, rows, lens, 0.125, sinks=high_sinks, window=window)
    ref = reference(q, k, v, rows, lens, 0.125, high_sinks, window)
    assert high.isfinite().all() and (high - ref).abs().max().item() <= 1e-6
    assert high.abs().max().item() < 1e-6  # the values are N(0, 1): e^-30 of them is nothing
    mixed = torch.tensor([1e4, -1e4, 50.0, -50.0, 0.0, 3.0, -3.0, 88.0])
    out = decode_attention(q, k, v, rows, lens, 0.125, sinks=mixed, window=window)
    ref = reference(q, k, v, rows, lens, 0.125, mixed, window)
    assert out.isfinite().all() and (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-7


def test_no_sinks_no_window_is_bitwise_the_plain_call():
    # a window at least the context and no sinks: the same splits and the same bits as the call without them
    q, k, v, rows, lens, _ = case(8, 2, 64, torch.bfloat16, "plain")
    plain = decode_attention(q, k, v, rows, lens, 0.125)
    assert torch.equal(decode_attention(q, k, v, rows, lens, 0.125, window=CAP), plain)


def test_bitwise_across_thread_counts():
    q, k, v, rows, lens, sinks = case(32, 4, 64, torch.bfloat16, "threads")
    outs = [decode_attention(q, k, v, rows, lens, 0.1, sinks=sinks, window=window, pool=pool)
            for window in (None, 300) for pool in (WorkerPool(1), WorkerPool(2))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])


def test_portable_build():
    # HETMOE_MAX_ISA=scalar: the portable build of the loops, against the same reference
    code = ("import sys; sys.path[:0] = sys.argv[1:]; import torch; from test_cpu_attention_sinks import *; "
            "assert attention_kernel() == 'portable'; "
            "test_sinks_and_window_match_reference(12, 3, 40, 300, torch.float32, 1e-5); "
            "test_sinks_and_window_match_reference(8, 2, 64, 5, torch.bfloat16, 1e-2); "
            "test_extreme_sinks(128); print('ok')")
    here = os.path.dirname(__file__)
    env = {**os.environ, "HETMOE_MAX_ISA": "scalar"}
    proc = subprocess.run([sys.executable, "-c", code, here, os.path.dirname(here)], capture_output=True, text=True,
                          env=env, timeout=180)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 0}, "window must be an int >= 1"),
    ({"window": -3}, "window must be an int >= 1"),
    ({"window": 2.5}, "window must be an int >= 1"),
    ({"window": True}, "window must be an int >= 1"),
    ({"sinks": torch.zeros(7)}, r"sinks must be a CPU float tensor of shape \[8\]"),
    ({"sinks": torch.zeros(8, dtype=torch.int32)}, "sinks must be a CPU float tensor"),
    ({"sinks": [0.0] * 8}, "sinks must be a CPU float tensor"),
], ids=["window0", "window-neg", "window-float", "window-bool", "sinks-shape", "sinks-int", "sinks-list"])
def test_bad_sinks_or_window_refused(kwargs, message):
    q, k, v, rows, lens, _ = case(8, 2, 16, torch.float32, "bad")
    with pytest.raises(ValueError, match=message):
        decode_attention(q, k, v, rows, lens, 0.25, **kwargs)
