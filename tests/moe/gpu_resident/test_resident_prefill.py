"""The resident experts' prefill (``GpuExperts._grouped``: the routed resident experts unpacked into the shared weight
scratch, then the grouped GEMMs of hetmoe/moe/grouped.py), its place in the layerwise prefill of partly resident
layers, the layerwise threshold's CPU measurement, and --gpu-experts above the expert count.

References: the naive float64 layer (tests/reference.py) over the values the CPU engine multiplies by
(``CPUExperts.dequantized``), restricted to the resident experts: resident experts of the engine's own format hold
those values exactly (same codes), so the torch path's bound is summation order only. Across paths (the CPU engine
rounds its activations: int8 to int16, int4 / lut4 to int8 per group) the formats' bounds of tests/moe/streamed.
Paths: CPU tensors through the torch ops (CI); Triton's interpreter on CPU tensors (slow tier: the unpack kernel, the
sync-free grouped GEMM branch); the GPU (marked gpu): bf16 activations and weights, bound BF16 below.

Measured (AVX2 dev machine, fp32): grouped vs float64 <= 3.0e-7 for every layout below; partly resident layerwise vs
all streamed <= 2.5e-7.
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import checked_accesses, gpu_branch_on_cpu, triton_module

from cases import generator, make_routing
from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.moe.gpu_resident import format as rf
from hetmoe.moe.gpu_resident.experts import GpuExperts
from paths import BEST_ROW_PATH
from reference import moe_reference, rel_err

HAS_CUDA = torch.cuda.is_available()
E, H, I = 10, 96, 40  # E not a power of two; I not a multiple of the groups
RESIDENT = [9, 1, 4, 5, 7]
FP32 = 1e-5  # summation order only (measured <= 3.0e-7)
BF16 = 2e-2  # GPU: x, h and the weights' products in bf16 (the resident decode kernels' bound is 1.5e-2)
ACROSS = {"bf16": 1e-4, "int8": 1e-3, "int4": 3e-2, "lut4": 3e-2}  # against the engine: its activation rounding
# the resident path's layouts of a CPU engine: its own codes kept (int8/int4 of any group the GPU takes, per-row,
# fp16 scales as GGUF's Q4_0 / Q8_0 blocks, lut4 with e8m0 scales as MXFP4, IQ4_NL's codebook), or bf16 values
ENGINES = {
    "bf16": dict(weight_format="bf16"),
    "int8-g64": dict(weight_format="int8", group_size=64),
    "int8-row": dict(weight_format="int8", group_size=0),
    "int4-g32": dict(weight_format="int4", group_size=32),
    "q4_0": dict(weight_format="int4", group_size=32, scale_dtype="fp16"),
    "q8_0": dict(weight_format="int8", group_size=32, scale_dtype="fp16"),
    "mxfp4": dict(weight_format="lut4", group_size=32, scale_dtype="e8m0", codebook="e2m1"),
    "iq4_nl": dict(weight_format="lut4", group_size=32, scale_dtype="fp16", codebook="iq4nl"),
}


def _engine(name: str) -> CPUExperts:
    """Forced to the row-block path, whose activation rounding ACROSS bounds (an AMX machine's auto path would put
    the 300-token calls on the tile GEMM: bf16 / int8-per-group activations, another bound)."""
    ex = CPUExperts(E, H, I, threads=1, **ENGINES[name], **BEST_ROW_PATH.options)
    ex.fill_random(seed=len(name))
    return ex


def _reference(ex: CPUExperts, x, ids, wts, resident=RESIDENT):
    """float64 layer over the engine's own values, only the resident experts."""
    gate, up, down = torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I)
    for e in range(E):
        gate[e], up[e], down[e] = ex.dequantized(e)
    skip = torch.ones(E, dtype=torch.bool)
    skip[resident] = False
    return moe_reference(x.float(), gate, up, down, ids, wts, skip_mask=skip)


def _kind(name: str) -> str:
    return ENGINES[name]["weight_format"]


