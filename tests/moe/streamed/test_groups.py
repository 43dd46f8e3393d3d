"""Expert-group streaming in the layerwise GPU prefill (hetmoe/moe/streamed/layerwise.py with ``group`` < E): a ring of
slots of G experts each, refilled as units are computed; a layer of several units sorts its rows once and computes
each unit's rows, a bounded window at a time (hetmoe/moe/grouped.py ``sort_pairs`` / ``swiglu_rows``); the planner's
choice of groups, chunk and ring (hetmoe/plan/placement.py ``fit_prefill``); out of GPU memory, the CPU engine.

CPU (CI): the sorted-rows computation against ``grouped_swiglu`` (windows of 1 row up to all, skipped slots,
experts with no row); the whole path on CPU tensors in groups of 1-3 experts and row windows of 5, against whole
layers read in place and against the CPU engine, qwen3-like and deepseek-like models, bf16 and int4, prompts ending
mid-chunk, with and without a CPU share; the ring's order and depth; an injected torch.OutOfMemoryError; the plans
of the deepseek-v3 shape at 24 and 16 GiB and a budget too small for two slots.
Under Triton's interpreter (slow tier, no GPU): the GPU branch's kernels with the accumulating combine, bounds
checked.
GPU (marked): group prefill vs the CPU engine's logits, with resident experts, and the injected out-of-memory
fallback on CUDA.

Tolerances: relative max logit errors, written beside each assert with what was measured.
"""

import re

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.cpu import cpu_info
from hetmoe.engine.runner import Runner
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.moe.grouped import grouped_swiglu, sort_pairs, swiglu_rows
from hetmoe.moe.streamed import layerwise as layerwise_module
from hetmoe.moe.streamed.layerwise import LayerwisePrefill
from hetmoe.moe.streamed.vram import group_rows, group_sizes, min_group
from tests.triton_interp import checked_accesses, gpu_branch_on_cpu

TOL = {"bf16": 1e-5, "int8": 1e-4, "int4": 1e-2}  # the torch path vs the engine (test_layerwise.py's bounds)


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _cpu_model(checkpoints, arch, fmt, **kwargs):
    isa = next(i for i in ("avx512", "avx2", "scalar") if i in cpu_info()["supported_isas"])
    loaded = load_model(checkpoints(arch), EngineOptions(device="cpu", experts_format=fmt, dtype="fp32", isa=isa),
                        expert_cache=None, log=lambda m: None)
    layers = [layer for _, layer in moe_blocks(loaded.model)]
    return loaded, LayerwisePrefill(layers, "cpu", torch.float32, min_tokens=1, unpack_batch=2, **kwargs)


@pytest.mark.parametrize("window", [1, 3, 17, 1000])
def test_sorted_rows_equal_grouped_swiglu(window):
    gen = torch.Generator().manual_seed(window)
    E, H, I, T, k = 9, 24, 10, 29, 3
    w_gu, w_down = torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)
    x, w = torch.randn(T, H, generator=gen), torch.rand(T, k, generator=gen)
    ids = torch.stack([torch.randperm(E - 3, generator=gen)[:k] for _ in range(T)])  # experts 6..8 get no row
    ids[2, 0] = ids[5, 2] = -1
    ref = grouped_swiglu(x, ids, w, w_gu, w_down)
    pairs = sort_pairs(ids, E)
    assert pairs.rows(0, E) == int((ids >= 0).sum()) and pairs.rows(6, 9) == 0
    got = torch.zeros(T, H)
    for p0, p1 in ((0, 2), (2, 5), (5, 9)):  # units of 2, 3 and 4 experts
        swiglu_rows(x, pairs, p0, p1, w, w_gu[p0:p1], w_down[p0:p1], got, window)
    assert _max_rel(got, ref) < 1e-5  # measured 0 to 1.2e-7: the same rows, the same order of sums


