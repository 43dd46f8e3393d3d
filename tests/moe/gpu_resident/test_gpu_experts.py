"""GPU-resident experts (--gpu-experts N; hetmoe/moe/gpu_resident/experts.py, MoELayer.set_gpu_experts,
hetmoe/load/calibration.py).

CPU (CI): the combine matrix against a naive loop; GpuExperts (dense and grouped paths) on CPU tensors against
TorchExperts over odd shapes; the CPU engine's static skip mask plus the resident part equals the all-CPU result
(also through the hybrid MoELayer run on CPU tensors and Expert Deferral, where resident experts are never
deferred); calibration picks
the most routed experts on a crafted router; option validation, the memory plan, the CLI flag.
GPU (marked, skipped without CUDA): hybrid placement with --gpu-experts N against the all-CPU placement (qwen3_moe and
deepseek_v3 tiny checkpoints; decode as a CUDA graph, the same step eager, and the plain synchronous path; decode steps
take the routed Triton path); deferral + resident experts against a CPU emulation of the same dispatch; every expert
resident makes deferral a no-op; the dense and routed decode paths captured into a CUDA graph on their own. The routed
kernels alone: tests/moe/gpu_resident/test_gpu_experts_routed.py.

Tolerances (relative errors ||out - ref|| / ||ref||, or max |diff| / max |ref| for logits) are written beside each
assert with what was measured.
"""

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.cpu import CPUExperts
from hetmoe.load.calibration import (
    DEFAULT_TEXT,
    check_gpu_experts,
    choose_experts,
    count_routing,
    coverage,
    place_gpu_experts,
)
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.moe import DeferralChain, HostStaging, MoELayer, RouterSpec, TorchExperts, split_deferred
from hetmoe.moe.gpu_resident.experts import GpuExperts, combine_matrix
from hetmoe.plan.memory import ModelShapes
from hetmoe.plan.placement import plan_memory
from reference import rel_err

E, H, I = 10, 48, 40  # E not a power of two; H, I not multiples of the kernels' blocks


def _weights(gen, n=E, h=H, i=I):
    gate = torch.randn(n, i, h, generator=gen) * 0.3
    up = torch.randn(n, i, h, generator=gen) * 0.3
    down = torch.randn(n, h, i, generator=gen) * 0.3
    return gate, up, down


