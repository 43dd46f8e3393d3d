"""The thread pool and job queue of the CPU expert engine, prepared jobs, and API errors."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from cases import make_routing, make_weights, make_x
from hetmoe.cpu import ISAS, CPUExperts, CPULinear, EngineJob, WorkerPool, cpu_info
from hetmoe.cpu.pool import job_list
from reference import rel_err

BEST_ISA = cpu_info()["best_isa"]
E, H, I = 12, 160, 96


def make_layer(pool, fmt="int8", group=128, shape=(E, H, I), seed=0, path=None) -> CPUExperts:
    """On ``path`` (tests/paths.py) when given, else on the best ISA with the engine's own AMX crossover."""
    kw = path.options if path is not None else {"isa": BEST_ISA}
    ex = CPUExperts(*shape, fmt, group, pool=pool, **kw)
    ex.load(*make_weights(*shape, seed))
    return ex


def make_inputs(T, k, shape=(E, H, I), seed=0):
    x = make_x(T, shape[1], seed)
    ids, w = make_routing(T, k, shape[0], seed)
    return x, ids, w


@pytest.fixture(scope="module")
def layer(pool):
    return make_layer(pool)


# ---------------------------------------------------------------- queue: order, sync, pending


def test_sync_allow_pending(pool):
    shapes = [(E, H, I), (8, 200, 88), (6, 1024, 512)]  # the slowest job goes last
    formats = [("bf16", 128), ("int4", 32), ("int8", 0)]
    layers = [make_layer(pool, fmt, g, shape, seed) for seed, ((fmt, g), shape) in enumerate(zip(formats, shapes))]
    calls = [make_inputs(T, 4, shape, seed) for seed, (T, shape) in enumerate(zip((7, 64, 300), shapes))]
    expected = [ex(*call) for ex, call in zip(layers, calls)]
    outs = [torch.full_like(y, math.nan) for y in expected]
    for ex, call, out in zip(layers, calls, outs):
        ex.submit(*call, out)
    pool.sync(allow_pending=1)
    assert pool.pending() <= 1
    assert torch.equal(outs[0], expected[0]) and torch.equal(outs[1], expected[1])
    pool.sync()
    assert pool.pending() == 0
    assert torch.equal(outs[2], expected[2])


def test_jobs_run_in_submission_order(pool):
    a, b = make_layer(pool, "bf16", seed=4), make_layer(pool, "int4", 64, seed=5)
    (xa, ia, wa), (xb, ib, wb) = make_inputs(64, 6, seed=4), make_inputs(64, 2, seed=5)
    ya, yb = a(xa, ia, wa), b(xb, ib, wb)
    out = torch.full((64, H), math.nan)
    a.submit(xa, ia, wa, out)  # overwrites
    b.submit(xb, ib, wb, out, accumulate=True)  # must see a's result
    a.submit(xa, ia, wa, out, accumulate=True)
    pool.sync()
    assert rel_err(out, 2 * ya.double() + yb.double()) <= 1e-6


def test_borrowed_job_id_is_stored_before_the_job_runs(pool):
    """A borrowed submission (CUDA host functions, stream signals) records its id for later release checks; the id
    must be in place before the job can start, or a job that finishes first is never seen as finished."""
    raw = pool._pool
    for _ in range(20):
        assert raw.borrowed_ids_seen(64) == 64


def test_resubmit_prepared_job_reads_current_contents(pool, engine_path):
    layer = make_layer(pool, path=engine_path)
    x, ids, w = make_inputs(64, 6, seed=6)
    x2, ids2, w2 = make_inputs(64, 6, seed=7)
    out = torch.empty(64, H)
    job = layer.prepare(x, ids, w, out)
    assert isinstance(job, EngineJob) and job.out is out
    pool.submit(job)
    pool.sync()
    assert torch.equal(out, layer(x, ids, w))
    x.copy_(x2)
    ids.copy_(ids2)
    pool.submit(job)
    pool.sync()
    assert torch.equal(out, layer(x2, ids2, w))
    w.copy_(w2)
    layer.submit(job)
    layer.sync()
    assert torch.equal(out, layer(x2, ids2, w2))