def test_group_sizes_and_rows():
    assert min_group(256, 24 << 20) == 4 and min_group(128, 2 << 20) == 32 and min_group(8, 1 << 30) == 1
    assert group_sizes(256, 24 << 20) == [4, 2, 1]
    assert group_rows(8192, 8, 4, 256) == 2048 and group_rows(32768, 8, 4, 256) == 8192
    assert group_rows(16, 2, 4, 8) == 32  # never more than the chunk's rows


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_groups_equal_whole_layers_and_the_cpu_engine(checkpoints, arch, fmt):
    """Groups of 1 to 3 experts in a ring of 2 or 3 slots, windows of 5 rows, in chunks of 16 tokens (a prompt of
    37: the last chunk ends mid-chunk; 3 tokens: most units get no row), with and without a CPU share: the same
    logits as whole layers (the same rows in the same order: fp32 summation only) and the CPU engine's."""
    loaded, whole = _cpu_model(checkpoints, arch, fmt)
    runner = Runner(loaded)
    runner.prefill_chunk = 16
    prompts = [torch.randint(0, loaded.config.vocab_size, (37,), generator=torch.Generator().manual_seed(4)).tolist(),
               [7, 19, 3]]
    E = whole.layouts[0].num_experts
    for ids in prompts:
        ref = runner.score(ids)  # the CPU engine
        runner.layerwise = whole
        want = runner.score(ids)
        for group, slots in ((1, 2), (3, 3)):
            _, lw = _cpu_model(checkpoints, arch, fmt, group=group, slots=slots, rows=5)
            lw.layers = whole.layers  # the same model's layers (one engine in RAM)
            lw._index = whole._index
            runner.layerwise = lw
            for share in ("off", 2):
                lw.enable_share(share, chunk=16)
                before = lw.layers_run
                got = runner.score(ids)
                assert lw.layers_run - before == len(lw.layers) * -(-len(ids) // 16)
                assert lw.fallbacks == 0
                # measured: vs whole layers <= 2.4e-7 (bf16) / 4.8e-7 (int4); a share: the engine's rounding
                assert _max_rel(got, want) < (1e-5 if share == "off" else TOL[fmt]), (group, share)
                assert _max_rel(got, ref) < TOL[fmt], (group, share, _max_rel(got, ref))
            lw.close()
        runner.layerwise = None
    assert E > 3


def test_the_ring_runs_ahead_at_most_its_slots(checkpoints):
    """Units are issued in order, across layers (the next layer's first units before its router ran), never more
    than S ahead of the last computed one; each layer's units cover its experts once, in ascending order."""
    loaded, lw = _cpu_model(checkpoints, "qwen3_moe", "int4", group=3, slots=2)
    runner = Runner(loaded)
    runner.layerwise = lw
    issued, issue = [], lw._issue

    def spy(u):
        assert u == len(issued) and u < lw._done + lw.n_slots, (u, lw._done)
        issued.append(lw._units[u])
        issue(u)

    lw._issue = spy
    runner.score(list(range(5, 40)))
    E = lw.layouts[0].num_experts
    per_layer = {}
    for i, experts in issued:
        per_layer.setdefault(i, []).extend(experts)
    assert sorted(per_layer) == list(range(len(lw.layers)))
    assert all(v == list(range(E)) for v in per_layer.values())
    assert all(len(e) <= 3 for _, e in issued) and lw._done == len(issued)
    # layer 1's first unit was issued while layer 0 computed (before layer 1's router)
    assert len(issued) > -(-E // 3) and issued[-(-E // 3)][0] == 1


def test_out_of_memory_falls_back_to_the_cpu_engine(checkpoints, monkeypatch):
    """An injected torch.OutOfMemoryError in a layer's GPU compute: that layer and the rest of the call on the CPU
    engine (the same logits as the CPU prefill), one line said; the next call runs on the GPU path again."""
    loaded, lw = _cpu_model(checkpoints, "deepseek_v3", "bf16", group=2, rows=7)
    runner = Runner(loaded)
    ids = list(range(3, 40))
    ref = runner.score(ids)
    runner.layerwise = lw
    want = runner.score(ids)
    real, calls = layerwise_module.swiglu_rows, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args)

    monkeypatch.setattr(layerwise_module, "swiglu_rows", failing)
    before = lw.layers_run
    got = runner.score(ids)
    assert lw.fallbacks == 1 and lw.failed is not None and "out of memory" in lw.failed
    assert lw.layers_run - before < len(lw.layers)  # the layers after the failure took the CPU engine
    assert _max_rel(got, ref) < TOL["bf16"]
    monkeypatch.setattr(layerwise_module, "swiglu_rows", real)
    before = lw.layers_run
    again = runner.score(ids)
    assert lw.failed is None and lw.layers_run - before == len(lw.layers) and lw.fallbacks == 1
    assert torch.equal(again, want)


def test_bad_group_arguments_are_refused():
    with pytest.raises(ValueError, match="group .* and rows must be >= 1"):
        LayerwisePrefill([], "cpu", torch.float32, 1, group=0)
    with pytest.raises(ValueError, match="group .* and rows must be >= 1"):
        LayerwisePrefill([], "cpu", torch.float32, 1, rows=-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run in Triton's interpreter where there is no GPU")
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_groups_on_the_gpu_branch(checkpoints, fmt, monkeypatch):
    """The GPU branch's kernels (Triton unpack of a slot, grouped GEMMs over a window of sorted rows, the combine
    kernel adding into the layer's sum) under the interpreter, every access bounds-checked, deepseek_v3 in groups of
    2 with windows of 3 rows, chunks of 1-4 and 9 tokens: the torch path's logits."""
    loaded, lw = _cpu_model(checkpoints, "deepseek_v3", fmt, group=2, rows=3)
    runner = Runner(loaded)
    runner.layerwise = lw
    prompts = [[11], [7, 19], [7, 19, 3], [7, 19, 3, 40], list(range(20, 29))]
    ref = [runner.score(p) for p in prompts]
    gpu_branch_on_cpu(monkeypatch, lw)
    with checked_accesses():
        got = [runner.score(p) for p in prompts]
    for p, g, r in zip(prompts, got, ref):
        assert _max_rel(g, r) < 1e-5, (len(p), _max_rel(g, r))  # fp32: summation order, silu's formula


# ---------------------------------------------------------------- the plan


def _cli(capsys, *args):
    from hetmoe.cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _projected(out: str) -> tuple:
    text = " ".join(out.split())
    m = re.search(r"projected prefill of 8192 tokens: ([\d,]+) tok/s .*?([\d.]+)x the CPU engine's ([\d,]+) tok/s",
                  text)
    assert m, out
    return float(m[1].replace(",", "")), float(m[2]), float(m[3].replace(",", ""))


@pytest.mark.parametrize("layers, budget", [(12, "24GiB"), (12, "16GiB"), (None, "24GiB"), (None, "16GiB")])
def test_deepseek_v3_plans_gpu_prefill_in_groups(capsys, layers, budget):
    """The deepseek-v3 shape (int4 experts, 6 GiB a layer) at 24 and 16 GiB: two whole layers do not fit, slots of
    a few experts do; the plan fits its budget and projects the prefill of 8K tokens at >= 5x the CPU engine."""
    args = ["plan", "--shape", "deepseek-v3", "--device", "cuda", "--gpu-memory", budget, "--cpu-memory", "512GiB",
            "--max-context", 32768, "--experts-format", "int4"] + (["--layers", layers] if layers else [])
    code, out, err = _cli(capsys, *args)
    assert code == 0, err
    assert re.search(r"prefill slots +cuda +[\d.]+ [MG]iB +layerwise GPU prefill in groups: \d+ slots of \d+ of\s+256"
                     r"\s+experts", out), out
    assert re.search(r"chunks of \d+ tokens, the longest whose\s+activations fit", out), out
    assert "fits: " + budget.replace("GiB", ".00 GiB") in out
    gpu, ratio, cpu = _projected(out)
    assert ratio >= 5 and abs(gpu / cpu - ratio) < 0.1, out


def test_a_budget_too_small_for_two_slots_prefills_on_the_cpu(capsys):
    code, out, err = _cli(capsys, "plan", "--shape", "deepseek-v3", "--layers", 5, "--device", "cuda", "--gpu-memory",
                          "5.1GiB", "--cpu-memory", "512GiB", "--max-context", 4096, "--experts-format", "int4",
                          "--dense-format", "int4")
    assert code == 0, err
    text = " ".join(out.split())
    assert re.search(r"prefill slots cuda 0\.0 MiB none: two slots of one expert \([\d.]+ MiB each\) with their "
                     r"buffers for chunks of 1024 tokens need [\d.]+ [MG]iB, [\d.]+ [MG]iB left \(the CPU prefills\)",
                     text), out


def test_whole_layers_keep_their_plan(capsys):
    """Where two whole layers fit (qwen3-30b-a3b at 24 GiB), the plan is as before: no groups."""
    code, out, err = _cli(capsys, "plan", "--shape", "qwen3-30b-a3b", "--device", "cuda", "--gpu-memory", "24GiB",
                          "--experts-format", "int4", "--max-context", 32768, "--cpu-memory", "64GiB")
    assert code == 0, err
    assert "layerwise GPU prefill, chunks of 8192 tokens" in " ".join(out.split()) and "in groups" not in out


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


def _hybrid(path, fmt, **opts):
    return load_model(path, EngineOptions(device="cuda", experts_format=fmt, **opts), expert_cache=None,
                      log=lambda m: None)


def _groups_on(loaded, group, slots, rows):
    """The loaded model's layerwise prefill replaced by one of slots of ``group`` experts."""
    old = loaded.layerwise
    lw = LayerwisePrefill(old.layers, "cuda", old.dtype, 1, slots=slots, unpack_batch=1, group=group, rows=rows)
    old.close()
    loaded.layerwise = lw
    return lw


@gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("gpu_experts", [0, 2])
def test_gpu_groups_match_the_cpu_engine(checkpoints, arch, fmt, gpu_experts):
    """Groups of 3 experts, 3 slots, windows of 64 rows on CUDA (with 2 resident experts a layer: their own units),
    a 95-token prompt in chunks of 32 (the last ends mid-chunk) and a 3-token one (units without rows): the CPU
    engine's logits within test_layerwise.py's whole-model bound; whole layers and groups agree closer."""
    path = checkpoints(arch)
    ref_model = _hybrid(path, fmt, gpu_prefill="off", gpu_experts=gpu_experts)
    loaded = _hybrid(path, fmt, gpu_prefill=1, gpu_experts=gpu_experts)
    whole = Runner(loaded)
    whole.prefill_chunk = 32
    for ids in (list(range(5, 100)), [7, 19, 3]):
        ref = Runner(ref_model).score(ids)
        want = whole.score(ids)
        lw = _groups_on(loaded, 3, 3, 64)
        runner = Runner(loaded)
        runner.prefill_chunk = 32
        got = runner.score(ids)
        assert lw.layers_run == len(lw.layers) * -(-len(ids) // 32) and lw.fallbacks == 0
        err, agree = _max_rel(got, ref), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{arch} {fmt} gpu_experts={gpu_experts} {len(ids)} tokens: groups vs CPU engine {err:.2e}, "
              f"vs whole layers {_max_rel(got, want):.2e}")
        assert err < 8e-2 and agree >= 0.95, (err, agree)
        assert _max_rel(got, want) < 3e-2  # bf16 sums in another order (groups, then slots)
        assert torch.equal(runner.score(ids), got)  # the combine kernel's fixed order: reproducible


@gpu
def test_gpu_out_of_memory_falls_back(checkpoints, monkeypatch):
    """An injected torch.OutOfMemoryError on CUDA: the call completes on the CPU engine (its logits), the next call
    on the GPU path again, with the same logits as before the failure."""
    path = checkpoints("qwen3_moe")
    ref = Runner(_hybrid(path, "int4", gpu_prefill="off")).score(list(range(5, 70)))
    loaded = _hybrid(path, "int4", gpu_prefill=1)
    lw = _groups_on(loaded, 2, 2, 32)
    runner = Runner(loaded)
    want = runner.score(list(range(5, 70)))
    real, calls = layerwise_module.swiglu_rows, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(*args)

    monkeypatch.setattr(layerwise_module, "swiglu_rows", failing)
    got = runner.score(list(range(5, 70)))
    assert lw.fallbacks == 1 and _max_rel(got, ref) < 3e-2
    monkeypatch.setattr(layerwise_module, "swiglu_rows", real)
    assert torch.equal(runner.score(list(range(5, 70))), want) and lw.failed is None