# ------------------------------------------------------------------------------------------ CPU tensors (CI)


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("T", [1, 3, 8, 300])
def test_grouped_prefill_holds_the_engines_values(name, T):
    """The grouped path at batch sizes 1, 3, 8 and a 300-token prefill (forced: dense_max_tokens=0) against the
    engine's own values (tight: the same codes) and against the engine itself (its activation rounding)."""
    ex = _engine(name)
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", dense_max_tokens=0, decode="dense")
    assert g.storage.name == {"bf16": "bf16"}.get(name, _kind(name))  # the engine's own format: its codes
    x = torch.randn(T, H, generator=generator("resident prefill x", name, T))
    ids, wts = make_routing(T, 4, E, "resident prefill", name, T)
    got = g(x, ids, wts)
    ref = _reference(ex, x, ids, wts)
    assert got.dtype == torch.float32 and rel_err(got, ref) < FP32, rel_err(got, ref)
    skip = torch.ones(E, dtype=torch.bool)
    skip[RESIDENT] = False
    engine = ex.forward(x, ids, wts, torch.empty(T, H), skip_mask=skip)
    assert rel_err(got, engine) < ACROSS[_kind(name)], rel_err(got, engine)


def test_grouped_prefill_skips_and_empty_routing():
    """A skip mask, ids of -1 and a chunk that routes to no resident expert: zeros, no error."""
    ex = _engine("int4-g32")
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto", dense_max_tokens=0, decode="dense")
    x = torch.randn(40, H, generator=generator("skips"))
    ids, wts = make_routing(40, 3, E, "skips")
    skip = torch.zeros(E, dtype=torch.bool)
    skip[[1, 5]] = True
    got = g(x, ids, wts, skip_mask=skip)
    assert rel_err(got, _reference(ex, x, ids, wts, [e for e in RESIDENT if not skip[e]])) < FP32
    none = torch.tensor([[0, 2, -1]] * 40)
    assert torch.equal(g(x, none, wts), torch.zeros(40, H))


def test_used_marks_only_the_routed_resident_experts():
    ex = _engine("int8-g64")
    g = GpuExperts.from_cpu(ex, RESIDENT, torch.float32, "cpu", "auto")
    ids = torch.tensor([[9, 0], [4, -1], [3, 9]])
    slots = g.slots(ids)
    assert slots.tolist() == [[0, -1], [2, -1], [-1, 0]]
    assert g.used(slots).tolist() == [True, False, True, False, False]


def test_unpack_into_refuses_a_wrong_buffer():
    g = GpuExperts.from_cpu(_engine("int4-g32"), RESIDENT, torch.float32, "cpu", "auto")
    with pytest.raises(ValueError, match="contiguous"):
        g.unpack_into(torch.empty(len(RESIDENT), 2 * I, H + 1), torch.empty(len(RESIDENT), H, I))


