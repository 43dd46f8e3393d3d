"""GPU-resident experts stored in int8/int4 (``GpuExperts(storage=...)``, hetmoe/moe/gpu_resident/format.py, the routed
kernels of hetmoe/ops/triton/experts.py, routed_int), their place in the memory plan (--gpu-experts-format, the rules'
``gpu_experts_format``).

References: the naive float64 layer (tests/reference.py ``moe_reference``) over the *dequantized* weights (scale * q,
exact in fp32), the non-resident and skipped experts masked out: the kernels' correctness, tight. The fp32 values a
CPU engine multiplies by (``CPUExperts.dequantized``): resident experts of its own format hold them bitwise.
Paths: Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, tests/conftest.py; skipped without triton) with the
interpreter's wide tiles and with the GPU's (``plan(T, on_gpu=True)``: GEMV, deferred GEMV, dots); the torch paths
(dense: all N experts dequantized per call; grouped: the prefill's grouped GEMMs); the GPU (marked gpu): bf16
activations, eager and captured in a CUDA graph.

Measured, ||out - ref|| / ||ref||, fp32 activations, interpreter: routed, dense and grouped vs float64 <= 3.1e-7 for
int8 and int4, groups 32-128 (bound 1e-5: summation order only). GPU bound: BF16_X below.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton_interp import triton_module

from cases import generator, make_routing
from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.moe.gpu_resident import format as rf
from hetmoe.moe.gpu_resident.experts import GpuExperts
from hetmoe.plan.memory import ModelShapes
from hetmoe.plan.placement import plan_memory
from reference import moe_reference, rel_err

HAS_CUDA = torch.cuda.is_available()
E, H, I = 10, 48, 40  # E not a power of two; H, I not multiples of the groups or the kernels' blocks
RESIDENT = [9, 1, 4, 5]  # any order: resident index = position
FP32_BOUND = 1e-5  # summation order only (measured <= 3.1e-7)
BF16_X = 1.5e-2  # GPU: x (and, in the dots, h and the weights) rounded to bf16
STORAGES = {"int4-32": rf.Storage.of("int4", 32), "int4-128": rf.Storage.of("int4", 128),
            "int8-64": rf.Storage.of("int8", 64), "int4/int8": rf.Storage("int4", "int8", 32, 128)}


@pytest.fixture(scope="module")
def kernels():
    return triton_module("hetmoe.ops.triton.experts", on_cpu=True)


def _weights(*params):
    gen = generator("int experts", *params)
    return tuple(torch.randn(*shape, generator=gen) * 0.3 for shape in ((E, I, H), (E, I, H), (E, H, I)))


def _experts(w, storage, resident=RESIDENT, decode="routed", device="cpu", dtype=torch.float32):
    gate, up, down = w
    return GpuExperts(resident, gate[resident], up[resident], down[resident], E, dtype, device, decode=decode,
                      storage=storage)


def _dequantized(g: GpuExperts) -> tuple:
    """[E, I, H] x 2, [E, H, I] fp32: the stored values of the resident experts, zeros elsewhere."""
    st, n = g.storage, g.n
    gu = rf.dequantize(g.w_gate_up.cpu(), g.s_gate_up.cpu(), st.gate_up, st.group, H,
                       codebook=st.gate_up_codebook).view(n, 2, I, H)
    d = rf.dequantize(g.w_down.cpu(), g.s_down.cpu(), st.down, st.down_group, I,
                      codebook=st.down_codebook).view(n, H, I)
    out = (torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    out[0][g.expert_ids], out[1][g.expert_ids], out[2][g.expert_ids] = gu[:, 0], gu[:, 1], d
    return out


def _reference(g, x, ids, wts, skip=None):
    mask = torch.ones(E, dtype=torch.bool)
    mask[g.expert_ids] = False
    if skip is not None:
        mask |= skip.cpu()
    return moe_reference(x.cpu().float(), *_dequantized(g), ids.cpu(), wts.cpu(), skip_mask=mask)


def _case(T, k, *params):
    x = torch.randn(T, H, generator=generator("int x", T, k, *params))
    ids, wts = make_routing(T, k, E, "int", *params)  # some slots -1
    if not any(e in RESIDENT for e in ids[0].tolist()):
        ids[0, 0] = RESIDENT[-1]  # token 0 routes to a resident expert: the output is never all zero
    return x, ids, wts


CASES = [("int4-32", 1, 8), ("int4-32", 7, 2), ("int4-128", 3, 1), ("int4-128", 1, 2), ("int8-64", 3, 8),
         ("int8-64", 1, 1), ("int4/int8", 5, 2), ("int4/int8", 1, 8)]


@pytest.mark.parametrize("name,T,k", CASES)
def test_routed_dense_and_grouped_match_the_dequantized_reference(kernels, name, T, k):
    w = _weights(name, T, k)
    x, ids, wts = _case(T, k, name)
    g = _experts(w, STORAGES[name])
    ref = _reference(g, x, ids, wts)
    assert ref.abs().max() > 0
    out = g(x, ids, wts)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert rel_err(out, ref) < FP32_BOUND, rel_err(out, ref)
    dense = _experts(w, STORAGES[name], decode="dense")
    assert rel_err(dense(x, ids, wts), ref) < FP32_BOUND
    assert rel_err(dense._grouped(x, ids, wts, None), ref) < FP32_BOUND  # the prefill path (grouped GEMMs)


TILE_CASES = [("int4-32", 1, 8, True), ("int4-32", 1, 8, False), ("int4-32", 2, 2, False), ("int4-32", 5, 3, False),
              ("int8-64", 1, 4, True), ("int8-64", 3, 3, False)]


@pytest.mark.parametrize("name,T,k,defer", TILE_CASES)
def test_gpu_tiles_in_the_interpreter(kernels, name, T, k, defer):
    """The GPU's tiles (narrow row blocks, K steps of several groups): GEMV at T <= 4 (also with the reduction
    deferred after the K loop), dots above."""
    w = _weights("tiles", name, T, k)
    x, ids, wts = _case(T, k, "tiles", name)
    g = _experts(w, STORAGES[name])
    launch = dataclasses.replace(triton_module("hetmoe.ops.triton.experts").plan(T, on_gpu=True), defer=defer)
    out = kernels.routed_int(x, ids, wts, (g.w_gate_up, g.s_gate_up), (g.w_down, g.s_down), g.storage, g.slot_of, None,
                         E, I, launch=launch)
    assert rel_err(out, _reference(g, x, ids, wts)) < FP32_BOUND


def test_no_hit_all_hits_and_skip_mask(kernels):
    st = STORAGES["int4-32"]
    w = _weights("hits")
    g = _experts(w, st)
    x = torch.randn(3, H, generator=generator("hits x"))
    none = torch.tensor([[0, 2], [3, -1], [-1, -1]])  # none resident, and empty slots
    assert torch.equal(g(x, none, torch.rand(3, 2) + 0.1), torch.zeros(3, H))
    everything = _experts(w, st, resident=list(range(E))[::-1])
    x = x[:2]
    ids = torch.stack([torch.randperm(E, generator=generator("hits ids", t))[:4] for t in range(2)])
    wts = torch.rand(2, 4, generator=generator("hits w")) + 0.05
    assert rel_err(everything(x, ids, wts), _reference(everything, x, ids, wts)) < FP32_BOUND
    skip = torch.zeros(E, dtype=torch.bool)
    skip[[int(ids[0, 0]), 7]] = True
    out = everything(x, ids, wts, skip_mask=skip)
    assert rel_err(out, _reference(everything, x, ids, wts, skip)) < FP32_BOUND
    cut = ids.masked_fill(skip[ids], -1)
    assert torch.equal(out, everything(x, cut, wts))  # a skipped expert is an empty slot: the same bits


def test_prefill_unpacks_experts_in_chunks():
    """T > dense_max_tokens takes the grouped path: on CPU tensors int4 experts dequantized TORCH_UNPACK_EXPERTS at a
    time (20 resident: two chunks) into the scratch, then the grouped GEMMs over the tokens sorted by expert."""
    from hetmoe.moe.gpu_resident.experts import TORCH_UNPACK_EXPERTS

    e, resident = 37, list(range(36, 16, -1))
    assert len(resident) > TORCH_UNPACK_EXPERTS
    gen = generator("gather chunks")
    gate, up, down = (torch.randn(e, *shape, generator=gen) * 0.3 for shape in ((I, H), (I, H), (H, I)))
    g = GpuExperts(resident, gate[resident], up[resident], down[resident], e, torch.float32, storage="int4",
                   decode="dense")
    x = torch.randn(40, H, generator=gen)
    ids, wts = make_routing(40, 4, e, "gather chunks")
    st, n = g.storage, g.n
    gu = rf.dequantize(g.w_gate_up, g.s_gate_up, "int4", st.group, H).view(n, 2, I, H)
    dq = (torch.zeros(e, I, H), torch.zeros(e, I, H), torch.zeros(e, H, I))
    dq[0][resident], dq[1][resident] = gu[:, 0], gu[:, 1]
    dq[2][resident] = rf.dequantize(g.w_down, g.s_down, "int4", st.down_group, I).view(n, H, I)
    mask = torch.ones(e, dtype=torch.bool)
    mask[resident] = False
    ref = moe_reference(x, *dq, ids, wts, skip_mask=mask)
    assert rel_err(g(x, ids, wts), ref) < FP32_BOUND


def test_storage_bytes_and_layout():
    w = _weights("bytes")
    bf16 = _experts(w, None, decode="dense", dtype=torch.bfloat16)
    assert bf16.storage == rf.Storage() and not bf16.storage.quantized and bf16.nbytes == 4 * 3 * H * I * 2
    for name, st in STORAGES.items():
        g = _experts(w, st, decode="dense")
        assert g.nbytes == 4 * rf.expert_bytes(st, H, I), name
    # int4 codes: byte i of a group holds weights i (low nibble) and group/2 + i (high), stored as q + 8
    q = torch.arange(-8, 8).repeat(8).view(2, 64).to(torch.int8)
    packed = rf.pack_int4(q, 32)
    assert packed.shape == (2, 32) and int(packed[0, 0]) == (q[0, 0] + 8) | ((q[0, 16] + 8) << 4)
    assert torch.equal(rf.unpack_int4(packed, 32), q)


@pytest.mark.parametrize("fmt,group,down_group", [("int4", 32, None), ("int4", 128, None), ("int8", 0, None),
                                                  ("int4", 0, None), (("int4", "int8"), 64, 128)])
def test_from_cpu_keeps_the_engines_values(fmt, group, down_group):
    """storage auto: the CPU engine's codes and scales, read from its packed bytes -- the same fp32 values bitwise,
    so the resident part equals a float copy of those values (bf16 storage in fp32) up to summation order."""
    ex = CPUExperts(E, H, I, fmt, group, threads=1, down_group_size=down_group)
    ex.fill_random(seed=3, std=0.3)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", decode="dense")
    assert g.storage == rf.cpu_storage(ex) and g.storage.quantized
    gate, up, down = _dequantized(g)
    for e in RESIDENT:
        cg, cu, cd = ex.dequantized(e)
        assert torch.equal(gate[e], cg) and torch.equal(up[e], cu) and torch.equal(down[e], cd), e
    full = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "bf16", decode="dense")  # fp32 values copied
    assert g.nbytes == len(RESIDENT) * rf.expert_bytes(g.storage, H, I)
    x, ids, wts = _case(5, 4, "cpu", str(fmt))
    assert rel_err(g(x, ids, wts), full(x, ids, wts)) < FP32_BOUND


def test_from_cpu_in_another_format():
    """int4 resident copies of int8 CPU experts: quantized from the engine's values in the default group (the
    error of a fresh int4 quantization, measured 0.10 of the weights' norm)."""
    ex = CPUExperts(E, H, I, "int8", 128, threads=1)
    ex.fill_random(seed=4, std=0.3)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "int4", decode="dense")
    assert g.storage == rf.Storage.of("int4", rf.DEFAULT_GROUP)
    assert rf.storage_for(ex, "int8") == rf.Storage.of("int8", 128)  # its own format: its group (its codes)
    gate = _dequantized(g)[0]
    cg = torch.stack([ex.dequantized(e)[0] for e in RESIDENT])
    assert 0.02 < rel_err(gate[RESIDENT], cg) < 0.15


