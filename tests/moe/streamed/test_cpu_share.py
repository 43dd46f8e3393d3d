"""The CPU's share of each layer's experts during the layerwise GPU prefill (hetmoe/moe/streamed/cpu_share.py, the
choice in hetmoe/moe/streamed/choice.py).

CPU (CI): the whole path on CPU tensors (the CPU job through stream host functions on a ``_C.FakeStream``, the GPU
part through the layerwise path's torch code) with a share of c in {some, all but one} of the experts, against the
same path with c = 0, for bf16, int8 and int4 experts, a qwen3-like and a deepseek-like (shared experts, sigmoid
router) model; the GPU part reads only the first E - c experts; the share chooser.
GPU (marked): the same comparisons on CUDA (pinned staging, the jobs ordered on the stream, ``add_rows``), and the
load option.

Paths: the engine's row-block kernels on this machine's best non-AMX ISA (the CPU part) + the torch path in fp32
(the GPU part) vs the torch path alone: the engine rounds its activations (int8: int16, int4: int8 per group), so
the tolerances are those of tests/moe/streamed/test_layerwise.py's path-vs-engine test. Relative max logit errors.
"""

import pytest
import torch

from hetmoe.config.options import EngineOptions, parse_cpu_share
from hetmoe.cpu import cpu_info
from hetmoe.engine.runner import Runner
from hetmoe.load.loader import load_model, moe_blocks
from hetmoe.moe.streamed.choice import (
    CPU_CONTENTION,
    choose_cpu_share,
    describe_share,
    layer_seconds,
    share_capacity,
)
from hetmoe.moe.streamed.layerwise import LayerwisePrefill

# measured here (AVX2), share vs no share: bf16 <= 3.1e-7, int8 <= 7.8e-6, int4 <= 1.8e-3 (test_layerwise.py bounds)
TOL = {"bf16": 1e-5, "int8": 1e-4, "int4": 1e-2}


def _max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _cpu_model(checkpoints, arch, fmt):
    isa = next(i for i in ("avx512", "avx2", "scalar") if i in cpu_info()["supported_isas"])
    loaded = load_model(checkpoints(arch), EngineOptions(device="cpu", experts_format=fmt, dtype="fp32", isa=isa),
                        expert_cache=None, log=lambda m: None)
    layers = [layer for _, layer in moe_blocks(loaded.model)]
    return loaded, LayerwisePrefill(layers, "cpu", torch.float32, min_tokens=1, unpack_batch=3)


