"""--gpu-memory made binding (hetmoe/plan/vram_cap.py): torch's allocator limited to the cap less what is kept for
outside torch. The arithmetic, the refusal of a cap with nothing left for torch, and what a plan sets (the fraction,
expandable segments) or leaves alone (no cap, the CPU, a GPU planned for but not here), with torch.cuda's functions
monkeypatched on this CPU machine; then, on a GPU, a small capped engine whose peak stays within the cap."""

import gc

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.config.units import gib
from hetmoe.load.loader import build_meta, moe_blocks, plan_model
from hetmoe.plan import placement, vram_cap
from hetmoe.plan.memory import PlanError
from hetmoe.plan.vram_cap import CUDA_CONTEXT_BYTES, LATE_CUDA_BYTES, SHARED_GPU_BYTES, vram_limit

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 80 * GiB  # an H100's bytes, as mem_get_info reports them


# ---------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize("outside, reserve", [
    (0, CUDA_CONTEXT_BYTES),  # nothing measured: the plan's allowance
    (500 * MiB, CUDA_CONTEXT_BYTES),  # a fresh context: within the allowance with the late kernels' margin
    (CUDA_CONTEXT_BYTES, CUDA_CONTEXT_BYTES + LATE_CUDA_BYTES),  # more measured: measured + margin
    (SHARED_GPU_BYTES, SHARED_GPU_BYTES + LATE_CUDA_BYTES),
])
def test_the_limit_is_the_cap_less_the_larger_reserve(outside, reserve):
    lim = vram_limit(24 * GiB, TOTAL, outside)
    assert (lim.reserve, lim.limit, lim.shared) == (reserve, 24 * GiB - reserve, False)
    assert lim.fraction == (24 * GiB - reserve) / TOTAL
    assert lim.fraction * TOTAL + reserve <= 24 * GiB  # torch's reserved bytes at most + outside: within the cap


def test_other_processes_on_the_gpu_are_not_counted_in_the_cap():
    """More outside torch than one process holds: another process's; this one's is the plan's CUDA context."""
    lim = vram_limit(24 * GiB, TOTAL, SHARED_GPU_BYTES + 1)
    assert lim.shared and lim.reserve == CUDA_CONTEXT_BYTES and lim.limit == 24 * GiB - CUDA_CONTEXT_BYTES
    assert "other processes" in lim.describe()


def test_a_cap_above_the_gpu_limits_nothing():
    lim = vram_limit(200 * GiB, TOTAL, 500 * MiB)
    assert lim.fraction == 1.0 and lim.limit == 200 * GiB - CUDA_CONTEXT_BYTES


@pytest.mark.parametrize("cap, outside, reserve", [
    (CUDA_CONTEXT_BYTES, 0, CUDA_CONTEXT_BYTES), (512 * MiB, 0, CUDA_CONTEXT_BYTES),
    (GiB, GiB - LATE_CUDA_BYTES, GiB), (GiB + LATE_CUDA_BYTES, GiB, GiB + LATE_CUDA_BYTES)])
def test_a_cap_within_the_reserve_is_refused_saying_why(cap, outside, reserve):
    with pytest.raises(MemoryError, match=r"--gpu-memory [0-9.]+ [MG]iB leaves nothing for the model: [0-9.]+ [MG]iB "
                                          r"of it is kept for what the process holds on the GPU outside torch"):
        vram_limit(cap, TOTAL, outside)
    assert vram_limit(reserve + MiB, TOTAL, outside).limit == MiB  # a MiB more than the reserve: a (tiny) limit


# ---------------------------------------------------------------- what a plan sets


class FakeCUDA:
    """torch.cuda as the plan sees it on a GPU of TOTAL bytes with ``outside`` bytes outside torch: mem_get_info,
    memory_reserved, is_initialized, current_device, and set_per_process_memory_fraction recorded in ``fractions``."""

    def __init__(self, monkeypatch, outside=500 * MiB, initialized=False):
        self.outside, self.fractions = outside, []
        for name, fn in (("mem_get_info", lambda device=None: (TOTAL - self.outside, TOTAL)),
                         ("memory_reserved", lambda device=None: 0), ("is_initialized", lambda: initialized),
                         ("current_device", lambda: 0),
                         ("set_per_process_memory_fraction", lambda f, device=None: self.fractions.append((f, device))),
                         ):
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(placement, "resolve_device", lambda d: torch.device(d if d != "auto" else "cuda"))
        for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """FakeCUDA(outside=..., initialized=...); at the end, the test's plans collected while it still stands (their
    finalizers call set_per_process_memory_fraction)."""
    yield lambda **kw: FakeCUDA(monkeypatch, **kw)
    gc.collect()
    assert not any(vram_cap._held.values()), vram_cap._held



