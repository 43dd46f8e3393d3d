"""The AMX GEMM's two loops for grouped int8 weights (csrc/kernels/amx/gemm.h) give the same bits: calls of up to
HETMOE_AMX_PP_MAX_TOKENS tokens (default 32) take the 16-token loop with two sets of C tiles, longer ones the
32-token loop; 0 sends every call to the 32-token loop. Per output the groups are summed in the same order either
way, so the emulated GEMM must agree bitwise between a child run with the cut at 0 and one with it past every call.
int4 weights take the two-set loop at every length, whatever the cut: their cases here check that the cut does not
reach them. Symmetric int4 expanded to unsigned bytes (HETMOE_AMX_INT4_SIGNED=0: tdpbsud, offset 8 undone in the
epilogue) gives the bits of its signed default (tdpbssd, no offset). The knobs are read once per process, hence the
child processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from cases import make_routing, make_weights, make_x
from hetmoe.cpu import CPUExperts, shared_pool

shape = (6, 200, 136)  # E, H, I: H and I not multiples of 64; groups cut partial K chunks
E, H, I = shape
weights = make_weights(*shape, "amx")
outs = []
for fmt, group in [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 16), ("int8", 32), ("int8", 64), ("int8", 128)]:
    ex = CPUExperts(E, H, I, fmt, group, isa="amx-emulated", pool=shared_pool(), amx_min_tokens=1)
    ex.load(*weights)
    for T in (1, 21, 50, 77):  # 2 of 6 experts each: calls of ~7, 17, 33 and 51 tokens
        x = make_x(T, H, shape, 2, 0.0, "amx")
        ids, w = make_routing(T, 2, E, shape, "amx")
        outs.append(ex(x, ids, w))
torch.save(outs, sys.argv[1])
"""


def _run(cut: int, path: Path, int4_signed: bool = True) -> list:
    env = {**os.environ, "HETMOE_AMX_PP_MAX_TOKENS": str(cut), "HETMOE_AMX_INT4_SIGNED": "1" if int4_signed else "0"}
    code = CHILD.format(tests=str(HERE.parent))
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(path)


@pytest.fixture(scope="module")
def two_set(tmp_path_factory) -> list:
    """Every call in the two-set loop (the cut past every call), int4 on signed bytes (the default)."""
    return _run(1 << 20, tmp_path_factory.mktemp("amx_loops") / "two_set.pt")


def test_both_grouped_loops_give_the_same_bits(tmp_path, two_set):
    old = _run(0, tmp_path / "old.pt")
    assert len(old) == len(two_set) == 28
    for i, (a, b) in enumerate(zip(old, two_set)):
        assert torch.isfinite(a).all() and a.abs().max() > 0, f"case {i}: no output"
        assert torch.equal(a, b), f"case {i}: the loops differ by {(a - b).abs().max().item():.3g}"


def test_signed_and_unsigned_int4_give_the_same_bits(tmp_path, two_set):
    unsigned = _run(1 << 20, tmp_path / "unsigned.pt", int4_signed=False)
    assert len(two_set) == len(unsigned) == 28
    for i, (a, b) in enumerate(zip(two_set, unsigned)):
        assert torch.equal(a, b), f"case {i}: signed and unsigned int4 differ by {(a - b).abs().max().item():.3g}"
