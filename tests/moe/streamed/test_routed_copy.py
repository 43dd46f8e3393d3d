"""Routed-only copying in the layerwise GPU prefill (hetmoe/moe/streamed/copy.py): when T·k is small against E, each
layer copies only the experts its router reaches, packed one after another in the slot, the routing renumbered.

CPU (CI): the helpers (which experts, the renumbering, the runs of consecutive experts, the packed copies); the whole
path on CPU tensors (host "slots") with routed-only copying against whole layers read in place, with and without a
CPU share, qwen3-like and deepseek-like models, bf16 and int4 experts: the same experts with the same rows in the
same order, so the same bits (the torch path; its sums run in expert order either way); the GPU branch's kernels
under Triton's interpreter with every access bounds-checked, routed-only against whole layers, chunks of 1-4 tokens;
the choice rule.
GPU (marked): routed-only vs whole-layer copies on CUDA, one layer and the whole model, in a child process that
names the step an illegal memory access would kill it in.
"""

import sys

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine.runner import Runner
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.moe.streamed.choice import routed_fraction, wants_routed_only
from hetmoe.moe.streamed.copy import copy_experts, routed_experts, runs
from hetmoe.moe.streamed.layerwise import LayerwisePrefill
from tests.gpu_child import run_steps, say
from tests.triton_interp import checked_accesses, gpu_branch_on_cpu


def test_routed_experts_and_renumbering():
    ids = torch.tensor([[5, 2], [-1, 5], [7, 2], [0, -1]])
    experts, renumbered = routed_experts(ids, 8)
    assert experts == [0, 2, 5, 7]
    assert renumbered.tolist() == [[2, 1], [-1, 2], [3, 1], [0, -1]]
    none, r = routed_experts(torch.full((2, 3), -1), 4)
    assert none == [] and (r == -1).all()


def test_runs_and_packed_copies():
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 1), (7, 2)] and runs([]) == []
    per = [3, 2]  # bytes per expert of two ranges
    src = [torch.arange(6 * b, dtype=torch.uint8) for b in per]  # 6 experts
    dst = [torch.zeros(6 * b, dtype=torch.uint8) for b in per]
    copy_experts(dst, src, per, [1, 2, 4])
    for d, s, b in zip(dst, src, per):
        want = torch.cat([s[1 * b:3 * b], s[4 * b:5 * b]])
        assert torch.equal(d[:3 * b], want) and not d[3 * b:].any()
    copy_experts(dst, src, per, None, 2)  # a prefix
    assert all(torch.equal(d[:2 * b], s[:2 * b]) for d, s, b in zip(dst, src, per))


def test_the_routed_only_rule():
    E, k = 128, 8
    assert abs(routed_fraction(16, k, E) - (1 - (127 / 128) ** 128)) < 1e-12  # ~63%
    assert wants_routed_only(4, k, E) and not wants_routed_only(16, k, E)  # 22% / 63% of the experts reached
    assert not wants_routed_only(64, k, E, None)  # T·k = 4 E: never
    # with rates: copy 6 ms, GPU compute 0.5 ms + 0.7 us/token
    rates = {"copy_s": 6e-3, "gpu_s": {256: 0.5e-3 + 0.7e-6 * 256, 1024: 0.5e-3 + 0.7e-6 * 1024}}
    assert wants_routed_only(16, k, E, rates)  # 63% of 6 ms + 0.5 ms < 6 ms
    assert not wants_routed_only(40, k, E, rates)  # 92% of the experts: the overlap is worth more
    assert not wants_routed_only(16, k, E, dict(rates, copy_s=0.2e-3))  # compute-bound: keep the overlap