def _routing(gen, T, k, e=E, holes=True):
    """Distinct ids per token, some slots -1; positive weights."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(T)])
    if holes and T > 2:
        ids[1, 0] = -1
        ids[T - 1, k - 1] = -1
    return ids, torch.rand(T, k, generator=gen) + 0.05


def _resident_mask(ids_resident, e=E):
    mask = torch.zeros(e, dtype=torch.bool)
    mask[ids_resident] = True
    return mask


def _hybrid_layer(engine, k, ids=None, weights=None):
    """A MoE layer in the hybrid placement's configuration (the CPU engine behind a GPU model: staging attached),
    run here on CPU tensors, where the staging buffers are not used. With ``ids``/``weights`` its route stage
    returns that fixed routing (ids may hold -1) whatever the logits, so that a test picks the (token, slot) pairs."""
    layer = MoELayer(RouterSpec("softmax", k), engine.num_experts)
    layer.attach(engine, HostStaging(engine.hidden_size, k, torch.float32))
    if ids is not None:
        _fix_route(layer, ids, weights)
    return layer


def _fix_route(layer, ids, weights):
    layer.route = lambda logits, correction_bias=None: (weights, ids)


# ---------------------------------------------------------------- the combine matrix and GpuExperts on CPU tensors

@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (7, 6), (300, 8)])
def test_combine_matrix_matches_naive_loop(T, k):
    gen = torch.Generator().manual_seed(T * 10 + k)
    ids, w = _routing(gen, T, k)
    resident = [9, 0, 4]  # any order: resident index r = position in this list
    slot_of = torch.full((E + 1,), -1, dtype=torch.int64)
    slot_of[torch.tensor(resident)] = torch.arange(len(resident))
    c = combine_matrix(ids, w, slot_of, len(resident))
    ref = torch.zeros(T, len(resident))
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if e in resident:
                ref[t, resident.index(e)] += float(w[t, j])
    assert c.shape == (T, len(resident)) and c.dtype == torch.float32
    assert torch.equal(c, ref)


@pytest.mark.parametrize("T", [1, 2, 3, 7, 64, 300])
@pytest.mark.parametrize("k", [1, 2, 6, 8])
@pytest.mark.parametrize("path", ["dense", "grouped"])
def test_gpu_experts_match_torch_experts(T, k, path):
    gen = torch.Generator().manual_seed(1000 * T + 10 * k + (path == "dense"))
    gate, up, down = _weights(gen)
    x = torch.randn(T, H, generator=gen)
    ids, w = _routing(gen, T, k)
    resident = [1, 4, 5, 8] if k < 8 else list(range(E))  # with k = 8, all ten resident
    if resident[0] not in ids[0].tolist():
        ids[0, 0] = resident[0]  # at least one resident expert has a token
    gpu = GpuExperts(resident, gate[resident], up[resident], down[resident], E, torch.float32, "cpu",
                     dense_max_tokens=10**6 if path == "dense" else 0)
    out = gpu(x, ids, w)
    ref = TorchExperts(gate, up, down).forward(x, ids, w, torch.empty(T, H), skip_mask=~_resident_mask(resident))
    assert out.dtype == torch.float32 and out.shape == (T, H)
    # fp32, summation order only: measured <= 2.7e-7
    assert rel_err(out, ref) < 1e-5, rel_err(out, ref)


def test_gpu_experts_bf16_and_no_routed_token():
    gen = torch.Generator().manual_seed(7)
    gate, up, down = _weights(gen)
    x = torch.randn(5, H, generator=gen)
    ids, w = _routing(gen, 5, 2)
    resident = [0, 3, 6]
    ids[0, 0], ids[2, 1] = 3, 6  # resident experts with tokens (row 0 and 2 hold no -1)
    gpu = GpuExperts(resident, gate[resident], up[resident], down[resident], E, torch.bfloat16, "cpu")
    ref = TorchExperts(gate, up, down).forward(x, ids, w, torch.empty(5, H), skip_mask=~_resident_mask(resident))
    assert rel_err(gpu(x.bfloat16(), ids, w), ref) < 2e-2  # bf16 weights and activations: measured 8.5e-3
    none = torch.full_like(ids, 2)  # every slot on a non-resident expert: the resident part is exactly 0
    none[:, 1] = 7
    assert torch.equal(gpu(x, none, w), torch.zeros(5, H))


def test_gpu_experts_bad_input():
    gen = torch.Generator().manual_seed(8)
    gate, up, down = _weights(gen, 2)
    with pytest.raises(ValueError, match="distinct"):
        GpuExperts([1, 1], gate, up, down, E, torch.float32)
    with pytest.raises(ValueError, match=r"in \[0, 10\)"):
        GpuExperts([0, 10], gate, up, down, E, torch.float32)
    with pytest.raises(ValueError, match="at least one"):
        GpuExperts([], gate[:0], up[:0], down[:0], E, torch.float32)
    with pytest.raises(ValueError, match="gate/up"):
        GpuExperts([0, 1], gate, up, down.transpose(1, 2), E, torch.float32)
    gpu = GpuExperts([0, 1], gate, up, down, E, torch.float32)
    with pytest.raises(ValueError, match="x must be"):
        gpu(torch.zeros(3, H + 1), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="topk_ids"):
        gpu(torch.zeros(3, H), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2))


# ---------------------------------------------------------------- CPU engine with its skip mask + the resident part

def _engine(fmt, seed, e=E):
    gate, up, down = _weights(torch.Generator().manual_seed(seed), e)
    ex = CPUExperts(e, H, I, fmt, group_size=32, threads=2)
    ex.load(gate, up, down)
    return ex


# The GPU side computes in fp32 here on the engine's own (dequantized) weights; it does not round activations as the
# CPU engine does with int8/int4 weights (int16 / int8 activations) or bf16 activations (AMX). Bounds by activation.
# Measured (T = 7 and 300, 3 of 10 experts resident): fp32 1.7e-7 and int16 2.3e-5 on AVX2; with isa="amx-emulated"
# and amx_min_tokens=1: bf16 1.6e-3, int8 7.2e-3 (int4's int8 activations: 6.9e-3 on AVX2 as well).
SPLIT_TOL = {"fp32": 1e-5, "bf16": 5e-3, "int16": 1e-3, "int8": 3e-2}


def _split_tol(ex) -> float:
    """The bound for an engine: its row-block activation precision, or AMX's (bf16 / int8) when it has AMX, which
    experts with >= amx_min_tokens tokens use."""
    info = ex.info()
    acts = [info["activation"]]
    if info.get("amx", "off") != "off" and info.get("amx_activation"):
        acts.append(info["amx_activation"])
    return max(SPLIT_TOL[a] for a in acts)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_skip_mask_plus_resident_equals_all_cpu(fmt, T):
    ex = _engine(fmt, 21)
    gen = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=gen)
    ids, w = _routing(gen, T, 4)
    if 2 not in ids[0].tolist():
        ids[0, 0] = 2  # a resident expert has a token
    all_cpu = ex.forward(x, ids, w).clone()
    off = _hybrid_layer(ex, 4, ids, w)
    resident = [2, 3, 7]
    off.set_gpu_experts(GpuExperts.from_cpu(ex, resident, torch.float32, "cpu"))
    assert torch.equal(ex.skip_mask, _resident_mask(resident))
    cpu_part = ex.forward(x, ids, w).clone()  # the static mask applies to every later call
    both = off(x, torch.zeros(T, E))
    tol = _split_tol(ex)
    assert rel_err(both, all_cpu) < tol, (fmt, rel_err(both, all_cpu))
    assert rel_err(cpu_part, all_cpu) > 0.05  # the resident experts carry a real share: the test can fail
    explicit = ex.forward(x, ids, w, skip_mask=torch.zeros(E, dtype=torch.bool))  # an explicit mask wins
    assert torch.equal(explicit, all_cpu)
    job = ex.prepare(x, ids, w)  # jobs prepared after set_skip_mask carry it
    ex.pool.submit(job)
    ex.pool.sync(0)
    assert torch.equal(job.out, cpu_part)
    off.set_gpu_experts(None)  # detaching clears the mask
    assert ex.skip_mask is None and off.gpu is None and torch.equal(ex.forward(x, ids, w), all_cpu)


def test_set_skip_mask_bad_input():
    ex = _engine("bf16", 3)
    with pytest.raises(ValueError, match="num_experts=10"):
        ex.set_skip_mask(torch.zeros(E + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="dtype"):
        ex.set_skip_mask(torch.zeros(E, dtype=torch.float32))
    # GPU experts need the CPU engine behind a GPU model: not the engine without staging, nor another backend
    alone = MoELayer(RouterSpec("softmax", 2), E)
    alone.attach(ex)
    with pytest.raises(TypeError, match="hybrid placement"):
        alone.set_gpu_experts(None)
    torch_layer = MoELayer(RouterSpec("softmax", 2), E)
    torch_layer.attach(TorchExperts(*_weights(torch.Generator().manual_seed(3))), HostStaging(H, 2, torch.float32))
    with pytest.raises(TypeError, match="hybrid placement"):
        torch_layer.set_gpu_experts(None)
    assert ex.skip_mask is None and alone.gpu is None and torch_layer.gpu is None


def test_deferral_never_defers_resident_experts():
    """Three MoE layers (first, middle, last), d = 1, resident experts on each: layer l returns
    G_l(x_l; every slot) + CPU_l(x_l; immediate, masked) + CPU_{l-1}(x_{l-1}; deferred, masked)."""
    chain, layers, engines = DeferralChain(3), [], []
    gen = torch.Generator().manual_seed(5)
    T, k = 6, 4
    xs = [torch.randn(T, H, generator=gen) for _ in range(3)]
    routes = [_routing(gen, T, k, holes=False) for _ in range(3)]
    for i in range(3):
        ex = _engine("bf16", 40 + i)
        off = _hybrid_layer(ex, k, *routes[i])
        off.set_gpu_experts(GpuExperts.from_cpu(ex, [i, 5, 9], torch.float32, "cpu"))
        off.set_deferral(1, chain, i)
        engines.append(ex)
        layers.append(off)
    outs = [layer(x, torch.zeros(T, E)) for layer, x in zip(layers, xs)]
    prev = None
    for i in range(3):
        ids, w = routes[i]
        imm, dfr = split_deferred(ids, w, 1) if i < 2 else (ids, None)
        want = engines[i].forward(xs[i], imm, w).float() + layers[i].gpu(xs[i], ids, w)
        if prev is not None:
            want = want + prev
        prev = engines[i].forward(xs[i], dfr, w).clone() if dfr is not None else None
        assert rel_err(outs[i], want) < 1e-6, (i, rel_err(outs[i], want))  # measured 0 (same engine calls)
    # and resident slots among the deferred ones count at layer l: the deferred CPU job skips them
    ids, w = routes[0]
    _, dfr = split_deferred(ids, w, 1)
    assert torch.equal(engines[0].forward(xs[0], dfr, w), engines[0].forward(
        xs[0], dfr.masked_fill(torch.isin(dfr, torch.tensor([0, 5, 9])), -1), w, skip_mask=torch.zeros(E).bool()))


# ---------------------------------------------------------------- calibration

def _tiny_qwen3(n_layers=2):
    from hetmoe.load.random_weights import TINY, build_random_model

    cfg = dict(model_type="qwen3_moe", vocab_size=300, rms_norm_eps=1e-6, rope_theta=10000.0,
               max_position_embeddings=256, **{**TINY["qwen3_moe"], "num_hidden_layers": n_layers})
    loaded = build_random_model(cfg, options=EngineOptions(device="cpu", dtype="fp32", max_context=64),
                                log=lambda m: None)
    for _, block in moe_blocks(loaded.model):  # the hybrid dispatch stage, run on CPU tensors
        block.attach(block.experts, HostStaging(cfg["hidden_size"], block.router.top_k, torch.float32))
    return loaded


class _CraftedRouter(torch.nn.Module):
    """Logits [T, 8] in which expert 5 always wins, expert 2 comes second on rows r % 3 in {0, 1}, expert 7 on the
    others: over 30 tokens, 5 is chosen 30 times, 2 20 times, 7 10 times (top-2)."""

    def forward(self, flat):
        logits = torch.zeros(flat.shape[0], 8)
        logits[:, 5] = 10.0
        rows = torch.arange(flat.shape[0]) % 3
        logits[rows < 2, 2] = 5.0
        logits[rows == 2, 7] = 5.0
        return logits


def test_calibration_picks_the_most_routed_experts():
    loaded = _tiny_qwen3()
    blocks = moe_blocks(loaded.model)
    engines = [b.experts for _, b in blocks]
    loaded.model.get_submodule(blocks[0][0]).gate = _CraftedRouter()
    tokens = list(range(3, 33))  # 30 tokens, one chunk
    counts = count_routing(loaded.model, blocks, tokens, "cpu", torch.float32)
    assert counts[0].tolist() == [0, 0, 20, 0, 0, 30, 0, 10]
    assert int(counts[1].sum()) == 60  # the other layer: its own router, 30 tokens x top-2
    # the counters are gone, the layers as they were
    assert all(b.route_observer is None and b.experts is e and b.staging is not None
               for (_, b), e in zip(blocks, engines))
    logs = []
    report = place_gpu_experts(loaded.model, blocks, 2, torch.float32, "cpu", tokens, "crafted", logs.append)
    assert report["layers"][0]["experts"] == [2, 5]
    assert report["layers"][0]["coverage"] == pytest.approx(50 / 60)
    assert report["layers"][1]["experts"] == choose_experts(counts[1], 2)
    assert blocks[0][1].gpu.expert_ids == [2, 5]
    assert torch.equal(blocks[0][1].engine.skip_mask, _resident_mask([2, 5], 8))
    assert report["chosen_by"] == "calibration" and report["calibration_tokens"] == 30
    assert len(logs) == 2 and "cover" in logs[0] and "L0 83%: 2,5;" in logs[1], logs


def test_choose_experts_ties_and_coverage():
    assert choose_experts(torch.tensor([3, 5, 5, 1]), 2) == [1, 2]
    assert choose_experts(torch.tensor([2, 2, 2]), 2) == [0, 1]  # ties: the lower id
    assert choose_experts(torch.tensor([0, 9, 1, 4]), 4) == [0, 1, 2, 3]
    assert coverage(torch.tensor([1, 3, 0, 4]), [1, 3]) == pytest.approx(7 / 8)
    assert coverage(torch.zeros(4, dtype=torch.int64), [0]) == 0.0


def test_resident_experts_keep_the_model_output():
    """A whole model (2 MoE layers, every expert routed somewhere): logits with 3 experts per layer resident equal
    the all-CPU logits (bf16 engine weights; the resident copy holds the same values, computed in fp32)."""
    from hetmoe.engine.runner import Runner

    loaded = _tiny_qwen3()
    prompt = list(range(5, 45))  # 40 tokens: the grouped path in prefill, the dense path in decode
    runner = Runner(loaded)
    ref = torch.stack([runner.prefill(prompt), runner.decode(17), runner.decode(250)])
    report = place_gpu_experts(loaded.model, moe_blocks(loaded.model), 3, torch.float32, "cpu",
                               [ord(c) % 300 for c in DEFAULT_TEXT[:200]], "built-in text", lambda m: None)
    assert 0 < report["mean_coverage"] < 1
    runner = Runner(loaded)
    out = torch.stack([runner.prefill(prompt), runner.decode(17), runner.decode(250)])
    tol = _split_tol(moe_blocks(loaded.model)[0][1].engine)
    assert rel_err(out, ref) < tol, rel_err(out, ref)  # measured 3e-7 on AVX2 (fp32 activations)
    report = place_gpu_experts(loaded.model, moe_blocks(loaded.model), 2, torch.float32, "cpu", None, "", print)
    assert report["chosen_by"] == "first" and report["layers"][0]["experts"] == [0, 1]


# ---------------------------------------------------------------- options, memory plan, CLI

def test_option_validation():
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="gpu-experts"):
            EngineOptions(gpu_experts=bad)
    assert EngineOptions(gpu_experts=3).gpu_experts == 3
    check_gpu_experts([8, 8], 8)
    check_gpu_experts([], 0)
    with pytest.raises(ValueError, match="at most 8"):
        check_gpu_experts([8, 8], 9)
    with pytest.raises(ValueError, match="no routed experts"):
        check_gpu_experts([], 1)


def test_load_refuses_too_many_and_ignores_on_cpu(tmp_path):
    from hetmoe.engine.llm import default_model_path

    logs = []
    with pytest.raises(ValueError, match="at most 16"):
        load_model(default_model_path(), EngineOptions(device="cpu", gpu_experts=17), expert_cache=None,
                   progress=False, log=logs.append)
    assert not any("loaded in" in m for m in logs)  # refused before loading
    with pytest.raises(ValueError, match="calibration-file"):
        load_model(default_model_path(), EngineOptions(device="cpu", gpu_experts=2,
                                                       calibration_file=str(tmp_path / "missing.txt")),
                   expert_cache=None, progress=False, log=logs.append)
    logs.clear()
    loaded = load_model(default_model_path(), EngineOptions(device="cpu", gpu_experts=4), expert_cache=None,
                        progress=False, log=logs.append)
    assert any("--gpu-experts 4 ignored" in m and "CPU-only" in m for m in logs), logs
    assert loaded.info["gpu_experts"] == {}
    assert all(isinstance(b.experts, CPUExperts) and b.gpu is None and b.experts.skip_mask is None
               for _, b in moe_blocks(loaded.model))


def test_memory_plan_counts_and_refuses(monkeypatch):
    from hetmoe.plan import placement

    shapes = ModelShapes(hidden=2048, vocab_size=1000, n_routed=48 * 128, expert_inter=768, dense_params=10**6,
                         kv_elems_per_token=1000, act_width=8 * 2048, max_position_embeddings=4096, n_moe_layers=48)
    cuda = torch.device("cuda")
    plan = plan_memory(shapes, EngineOptions(gpu_experts=8, dtype="bf16", gpu_experts_format="bf16"), cuda, "int4")
    assert plan.vram["GPU experts"] == 8 * 48 * 3 * 2048 * 768 * 2
    # auto: the experts' own int4 codes (a byte per 2 weights) and fp32 scales (one per 64)
    plan = plan_memory(shapes, EngineOptions(gpu_experts=8, dtype="bf16"), cuda, "int4")
    assert plan.vram["GPU experts"] == 8 * 48 * 3 * 2048 * 768 * (1 / 2 + 4 / 64)
    assert {(lp.gpu_format, lp.gpu_expert_bytes) for lp in plan.layers} == {("int4", 3 * 2048 * 768 * 9 // 16)}
    assert "GPU experts" not in plan_memory(shapes, EngineOptions(gpu_experts=8), torch.device("cpu"), "int4").ram
    base = plan_memory(shapes, EngineOptions(dtype="bf16"), cuda, "int4").vram_bytes
    monkeypatch.setattr(placement, "resolve_device", lambda d: cuda)
    monkeypatch.setattr(placement, "free_vram", lambda d: int((base + 2**30) / placement.HEADROOM))
    monkeypatch.setattr(placement, "free_ram", lambda: 1 << 40)
    assert placement.choose_plan(shapes, EngineOptions(gpu_experts=1, dtype="bf16", experts_format="int4"))
    with pytest.raises(MemoryError, match="fewer --gpu-experts"):
        placement.choose_plan(shapes, EngineOptions(gpu_experts=8, dtype="bf16", experts_format="int4",
                                                    gpu_experts_format="bf16"))


def test_cli_flag():
    from hetmoe.cli import build_parser
    from hetmoe.config.flags import engine_options

    for argv in (["generate"], ["chat"], ["serve"], ["eval", "--text", "t"], ["bench", "e2e"], ["bench", "serve"]):
        args = build_parser().parse_args(argv + ["--gpu-experts", "3", "--calibration-file", "c.txt"])
        assert args.gpu_experts == 3 and args.calibration_file == "c.txt", argv
    opts = engine_options(build_parser().parse_args(["generate", "--gpu-experts", "5"]))
    assert opts.gpu_experts == 5 and opts.calibration_file is None
    with pytest.raises(ValueError, match="gpu-experts"):
        engine_options(build_parser().parse_args(["generate", "--gpu-experts", "-1"]))


# ---------------------------------------------------------------- on the GPU

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    from hetmoe.load.random_weights import write_checkpoint

    root = tmp_path_factory.mktemp("gpuexp")
    return {a: write_checkpoint(root / a, a, seed=11 + i, dtype="float32")
            for i, a in enumerate(("qwen3_moe", "deepseek_v3"))}


PROMPT = list(range(3, 43))  # 40 tokens: the grouped path in prefill; decode steps take the dense path


def _logits(path, logs=None, mode="graph", **opts):
    """Logits of a 40-token prefill and 4 decode steps. On a GPU, ``mode``: "graph" (decode steps replay a CUDA
    graph), "eager" (the same stream-ordered step, not captured) or "sync" (the MoE layers' plain eager path: staged
    copies, stream synchronize, CPU forward)."""
    from hetmoe.engine.runner import Runner

    options = EngineOptions(**{"dtype": "fp32", "experts_format": "bf16", "max_context": 64, **opts})
    loaded = load_model(path, options, expert_cache=None, progress=False,
                        log=(logs.append if logs is not None else lambda m: None))
    runner = Runner(loaded, cuda_graph=(mode == "graph"))
    if mode == "sync":
        runner.decoder = None
    out = [runner.prefill(PROMPT)]
    for t in (7, 200, 31, 99):
        out.append(runner.decode(t))
    if getattr(runner, "decoder", None) is not None:
        runner.decoder.close()
    return loaded, torch.stack([o.float().cpu() for o in out])


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


_cpu_refs: dict = {}


def _cpu_logits(path, fmt="bf16"):
    """The all-CPU placement's logits (computed once per checkpoint and format)."""
    if (path, fmt) not in _cpu_refs:
        _cpu_refs[path, fmt] = _logits(path, device="cpu", experts_format=fmt)[1]
    return _cpu_refs[path, fmt]


