"""GGUF's ternary experts (TQ2_0, TQ1_0) held exactly as int2 symmetric, group 128, fp16 scales
(hetmoe/load/gguf/ternary.py -> hetmoe/cpu/codes.py EXACT_TYPES). The engine's kernels on these layouts, every
path: tests/load/gguf/test_kquants.py (its LAYERS hold the ternary types); here the decoder on every byte pattern, a
file of each type end to end, and the bad inputs.

Fixtures: gguf.quants.quantize (which writes TQ2_0's q in 0..2, as llama.cpp does) and random bytes (every byte is a
valid TQ1_0 byte; TQ2_0's q of 3, value 2 d, too); ``gguf.quants.dequantize`` is the reference. No binary fixture is
committed. Paths: the row-block kernels at the best ISA the tests may use (HETMOE_MAX_ISA caps it), the GPU
prefill's PyTorch unpack and its Triton kernel (interpreted here), the GPU-resident copy of the engine's codes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_interp import assert_unpack_equals_engine

from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.cpu.codes import exact_layout, load_codes
from hetmoe.load.gguf.ternary import TERNARY, ternary_codes

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from gguf_files import assert_torch_unpack_equals_engine  # noqa: E402
from test_gguf_model import KSIZES, _assert_exact, _layout, _load, logit_error, quantized_gguf  # noqa: E402

from hetmoe.load.gguf import GGUFError  # noqa: E402
from hetmoe.load.loader import moe_blocks  # noqa: E402

E, H, I = 3, 256, 512
TYPES = list(TERNARY)


def random_ternary(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a [rows, cols] ``kind`` matrix with a finite fp16 d (TQ2_0: q of 3 included)."""
    nbytes = TERNARY[kind]
    raw = rng.integers(0, 256, (rows, cols // 256, nbytes), dtype=np.uint8)
    d = (rng.uniform(-1.0, 1.0, (rows, cols // 256)) * 0.01).astype(np.float16)
    raw[..., nbytes - 2:] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def dequantized(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (s.shape[-1], -1)) * s[..., None]).flatten(-2)


@pytest.mark.parametrize("kind", TYPES)
def test_decoded_codes_times_scales_are_gguf_values(kind):
    """gguf-quantized blocks: codes in {-1, 0, 1} and d, bit for bit gguf's values; random bytes (every TQ1_0 byte,
    243..255 included; TQ2_0's q of 3): the same values, a TQ2_0 group holding a 3 negated (codes 1 - q, scale -d)."""
    rng = np.random.default_rng(1)
    qt = getattr(gguf.GGMLQuantizationType, kind)
    raw = gguf.quants.quantize(rng.standard_normal((8, 512)).astype(np.float32) * 0.05, qt)
    q, s = ternary_codes(raw, kind, (8, 512))
    assert q.dtype == torch.int8 and {int(v) for v in q.unique()} == {-1, 0, 1} and s.shape == (8, 4)
    want = torch.from_numpy(gguf.quants.dequantize(raw, qt).astype(np.float32))
    assert torch.equal(dequantized(q, s).view(torch.int32), want.view(torch.int32))  # -0.0 included
    raw = random_ternary(kind, 16, 1024, rng)
    q, s = ternary_codes(raw, kind, (2, 8, 1024), threads=2)  # rows of experts, decoded on two threads
    want = torch.from_numpy(gguf.quants.dequantize(raw, qt).astype(np.float32)).view(2, 8, 1024)
    assert torch.equal(dequantized(q, s), want)
    if kind == "TQ1_0":
        assert torch.equal(dequantized(q, s).view(torch.int32), want.view(torch.int32))
    else:  # a group holding a 3 is held negated, in int2's [-2, 1]
        assert int(q.min()) == -2 and int(q.max()) == 1
        d = torch.from_numpy(raw.reshape(16, 4, 66)[..., 64:].copy().view(np.float16)[..., 0].astype(np.float32))
        flipped = s.view(16, 4, 2) != d[..., None]
        assert torch.equal(s.view(16, 4, 2)[flipped], -d[..., None].expand(16, 4, 2)[flipped]) and flipped.any()


@pytest.mark.parametrize("kind", TYPES)
def test_random_blocks_load_at_their_values(kind):
    """Random bytes packed into the engine (one pool and two NUMA subpools): its values are gguf's (TQ2_0's q of 3
    included); the GPU prefill's torch unpack reads them as the engine does."""
    rng = np.random.default_rng(2)
    for pool in (WorkerPool(1), WorkerPool(2, numa=2)):
        experts = CPUExperts(E, H, I, pool=pool, **exact_layout(kind, kind))
        parts, refs = [], []
        for rows, cols in ((I, H), (I, H), (H, I)):
            raw = np.stack([random_ternary(kind, rows, cols, rng) for _ in range(E)])
            parts.append(ternary_codes(raw, kind, (E, rows, cols)))
            refs.append(torch.from_numpy(gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))))
        load_codes(experts, [p[0] for p in parts], [p[1] for p in parts])
        for e in range(E):
            for got, want in zip(experts.dequantized(e), refs):
                assert torch.equal(got, want[e].float())
    one = CPUExperts(E, H, I, pool=WorkerPool(1), **exact_layout(kind, kind))
    load_codes(one, [p[0] for p in parts], [p[1] for p in parts])
    assert_torch_unpack_equals_engine(one, E)


def test_the_gpu_readers_take_the_layout():
    """int2 symmetric, group 128, fp16 scales: the layerwise prefill's Triton unpack (@gpu run: the same test) and the
    GPU-resident copy (int2 codes widened into int4, scales into fp32: the engine's values exactly)."""
    from hetmoe.moe.gpu_resident import format as rf

    layout = exact_layout("TQ2_0", "TQ2_0")
    assert_unpack_equals_engine((2, 256, 128), [{k: layout[k] for k in ("weight_format", "group_size",
                                                                        "scale_dtype")}])
    experts = CPUExperts(E, H, I, pool=WorkerPool(1), **layout)
    gen = torch.Generator().manual_seed(3)
    experts.load(*(torch.randn(E, r, c, generator=gen) * 0.05 for r, c in ((I, H), (I, H), (H, I))))
    st = rf.cpu_storage(experts)
    assert (st.gate_up, st.down, st.group, st.down_group) == ("int4", "int4", 128, 128)
    (gu_q, gu_s), (d_q, d_s) = rf.cpu_codes(experts, E - 1, st)
    g, u, d = experts.dequantized(E - 1)
    assert torch.equal(rf.dequantize(gu_q, gu_s, st.gate_up, st.group, H), torch.cat([g, u]))
    assert torch.equal(rf.dequantize(d_q, d_s, st.down, st.down_group, I), d)


# Max rel. logit error against the fp32 reference on the dequantized weights: what bounds it is the engine's int8
# activations, rounded per group of the weights' group, 128 here (x and h: 4x Q4_0's 32). MEASURED 9.8e-2 for both
# types (the same values: gguf writes the same ternary codes); the same codes with their scales repeated per 64 / 32
# gave 2.7e-2 / 2.0e-2 (Q4_0: 2.0e-2), and int8 codes with int16 activations (--experts-format int8) 1.3e-4.
TERNARY_LOGIT_BOUND = 1.5e-1
@pytest.mark.parametrize("kind", TYPES)
def test_a_ternary_file_loads_exactly(tmp_path, kind):
    """A qwen3moe file whose experts gguf quantized to ``kind``: planned as int4 group 128, every layer int2 symmetric
    group 128 fp16, every expert's values gguf's dequantization bit for bit, said on the log, and logits within the
    bound of int8 activations per group of 128."""
    from hetmoe.config.options import EngineOptions
    from hetmoe.load.loader import load_model

    path, cfg, state, deq = quantized_gguf(tmp_path, "qwen3_moe", kind, **KSIZES["qwen3_moe"])
    said = []
    loaded = load_model(path, EngineOptions(device="cpu", dtype="fp32", threads=1), expert_cache=None,
                        progress=False, log=said.append)
    assert (loaded.plan.experts_format, loaded.plan.group_size) == ("int4", 128)
    assert any(f"are {kind}: packed as int2 (planned as int4 group 128), exactly" in s for s in said), said
    for _, layer in moe_blocks(loaded.model):
        assert _layout(layer.engine) == ("int2", 128, 128, ("symmetric", "symmetric"))
        assert layer.engine.info()["gate_up_scale_dtype"] == layer.engine.info()["down_scale_dtype"] == "fp16"
    _assert_exact(loaded, deq)
    err = logit_error(tmp_path, "qwen3_moe", path, cfg, state, deq)
    print(f"{kind}: max rel. logit error {err:.2e}")
    assert err < TERNARY_LOGIT_BOUND


def test_bad_ternary_tensors_are_refused(tmp_path):
    """Bytes that are not the shape's, rows that are not whole blocks, and a file cut inside a TQ1_0 tensor: each
    named."""
    with pytest.raises(ValueError, match=r"TQ1_0 \[2, 256\] needs 108 bytes, got 107"):
        ternary_codes(np.zeros(107, np.uint8), "TQ1_0", (2, 256))
    with pytest.raises(ValueError, match="TQ2_0 rows of 128 values are not whole blocks of 256"):
        ternary_codes(np.zeros(66, np.uint8), "TQ2_0", (2, 128))
    path, _, _, _ = quantized_gguf(tmp_path, "qwen3_moe", "TQ1_0", **KSIZES["qwen3_moe"])
    reader = gguf.GGUFReader(str(path))
    last = max((t for t in reader.tensors if t.tensor_type.name == "TQ1_0"), key=lambda t: t.data_offset)
    assert last.data_offset + last.n_bytes == max(t.data_offset + t.n_bytes for t in reader.tensors)
    path.write_bytes(path.read_bytes()[:int(last.data_offset) + 1000])
    with pytest.raises(GGUFError, match=rf"is truncated: tensor {last.name}'s data ends at byte \d+, the file has"):
        _load(path)