def _plan(model, planned_for=None, **opts):
    """A plan on --device (default cuda) "here", through choose_plan's measure, or for a GPU ``planned_for`` not
    here (hetmoe plan --device cuda)."""
    cfg, meta, blocks, inter = model
    opts = {"cpu_memory": "4TiB", "max_context": 4096, "experts_format": "int4", "device": "cuda", **opts}
    return plan_model(meta, cfg, blocks, EngineOptions(**opts), inter, planned_for)


def test_a_capped_plan_limits_torch_while_it_lives(qwen, fake_cuda):
    cuda = fake_cuda()
    plan = _plan(qwen, gpu_memory="24GiB")
    want = (24 * GiB - CUDA_CONTEXT_BYTES) / TOTAL
    assert cuda.fractions == [(want, 0)] and vram_cap.held_fraction(0) == want
    assert plan.vram_limit.limit == 24 * GiB - CUDA_CONTEXT_BYTES and plan.vram_limit.outside == 500 * MiB
    assert plan.vram_limit.expandable is True
    assert vram_cap.envs.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"
    said = (f"torch's allocator is limited to {gib(24 * GiB - CUDA_CONTEXT_BYTES)} of this GPU's 80.00 GiB "
            "(--gpu-memory 24.00 GiB")
    assert any(said in n for n in plan.notes), plan.notes
    assert plan.budgets["VRAM"][0] == 24 * GiB and plan.vram_bytes <= 24 * GiB  # the context within the plan
    del plan
    gc.collect()
    assert cuda.fractions[-1] == (1.0, 0) and vram_cap.held_fraction(0) is None  # torch's default again


def test_the_newest_live_plan_holds_its_limit(qwen, fake_cuda):
    cuda = fake_cuda()
    first = _plan(qwen, gpu_memory="24GiB")
    second = _plan(qwen, gpu_memory="40GiB")
    assert [f for f, _ in cuda.fractions] == [(24 * GiB - CUDA_CONTEXT_BYTES) / TOTAL,
                                              (40 * GiB - CUDA_CONTEXT_BYTES) / TOTAL]
    del second
    gc.collect()
    assert cuda.fractions[-1][0] == (24 * GiB - CUDA_CONTEXT_BYTES) / TOTAL  # the first one's again
    del first
    gc.collect()
    assert cuda.fractions[-1] == (1.0, 0)


def test_more_outside_torch_than_the_context_shrinks_the_budget(qwen, fake_cuda):
    """1 GiB outside torch already: 1.25 GiB is kept for it, more than the plan's CUDA context row, which
    the VRAM budget loses (a note says); the plan and torch's limit still add up to the cap."""
    cuda = fake_cuda(outside=GiB)
    plan = _plan(qwen, gpu_memory="24GiB", gpu_experts="auto")
    more = GiB + LATE_CUDA_BYTES - CUDA_CONTEXT_BYTES
    assert plan.budgets["VRAM"][0] == 24 * GiB - more and plan.vram_bytes <= 24 * GiB - more
    assert plan.vram_bytes - plan.vram["CUDA context"] <= plan.vram_limit.limit  # what torch allocates fits its limit
    assert cuda.fractions[-1][0] == (24 * GiB - GiB - LATE_CUDA_BYTES) / TOTAL
    assert any("1.00 GiB of the GPU is outside torch already" in n for n in plan.notes), plan.notes
    assert plan.budgets["VRAM"][2] == f"--gpu-memory less {gib(more)}"  # the table's source of the budget


def test_a_cap_with_nothing_left_for_torch_is_refused_before_planning(qwen, fake_cuda):
    cuda = fake_cuda(outside=GiB)
    with pytest.raises(MemoryError, match="--gpu-memory 1.00 GiB leaves nothing for the model") as err:
        _plan(qwen, gpu_memory="1GiB")
    assert not isinstance(err.value, PlanError) and not cuda.fractions