def _bf16_tol():
    """Hybrid (resident experts in fp32 on the GPU) vs all-CPU, bf16 experts. With AMX the CPU engine rounds the
    activations of experts with >= amx_min_tokens tokens (prefill) to bf16, which the GPU copy does not: that adds
    up to ~2^-9 per element of those experts' inputs. Without AMX only matmul summation order differs."""
    from hetmoe.cpu import cpu_info

    return 1e-2 if "amx" in cpu_info()["supported_isas"] else 2e-3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt,n,mode", [("bf16", 3, "graph"), ("bf16", 3, "eager"), ("bf16", 3, "sync"),
                                        ("bf16", 8, "graph"), ("int4", 3, "graph"), ("int4", 3, "eager"),
                                        ("int8", 3, "graph")])
def test_hybrid_gpu_experts_match_cpu(checkpoints, arch, fmt, n, mode):
    path = checkpoints[arch]
    ref = _cpu_logits(path, fmt)
    logs = []
    loaded, hyb = _logits(path, logs, mode, device="cuda", experts_format=fmt, gpu_experts=n)
    report = loaded.info["gpu_experts"]
    assert report["n"] == n and report["chosen_by"] == "calibration" and 0 < report["mean_coverage"] <= 1
    assert any("GPU experts: " in m and "cover" in m for m in logs), logs
    blocks = moe_blocks(loaded.model)
    for _, b in blocks:
        assert b.gpu is not None and len(b.gpu.expert_ids) == n
        assert b.gpu.w_gate_up.is_cuda and int(b.engine.skip_mask.sum()) == n
        assert b.gpu.storage.name == fmt  # --gpu-experts-format auto: the experts' own format (their codes)
    err = _max_rel(hyb, ref)
    print(f"{arch} {fmt} N={n} {mode}: hybrid --gpu-experts vs cpu, max rel. logit error {err:.2e}")
    # bf16 experts: cuBLAS vs CPU matmuls on the same weight values (and AMX's bf16 activations, _bf16_tol); int4:
    # the CPU rounds activations to int8 (both placements, non-resident experts), the GPU copy does not.
    # measured in CPU emulation on AVX2: bf16 2.4e-7, int4 2.2e-3
    assert err < (_bf16_tol() if fmt == "bf16" else 2e-2), err