def test_n_tokens_read_at_execution(pool, engine_path):
    layer = make_layer(pool, path=engine_path)
    x, ids, w = make_inputs(64, 6, seed=8)
    sentinel = 12345.0
    out = torch.full((64, H), sentinel)
    n = torch.tensor([5])
    job = layer.prepare(x, ids, w, out, n_tokens=n)
    pool.submit(job)
    pool.sync()
    assert torch.equal(out[:5], layer(x[:5], ids[:5], w[:5]))
    assert (out[5:] == sentinel).all(), "rows beyond n_tokens were written"
    n[0] = 64
    pool.submit(job)
    pool.sync()
    assert torch.equal(out, layer(x, ids, w))
    out.fill_(sentinel)
    n[0] = 0
    pool.submit(job)
    pool.sync()
    assert (out == sentinel).all()
    for bad in (65, -1):
        n[0] = bad
        pool.submit(job)
        with pytest.raises(ValueError, match=rf"number of tokens {bad} is outside \[0, 64\], the capacity"):
            pool.sync()


def test_n_tokens_must_be_one_int64(layer):
    x, ids, w = make_inputs(4, 2)
    with pytest.raises(ValueError, match="n_tokens has dtype int32"):
        layer.prepare(x, ids, w, n_tokens=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="n_tokens must hold one value, got 2"):
        layer.prepare(x, ids, w, n_tokens=torch.tensor([2, 3]))


# ---------------------------------------------------------------- job errors


def test_job_list_runs_its_jobs_in_order_as_one_job(pool):
    """``job_list``: prepared jobs of experts and linears queued with one submit, each reading what the one before
    wrote; the same bits as the jobs submitted one by one. An error stops the list and is raised at the sync."""
    a, b = make_layer(pool, "int8", 64, seed=6), make_layer(pool, "int4", 64, seed=7)
    lin = CPULinear(H, H, "int8", 64, pool=pool)
    lin.load(torch.randn(H, H, generator=torch.Generator().manual_seed(6)) * 0.02)
    (x, ia, wa), (_, ib, wb) = make_inputs(3, 4, seed=6), make_inputs(3, 2, seed=7)
    h, out = torch.empty(3, H), torch.empty(3, H)
    jobs = [a.prepare(x, ia, wa, h), lin.prepare(h, out=out), b.prepare(h, ib, wb, out, accumulate=True)]
    pool.submit(job_list(jobs))
    pool.sync()
    ref_h = a(x, ia, wa)
    ref = lin(ref_h)
    b(ref_h, ib, wb, ref, accumulate=True)
    assert torch.equal(h, ref_h) and torch.equal(out, ref)
    job = job_list(jobs)
    ia[1, 0] = 999
    out.fill_(math.nan)
    pool.submit(job)
    with pytest.raises(ValueError, match="999"):
        pool.sync()
    assert out.isnan().all(), "the jobs after the failing one ran"
    with pytest.raises(TypeError, match="job_list"):
        job_list([])
    with pytest.raises(TypeError, match="job_list"):
        job_list([x])


def test_job_error_raised_once_at_sync(pool, layer):
    x, ids, w = make_inputs(7, 2, seed=9)
    bad = ids.clone()
    bad[2, 1] = 999
    good_out = torch.full((7, H), math.nan)
    layer.submit(x, bad, w)
    layer.submit(x, ids, w, good_out)
    with pytest.raises(ValueError, match=rf"topk_ids\[2, 1\] = 999 is not an expert id in \[0, {E}\) or -1"):
        pool.sync()
    pool.sync()  # the error was reported once
    assert torch.equal(good_out, layer(x, ids, w)), "the job after the failing one did not run"
    bad[2, 1] = -2
    with pytest.raises(ValueError, match=r"topk_ids\[2, 1\] = -2"):
        layer(x, bad, w)
    assert torch.equal(layer(x, ids, w), good_out)