def test_a_plan_that_does_not_fit_sets_nothing(qwen, fake_cuda):
    cuda = fake_cuda()
    with pytest.raises(PlanError):
        _plan(qwen, gpu_memory="2GiB")
    assert not cuda.fractions


def test_the_users_allocator_settings_stand(qwen, fake_cuda, monkeypatch):
    cuda = fake_cuda()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    plan = _plan(qwen, gpu_memory="24GiB")
    assert vram_cap.envs.get("PYTORCH_CUDA_ALLOC_CONF") == "max_split_size_mb:128"
    assert plan.vram_limit.expandable is False and len(cuda.fractions) == 1  # the limit is set all the same
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "garbage_collection_threshold:0.8")  # torch's newer name
    assert vram_cap.prepare() is False and vram_cap.envs.get("PYTORCH_CUDA_ALLOC_CONF") is None


def test_cuda_initialised_already_keeps_its_allocator(fake_cuda, monkeypatch):
    fake_cuda(initialized=True)
    assert vram_cap.prepare() is None and vram_cap.envs.get("PYTORCH_CUDA_ALLOC_CONF") is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # set before CUDA (bench e2e), asked again after
    assert vram_cap.prepare() is True
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert vram_cap.prepare() is True and vram_cap.envs.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"


@pytest.mark.parametrize("case", ["no cap", "cpu", "planned for a GPU not here"])
def test_nothing_is_set_without_a_cap_on_a_gpu_here(qwen, fake_cuda, case):
    cuda = fake_cuda()
    if case == "no cap":
        plan = _plan(qwen)
    elif case == "cpu":
        plan = _plan(qwen, device="cpu", gpu_memory="24GiB")
    else:
        plan = _plan(qwen, torch.device("cuda"), gpu_memory="24GiB")  # hetmoe plan --device cuda
    assert plan.vram_limit is None and not cuda.fractions
    assert vram_cap.envs.get("PYTORCH_CUDA_ALLOC_CONF") is None


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_a_capped_engine_stays_within_its_cap():
    """The deepseek-v3 shape, 2 layers (a dense layer, a MoE layer of 16 experts), with a cap 512 MiB above its
    plan: prefill of 2048 tokens and decode; torch's peak reserved + what is outside torch stays within the cap, and
    an allocation past torch's limit is an OutOfMemoryError though the GPU has room. The limit goes with the model."""
    from hetmoe.engine.runner import Runner
    from hetmoe.load import random_weights as synthetic

    shape = {**synthetic.SHAPES["deepseek-v3"], "first_k_dense_replace": 1, "n_routed_experts": 16}
    opts = EngineOptions(device="cuda", dense_format="int4", experts_format="int4", max_context=4096,
                         gpu_prefill="off")
    cfg = synthetic.shape_config(shape, 2)
    model = build_meta(cfg)
    blocks = moe_blocks(model)
    need = plan_model(model, cfg, blocks, EngineOptions(**{**opts.__dict__, "gpu_memory": 1 << 40}),
                      cfg.moe_intermediate_size, torch.device("cuda")).vram_bytes
    cap = need + 512 * MiB
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    loaded = synthetic.build_random_model(shape, 2, EngineOptions(**{**opts.__dict__, "gpu_memory": cap}),
                                          log=lambda m: None)
    lim = loaded.plan.vram_limit
    assert lim is not None and torch.cuda.get_per_process_memory_fraction() == pytest.approx(lim.fraction)
    runner = Runner(loaded)
    gen = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(runner.vocab_size, (2048,), generator=gen).tolist())
    for tok in torch.randint(runner.vocab_size, (8,), generator=gen).tolist():
        runner.decode(tok)
    runner.synchronize()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    peak = torch.cuda.max_memory_reserved() + outside
    msg = (f"peak reserved {torch.cuda.max_memory_reserved() / MiB:.0f} MiB + outside {outside / MiB:.0f} MiB, cap "
           f"{cap / MiB:.0f} MiB, torch limit {lim.limit / MiB:.0f} MiB, outside at the plan {lim.outside / MiB:.0f}")
    print(msg)
    assert torch.cuda.max_memory_reserved() <= lim.limit and peak <= cap, msg
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(lim.limit, dtype=torch.uint8, device="cuda")
    del runner, loaded
    gc.collect()
    assert torch.cuda.get_per_process_memory_fraction() == 1.0