@pytest.mark.gpu
@gpu
def test_hybrid_all_resident_ignores_deferral(checkpoints):
    """With every expert resident nothing is left to defer: d = 1 gives the d = 0 result (resident experts are
    never deferred), and both match the CPU placement."""
    path = checkpoints["qwen3_moe"]
    ref = _cpu_logits(path)
    _, d0 = _logits(path, device="cuda", gpu_experts=8)
    _, d1 = _logits(path, device="cuda", gpu_experts=8, defer_experts=1)
    print(f"all resident: d=1 vs d=0 {_max_rel(d1, d0):.2e}, d=0 vs cpu {_max_rel(d0, ref):.2e}")
    assert _max_rel(d1, d0) < 1e-5
    assert _max_rel(d0, ref) < _bf16_tol()


def _emulated_logits(path, resident: list, **opts):
    """The hybrid dispatch stage (each MoELayer with staging and GPU experts attached, deferring when asked) run on
    CPU tensors with fp32 resident experts ``resident[i]`` on MoE block i: what the hybrid computes, without a GPU."""
    from hetmoe.engine.runner import Runner

    options = EngineOptions(**{"dtype": "fp32", "experts_format": "bf16", "max_context": 64, "device": "cpu", **opts})
    loaded = load_model(path, options, expert_cache=None, progress=False, log=lambda m: None)
    for (_, block), ids in zip(moe_blocks(loaded.model), resident):
        block.attach(block.experts, HostStaging(loaded.config.hidden_size, block.router.top_k, torch.float32))
        block.set_gpu_experts(GpuExperts.from_cpu(block.engine, ids, torch.float32, "cpu"))
    assert all(b.defer == opts.get("defer_experts", 0) for _, b in moe_blocks(loaded.model))
    runner = Runner(loaded)
    out = [runner.prefill(PROMPT)] + [runner.decode(t) for t in (7, 200, 31, 99)]
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_emulated_hybrid_matches_cpu(checkpoints, arch):
    """The CPU emulation the GPU deferral test compares with: without deferral it is the all-CPU model."""
    cpu = _cpu_logits(checkpoints[arch])
    emu = _emulated_logits(checkpoints[arch], [[0, 3, 5]] * 3)
    # measured 2.4e-7 on AVX2 (fp32 activations); AMX rounds prefill activations to bf16 on the CPU side only
    assert _max_rel(emu, cpu) < (_bf16_tol() if _bf16_tol() > 2e-3 else 1e-5), _max_rel(emu, cpu)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["graph", "sync"])
