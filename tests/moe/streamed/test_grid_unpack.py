"""The grid format's PyTorch decoder (hetmoe/moe/streamed/grid.py: GGUF's i-quants IQ2_XXS .. IQ1_M held at their
file's bytes) and the GPU paths it opens: the layerwise prefill streams grid layers (their bytes copied as they are,
decoded on the device into the weight scratch), GPU-resident experts take the engine's own int8 codes and scales.

Paths: the decoder in torch ops on the CPU against gguf.quants.dequantize of the file's blocks and against the CPU
engine's own decoder (``CPUExperts.dequantized``, csrc/formats/grid.h): bitwise, fp32. The layerwise path on CPU
tensors inside a model against the CPU engine's row blocks (BEST_ROW_PATH): the engine's int8 activation rounding
alone. GPU (marked): the decoder on CUDA bitwise the CPU's; the streamed prefill on a random i-quant GGUF file
against the CPU engine's prefill, with the bounds tests/moe/streamed/test_layerwise.py sets for int4 (the engine reads
int8 activations for both); resident experts bitwise the engine's values.

Blocks are random (hetmoe/load/gguf/random_file.py: random grid indices, signs and sub-scales, fp16 d around a weight
std of 0.02; every byte pattern is a valid block).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hetmoe.cpu import CPUExperts, WorkerPool
from hetmoe.cpu.codes import GRID_TYPES, exact_layout, load_codes
from hetmoe.cpu.layout import GRIDS, ROWS
from hetmoe.load.gguf.checkpoint import grid_blocks
from hetmoe.load.gguf.random_file import EXPERT_MIXES, qwen3moe_plan, random_tensor, write_random_gguf
from hetmoe.moe.gpu_resident import format as rf
from hetmoe.moe.gpu_resident.experts import GpuExperts
from hetmoe.moe.streamed import grid, layerwise
from hetmoe.moe.streamed.choice import setup, unreadable
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts
from paths import BEST_ROW_PATH

gguf = pytest.importorskip("gguf")

E = 3
# (gate/up, down) GGML types: every grid type on each side, groups of 32 beside 16, IQ1_M (no d apart) on each side,
# an i-quant beside a K-quant (int4 affine, k8 scales) either way
MIXES = [("IQ2_XXS", "IQ3_XXS"), ("IQ2_XS", "IQ3_S"), ("IQ2_S", "IQ1_S"), ("IQ1_M", "IQ2_XXS"),
         ("IQ3_XXS", "IQ1_M"), ("IQ2_XS", "Q4_K"), ("Q4_K", "IQ3_S")]


def _raw(kind: str, shape: tuple, seed: int) -> np.ndarray:
    return random_tensor(kind, shape, np.random.default_rng(seed))


def _gguf_values(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).astype(np.float32))


def _engine(gate_up: str, down: str, H: int, I: int, seed: int = 0) -> tuple:
    """CPUExperts holding gate/up of GGML type ``gate_up`` and down of ``down`` from random blocks -> (engine, the
    file's bytes of one expert)."""
    from hetmoe.load.gguf.kquants import KQUANTS, kquant_codes

    ex = CPUExperts(E, H, I, pool=WorkerPool(1), **exact_layout(gate_up, down))
    codes, scales, mins, nbytes = [], [], [], 0
    for m, (kind, shape) in enumerate(((gate_up, (E, I, H)), (gate_up, (E, I, H)), (down, (E, H, I)))):
        raw = _raw(kind, shape, seed + m)
        nbytes += raw.nbytes // E
        if kind in GRID_TYPES:
            q, s, mn = grid_blocks(raw, kind, shape), None, None
        else:
            assert kind in KQUANTS
            q, s, mn = kquant_codes(raw, kind, shape)
        codes.append(q)
        scales.append(s)
        mins.append(mn)
    load_codes(ex, codes, scales, mins=mins)
    return ex, nbytes


# ---------------------------------------------------------------- the decoder


@pytest.mark.parametrize("kind", GRID_TYPES)
@pytest.mark.parametrize("rows,k", [(1, 256), (37, 768), (16, 512)])
def test_decoder_is_gguf_dequantization(kind, rows, k):
    """A file's blocks (odd row counts, one and several super-blocks): scale * q bitwise gguf's fp32 values; int8
    codes of at most 63 in magnitude, the type's group; the bf16 weights those values rounded once."""
    book = kind.lower()
    raw = _raw(kind, (rows, k), GRID_TYPES.index(kind) + rows)
    blocks, d = grid.file_rows(torch.from_numpy(raw), book)
    want = _gguf_values(raw, kind)
    got = grid.dequantize(blocks, d, book)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), kind
    codes, scales = grid.decode(blocks, d, book)
    assert codes.dtype == torch.int8 and codes.shape == (rows, k) and codes.abs().max() <= 63
    assert scales.shape == (rows, k // GRIDS[book][0]) and scales.dtype == torch.float32
    assert codes.unique().numel() >= 6 and scales.unique().numel() > rows  # (IQ2_*, IQ1_*: 6 distinct codes)
    assert torch.equal(grid.dequantize(blocks, d, book, torch.bfloat16), want.bfloat16())


def _row_blocks(raw: np.ndarray, book: str) -> tuple:
    """A file's blocks [R, S * file bytes] laid out as one matrix of the engine's row blocks (csrc/formats/layout.h:
    per row block [S][16 rows][row bytes], its d [S][16] fp16; padded rows zero bytes, d = 0) -> (data, d bytes or
    None, row blocks)."""
    blocks, d = grid.file_rows(torch.from_numpy(raw), book)
    R, S, rb = blocks.shape
    NB = -(-R // ROWS)
    data = torch.zeros(NB * ROWS, S, rb, dtype=torch.uint8)
    data[:R] = blocks
    data = data.view(NB, ROWS, S, rb).transpose(1, 2).contiguous().view(-1)
    if d is None:
        return data, None, NB
    dd = torch.zeros(NB * ROWS, S, dtype=torch.float16)
    dd[:R] = d.half()
    return data, dd.view(NB, ROWS, S).transpose(1, 2).contiguous().view(torch.uint8).view(-1), NB


@pytest.mark.parametrize("kind", GRID_TYPES)
def test_engine_row_blocks_are_read_in_row_order(kind):
    """The engine's row-block layout read back into rows: 37 rows (three row blocks, the last padded) of three
    super-blocks, the padding cut."""
    book, rows, k = kind.lower(), 37, 768
    raw = _raw(kind, (rows, k), 5)
    data, d_bytes, NB = _row_blocks(raw, book)
    blocks, d = grid.engine_rows(data, d_bytes, book, NB, k, 1, rows)
    assert torch.equal(grid.dequantize(blocks, d, book).view(torch.int32), _gguf_values(raw, kind).view(torch.int32))


def test_decoder_refuses_what_it_cannot_read():
    blocks = torch.zeros(2, 1, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="iq2_xxs blocks must be uint8 .*64"):
        grid.decode(blocks[..., :60], torch.zeros(2, 1), "iq2_xxs")
    with pytest.raises(ValueError, match="take their d as fp32"):
        grid.decode(blocks, None, "iq2_xxs")
    with pytest.raises(ValueError, match="take no d"):
        grid.decode(torch.zeros(2, 1, 56, dtype=torch.uint8), torch.zeros(2, 1), "iq1_m")
    with pytest.raises(ValueError, match="not a grid type"):
        grid.tables("iq4nl", torch.device("cpu"))
    from hetmoe.moe.streamed.packed import MatrixShape

    with pytest.raises(ValueError, match="whole super-blocks of 256"):
        MatrixShape.make("grid", 32, 200, 32, codebook="iq2_xxs")


# ---------------------------------------------------------------- the engine's packed experts


@pytest.mark.parametrize("gate_up,down", MIXES, ids=["+".join(m) for m in MIXES])
@pytest.mark.parametrize("H,I", [(512, 256), (256, 768)])
def test_unpack_equals_the_engine(gate_up, down, H, I):
    """The streamed prefill's reader (packed.unpack_experts, the PyTorch path every grid layer takes) on experts 1..2
    of 3, as a slot holds them: bitwise ``CPUExperts.dequantized`` in fp32, that rounded once in bf16 written into
    the scratch; an expert's bytes (what a slot copies) are the file's."""
    ex, file_bytes = _engine(gate_up, down, H, I, seed=H + I)
    lay = ExpertLayout.of(ex)
    assert lay.grid and lay.expert_bytes == ex.info()["bytes_per_expert"]
    if "Q4_K" not in (gate_up, down):  # (Q4_K's k8 scales: 1.016x its file's bytes)
        assert lay.expert_bytes == file_bytes
    ranges, per = expert_ranges(ex), [b for b in lay.range_bytes() if b]
    assert [r.numel() for r in ranges] == [E * b for b in per]
    a, n = 1, 2
    part = [r[a * b:(a + n) * b] for r, b in zip(ranges, per)]
    gu, d = unpack_experts(lay, part, n, torch.float32)
    out = (torch.full((n, 2 * I, H), float("nan"), dtype=torch.bfloat16),
           torch.full((n, H, I), float("nan"), dtype=torch.bfloat16))
    unpack_experts(lay, part, n, torch.bfloat16, out)
    for i in range(n):
        g, u, dd = ex.dequantized(a + i)
        assert torch.equal(gu[i], torch.cat([g, u])) and torch.equal(d[i], dd), (gate_up, down, a + i)
        assert torch.equal(out[0][i], torch.cat([g, u]).bfloat16()) and torch.equal(out[1][i], dd.bfloat16())


class _Driver:
    """Stands in for LayerwisePrefill in ``setup``: reads every layer's packed layout as the real one does."""

    def __init__(self, layers, device, dtype, threshold, slots, unpack, group, rows):
        self.layouts = [ExpertLayout.of(layer.engine) for layer in layers]
        self.group, self.n_slots, self.slot_bytes, self.min_tokens = 8, slots, 1 << 20, threshold

    def enable_share(self, share, chunk):
        return None


@pytest.mark.parametrize("triton", [False, True])
def test_setup_streams_grid_layers(monkeypatch, triton):
    """A plan with the GPU prefill on and grid layers (an i-quant beside a K-quant too): the prefill is set up (the
    refusal by name that kept them on the CPU is gone), with or without Triton (whose kernel reads no grid: those
    layers take the PyTorch decoder)."""
    from hetmoe.ops.triton import packed as packed_triton

    monkeypatch.setattr(layerwise, "LayerwisePrefill", _Driver)
    monkeypatch.setattr(packed_triton, "available", lambda: triton)
    layers = [SimpleNamespace(engine=_engine(*m, 256, 256)[0], plain_swiglu=True)
              for m in (("IQ2_XXS", "IQ3_XXS"), ("IQ2_XS", "Q4_K"))]
    assert unreadable(layers) is None
    plan = SimpleNamespace(gpu_prefill=True, device="cpu", dtype=torch.float32, prefill_chunk=512)
    said = []
    driver, report = setup(layers, plan, SimpleNamespace(gpu_prefill=64, gpu_prefill_cpu_share="off"), said.append)
    assert isinstance(driver, _Driver) and report["enabled"], (report, said)
    assert [(lay.gate_up.fmt, lay.down.fmt) for lay in driver.layouts] == [("grid", "grid"), ("grid", "int4")]


# ---------------------------------------------------------------- a random i-quant GGUF file


def _gguf_file(tmp_path, mix: tuple, n_experts: int = 8) -> tuple:
    """A 2-layer qwen3moe file of random blocks (hetmoe/load/gguf/random_file.py; H = I = 256), experts of ``mix``
    (gate/up, down), the rest F32 -> (path, its expert tensors' bytes per layer)."""
    from hetmoe.load.random_weights import SHAPES
    from hetmoe.models.config import ModelConfig

    cfg = ModelConfig({**copy.deepcopy(SHAPES["qwen3-30b-a3b"]), "hidden_size": 256, "moe_intermediate_size": 256,
                       "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                       "num_experts": n_experts, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                       "vocab_size": 600, "bos_token_id": 597, "eos_token_id": 598})
    dense = dict.fromkeys(("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "output"), "F32")
    plan = [(name, shape, mix[1] if "_down_exps" in name else mix[0] if "_exps" in name else kind)
            for name, shape, kind in qwen3moe_plan(cfg, "IQ2_XXS", dense)]
    path = tmp_path / f"random-{'+'.join(mix)}.gguf"
    info = write_random_gguf(path, cfg, plan, "random", 7, seed=1)
    per_layer = [sum(info["tensor_bytes"][f"blk.{b}.ffn_{w}_exps.weight"] for w in ("gate", "up", "down"))
                 for b in range(cfg.num_hidden_layers)]
    return path, per_layer


def _load(path, **opts):
    from hetmoe.config.options import EngineOptions
    from hetmoe.load.loader import load_model

    return load_model(path, EngineOptions(**opts), expert_cache=None, progress=False, log=lambda m: None)


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("mix", [EXPERT_MIXES["UD-IQ2_XXS"], ("IQ1_M", "IQ3_S")], ids=["ud-iq2_xxs", "iq1_m+iq3_s"])
def test_the_path_on_cpu_tensors_matches_the_cpu_engine(tmp_path, mix):
    """The layerwise path's code on CPU tensors (no copies; the grid layers decoded by the PyTorch reader) inside the
    model, against the CPU engine's row blocks; each layer's streamed bytes are the file's expert bytes."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import moe_blocks

    path, file_bytes = _gguf_file(tmp_path, mix)
    loaded = _load(path, device="cpu", dtype="fp32", threads=1, isa=BEST_ROW_PATH.isa)
    runner = Runner(loaded)
    ids = torch.randint(0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = runner.score(ids)
    layers = [layer for _, layer in moe_blocks(loaded.model)]
    assert all(ExpertLayout.of(layer.engine).grid for layer in layers)
    lw = layerwise.LayerwisePrefill(layers, "cpu", torch.float32, min_tokens=1, unpack_batch=3)
    assert [lw.layer_bytes(i) for i in range(len(layers))] == file_bytes  # bytes over the link = the file's
    with lw.prefill():
        got = runner.score(ids)
    assert lw.layers_run == len(layers)
    per_token = (got - ref).abs().amax(-1) / ref.abs().max()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{'+'.join(mix)}: layerwise path on CPU tensors vs the CPU engine, max rel. logit error per token "
          f"{per_token.median():.2e} (median) .. {per_token.max():.2e}, argmax agrees {agree:.1%}")
    # The engine rounds its activations to int8 per group, the torch path keeps fp32: MEASURED 4.8e-3 at most per
    # token; across the model a near-tie of these random routers can flip (IQ1_M+IQ3_S: one token of 37 at 0.18)
    assert (per_token < 1e-2).float().mean() >= 0.95 and agree >= 0.95, per_token

    gen = torch.Generator().manual_seed(3)  # one layer, the same input and router logits: the format's own error
    x = torch.randn(300, loaded.config.hidden_size, generator=gen) * 0.5
    logits = torch.randn(300, layers[0].num_experts, generator=gen)
    one = layers[0](x, logits)
    with lw.prefill():
        streamed = lw.run(layers[0], x, logits)
    err = ((streamed - one).norm() / one.norm()).item()
    print(f"{'+'.join(mix)}: one layer, layerwise path vs CPU engine, rel. error {err:.2e}")
    assert err < 3e-2, err  # the engine's int8 activations: MEASURED 1.1e-2 (1.2e-2 for Q4_K on the same path)


# ---------------------------------------------------------------- GPU-resident experts

RESIDENT = [2, 0]


@pytest.mark.parametrize("gate_up,down", [("IQ2_XS", "IQ3_XXS"), ("IQ1_M", "IQ2_S"), ("IQ2_XXS", "Q4_K")],
                         ids=["iq2_xs+iq3_xxs", "iq1_m+iq2_s", "iq2_xxs+q4_k"])
def test_resident_copy_is_the_engines_values(gate_up, down):
    """storage auto: grid matrices as int8 in the type's group, their codes and scales decoded from the blocks
    (exact, no re-quantization): the resident values bitwise the engine's."""
    ex, _ = _engine(gate_up, down, 256, 512)
    st = rf.cpu_storage(ex)
    assert (st.gate_up, st.group) == ("int8", GRIDS[gate_up.lower()][0]) or gate_up == "Q4_K"
    own = rf.cpu_codes(ex, 1, st)
    assert all(part is not None for part in own)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", decode="dense")
    n, H, I = len(RESIDENT), 256, 512
    gu = rf.dequantize(g.w_gate_up, g.s_gate_up, st.gate_up, st.group, H, mins=g.m_gate_up).view(n, 2 * I, H)
    d = rf.dequantize(g.w_down, g.s_down, st.down, st.down_group, I, mins=g.m_down).view(n, H, I)
    for j, e in enumerate(RESIDENT):
        cg, cu, cd = ex.dequantized(e)
        assert torch.equal(gu[j], torch.cat([cg, cu])) and torch.equal(d[j], cd), (gate_up, down, e)


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("kind", GRID_TYPES)
def test_cuda_decoder_is_the_cpus(kind):
    """The decoder on the GPU: codes and scales bitwise the CPU's (and so gguf's), bf16 weights written in place."""
    book = kind.lower()
    raw = _raw(kind, (300, 1024), 11)
    blocks, d = grid.file_rows(torch.from_numpy(raw), book)
    codes, scales = grid.decode(blocks, d, book)
    gc, gs = grid.decode(blocks.cuda(), None if d is None else d.cuda(), book)
    assert torch.equal(gc.cpu(), codes) and torch.equal(gs.cpu(), scales)
    out = torch.empty(300, 1024, dtype=torch.bfloat16, device="cuda")
    grid.dequantize(blocks.cuda(), None if d is None else d.cuda(), book, out=out)
    assert torch.equal(out.cpu(), _gguf_values(raw, kind).bfloat16())


@gpu
@pytest.mark.parametrize("mix", [EXPERT_MIXES["UD-IQ2_XXS"], ("IQ1_M", "IQ3_S"), ("IQ2_XS", "Q4_K")],
                         ids=["ud-iq2_xxs", "iq1_m+iq3_s", "iq2_xs+q4_k"])
def test_gpu_prefill_of_grid_layers_matches_the_cpu_engine(tmp_path, mix):
    """A random i-quant GGUF file on the GPU machine: the streamed prefill takes its grid layers (copied as the file's
    bytes, decoded on the GPU) and its logits match the CPU engine's prefill; one layer with the same input and
    router logits within the format's own error. Bounds: test_layerwise.py's for int4 (int8 activations in the
    engine, bf16 h on the GPU)."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.loader import moe_blocks

    path, file_bytes = _gguf_file(tmp_path, mix)
    ids = list(range(5, 100))
    ref = Runner(_load(path, device="cuda", gpu_prefill="off")).score(ids)
    loaded = _load(path, device="cuda", gpu_prefill=1)
    lw = loaded.layerwise
    assert lw is not None and loaded.info["gpu_prefill"]["enabled"], loaded.info["gpu_prefill"]
    assert all(lay.grid for lay in lw.layouts)
    if "Q4_K" not in mix:
        assert [lw.layer_bytes(i) for i in range(len(lw.layers))] == file_bytes
    got = Runner(loaded).score(ids)
    assert lw.layers_run == len(moe_blocks(loaded.model))
    per_token = (got - ref).abs().amax(-1) / ref.abs().max()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{'+'.join(mix)}: GPU prefill vs CPU engine, max rel. logit error per token {per_token.median():.2e} "
          f"(median) .. {per_token.max():.2e}, argmax agrees {agree:.1%}")
    # test_layerwise.py's bound (8e-2) per token: a near-tie of these random routers flips a token now and then
    # (H100: IQ2_XS+Q4_K 0.28 on one token of 95; the whole model otherwise 7.7e-3..8.3e-3)
    assert (per_token < 8e-2).float().mean() >= 0.95 and agree >= 0.95, per_token

    layer = lw.layers[0]
    gen = torch.Generator().manual_seed(3)
    T, H = 300, loaded.config.hidden_size
    x = (torch.randn(T, H, generator=gen) * 0.5).to("cuda", torch.bfloat16)
    logits = torch.randn(T, layer.num_experts, generator=gen).to("cuda")
    one = layer(x, logits).float()
    with lw.prefill():
        streamed = lw.run(layer, x, logits).float()
    err = ((streamed - one).norm() / one.norm()).item()
    print(f"{'+'.join(mix)}: one layer, GPU path vs CPU engine, rel. error {err:.2e}")
    assert err < 4e-2, err


@gpu
def test_cuda_resident_grid_experts():
    """Resident grid experts on the GPU: the engine's codes and scales decoded there, bitwise its values."""
    ex, _ = _engine("IQ2_XXS", "IQ1_M", 256, 512)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cuda", "auto", decode="dense")
    st, n, H, I = g.storage, len(RESIDENT), 256, 512
    gu = rf.dequantize(g.w_gate_up.cpu(), g.s_gate_up.cpu(), st.gate_up, st.group, H).view(n, 2 * I, H)
    d = rf.dequantize(g.w_down.cpu(), g.s_down.cpu(), st.down, st.down_group, I).view(n, H, I)
    for j, e in enumerate(RESIDENT):
        cg, cu, cd = ex.dequantized(e)
        assert torch.equal(gu[j], torch.cat([cg, cu])) and torch.equal(d[j], cd), e