def _score(runner, lw, ids):
    """The runner's prefill logits on the layerwise path (the runner passes the token count: the share applies)."""
    runner.layerwise = lw
    return runner.score(ids)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_a_cpu_share_equals_the_all_gpu_path(checkpoints, arch, fmt):
    loaded, lw = _cpu_model(checkpoints, arch, fmt)
    runner = Runner(loaded)
    ids = torch.randint(0, loaded.config.vocab_size, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _score(runner, lw, ids)  # c = 0: every expert on the "GPU" path
    E = lw.layouts[0].num_experts
    for c in (3, E - 1):
        share = lw.enable_share(c, chunk=64)
        assert share is not None and share.experts_for(len(ids), E) == c
        before = lw.layers_run
        got = _score(runner, lw, ids)
        assert lw.layers_run - before == len(lw.layers)
        # a CPU job per layer ran, on the layer's last c experts
        assert {key for key in share._jobs} == {(i, tuple(range(E - c, E))) for i in range(len(lw.layers))}
        err = _max_rel(got, ref)
        print(f"{arch} {fmt}: CPU share {c}/{E} vs all on the GPU path, max rel. logit error {err:.2e}")
        assert err < TOL[fmt], (c, err)
    lw.close()


def test_the_gpu_part_reads_only_its_experts(checkpoints):
    """With a share of c, only the first E - c experts are unpacked and read: the scratch rows of the CPU's experts
    hold NaN and the output stays finite (and equals the all-GPU output)."""
    loaded, lw = _cpu_model(checkpoints, "qwen3_moe", "int8")
    layer = lw.layers[0]
    gen = torch.Generator().manual_seed(5)
    T, E = 57, layer.num_experts
    x = torch.randn(T, lw.layouts[0].hidden, generator=gen)
    logits = torch.randn(T, E, generator=gen)
    with lw.prefill(T):
        ref = lw.run(layer, x, logits)
    c = 5
    lw.enable_share(c, chunk=T)
    lw.w_gu.fill_(float("nan"))
    lw.w_down.fill_(float("nan"))
    with lw.prefill(T):
        assert lw.cpu_experts == c and lw.gpu_experts(0) == E - c
        got = lw.run(layer, x, logits)
    assert torch.isnan(lw.w_gu[E - c:]).all() and not torch.isnan(lw.w_gu[:E - c]).any()
    assert torch.isfinite(got).all()
    assert _max_rel(got, ref) < TOL["int8"]
    with lw.prefill(T + 1):  # past the staging buffers' capacity: no share
        assert lw.cpu_experts == 0
    lw.close()


TRITON_PREFIX = """
import sys, torch
from hetmoe.cpu import CPUExperts
from hetmoe.ops.triton import packed as packed_triton
from hetmoe.moe.streamed.packed import ExpertLayout, expert_ranges, unpack_experts
dev = "cuda" if torch.cuda.is_available() else "cpu"
for fmt in ("bf16", "int4"):
    E, n, H, I = 4, 2, 130, 24
    experts = CPUExperts(E, H, I, fmt, 32, threads=1)
    experts.fill_random(seed=4)
    lay = ExpertLayout.of(experts)
    per = [b for b in lay.range_bytes() if b]
    ref_gu, ref_d = unpack_experts(lay, expert_ranges(experts), E, torch.float32)
    w_gu = torch.full((E, 2 * I, H), float("nan"), device=dev)
    w_d = torch.full((E, H, I), float("nan"), device=dev)
    packed_triton.unpack_into(lay, [r[:n * b].to(dev) for r, b in zip(expert_ranges(experts), per)], w_gu, w_d, n)
    if not (torch.equal(w_gu[:n].cpu(), ref_gu[:n]) and torch.equal(w_d[:n].cpu(), ref_d[:n])):
        sys.exit(f"{fmt}: the first {n} experts differ from the engine's")
    if not (torch.isnan(w_gu[n:]).all() and torch.isnan(w_d[n:]).all()):
        sys.exit(f"{fmt}: rows past the first {n} experts were written")
print("ok")
"""


def test_the_triton_unpack_of_a_prefix():
    """``packed_triton.unpack_into(..., n_experts)`` (the GPU part of a share): the first n experts from their bytes
    alone, bitwise the engine's values in fp32, the other rows untouched (Triton's interpreter without a GPU)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", TRITON_PREFIX], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# a layer of qwen3-30b-a3b int4 as the GPU machine measured it at load (H2D 324 MiB in 6.36 ms, the CPU engine 54,915
# tokens/s per layer, the GPU's experts 1.18 / 1.41 ms at 512 / 2048 tokens); with a share of 46 / 18 experts its
# prefill went 1,728 -> 2,366 tok/s at 512 tokens and 6,910 -> 5,770 at 2048 (bench e2e, 2026-12-02)
RATES = {"copy_s": 6.36e-3, "gpu_s": {512: 1.18e-3, 2048: 1.41e-3}, "cpu_s": {512: 512 / 54915, 2048: 2048 / 54915}}


def test_the_share_balances_the_cpu_against_the_copy():
    E = 128
    c = choose_cpu_share(RATES, 512, E)
    gpu, cpu = 1.18e-3, 512 / 54915
    f = (6.36e-3 - gpu) / (6.36e-3 + CPU_CONTENTION * cpu)  # (1 - f) copy = gpu + contention * f * cpu
    assert abs(c - f * E) <= 2, (c, f * E)
    best = layer_seconds(RATES, 512, E, c)
    assert best < 0.75 * layer_seconds(RATES, 512, E, 0)  # modelled ~30% less; measured 27% less
    assert all(best <= layer_seconds(RATES, 512, E, other) for other in range(E))
    shares = [choose_cpu_share(RATES, T, E) for T in (512, 1024, 2048, 4096, 8192, 32768)]
    assert shares == sorted(shares, reverse=True) and shares[0] > shares[1] > 0  # less as the CPU's time grows
    assert shares[2:] == [0] * 4  # from 2048 tokens none: there a share measured slower than none
    cap = share_capacity(RATES, E, 32768)
    assert 1024 <= cap < 2048 and choose_cpu_share(RATES, cap, E) > 0 and choose_cpu_share(RATES, cap + 1, E) == 0
    assert share_capacity(RATES, E, 1024) == 1024
    slow_link = dict(RATES, copy_s=1.0)  # the CPU takes all but one expert at most
    assert choose_cpu_share(slow_link, 512, E) == E - 1
    fast_link = dict(RATES, copy_s=1e-6, gpu_s={256: 1e-6, 1024: 2e-6})
    assert choose_cpu_share(fast_link, 512, E) == 0 and share_capacity(fast_link, E, 8192) == 0
    assert choose_cpu_share(RATES, 512, 1) == 0
    text = describe_share(RATES, E, 282, 32768)
    assert text.startswith(f"{choose_cpu_share(RATES, 512, E)}/128 experts at 512 tokens") and "none from" in text


def test_share_option():
    assert parse_cpu_share("auto") == "auto" and parse_cpu_share(" OFF ") == "off" and parse_cpu_share("12") == 12
    assert parse_cpu_share("0") == "off" and parse_cpu_share(3) == 3
    assert EngineOptions(gpu_prefill_cpu_share="5").gpu_prefill_cpu_share == 5
    for bad in ("-1", "half", "1.5", "", True):
        with pytest.raises(ValueError, match="gpu-prefill-cpu-share must be auto, off or a number"):
            parse_cpu_share(bad)
    with pytest.raises(ValueError, match="gpu-prefill-cpu-share"):
        EngineOptions(gpu_prefill_cpu_share="half")


def test_auto_needs_measured_rates(checkpoints):
    _, lw = _cpu_model(checkpoints, "qwen3_moe", "bf16")
    assert lw.enable_share("auto") is None and lw.enable_share("off") is None  # nothing measured on a CPU device
    lw.rates = RATES
    share = lw.enable_share("auto", chunk=4096)
    assert share is not None and share.capacity == share_capacity(RATES, 8, 4096)
    lw.close()


# ---------------------------------------------------------------- GPU

gpu = pytest.mark.gpu


def _hybrid(path, fmt, **opts):
    return load_model(path, EngineOptions(device="cuda", experts_format=fmt, gpu_prefill=1, **opts),
                      expert_cache=None, log=lambda m: None)


@gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_gpu_cpu_share_equals_the_all_gpu_path(checkpoints, arch, fmt):
    """One layer and the whole model: shares of 0, 3 and E - 1 experts on CUDA (pinned staging, stream-ordered
    jobs, the CPU output read by ``add_rows``)."""
    loaded = _hybrid(checkpoints(arch), fmt)
    lw = loaded.layerwise
    layer, E = lw.layers[0], lw.layouts[0].num_experts
    gen = torch.Generator().manual_seed(3)
    T, H = 300, loaded.config.hidden_size
    x = (torch.randn(T, H, generator=gen) * 0.5).to("cuda", torch.bfloat16)
    logits = torch.randn(T, E, generator=gen).to("cuda")
    block = next(m for m in loaded.model.modules() if getattr(m, "moe", None) is layer)
    bias = getattr(block.gate, "correction_bias", None)
    ids = list(range(5, 100))
    lw.enable_share("off")
    with lw.prefill(T):
        ref_layer = lw.run(layer, x, logits, correction_bias=bias).float()
    ref = Runner(loaded).score(ids)
    for c in (3, E - 1):
        lw.enable_share(c, chunk=512)
        with lw.prefill(T):
            assert lw.cpu_experts == c
            got_layer = lw.run(layer, x, logits, correction_bias=bias).float()
        got = Runner(loaded).score(ids)
        err_layer = ((got_layer - ref_layer).norm() / ref_layer.norm()).item()
        err = _max_rel(got, ref)
        print(f"{arch} {fmt} share {c}/{E}: one layer {err_layer:.2e}, logits {err:.2e}")
        # the CPU engine's rounding vs the GPU's on c/E of the rows: within test_layerwise.py's one-layer bounds
        assert err_layer < {"bf16": 1e-2, "int8": 2e-2, "int4": 4e-2}[fmt], err_layer
        assert err < 8e-2, err  # test_layerwise.py's whole-model bound (near-ties of tiny routers)
    lw.close()


@gpu
def test_gpu_share_option_and_profile(checkpoints, monkeypatch):
    path = checkpoints("qwen3_moe")
    loaded = _hybrid(path, "int4", gpu_prefill_cpu_share="off")
    assert loaded.layerwise.share is None and loaded.info["gpu_prefill"]["cpu_share"]["mode"] == "off"
    loaded = _hybrid(path, "int4", gpu_prefill_cpu_share=3)
    lw = loaded.layerwise
    assert lw.share is not None and loaded.info["gpu_prefill"]["cpu_share"]["mode"] == 3
    lw.profiling = True
    Runner(loaded).score(list(range(5, 60)))
    prof = lw.profile()
    lw.profiling = False
    assert prof["cpu_experts"] == 3 and prof["cpu_ms"] > 0 and prof["layers"] == len(lw.layers)