def test_hybrid_deferral_with_gpu_experts(checkpoints, arch, mode):
    """--defer-experts 1 --gpu-experts 3 on the GPU against the same dispatch run on CPU tensors with the resident
    sets the calibration chose (resident experts never deferred, the other experts' split as usual)."""
    path = checkpoints[arch]
    # the prefill on the CPU, as the emulation's: a load that measures the GPU path faster for 40 tokens would
    # prefill in bf16 on the GPU (1.1e-2 / 2.4e-3 against the emulation on the GPU machine at 5698460), which is the
    # layerwise tests' subject, not this one's
    loaded, hyb = _logits(path, None, mode, device="cuda", gpu_experts=3, defer_experts=1, gpu_prefill="off")
    resident = [layer["experts"] for layer in loaded.info["gpu_experts"]["layers"]]
    emu = _emulated_logits(path, resident, defer_experts=1)
    err = _max_rel(hyb, emu)
    print(f"{arch} N=3 d=1 {mode}: hybrid vs CPU emulation {err:.2e}")
    # measured on CPU: this deferral moves deepseek_v3's logits by 0.14 and qwen3_moe's by 0.015 against d = 0, so
    # a resident expert wrongly deferred (or counted twice) shows far above this bound
    assert err < 2e-3, err


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", [1, 2, 4, 8])
@pytest.mark.parametrize("decode", ["dense", "routed"])
def test_decode_path_captures_into_cuda_graph(T, decode):
    gen = torch.Generator().manual_seed(T)
    gate, up, down = _weights(gen)
    resident = [0, 2, 5, 9]
    gpu = GpuExperts(resident, gate[resident], up[resident], down[resident], E, torch.bfloat16, "cuda", decode=decode)
    x = torch.randn(T, H, generator=gen).cuda().bfloat16()
    ids, w = (t.cuda() for t in _routing(gen, T, 3, holes=False))
    eager0 = gpu(x, ids, w)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu(x, ids, w)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(x, ids, w)
    for seed in range(3):  # new routing and inputs, replayed
        g2 = torch.Generator().manual_seed(100 + seed)
        x.copy_(torch.randn(T, H, generator=g2).bfloat16())
        new_ids, new_w = _routing(g2, T, 3, holes=False)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        ref = gpu(x, ids, w)
        if not ref.abs().max():  # no token chose a resident expert (1 in 6 per token here): nothing to compare
            assert not out.abs().max(), (seed, "the replay computed experts no token chose")
            continue
        # the same math up to cuBLAS's kernel choice inside a capture; stale inputs would give an error ~1
        err = rel_err(out, ref)
        print(f"T={T} replay {seed}: graph vs eager {err:.2e}")
        assert err < 5e-3, (seed, err)
    assert rel_err(out, eager0) > 0.1