def test_sync_raises_error_of_job_that_finished_before(pool, layer):
    """sync(allow_pending) also reports errors of jobs it did not wait for."""
    x, ids, w = make_inputs(7, 2, seed=10)
    bad = torch.full_like(ids, E)
    layer.submit(x, bad, w)
    with pytest.raises(ValueError, match=rf"topk_ids\[0, 0\] = {E}"):
        pool.sync()
    layer.submit(x, ids, w)
    pool.sync(allow_pending=5)  # no error pending
    pool.sync()


def test_load_does_not_consume_other_jobs_errors(pool, layer):
    x, ids, w = make_inputs(7, 2, seed=11)
    layer.submit(x, torch.full_like(ids, 999), w)
    other = CPUExperts(4, 64, 32, "bf16", isa=BEST_ISA, pool=pool)
    try:
        other.load(*make_weights(4, 64, 32, 11))
        assert other.info()["experts_loaded"] == 4
    finally:
        with pytest.raises(ValueError, match="999"):
            pool.sync()


# ---------------------------------------------------------------- argument checking


def test_bad_call_arguments(layer):
    x, ids, w = make_inputs(4, 2)
    cases = [
        (dict(x=x.half()), ValueError, "x has dtype float16; expected one of: float32, bfloat16"),
        (dict(x=x.int()), ValueError, "x has dtype int32"),
        (dict(x=torch.randn(4, H + 1)), ValueError, rf"x has hidden size {H + 1}; this layer has hidden_size={H}"),
        (dict(x=x[0]), ValueError, r"x must be 2-D, got shape \(160,\)"),
        (dict(x=torch.randn(H, 4).t()), ValueError, "x must be contiguous"),
        (dict(x=torch.randn(4, 2 * H)[:, ::2]), ValueError, "x must be contiguous"),
        (dict(x=x.numpy()), TypeError, "x must be a torch.Tensor, got ndarray"),
        (dict(w=w.double()), ValueError, "topk_weights has dtype float64; expected one of: float32"),
        (dict(ids=ids.float()), ValueError, "topk_ids has dtype float32; expected one of: int32, int64"),
        (dict(ids=ids[:3].contiguous()), ValueError, r"must both be \[T=4, k\]"),
        (dict(ids=ids[:, :1].contiguous()), ValueError, r"must both be \[T=4, k\]"),
        (dict(ids=ids[:, :0].contiguous(), w=w[:, :0].contiguous()), ValueError, "at least one column"),
        (dict(out=torch.empty(4, H - 1)), ValueError, rf"out has shape \(4, {H - 1}\); expected \(4, {H}\)"),
        (dict(out=torch.empty(5, H)), ValueError, "out has shape"),
        (dict(out=torch.empty(4, H, dtype=torch.float16)), ValueError, "out has dtype float16"),
        (dict(accumulate=True), ValueError, "accumulate=True needs an out tensor"),
        (dict(skip_mask=torch.zeros(E - 1, dtype=torch.bool)), ValueError,
         rf"skip_mask has {E - 1} entries; expected num_experts={E}"),
        (dict(skip_mask=torch.zeros(E)), ValueError, "skip_mask has dtype float32"),
        (dict(x=torch.empty(4, H, device="meta")), ValueError, "x is on meta"),
        (dict(ids=torch.empty(4, 2, dtype=torch.long, device="meta")), ValueError, "topk_ids is on meta"),
    ]
    for change, exc, match in cases:
        args = dict(x=x, ids=ids, w=w, out=None, accumulate=False, skip_mask=None) | change
        with pytest.raises(exc, match=match):
            layer(args["x"], args["ids"], args["w"], args["out"], accumulate=args["accumulate"],
                  skip_mask=args["skip_mask"])
    assert layer.pool.pending() == 0, "a rejected call must not enqueue a job"


@pytest.mark.gpu
@pytest.mark.gpu
def test_cuda_tensor_rejected(layer):
    x, ids, w = make_inputs(4, 2)
    with pytest.raises(ValueError, match="x is on cuda"):
        layer(x.cuda(), ids, w)


