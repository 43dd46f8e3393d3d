"""The GPU prefill's readers of the bit-plane formats (int6, int5, int3, int2: GGUF's Q6_K, Q5_K, Q3_K, Q2_K at their
file's bytes, csrc/formats/layout.h): the PyTorch unpack (hetmoe/moe/streamed/packed.py) and the one-pass Triton
kernel (hetmoe/ops/triton/packed.py) against the CPU engine's own values (``CPUExperts.dequantized``: code x scale
(- min) in fp32), and the layerwise prefill's setup taking plane-format layers (hetmoe/moe/streamed/choice.py).

Paths: torch ops on the CPU (bitwise); the Triton kernel in Triton's interpreter in a fresh process where there is no
GPU (bitwise in fp32), on the GPU otherwise (bitwise the engine's values rounded to bf16): the same test.
"""

from types import SimpleNamespace

import pytest
import torch

from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.moe.streamed import layerwise
from hetmoe.moe.streamed.choice import setup
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts
from tests.triton_interp import assert_unpack_equals_engine

# (weight_format, scaling, group, scale dtype): every plane format symmetric and affine; the K-quants' own with k8
# (Q6_K, Q5_K, Q3_K, Q2_K), the others with fp32 or fp16 scales
CASES = [("int6", "symmetric", 16, "k8"), ("int6", "affine", 32, "fp32"), ("int5", "affine", 32, "k8"),
         ("int5", "symmetric", 16, "fp32"), ("int3", "symmetric", 16, "k8"), ("int3", "affine", 64, "fp16"),
         ("int2", "affine", 16, "k8"), ("int2", "symmetric", 128, "fp32")]
# Q4_K_M's mixed expert (Q4_K gate/up, Q6_K down) and Q3_K_M's (Q3_K gate/up, Q5_K down)
MIXED = [dict(weight_format=("int4", "int6"), group_size=32, down_group_size=16, scaling=("affine", "symmetric"),
              scale_dtype=("k8", "k8")),
         dict(weight_format=("int3", "int5"), group_size=16, down_group_size=32, scaling=("symmetric", "affine"),
              scale_dtype=("k8", "k8"))]


def _engine(E, H, I, seed, **kwargs) -> CPUExperts:
    ex = CPUExperts(E, H, I, pool=WorkerPool(1), **kwargs)
    ex.fill_random(seed=seed)  # codes over each format's whole range (every plane's bits)
    return ex


def _kwargs(case) -> dict:
    fmt, scaling, group, sdt = case
    return dict(weight_format=fmt, group_size=group, scaling=scaling, scale_dtype=sdt)


@pytest.mark.parametrize("kwargs", [_kwargs(c) for c in CASES] + MIXED,
                         ids=["-".join(map(str, c)) for c in CASES] + ["q4_k_m", "q3_k_m"])
@pytest.mark.parametrize("H,I", [(48, 80), (288, 40)])
def test_torch_unpack_equals_the_engine(kwargs, H, I):
    """H = 48 with group 16: K ends in half a unit of int5 / int3; H = 288: two k8 super-blocks, the second partial;
    I = 40 in groups of 32: K padded. Experts 1..2 of 4 alone, as the GPU path unpacks a few at a time."""
    E = 4
    ex = _engine(E, H, I, H + I, **kwargs)
    lay = ExpertLayout.of(ex)
    ranges = expert_ranges(ex)
    per = lay.range_bytes()
    assert lay.expert_bytes == ex.info()["bytes_per_expert"]
    assert [r.numel() for r in ranges] == [E * b for b in per]
    a, n = 1, 2
    gu, d = unpack_experts(lay, [r[a * b:(a + n) * b] for r, b in zip(ranges, per)], n, torch.float32)
    for i in range(n):
        g, u, dd = ex.dequantized(a + i)
        assert torch.equal(gu[i], torch.cat([g, u])) and torch.equal(d[i], dd), (kwargs, a + i)


def test_the_triton_unpack_equals_the_engine():
    """The one-pass kernel on every plane format, symmetric and affine, k8 / fp32 / fp16 scales, and the mixed
    experts (H = 48: half a unit; I = 40: padded K)."""
    assert_unpack_equals_engine((2, 48, 40), [_kwargs(c) for c in CASES] + MIXED)


def test_the_triton_unpack_over_super_blocks():
    """The K-quants' own layouts over two k8 super-blocks (H = 288, the second partial)."""
    assert_unpack_equals_engine((2, 288, 40), [_kwargs(c) for c in CASES if c[3] == "k8"] + MIXED[:1])


class _Driver:
    """Stands in for LayerwisePrefill in ``setup``: reads every layer's packed layout as the real one does (which
    refused the bit-plane formats before they had a GPU reader)."""

    def __init__(self, layers, device, dtype, threshold, slots, unpack, group, rows):
        self.layouts = [ExpertLayout.of(layer.engine) for layer in layers]
        self.group, self.n_slots, self.slot_bytes, self.min_tokens = 8, slots, 1 << 20, threshold

    def enable_share(self, share, chunk):
        return None


@pytest.mark.parametrize("kwargs", [_kwargs(CASES[0]), MIXED[0], _kwargs(CASES[6])], ids=["q6_k", "q4_k_m", "q2_k"])
def test_setup_streams_plane_format_layers(monkeypatch, kwargs):
    """A plan with the GPU prefill on and layers of plane formats: the prefill is set up (the fallback that kept such
    layers on the CPU is gone), and their layouts are read."""
    monkeypatch.setattr(layerwise, "LayerwisePrefill", _Driver)
    engine = _engine(3, 64, 32, 1, **kwargs)
    layers = [SimpleNamespace(engine=engine, plain_swiglu=True) for _ in range(2)]
    plan = SimpleNamespace(gpu_prefill=True, device="cpu", dtype=torch.float32, prefill_chunk=512)
    said = []
    driver, report = setup(layers, plan, SimpleNamespace(gpu_prefill=64, gpu_prefill_cpu_share="off"), said.append)
    assert isinstance(driver, _Driver) and report["enabled"], (report, said)
    assert not any("off" in line.split(";")[0] for line in said), said
    fmts = {(lay.gate_up.fmt, lay.down.fmt) for lay in driver.layouts}
    want = kwargs["weight_format"]
    assert fmts == {want if isinstance(want, tuple) else (want, want)}