def _tiny_hybrid(checkpoints, fmt: str, n_resident: int):
    """A 2-MoE-layer qwen3_moe model on CPU tensors with the hybrid dispatch (HostStaging) and ``n_resident`` of
    each layer's experts resident (the first ones, in the engine's own codes)."""
    from hetmoe.load.calibration import place_gpu_experts
    from hetmoe.load.loader import load_model, moe_blocks
    from hetmoe.moe import HostStaging

    loaded = load_model(checkpoints("qwen3_moe"), EngineOptions(device="cpu", experts_format=fmt, dtype="fp32"),
                        expert_cache=None, log=lambda m: None)
    blocks = moe_blocks(loaded.model)
    for _, block in blocks:
        block.attach(block.experts, HostStaging(loaded.config.hidden_size, block.router.top_k, torch.float32))
    if n_resident:
        place_gpu_experts(loaded.model, blocks, n_resident, torch.float32, "cpu", None, "", lambda m: None, "auto")
    return loaded, [block for _, block in blocks]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_layerwise_streams_only_the_non_resident_experts(checkpoints, fmt, monkeypatch):
    """A partly resident layer on the layerwise path: the copies leave the resident experts out, which are read from
    their storage into the scratch after the streamed ones; the logits equal those of every expert streamed (the
    same values), with and without a CPU share, with routed-only copies too."""
    from hetmoe.engine.runner import Runner
    from hetmoe.moe.streamed import layerwise
    from hetmoe.moe.streamed.layerwise import LayerwisePrefill

    loaded, layers = _tiny_hybrid(checkpoints, fmt, 0)
    runner = Runner(loaded)
    ids = torch.randint(0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    runner.layerwise = lw = LayerwisePrefill(layers, "cpu", torch.float32, min_tokens=1, unpack_batch=3)
    ref = runner.score(ids)  # every expert streamed (read in place on a CPU device)
    assert lw.layers_run == len(layers)
    resident = [1, 2, 5]
    from hetmoe.load.calibration import place_gpu_experts
    from hetmoe.load.loader import moe_blocks

    blocks = moe_blocks(loaded.model)
    monkeypatch.setattr("hetmoe.load.calibration.first_experts", lambda n_experts, n: resident)
    place_gpu_experts(loaded.model, blocks, len(resident), torch.float32, "cpu", None, "", lambda m: None, "auto")
    copied = []
    real = layerwise.copy_experts

    def spy(dst, src, per, experts=None, n=0):
        copied.append(list(experts) if experts is not None else list(range(n)))
        return real(dst, src, per, experts, n)

    monkeypatch.setattr(layerwise, "copy_experts", spy)
    E = lw.layouts[0].num_experts
    for share, routed in (("off", "off"), (2, "off"), ("off", "on")):
        lw.enable_share(share, chunk=64)
        lw.routed_copy = routed
        copied.clear()
        got = runner.score(ids)
        assert copied and all(not set(c) & set(resident) for c in copied), copied
        if share == 2:  # the CPU's ~2 * S / E of the S streamed experts were not copied
            c = (2 * (E - len(resident)) + E // 2) // E
            assert all(len(c_) == E - len(resident) - c for c_ in copied), copied
        assert rel_err(got, ref) < ACROSS[fmt] if share == 2 else rel_err(got, ref) < FP32, (share, routed)
    lw.close()


def test_a_fully_resident_layer_runs_no_cpu_job(checkpoints, monkeypatch):
    """Every expert of a layer resident: its forward call neither stages to the host nor calls the CPU engine."""
    from hetmoe.engine.runner import Runner

    loaded, layers = _tiny_hybrid(checkpoints, "int8", 0)
    ids = list(range(3, 43))
    ref = Runner(loaded).score(ids)
    loaded, layers = _tiny_hybrid(checkpoints, "int8", layers[0].num_experts)
    for layer in layers:
        monkeypatch.setattr(layer.engine, "forward", lambda *a, **k: pytest.fail("the CPU engine was called"))
        monkeypatch.setattr(layer.staging, "buffers", lambda *a, **k: pytest.fail("staged to the host"))
    got = Runner(loaded).score(ids)
    assert rel_err(got, ref) < ACROSS["int8"]  # the engine's int16 activations (measured 3e-6)


# ------------------------------------------------------------------ the threshold's CPU measurement

class _Recording:
    """A CPU engine stand-in that records the skip mask of each call and computes through the real engine."""

    def __init__(self, engine):
        self.engine, self.num_experts, self.masks, self.outs = engine, engine.num_experts, [], []

    def forward(self, x, ids, w, out=None, *, skip_mask=None):
        self.masks.append(skip_mask)
        self.outs.append(self.engine.forward(x, ids, w, skip_mask=skip_mask))
        return self.outs[-1]


def test_the_cpu_measurement_computes_every_expert():
    """A layer with resident experts (the engine's static skip mask set) is timed on all of its experts: the call
    passes an all-False mask, and its output is the whole layer's."""
    from hetmoe.moe.streamed.layerwise import cpu_layer_seconds

    ex = _engine("int8-g64")
    skip = torch.zeros(E, dtype=torch.bool)
    skip[RESIDENT] = True
    ex.set_skip_mask(skip)  # as set_gpu_experts leaves it
    x = torch.randn(16, H, generator=generator("measure"))
    ids = torch.stack([torch.randperm(E, generator=generator("measure ids", t))[:4] for t in range(16)])
    w = torch.rand(16, 4, generator=generator("measure w"))
    rec = _Recording(ex)
    assert cpu_layer_seconds(rec, x, ids, w, repeats=3) > 0
    assert len(rec.masks) == 3 and all(m is not None and m.shape == (E,) and not m.any() for m in rec.masks)
    ex.set_skip_mask(None)
    whole = ex.forward(x, ids, w)
    assert torch.equal(rec.outs[0], whole)  # every expert, not E - N of them
    ex.set_skip_mask(skip)
    assert not torch.equal(ex.forward(x, ids, w), whole)  # (the static mask would have left the resident out)
    assert torch.equal(ex.skip_mask, skip)  # the engine's own mask is untouched


def test_the_measured_rates_arithmetic():
    from hetmoe.moe.streamed.choice import cpu_tokens_per_second, describe_rates

    rates = {"copy_s": 0.0065, "copy_gbps": 52.3, "gpu_s": {256: 0.001, 1024: 0.002},
             "cpu_s": {256: 0.004, 1024: 0.0125}}
    assert cpu_tokens_per_second(rates) == pytest.approx(1024 / 0.0125)  # the larger count over its seconds
    assert cpu_tokens_per_second({**rates, "cpu_s": {1024: 0.0125, 256: 0.004}}) == pytest.approx(81920)
    text = describe_rates(rates, 324 * 2**20)
    assert text == "H2D 52.3 GB/s (324 MiB per layer in 6.5 ms), CPU experts 81920 tok/s per layer"


# ---------------------------------------------------------------------------------- --gpu-experts > E


def test_gpu_experts_above_the_expert_count_is_refused_before_any_weight(checkpoints, monkeypatch):
    from hetmoe.load.loader import load_model

    monkeypatch.setattr("hetmoe.load.loader.fill_experts", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=r"--gpu-experts 9: the MoE layers have 8 routed experts each; at most 8"):
        load_model(checkpoints("qwen3_moe"), EngineOptions(device="cpu", gpu_experts=9), expert_cache=None,
                   log=lambda m: None)


def test_sweep_counts():
    from hetmoe.bench.gpu_experts_sweep import parse_sweep, resolve

    assert parse_sweep("0,16,all") == [0, 16, "all"]
    assert resolve(parse_sweep("112,0,all,16"), 128) == [0, 16, 112, 128]
    for bad, why in (("0,-1", "integers >= 0"), ("4,x", "integers >= 0"), ("4,4", "twice"), ("", "integers")):
        with pytest.raises(ValueError, match=why):
            parse_sweep(bad)
    with pytest.raises(ValueError, match="129: the MoE layers have 128 routed experts each"):
        resolve([0, 129], 128)


# ---------------------------------------------------------------- Triton's interpreter (slow tier on a CPU)

UNPACK = {"int8-64": ("int8", 64, None), "int4-32": ("int4", 32, None), "int4-128": ("int4", 128, None),
          "lut4-32": ("lut4", 32, "iq4nl")}


@pytest.mark.parametrize("name", UNPACK)
def test_unpack_rows_writes_the_routed_experts_values(name):
    """The prefill's unpack kernel: the rows of the experts marked used hold exactly format.dequantize's values, the
    others are not written (NaN kept); every access inside its arguments."""
    kernels = triton_module("hetmoe.ops.triton.experts", on_cpu=True)
    fmt, group, book = UNPACK[name]
    n, rows, k = 5, 24, 72  # k not a multiple of the group: padding columns never stored
    gen = generator("unpack rows", name)
    kp = rf.padded(k, group)
    if fmt == "lut4":
        codes = rf.pack_int4(torch.randint(0, 16, (n * rows, kp), generator=gen), group, 0)
        scales = torch.rand(n * rows, kp // group, generator=gen) + 0.1
    else:
        codes, scales = rf.quantize(torch.randn(n * rows, k, generator=gen), fmt, group)
    lut = torch.tensor(rf.CODEBOOKS[book], dtype=torch.float32) if book else None
    out = torch.full((n * rows, k), float("nan"))
    used = torch.tensor([True, False, True, True, False])
    with checked_accesses():
        kernels.unpack_rows(codes, scales, fmt, group, out, used, rows, lut)
    want = rf.dequantize(codes, scales, fmt, group, k, codebook=book).view(n, rows, k)
    got = out.view(n, rows, k)
    assert torch.equal(got[used], want[used])
    assert torch.isnan(got[~used]).all()


@pytest.mark.parametrize("name", ["bf16", "int4-g32", "mxfp4"])
def test_the_sync_free_branch_equals_the_loop(name, monkeypatch):
    """The grouped GEMM branch (emulated torch._grouped_mm, the combine kernel under the interpreter) against the
    loop over experts, on the same scratch."""
    g = GpuExperts.from_cpu(_engine(name), RESIDENT, torch.float32, "cpu", "auto", dense_max_tokens=0,
                            decode="dense")
    x = torch.randn(33, H, generator=generator("branch", name))
    ids, wts = make_routing(33, 4, E, "branch", name)
    ref = g(x, ids, wts)
    gpu_branch_on_cpu(monkeypatch, None)
    with checked_accesses():
        got = g(x, ids, wts)
    assert torch.isfinite(got).all() and rel_err(got, ref) < FP32


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("T", [1, 3, 8, 300])
def test_cuda_resident_experts_hold_the_engines_values(name, T):
    """On the GPU, bf16 activations: decode sizes (1, 3, 8: the routed kernels) and a prefill (300: the unpack
    kernel and the grouped GEMMs) against the engine's values and against the engine; half the experts resident
    and all of them."""
    ex = _engine(name)
    for resident in (RESIDENT, list(range(E))):
        g = GpuExperts.from_cpu(ex, resident, torch.bfloat16, "cuda", "auto")
        x = torch.randn(T, H, generator=generator("cuda resident", name, T)).bfloat16()
        ids, wts = make_routing(T, 4, E, "cuda resident", name, T)
        got = g(x.cuda(), ids.cuda(), wts.cuda()).cpu()
        assert torch.isfinite(got).all()
        ref = _reference(ex, x, ids, wts, resident)
        if not ref.any():  # no slot routed to a resident expert (T = 1 may draw that): exact zeros
            assert not got.any(), resident
            continue
        assert rel_err(got, ref) < BF16, (resident, rel_err(got, ref))
        skip = torch.ones(E, dtype=torch.bool)
        skip[resident] = False
        engine = ex.forward(x, ids, wts, torch.empty(T, H), skip_mask=skip)
        assert rel_err(got, engine) < BF16 + ACROSS[_kind(name)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_cuda_model_prefill_with_resident_experts_matches_the_cpu_experts(fmt):
    """A 2-layer qwen3-shaped model with random weights on the GPU: prefill logits (300 tokens) and the next decode
    step with every expert resident, with half of them (the CPU computing the rest at the same time), and half of
    them with the layerwise prefill (the rest streamed), against every expert on the CPU engine."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load.random_weights import build_random_model

    def logits(**opts):
        options = EngineOptions(device="cuda", dtype="bf16", experts_format=fmt, max_context=512, **opts)
        loaded = build_random_model("qwen3-30b-a3b", 2, options, seed=3, log=lambda m: None)
        runner = Runner(loaded)
        prompt = torch.randint(0, loaded.config.vocab_size, (300,), generator=generator("cuda model")).tolist()
        out = torch.stack([runner.prefill(prompt).float().cpu(), runner.decode(17).float().cpu()])
        del runner, loaded
        torch.cuda.empty_cache()
        return out

    ref = logits(gpu_experts=0, gpu_prefill="off")
    for opts in (dict(gpu_experts=128, gpu_prefill="off"), dict(gpu_experts=64, gpu_prefill="off"),
                 dict(gpu_experts=64, gpu_prefill=1)):
        got = logits(**opts)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        print(f"{fmt} {opts}: max rel. logit error {err:.2e}")
        assert torch.isfinite(got).all() and err < 5e-2, (opts, err)  # bf16 paths vs the engine's rounding