def test_forward_before_load(pool):
    ex = CPUExperts(E, H, I, "bf16", pool=pool)
    with pytest.raises(RuntimeError, match=r"no experts loaded yet: call load"):
        ex(*make_inputs(2, 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight_format="fp6"), "unknown weight_format 'fp6'; expected one of bf16, int8, int4"),
        (dict(weight_format="int8", group_size=48),
         r"group_size must be 16, 32, 64 or 128 \(or 0 for per-row\), got 48"),
        (dict(weight_format="int4", group_size=8), r"group_size must be 16, 32, 64 or 128 \(or 0 for per-row\), got 8"),
        (dict(weight_format="int4", group_size=256),
         r"group_size must be 16, 32, 64 or 128 \(or 0 for per-row\), got 256"),
        (dict(isa="sse4"), "unknown isa 'sse4'"),
        (dict(num_experts=0), "num_experts must be positive"),
        (dict(hidden_size=0), "hidden_size and intermediate_size must be positive"),
    ],
)
def test_bad_constructor_arguments(pool, kwargs, match):
    args = dict(num_experts=E, hidden_size=H, intermediate_size=I, pool=pool) | kwargs
    with pytest.raises(ValueError, match=match):
        CPUExperts(**args)


@pytest.mark.parametrize("isa", [i for i in ISAS if i not in cpu_info()["supported_isas"]] or [None])
def test_unsupported_isa(pool, isa):
    if isa is None:
        pytest.skip("this CPU supports every ISA level")
    with pytest.raises(ValueError, match=f"this CPU cannot run the {isa} kernels"):
        CPUExperts(E, H, I, "int8", isa=isa, pool=pool)


def test_bad_weights(pool):
    ex = CPUExperts(E, H, I, "int8", pool=pool)
    gate, up, down = make_weights(E, H, I, 0)
    nan = gate.clone()
    nan[3, 5, 7] = math.nan
    inf = down.clone()
    inf[1, 0, 0] = math.inf
    cases = [
        ((gate.transpose(1, 2), up, down), ValueError, r"gate\[0\] has shape \(160, 96\); expected \(96, 160\)"),
        ((gate, up, down[:, :, :-1]), ValueError, r"down\[0\] has shape \(160, 95\)"),
        ((gate[0], up, down), ValueError, "gate must be a stacked 3-D tensor or a list of 2-D tensors"),
        ((nan, up, down), ValueError, r"gate\[3\] contains NaN or Inf"),
        ((gate, up, inf), ValueError, r"down\[1\] contains NaN or Inf"),
        ((gate.int(), up, down), ValueError, "expert weights must be floating point"),
        ((gate, up[:5], down), ValueError, "gate, up and down hold 12, 5 and 12 experts"),
        ((torch.cat([gate, gate[:1]]), torch.cat([up, up[:1]]), torch.cat([down, down[:1]])), ValueError,
         r"experts \[0, 13\) do not fit in num_experts=12"),
        (([gate[0], "w"], [up[0], up[1]], [down[0], down[1]]), TypeError, r"gate\[1\] must be a torch.Tensor"),
    ]
    for weights, exc, match in cases:
        with pytest.raises(exc, match=match):
            ex.load(*weights)
    with pytest.raises(ValueError, match=r"experts \[10, 13\) do not fit"):
        ex.load(gate[:3], up[:3], down[:3], first_expert=10)
    with pytest.raises(ValueError, match="do not fit"):
        ex.load(gate[:1], up[:1], down[:1], first_expert=-1)
    with pytest.raises(ValueError, match=r"expert 99 out of range"):
        ex.dequantized(99)


def test_pool_arguments(pool):
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        WorkerPool(0)
    with pytest.raises(TypeError, match="submit expects a EngineJob"):
        pool.submit("job")
    with pytest.raises(ValueError, match="allow_pending must be >= 0, got -1"):
        pool.sync(-1)


# ---------------------------------------------------------------- info