# CPU engines holding a checkpoint's own 4-bit codebook or narrow scales (csrc/formats/layout.h): MXFP4-like lut4 e2m1
# with e8m0 scales beside int8 fp16 down, IQ4_NL-like lut4 iq4nl with fp16 scales, Q4_0-like int4 with fp16 scales
LUT_ENGINES = {"lut4-e2m1/int8": dict(weight_format=("lut4", "int8"), group_size=32, scale_dtype=("e8m0", "fp16"),
                                      codebook=("e2m1", None)),
               "lut4-iq4nl": dict(weight_format="lut4", group_size=32, scale_dtype="fp16", codebook="iq4nl"),
               "int4-fp16": dict(weight_format="int4", group_size=64, scale_dtype="fp16")}


@pytest.mark.parametrize("name", LUT_ENGINES)
def test_from_cpu_keeps_codebooks_and_widens_scales(kernels, name):
    """storage auto of such an engine: lut4 codes kept with their codebook (int4's bytes), scales widened to fp32 --
    the engine's values bitwise; the routed kernels (interpreter tiles and the GPU's: GEMV, deferred GEMV, dots), the
    dense and the grouped paths against the float64 reference on them."""
    ex = CPUExperts(E, H, I, threads=1, **LUT_ENGINES[name])
    ex.fill_random(seed=5, std=0.3)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto")
    fmts = LUT_ENGINES[name]["weight_format"]
    assert (g.storage.gate_up, g.storage.down) == (fmts if isinstance(fmts, tuple) else (fmts, fmts))
    assert g.nbytes == len(RESIDENT) * rf.expert_bytes(g.storage, H, I)
    gate, up, down = _dequantized(g)
    for e in RESIDENT:
        cg, cu, cd = ex.dequantized(e)
        assert torch.equal(gate[e], cg) and torch.equal(up[e], cu) and torch.equal(down[e], cd), e
    for T, k in ((1, 8), (3, 2), (7, 4)):
        x, ids, wts = _case(T, k, "lut", name)
        ref = _reference(g, x, ids, wts)
        assert rel_err(g(x, ids, wts), ref) < FP32_BOUND
        assert rel_err(g._dense(x, ids, wts), ref) < FP32_BOUND
        assert rel_err(g._grouped(x, ids, wts, None), ref) < FP32_BOUND
        for defer in (True, False):
            launch = dataclasses.replace(kernels.plan(T, on_gpu=True), defer=defer)
            out = kernels.routed_int(x, ids, wts, (g.w_gate_up, g.s_gate_up), (g.w_down, g.s_down), g.storage,
                                     g.slot_of, None, E, I, launch=launch, luts=g.luts)
            assert rel_err(out, ref) < FP32_BOUND
    if g.luts is not None:
        with pytest.raises(ValueError, match="needs its codebook"):
            kernels.routed_int(x, ids, wts, (g.w_gate_up, g.s_gate_up), (g.w_down, g.s_down), g.storage, g.slot_of,
                               None, E, I)