def _cpu_model(checkpoints, arch, fmt):
    loaded = load_model(checkpoints(arch), EngineOptions(device="cpu", experts_format=fmt, dtype="fp32"),
                        expert_cache=None, log=lambda m: None)
    lw = LayerwisePrefill([layer for _, layer in moe_blocks(loaded.model)], "cpu", torch.float32, 1, unpack_batch=3)
    runner = Runner(loaded)
    runner.layerwise = lw
    return runner, lw


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_routed_only_equals_whole_layers(checkpoints, arch, fmt, monkeypatch):
    runner, lw = _cpu_model(checkpoints, arch, fmt)
    copied = []
    issue = lw._issue

    def spy(u):  # the experts each copy moves (consecutive ones are read in place on a CPU device)
        copied.append(lw._units[u][1])
        issue(u)

    monkeypatch.setattr(lw, "_issue", spy)
    ids = [11, 4, 29]  # 3 tokens x top-2 of 8 experts: at most 6 reached per layer
    E = lw.layouts[0].num_experts
    for share in ("off", 3):
        lw.enable_share(share, chunk=8)
        lw.routed_copy = "off"
        whole = runner.score(ids)
        assert len(copied) == len(lw.layers) and all(len(c) == E - (share != "off") * 3 for c in copied), copied
        copied.clear()
        lw.routed_copy = "on"
        routed = runner.score(ids)
        assert len(copied) == len(lw.layers) and all(len(c) < E for c in copied), copied
        limit = E - (share if share != "off" else 0)
        assert all(all(e < limit for e in c) for c in copied)  # the CPU's experts are not copied
        copied.clear()
        assert torch.equal(routed, whole), (share, (routed - whole).abs().max())
    lw.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run in Triton's interpreter where there is no GPU")
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_routed_only_on_the_gpu_branch(checkpoints, arch, fmt, monkeypatch):
    """The GPU branch's kernels (Triton unpack of the packed routed experts, sync-free grouped GEMMs over the renumbered
    experts, the combine kernel) on CPU tensors under Triton's interpreter, every load and store checked against its
    arguments' extents, chunks of 1 to 4 tokens (deepseek_v3: all of a chunk's pairs often on 2 experts): the same
    bits as whole layers on the same branch."""
    runner, lw = _cpu_model(checkpoints, arch, fmt)
    gpu_branch_on_cpu(monkeypatch, lw)
    with checked_accesses():
        for ids in ([11], [7, 19], [7, 19, 3], [7, 19, 3, 40]):
            out = {}
            for mode in ("off", "on"):
                lw.routed_copy = mode
                out[mode] = runner.score(ids)
            assert torch.equal(out["on"], out["off"]), (ids, (out["on"] - out["off"]).abs().max())
    lw.close()


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
FORMATS = ("bf16", "int8", "int4")


@gpu
def test_gpu_routed_only_equals_whole_layers(checkpoints):
    """Routed-only vs whole-layer copies on CUDA, one layer (3 tokens) and the whole model (4 tokens), qwen3_moe and
    deepseek_v3 in every format. Steps in a child process (tests/gpu_child.py), every routed-only step of every case
    before any whole-layer one: an illegal memory access (the GPU machine's run of 785dde0 died of one with
    deepseek_v3 before this order) fails this test alone and names the case, the mode and the step."""
    steps = run_steps(__file__, *(f"{arch}={checkpoints(arch)}" for arch in ("qwen3_moe", "deepseek_v3")))
    assert sum(s.startswith("compare") for s in steps) == 2 * len(FORMATS)


def _gpu_child(*cases: str) -> None:
    models, out = {}, {}
    for mode in ("on", "off"):
        for case in cases:
            arch, path = case.split("=", 1)
            for fmt in FORMATS:
                if (arch, fmt) not in models:
                    say(f"{arch} {fmt}: load")
                    models[arch, fmt] = load_model(path, EngineOptions(device="cuda", experts_format=fmt,
                                                                       gpu_prefill=1), expert_cache=None,
                                                   log=lambda m: None)
                loaded = models[arch, fmt]
                lw = loaded.layerwise
                lw.enable_share("off")
                lw.routed_copy = mode
                layer = lw.layers[0]
                gen = torch.Generator().manual_seed(8)
                x = (torch.randn(3, loaded.config.hidden_size, generator=gen) * 0.5).to("cuda", torch.bfloat16)
                logits = torch.randn(3, layer.num_experts, generator=gen).to("cuda")
                block = next(m for m in loaded.model.modules() if getattr(m, "moe", None) is layer)
                say(f"{arch} {fmt} routed-only {mode}: one layer, 3 tokens")
                with lw.prefill(3):
                    assert lw.routed_only == (mode == "on")
                    one = lw.run(layer, x, logits, correction_bias=getattr(block.gate, "correction_bias", None))
                say(f"{arch} {fmt} routed-only {mode}: the model, 4 tokens")
                out[arch, fmt, mode] = one.float(), Runner(loaded).score([7, 19, 3, 40])
    for (arch, fmt), loaded in models.items():
        say(f"compare {arch} {fmt}")
        (one_on, on), (one_off, off) = out[arch, fmt, "on"], out[arch, fmt, "off"]
        # the same weights and rows; the grouped GEMM's tiling may differ with the number of experts: bf16 rounding
        err = ((one_on - one_off).norm() / one_off.norm()).item()
        err_model = ((on - off).abs().max() / off.abs().max()).item()
        print(f"{arch} {fmt}: routed-only vs whole layers, one layer {err:.2e}, the model {err_model:.2e}", flush=True)
        if not (err < 1e-2 and err_model < 2e-2):
            sys.exit(f"{arch} {fmt}: routed-only differs from whole layers ({err:.2e}, {err_model:.2e})")
        loaded.layerwise.close()


if __name__ == "__main__":  # the child process of the GPU test above (tests/gpu_child.py)
    _gpu_child(*sys.argv[1:])