def packed_bytes(fmt: str, group: int, n: int, k: int) -> int:
    """Bytes of one packed [n, k] matrix by the rules of csrc/formats/layout.h (data + scales)."""
    unit = 32 if fmt == "bf16" else (group or 128)  # K padding unit; per-row scales repeat per 128
    kp = -(-k // unit) * unit
    blocks = -(-n // 16)
    k_per_line = {"bf16": 2, "int8": 4, "int4": 8}[fmt]
    data = blocks * (kp // k_per_line) * 64
    scales = 0 if fmt == "bf16" else blocks * (kp // unit) * 16 * 4
    return data + scales


@pytest.mark.parametrize("fmt, group", [("bf16", 128), ("int8", 128), ("int8", 0), ("int8", 32), ("int4", 64),
                                        ("int4", 0)])
@pytest.mark.parametrize("shape", [(E, H, I), (3, 200, 88)])
def test_info(pool, fmt, group, shape):
    ex = CPUExperts(*shape, fmt, group, isa="scalar", pool=pool)
    info = ex.info()
    for key in ("weight_format", "group_size", "isa", "kernel", "activation", "bytes_per_expert", "threads"):
        assert key in info
    assert info["weight_format"] == fmt and info["isa"] == "scalar" and info["kernel"] == f"{fmt}/scalar"
    if fmt != "bf16":
        assert info["group_size"] == group
    assert info["activation"] == {"bf16": "fp32", "int8": "int16", "int4": "int8"}[fmt]
    _, h, i = shape
    assert info["bytes_per_expert"] == 2 * packed_bytes(fmt, group, i, h) + packed_bytes(fmt, group, h, i)
    assert info["threads"] == pool.threads == 2
    assert info["experts_loaded"] == 0
    best = CPUExperts(*shape, fmt, group, pool=pool).info()
    assert best["isa"] == BEST_ISA and best["kernel"].startswith(f"{fmt}/")


# ---------------------------------------------------------------- idle cost and call overhead

TASKS = Path("/proc/self/task")


def _thread_ids() -> set:
    return {int(t.name) for t in TASKS.iterdir()}


def _thread_state(tid: int) -> tuple:
    """(state letter, voluntary + involuntary context switches) of one thread of this process (Linux)."""
    stat = (TASKS / str(tid) / "stat").read_text()
    status = (TASKS / str(tid) / "status").read_text()
    switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    return stat[stat.rindex(")") + 2], switches


@pytest.mark.skipif(not TASKS.is_dir(), reason="needs Linux /proc/self/task to see the pool's threads")
def test_idle_pool_threads_park_and_stay_parked():
    """An idle pool costs no CPU: after their spin (spin_us) every pool thread blocks in an untimed wait on a
    condition variable (state S) and is not woken again while nothing is submitted. Checked as an invariant, not a
    CPU-time budget: the threads reach S (a spinning or yielding thread is R), then their context-switch counts stay
    equal, which a thread that polls (a timed sleep, a timed wait) would change at every wake-up."""
    before = _thread_ids()
    pool = WorkerPool(2)
    threads = sorted(_thread_ids() - before)
    assert len(threads) == 2, f"a pool of 2 starts 2 threads, found new threads {threads}"
    layer = make_layer(pool)
    layer(*make_inputs(64, 6))  # every thread has worked, then went idle
    deadline = time.monotonic() + 60  # waiting for a state, not timing anything: generous for a loaded machine
    while True:
        states = {t: _thread_state(t) for t in threads}
        if all(state == "S" for state, _ in states.values()):
            break
        assert time.monotonic() < deadline, f"pool threads never all parked: {states}"
        time.sleep(0.01)
    time.sleep(0.2)  # a window to watch, not synchronization: nothing can wake a parked pool thread
    after = {t: _thread_state(t) for t in threads}
    assert after == states, f"an idle pool thread woke up: {states} -> {after}"
    layer(*make_inputs(8, 2))  # and the parked pool still serves
    assert pool.pending() == 0


def test_submit_sync_overhead(pool, layer):
    x, ids, w = make_inputs(8, 2)
    out = torch.full((8, H), 7.0)
    job = layer.prepare(x, ids, w, out, n_tokens=torch.tensor([0]))
    n = 1000
    t0 = time.perf_counter()
    for _ in range(n):
        pool.submit(job)
        pool.sync()
    per_call = (time.perf_counter() - t0) / n
    assert pool.pending() == 0 and (out == 7.0).all()
    print(f"submit + sync of an empty job: {per_call * 1e6:.1f} us")