def test_lut4_storage_is_only_copied():
    """lut4 resident storage holds a CPU engine's codes: it has int4's bytes, needs a codebook, is never quantized
    here; a NUMA-split lut4 engine (no codes to copy) gets int4, quantized from its values."""
    assert rf.expert_bytes(rf.Storage("lut4", "lut4", 32, 32, "e2m1", "e2m1"), H, I) == rf.expert_bytes(
        rf.Storage.of("int4", 32), H, I)
    with pytest.raises(ValueError, match="lut4 needs one of e2m1, iq4nl"):
        rf.Storage("lut4", "lut4", 32, 32)
    with pytest.raises(ValueError, match="other formats none"):
        rf.Storage("int4", "int4", 32, 32, "e2m1", None)
    with pytest.raises(ValueError, match="lut4 keeps a CPU engine's codes"):
        rf.quantize(torch.randn(4, 64), "lut4", 32)
    from hetmoe.cpu import WorkerPool

    split = CPUExperts(E, H, I, "lut4", 32, pool=WorkerPool(2, numa=2), codebook="iq4nl")
    assert rf.cpu_storage(split) == rf.Storage.of("int4", 32)


def test_model_with_int4_resident_experts():
    """A whole model on CPU tensors (2 MoE layers, int4 engine, the hybrid dispatch): 3 resident experts per layer in
    their own int4 codes give bitwise the logits of resident fp32 copies of the same values (the same torch paths),
    and stay within the CPU engine's int8 activation rounding of the all-CPU logits."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.calibration import place_gpu_experts
    from hetmoe.load.loader import moe_blocks
    from hetmoe.load.random_weights import TINY, build_random_model
    from hetmoe.moe import HostStaging

    cfg = dict(model_type="qwen3_moe", vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
               max_position_embeddings=256, **{**TINY["qwen3_moe"], "num_hidden_layers": 2})
    loaded = build_random_model(cfg, options=EngineOptions(device="cpu", dtype="fp32", max_context=64,
                                                           experts_format="int4"), log=lambda m: None)
    blocks = moe_blocks(loaded.model)
    for _, block in blocks:
        block.attach(block.experts, HostStaging(cfg["hidden_size"], block.router.top_k, torch.float32))
    prompt = list(range(5, 45))  # 40 tokens: the grouped path in prefill, the dense path in decode

    def logits():
        runner = Runner(loaded)
        return torch.stack([runner.prefill(prompt), runner.decode(17), runner.decode(250)])

    ref = logits()
    out = {}
    for storage in ("auto", "bf16"):
        report = place_gpu_experts(loaded.model, blocks, 3, torch.float32, "cpu", None, "", lambda m: None, storage)
        assert {layer["format"] for layer in report["layers"]} == {"int4" if storage == "auto" else "bf16"}
        out[storage] = logits()
        for _, block in blocks:
            block.set_gpu_experts(None)
    assert torch.equal(out["auto"], out["bf16"])  # the same weight values
    assert rel_err(out["auto"], ref) < 3e-2  # the CPU's int8 activations (measured 6.1e-4 on AVX2)


def test_bad_storage():
    with pytest.raises(ValueError, match="storage must be one of"):
        rf.Storage.of("int2")
    with pytest.raises(ValueError, match="scale group must be one of"):
        rf.Storage.of("int4", 48)
    with pytest.raises(ValueError, match="bf16 or int8/int4 throughout"):
        rf.Storage("bf16", "int4")
    ex = CPUExperts(E, H, I, "int4", 64, threads=1)
    with pytest.raises(ValueError, match="GPU experts format must be auto or one of"):
        GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "fp8")
    with pytest.raises(ValueError, match="gpu-experts-format"):
        EngineOptions(gpu_experts_format="int2")


# ---------------------------------------------------------------- the memory plan, the option, the rules

QWEN = ModelShapes(hidden=2048, vocab_size=1000, n_routed=48 * 128, expert_inter=768, dense_params=10**6,
                   kv_elems_per_token=1000, act_width=8 * 2048, max_position_embeddings=4096, n_moe_layers=48)


def test_plan_counts_resident_experts_at_their_stored_bytes(monkeypatch):
    from hetmoe.plan import placement

    cuda = torch.device("cuda")
    bf16_each, int4_each = 3 * 2048 * 768 * 2, 3 * 2048 * 768 * 9 // 16  # int4: nibbles + an fp32 scale per 64
    plan = plan_memory(QWEN, EngineOptions(gpu_experts=4, dtype="bf16", gpu_experts_format="int8"), cuda, "int4")
    assert plan.vram["GPU experts"] == 4 * 48 * 3 * 2048 * 768 * (1 + 4 / 64)  # int8 of int4 experts: group 64
    base = plan_memory(QWEN, EngineOptions(dtype="bf16"), cuda, "int4").vram_bytes
    monkeypatch.setattr(placement, "resolve_device", lambda d: cuda)
    monkeypatch.setattr(placement, "free_vram", lambda d: int((base + 12 * 2**30) / placement.HEADROOM))
    monkeypatch.setattr(placement, "free_ram", lambda: 1 << 40)
    opts = dict(gpu_experts="auto", dtype="bf16", experts_format="int4", gpu_prefill="off")
    auto = placement.choose_plan(QWEN, EngineOptions(**opts))
    bf16 = placement.choose_plan(QWEN, EngineOptions(**opts, gpu_experts_format="bf16"))
    n, n_bf16 = auto.layers[0].gpu_experts, bf16.layers[0].gpu_experts
    # without the layerwise prefill's buffers each resident expert also widens the prefill's bf16 weight scratch
    scratch, act = placement.resident_prefill_bytes(QWEN, 1, auto.prefill_chunk, 2)
    assert auto.vram["resident prefill"] == n * scratch + act
    assert bf16.vram["resident prefill"] == n_bf16 * scratch + act
    left = (12 * 2**30 + base - auto.vram_bytes + auto.vram["GPU experts"] + auto.vram["resident prefill"]
            - placement.RESIDENT_MARGIN - act)
    assert n == min(128, left // (48 * int4_each + scratch)) and n_bf16 == left // (48 * bf16_each + scratch)
    assert n >= 3.3 * n_bf16 > 0  # int4: ~3.4x as many experts in the same VRAM (the bf16 scratch is the same)
    table = "\n".join(auto.table())
    assert f"GPU experts ({n} per layer, int4)" in table, table
    assert f"GPU experts ({n_bf16} per layer, bf16)" in "\n".join(bf16.table())


def test_rules_set_the_resident_format(tmp_path):
    from hetmoe.config import rules

    path = tmp_path / "r.yaml"
    path.write_text("- match: 'model\\.layers\\.0\\.mlp\\.experts'\n  gpu_experts: 2\n  gpu_experts_format: bf16\n")
    r = rules.load(path)
    p = r.for_module("model.layers.0.mlp.experts")
    assert p.gpu_experts == 2 and p.gpu_experts_format == "bf16"
    plan = plan_memory(QWEN, EngineOptions(gpu_experts=3, dtype="bf16"), torch.device("cuda"), "int4",
                       layers=[p] + [None] * 47)
    assert (plan.layers[0].gpu_format, plan.layers[0].vram) == ("bf16", 2 * 3 * 2048 * 768 * 2)
    assert (plan.layers[1].gpu_format, plan.layers[1].vram) == ("int4", 3 * 3 * 2048 * 768 * 9 // 16)
    path.write_text("- match: x\n  gpu_experts_format: int2\n")
    with pytest.raises(rules.RulesError, match=r"r.yaml:2: .*gpu_experts_format: expected auto, bf16"):
        rules.load(path)


def test_cli_flag():
    from hetmoe.cli import build_parser
    from hetmoe.config.flags import engine_options

    opts = engine_options(build_parser().parse_args(["generate", "--gpu-experts-format", "int8"]))
    assert opts.gpu_experts_format == "int8"
    assert engine_options(build_parser().parse_args(["generate"])).gpu_experts_format == "auto"


# ---------------------------------------------------------------- compiled for a GPU, without one

_COMPILE = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hetmoe.ops.triton import experts as k

ptrs = dict(X="*bf16", SGU="*fp32", SD="*fp32", LUT="*fp32", IDS="*i64", WTS="*fp32", SLOT_OF="*i64", SKIP="*u8",
            HS="*fp32", P="*fp32")
n = 0
# (format, GEMV, DEFER, rows, BI / BH, BK gate/up, BK down, IEEE): decode at T = 1 and 4, dots at 16 rows (bf16 and
# fp32 x); int8 differs from int4 only in its loads, lut4 (2) in its codebook lookup
forms = [(1, True, True, 1, 8, 512, 256, False), (1, True, False, 4, 8, 512, 256, False),
         (1, False, False, 16, 32, 64, 64, False), (1, False, False, 16, 32, 128, 128, True),
         (0, False, False, 16, 32, 64, 64, False), (2, True, True, 1, 8, 512, 256, False),
         (2, False, False, 16, 32, 64, 64, False)]
for fmt, gemv, defer, rows, b, bk_gu, bk_d, ieee in forms:
    codes = "*u8" if fmt else "*i8"
    common = dict(K=8, KP=8, ROWS=rows, HAS_SKIP=True, N_EXPERTS=128, GEMV=gemv, DEFER=defer,
                  DOT_T=tl.float32 if ieee else tl.bfloat16, IEEE=ieee, FMT=fmt, GROUP=64)
    for fn, c in ((k._gate_up_int, dict(common, BI=b, BK=bk_gu)), (k._down_int, dict(common, BH=b, BK=bk_d))):
        types = dict(ptrs, WGU=codes, WD=codes, X="*fp32" if ieee else "*bf16")
        sig = {a: "constexpr" if a in c else types.get(a, "i32") for a in fn.arg_names}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c), target=GPUTarget("cuda", 90, 32))
        n += 1
print("compiled", n)
"""


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the tests below compile the kernels")
def test_kernels_compile_for_a_gpu(kernels):
    """Triton's interpreter runs code that compiled Triton refuses (a loop-carried variable that changes type, ...):
    compile the int kernels for sm_90 -- int4 GEMV, deferred GEMV, bf16 dots, IEEE fp32 dots; int8 dots -- in a
    process without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "compiled 14" in out.stdout, out.stderr[-3000:]


# ---------------------------------------------------------------- GPU (bf16 activations, eager and graph)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["int4-32", "int8-64", "int4/int8"])
@pytest.mark.parametrize("T,k", [(1, 8), (3, 2), (7, 8), (32, 8)])
def test_cuda_routed_int(name, T, k):
    pytest.importorskip("triton")
    w = _weights("cuda", name, T, k)
    x, ids, wts = (t.cuda() for t in _case(T, k, "cuda", name))
    g = _experts(w, STORAGES[name], decode="auto", device="cuda", dtype=torch.bfloat16)
    assert g.decode == "routed" and g.eager_routed  # int8/int4 eager calls take the kernels too
    xb = x.bfloat16()
    out = g(xb, ids, wts)
    ref = _reference(g, xb.float(), ids, wts)
    print(f"{name} T={T} k={k}: routed vs float64 {rel_err(out.cpu(), ref):.2e}")
    assert rel_err(out.cpu(), ref) < BF16_X
    if T > 1:
        assert rel_err(g._grouped(xb, ids, wts, None).cpu(), ref) < BF16_X
    g32 = _experts(w, STORAGES[name], decode="auto", device="cuda")  # fp32 x: fp32 GEMV products, IEEE dots
    assert rel_err(g32(x, ids, wts).cpu(), _reference(g32, x, ids, wts)) < FP32_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("name", LUT_ENGINES)
@pytest.mark.parametrize("T,k", [(1, 8), (3, 2), (32, 8)])
def test_cuda_routed_codebooks_and_narrow_scales(name, T, k):
    """The GPU's kernels on lut4 / widened-scale resident copies of a CPU engine, bf16 and fp32 activations."""
    pytest.importorskip("triton")
    ex = CPUExperts(E, H, I, threads=1, **LUT_ENGINES[name])
    ex.fill_random(seed=6, std=0.3)
    x, ids, wts = (t.cuda() for t in _case(T, k, "cuda lut", name))
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.bfloat16, "cuda", "auto")
    assert g.decode == "routed" and g.eager_routed
    xb = x.bfloat16()
    ref = _reference(g, xb.float(), ids, wts)
    print(f"{name} T={T} k={k}: routed vs float64 {rel_err(g(xb, ids, wts).cpu(), ref):.2e}")
    assert rel_err(g(xb, ids, wts).cpu(), ref) < BF16_X
    g32 = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cuda", "auto")
    assert rel_err(g32(x, ids, wts).cpu(), _reference(g32, x, ids, wts)) < FP32_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 8])
def test_cuda_graph_replay_equals_eager_int(T):
    pytest.importorskip("triton")
    g = _experts(_weights("graph", T), STORAGES["int4-128"], decode="auto", device="cuda", dtype=torch.bfloat16)
    x, ids, wts = _case(T, 8, "graph", 0)
    x, ids, wts = x.cuda().bfloat16(), ids.cuda(), wts.cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g(x, ids, wts)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = g(x, ids, wts)
    for seed in range(1, 4):
        nx, nids, nwts = _case(T, 8, "graph", seed)
        x.copy_(nx.bfloat16())
        ids.copy_(nids)
        wts.copy_(nwts)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, g(x, ids, wts)), seed  # eager takes the same kernels: the same bits
