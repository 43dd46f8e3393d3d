"""Stream host functions (csrc/stream/host_funcs.h): WorkerPool.submit_on_stream / sync_on_stream.

On machines without CUDA the host functions run on ``_C.FakeStream``, a stand-in whose own thread calls them in
order as the driver's thread would, and which can record and replay them as a CUDA graph does: that covers the
payloads, their lifetimes, the error path and submissions from foreign threads. The tests marked gpu run the
same sequences on real CUDA streams and graphs.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time

import pytest
import torch

from cases import make_routing, make_weights, make_x
from hetmoe import _C, cpu
from hetmoe.cpu import CPUExperts, HostFuncs, Slots, WorkerPool, cpu_info

BEST_ISA = cpu_info()["best_isa"]
E, H, I = 12, 160, 96
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.gpu


def make_inputs(T, k, seed=0):
    x = make_x(T, H, "hooks", seed)
    ids, w = make_routing(T, k, E, "hooks", seed)
    return x, ids, w


@pytest.fixture(scope="module")
def layer(pool):
    ex = CPUExperts(E, H, I, "int8", 128, isa=BEST_ISA, pool=pool)
    ex.load(*make_weights(E, H, I, "hooks"))
    return ex


@pytest.fixture(params=["callbacks", "signals"])
def mech(request):
    """The stream mechanism under test (hetmoe.cpu.HostFuncs): CUDA host functions or stream signals."""
    return request.param


def payloads(hf, submits: int, syncs: int) -> int:
    """Payloads a HostFuncs holds for that many live submits and syncs: host functions keep one per call,
    stream signals one per submit (a sync only enqueues waits on the submits' signals)."""
    return submits + (syncs if hf.mechanism == "callbacks" else 0)


def driver_has_host_funcs() -> bool:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return all(hasattr(lib, name) for name in ("cuLaunchHostFunc", "cuStreamIsCapturing"))


# ---------------------------------------------------------------- without CUDA


def test_available_matches_driver():
    assert cpu.cuda_hooks_available() == _C.cuda_hooks_available() == driver_has_host_funcs()
    if not cpu.cuda_hooks_available():
        assert "CUDA host functions need" in _C.cuda_hooks_error()
    else:
        assert _C.cuda_hooks_error() == ""


@pytest.mark.skipif(HAS_CUDA, reason="checks the error without CUDA")
def test_stream_ops_need_cuda(pool, layer):
    x, ids, w = make_inputs(3, 2)
    job = layer.prepare(x, ids, w)
    with pytest.raises(RuntimeError, match="submit_on_stream needs a CUDA device and driver"):
        pool.submit_on_stream(job)
    with pytest.raises(RuntimeError, match="sync_on_stream needs a CUDA device and driver"):
        pool.sync_on_stream()
    with pytest.raises(RuntimeError, match="sync_on_stream needs a CUDA device and driver"):
        pool.sync_on_stream(1, stream=None)
    assert pool.pending() == 0


@pytest.mark.skipif(HAS_CUDA, reason="checks the error without CUDA")
def test_bench_overhead_stream_without_cuda(capsys):
    from hetmoe.cli import main

    assert main(["bench", "overhead", "--stream", "--with-copies", "--iters", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(
        "hetmoe bench overhead: error: bench overhead --stream needs a CUDA device and driver")


def test_bad_arguments(pool, layer, stream):
    x, ids, w = make_inputs(3, 2)
    with pytest.raises(TypeError, match="submit_on_stream expects a EngineJob"):
        pool.submit_on_stream(x, stream)
    with pytest.raises(ValueError, match="allow_pending must be >= 0, got -1"):
        pool.sync_on_stream(-1, stream)
    with pytest.raises(TypeError, match="host_funcs must be a HostFuncs"):
        pool.sync_on_stream(0, stream, host_funcs=[])
    if HAS_CUDA:
        with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream or None"):
            pool.sync_on_stream(0, stream=7)


def test_fake_stream_misuse(stream):
    stream.begin_capture()
    with pytest.raises(RuntimeError, match="already capturing"):
        stream.begin_capture()
    with pytest.raises(RuntimeError, match="replay while capturing"):
        stream.replay()
    stream.end_capture()
    with pytest.raises(RuntimeError, match="without begin_capture"):
        stream.end_capture()


# ---------------------------------------------------------------- host functions on a (fake) stream


def test_submit_and_sync_in_stream_order(pool, layer, stream, mech):
    x, ids, w = make_inputs(7, 4, seed=1)
    expected = layer(x, ids, w)
    out = torch.full((7, H), math.nan)
    job = layer.prepare(x, ids, w, out)
    hf = HostFuncs(mech)
    stream.pause()  # the stream has not reached the host functions yet
    pool.submit_on_stream(job, stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    assert pool.pending() == 0 and out.isnan().all(), "the job was submitted before the stream reached it"
    assert len(hf) == payloads(hf, 1, 1) and hf._c.n_not_run == payloads(hf, 1, 1) and hf.n_captured == 0
    hf._c.release_finished()
    assert len(hf) == payloads(hf, 1, 1), "payloads freed before their host functions ran"
    stream.resume()
    stream.synchronize()
    assert torch.equal(out, expected)
    pool.sync()
    pool.sync_on_stream(0, stream, host_funcs=hf)  # frees the finished ones first
    stream.synchronize()
    assert len(hf) == payloads(hf, 0, 1) and not hf._jobs
    hf.close()
    assert len(hf) == 0


def test_paired_deferral_jobs_pair_through_the_stream(pool, layer, stream, mech):
    """A deferring layer's two jobs submitted on a stream in a hybrid step's order run as one list of tasks whichever
    mechanism queues them (the immediate job finds its partner through the mechanism's wrapper job), with the bits of
    the two jobs run one at a time."""
    x, ids, w = make_inputs(3, 4, seed=3)
    imm = layer.prepare(x, ids, w, torch.empty(3, H), slots=Slots.immediate(2))
    dfr = layer.prepare(x, ids, w, torch.empty(3, H), slots=Slots.deferred(2, pair=imm))
    for job in (imm, dfr):
        pool.submit(job)
        pool.sync()
    want = (imm.out.clone(), dfr.out.clone())
    hf = HostFuncs(mech)
    before = _C.paired_deferral_runs()
    gate = _C.GateJob()  # holds the pool until the stream has queued both jobs behind it: pairing by order alone
    pool._pool.submit(gate)
    try:
        stream.pause()
        pool.submit_on_stream(imm, stream, host_funcs=hf)
        pool.submit_on_stream(dfr, stream, host_funcs=hf)
        pool.sync_on_stream(0, stream, host_funcs=hf)
        stream.resume()
        # the stream's thread submits both jobs, then waits at its sync: a state to wait for, not a duration
        deadline = time.monotonic() + 60
        while pool.pending() < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pool.pending() == 3, pool.pending()  # the gate, the immediate job and the deferred one
    finally:
        gate.open()  # before synchronize: the sync host function waits on the pool
    stream.synchronize()
    pool.sync()
    assert _C.paired_deferral_runs() == before + 1
    assert torch.equal(imm.out, want[0]) and torch.equal(dfr.out, want[1])
    hf.close()


def test_sync_host_function_blocks_the_stream(pool, layer, stream):
    """The stream passes a sync host function only when the pool's jobs are done, those submitted from Python
    included (a callbacks-only guarantee: stream signals wait for their own submissions)."""
    x, ids, w = make_inputs(300, 6, seed=2)
    jobs = [layer.prepare(x, ids, w) for _ in range(8)]
    for job in jobs:  # several milliseconds of work, submitted from Python
        pool.submit(job)
    hf = HostFuncs("callbacks")
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.synchronize()
    assert pool.pending() == 0
    pool.sync()
    expected = layer(x, ids, w)
    assert all(torch.equal(job.out, expected) for job in jobs)
    hf.close()


def test_job_error_raised_at_next_sync_once(pool, layer, stream, mech):
    x, ids, w = make_inputs(7, 2, seed=4)
    bad = ids.clone()
    bad[2, 1] = 999
    hf = HostFuncs(mech)
    pool.submit_on_stream(layer.prepare(x, bad, w), stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.synchronize()  # the stream went on: the error waits in the pool
    assert pool.pending() == 0
    with pytest.raises(ValueError, match=rf"topk_ids\[2, 1\] = 999 is not an expert id in \[0, {E}\) or -1"):
        pool.sync()
    pool.sync()  # reported once
    out = torch.full((7, H), math.nan)
    pool.submit_on_stream(layer.prepare(x, ids, w, out), stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.synchronize()
    pool.sync()
    assert torch.equal(out, layer(x, ids, w)), "the pool stopped working after the error"
    hf.close()


def test_error_of_a_replayed_job_each_time(pool, layer, stream, mech):
    """A captured job that fails fails at every replay; each failure is raised by one sync."""
    x, ids, w = make_inputs(4, 2, seed=5)
    n = torch.tensor([4])
    job = layer.prepare(x, ids, w, n_tokens=n)
    hf = HostFuncs(mech)
    stream.begin_capture()
    pool.submit_on_stream(job, stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.end_capture()
    for bad in (9, -3):
        n[0] = bad
        stream.replay()
        stream.synchronize()
        with pytest.raises(ValueError, match=rf"number of tokens {bad} is outside \[0, 4\]"):
            pool.sync()
        pool.sync()
    hf.close()


def test_captured_host_functions_replay(pool, layer, stream, mech):
    """Captured once, replayed 5 times with new inputs and n_tokens: each replay submits and syncs again."""
    cap, k = 8, 4
    sentinel = 12345.0
    x_host, ids_host = torch.zeros(cap, H), torch.zeros(cap, k, dtype=torch.int64)
    w_host, out_host = torch.zeros(cap, k), torch.full((cap, H), sentinel)
    n = torch.tensor([cap])
    job = layer.prepare(x_host, ids_host, w_host, out_host, n_tokens=n)
    hf = HostFuncs(mech)
    stream.begin_capture()
    pool.submit_on_stream(job, stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.end_capture()
    stream.synchronize()
    assert pool.pending() == 0 and (out_host == sentinel).all(), "a captured host function ran at capture"
    assert len(hf) == payloads(hf, 1, 1) and hf.n_captured == payloads(hf, 1, 1)
    del job  # the HostFuncs keeps it (and its tensors) for the replays
    for i, t in enumerate((1, 3, 8, 2, 5)):
        x, ids, w = make_inputs(cap, k, seed=10 + i)
        x_host.copy_(x)
        ids_host.copy_(ids)
        w_host.copy_(w)
        n[0] = t
        out_host.fill_(sentinel)
        stream.replay()
        stream.synchronize()
        assert pool.pending() == 0
        assert torch.equal(out_host[:t], layer(x[:t], ids[:t], w[:t])), f"replay {i}"
        assert (out_host[t:] == sentinel).all()
        hf._release()
        assert len(hf) == payloads(hf, 1, 1), "captured payloads must live as long as the HostFuncs"
    pool.sync()
    hf.close()
    assert len(hf) == 0 and not hf._jobs


def test_close_leaks_host_functions_not_run_yet(pool, layer, stream, mech):
    """Closing a HostFuncs before its stream reached a host function keeps that payload and job's buffers."""
    x, ids, w = make_inputs(5, 3, seed=6)
    out = torch.full((5, H), math.nan)
    job = layer.prepare(x, ids, w, out)
    hf = HostFuncs(mech)
    stream.pause()
    pool.submit_on_stream(job, stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)  # the stream passes this only once the job is done
    n_leaked = len(cpu.leaked_jobs)
    hf.close()
    try:
        assert len(hf) == 0 and cpu.leaked_jobs[n_leaked:] == [job]
        del job
        stream.resume()
        stream.synchronize()
        pool.sync()
        assert torch.equal(out, layer(x, ids, w))
    finally:
        del cpu.leaked_jobs[n_leaked:]


def test_default_host_funcs_of_the_pool(stream):
    pool = WorkerPool(1)
    ex = CPUExperts(E, H, I, "int8", 128, isa=BEST_ISA, pool=pool)
    ex.load(*make_weights(E, H, I, "hooks"))
    x, ids, w = make_inputs(6, 2, seed=7)
    out = torch.full((6, H), math.nan)
    job = ex.prepare(x, ids, w, out)
    for _ in range(3):
        pool.submit_on_stream(job, stream)
        pool.sync_on_stream(0, stream)
    stream.synchronize()
    assert torch.equal(out, ex(x, ids, w))
    pool.sync_on_stream(0, stream)
    assert len(pool._host_funcs) <= 2, "eager payloads are freed once done"
    stream.synchronize()
    del pool, ex, job  # closes its HostFuncs, then the pool


def test_submissions_from_foreign_threads(pool, layer):
    """Host functions on several streams (each its own thread) and Python threads submit to one pool at once:
    every job runs exactly once, in each submitter's order. Each job accumulates, so a lost or doubled
    submission changes the sum."""
    rounds, k = 25, 3
    streams = [_C.FakeStream() for _ in range(3)]
    clients = []
    for c in range(len(streams) + 3):
        x, ids, w = make_inputs(5 + c, k, seed=100 + c)
        out = torch.zeros(5 + c, H)
        clients.append((layer.prepare(x, ids, w, out, accumulate=True), x, ids, w, out))
    expected = []
    for _, x, ids, w, _ in clients:
        ref = torch.zeros(x.shape[0], H)
        for _ in range(rounds):
            layer(x, ids, w, ref, accumulate=True)
        expected.append(ref)

    hf = HostFuncs()
    for s in streams:
        s.pause()  # let them all start together
    for s, (job, *_rest) in zip(streams, clients):
        for r in range(rounds):
            pool.submit_on_stream(job, s, host_funcs=hf)
            pool.sync_on_stream(r % 3, s, host_funcs=hf)

    errors = []

    def python_client(job):
        try:
            for r in range(rounds):
                pool.submit(job)
                pool.sync(allow_pending=r % 2)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=python_client, args=(c[0],)) for c in clients[len(streams):]]
    for s in streams:
        s.resume()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in streams:
        s.synchronize()
    pool.sync()
    assert not errors
    assert pool.pending() == 0
    for i, ((*_, out), ref) in enumerate(zip(clients, expected)):
        assert torch.equal(out, ref), f"client {i}"
    hf._release()
    assert len(hf) == 0 and not hf._jobs
    hf.close()


# ---------------------------------------------------------------- on a GPU


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


@gpu
@needs_cuda
def test_gpu_submit_sync_on_stream(pool, layer, mech):
    T, k = 7, 4
    x, ids, w = make_inputs(T, k, seed=20)
    x_half = (x / 2).cuda()
    x_pin = _pinned(torch.full((T, H), math.nan))
    out_pin = _pinned(torch.full((T, H), math.nan))
    job = layer.prepare(x_pin, _pinned(ids), _pinned(w), out_pin, n_tokens=torch.tensor([T]))
    out_gpu = torch.full((T, H), math.nan, device="cuda")
    hf = HostFuncs(mech)
    # Load the kernels used below first: CUDA loads a module at a kernel's first launch, and that load waited for
    # the busy device on the GPU machine, so the host functions were enqueued only after the sleep had ended.
    x_pin.copy_(x_half * 2, non_blocking=True)
    torch.cuda.synchronize()
    x_pin.fill_(math.nan)
    before = pool.pending()
    torch.cuda._sleep(1_000_000_000)  # the device is busy while we enqueue: nothing below may run early
    x_gpu = x_half * 2  # a kernel writes the input
    x_pin.copy_(x_gpu, non_blocking=True)
    pool.submit_on_stream(job, host_funcs=hf)
    pool.sync_on_stream(host_funcs=hf)
    out_gpu.copy_(out_pin, non_blocking=True)
    pending, untouched = pool.pending(), bool(out_pin.isnan().all())
    assert pending == before == 0 and untouched, (
        f"the job ran before the stream reached it (pending {before} -> {pending}, output untouched: {untouched})")
    torch.cuda.synchronize()
    pool.sync()
    assert torch.equal(out_gpu.cpu(), layer(x, ids, w))
    hf.close()


@gpu
@needs_cuda
def test_gpu_sync_on_side_stream(pool, layer, mech):
    """The layout of a decode step: submit on the main stream, wait on a side stream joined by events."""
    T, k = 5, 6
    x, ids, w = make_inputs(T, k, seed=21)
    x_gpu = x.cuda()
    x_pin, out_pin = _pinned(torch.zeros(T, H)), _pinned(torch.full((T, H), math.nan))
    job = layer.prepare(x_pin, _pinned(ids), _pinned(w), out_pin)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    hf = HostFuncs(mech)
    x_pin.copy_(x_gpu, non_blocking=True)
    pool.submit_on_stream(job, host_funcs=hf)
    side.wait_stream(main)
    pool.sync_on_stream(0, side, host_funcs=hf)
    shared = x_gpu * 3  # the main stream computes meanwhile
    main.wait_stream(side)
    out_gpu = out_pin.to("cuda", non_blocking=True) + shared * 0
    torch.cuda.synchronize()
    pool.sync()
    assert torch.equal(out_gpu.cpu(), layer(x, ids, w))
    hf.close()


@gpu
@needs_cuda
def test_gpu_graph_replays(pool, layer, mech):
    cap, k = 8, 4
    x_src = torch.zeros(cap, H, device="cuda")
    x_pin = _pinned(torch.zeros(cap, H))
    ids_pin, w_pin = _pinned(torch.zeros(cap, k, dtype=torch.int64)), _pinned(torch.zeros(cap, k))
    out_pin = _pinned(torch.zeros(cap, H))
    out_gpu = torch.zeros(cap, H, device="cuda")
    n = torch.tensor([cap])
    job = layer.prepare(x_pin, ids_pin, w_pin, out_pin, n_tokens=n)
    hf = HostFuncs(mech)

    def step():
        x_pin.copy_(x_src * 2, non_blocking=True)
        pool.submit_on_stream(job, host_funcs=hf)
        pool.sync_on_stream(host_funcs=hf)
        out_gpu.copy_(out_pin, non_blocking=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    assert hf.n_captured == payloads(hf, 1, 1)
    for i, t in enumerate((1, 3, 8, 2, 5)):
        x, ids, w = make_inputs(cap, k, seed=30 + i)
        x_src.copy_(x / 2)
        ids_pin.copy_(ids)
        w_pin.copy_(w)
        n[0] = t
        graph.replay()
        torch.cuda.synchronize()
        pool.sync()
        assert torch.equal(out_gpu[:t].cpu(), layer(x[:t], ids[:t], w[:t])), f"replay {i} (T={t})"
    assert hf.n_captured == payloads(hf, 1, 1)
    del graph
    hf.close()
    assert len(hf) == 0


@gpu
@needs_cuda
def test_gpu_job_error_at_next_sync_once(pool, layer, mech):
    T, k = 6, 2
    x, ids, w = make_inputs(T, k, seed=40)
    bad = ids.clone()
    bad[1, 0] = E + 5
    x_pin, ids_pin, w_pin = _pinned(x), _pinned(bad), _pinned(w)
    out_pin = _pinned(torch.full((T, H), math.nan))
    job = layer.prepare(x_pin, ids_pin, w_pin, out_pin)
    hf = HostFuncs(mech)
    pool.submit_on_stream(job, host_funcs=hf)
    pool.sync_on_stream(host_funcs=hf)
    torch.cuda.synchronize()  # the stream went on
    with pytest.raises(ValueError, match=rf"topk_ids\[1, 0\] = {E + 5} is not an expert id"):
        pool.sync()
    pool.sync()
    ids_pin.copy_(ids)
    pool.submit_on_stream(job, host_funcs=hf)
    pool.sync_on_stream(host_funcs=hf)
    out_gpu = out_pin.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    pool.sync()
    assert torch.equal(out_gpu.cpu(), layer(x, ids, w))
    hf.close()


# ---------------------------------------------------------------- stream signals only (csrc/stream/signals.h)


def test_signals_sync_covers_all_but_the_newest(pool, layer, stream):
    """sync(allow_pending=1) after two submits waits for the first only; sync(0) then for the second."""
    x, ids, w = make_inputs(300, 6, seed=50)
    out_a, out_b = torch.full((300, H), math.nan), torch.full((300, H), math.nan)
    a, b = layer.prepare(x, ids, w, out_a), layer.prepare(x, ids, w, out_b)
    hf = HostFuncs("signals")
    stream.pause()  # not reached yet
    pool.submit_on_stream(a, stream, host_funcs=hf)
    pool.submit_on_stream(b, stream, host_funcs=hf)
    pool.sync_on_stream(1, stream, host_funcs=hf)
    assert len(hf._c) == 2 and hf._c.n_not_run == 2
    stream.resume()
    stream.synchronize()  # the stream passed the wait for a: a is done
    expected = layer(x, ids, w)
    assert torch.equal(out_a, expected)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.synchronize()
    assert torch.equal(out_b, expected)
    assert hf._c.kicks == 2
    pool.sync()
    hf._release()
    assert len(hf) == 0 and not hf._jobs, "signals the stream has passed are freed"
    hf.close()


def test_signals_slots_are_reused(pool, layer, stream):
    """Eager submits release their signal once the stream has passed it: the slots in use stay few however
    many rounds run (the memory has 4096), and no submission is lost or doubled."""
    x, ids, w = make_inputs(2, 2, seed=51)
    out = torch.zeros(2, H)
    job = layer.prepare(x, ids, w, out, accumulate=True)
    hf = HostFuncs("signals")
    rounds = 300
    for r in range(rounds):
        pool.submit_on_stream(job, stream, host_funcs=hf)
        pool.sync_on_stream(0, stream, host_funcs=hf)
        if r % 50 == 49:
            stream.synchronize()
    stream.synchronize()
    pool.sync()
    assert hf._c.kicks == rounds, "a submission was lost or doubled"
    assert hf._c.slot_high_water <= 60, f"{hf._c.slot_high_water} slots used for one signal in flight at a time"
    assert torch.allclose(out, layer(x, ids, w) * rounds, rtol=1e-3, atol=1e-6)
    hf.close()


def test_signals_capacity_error(pool, layer, stream):
    x, ids, w = make_inputs(2, 2, seed=52)
    job = layer.prepare(x, ids, w)
    hf = HostFuncs("signals")
    stream.begin_capture()
    with pytest.raises(RuntimeError, match="more than 4096 stream signals alive"):
        for _ in range(4097):
            pool.submit_on_stream(job, stream, host_funcs=hf)
    stream.end_capture()
    assert hf.n_captured == 4096
    hf.close()
    assert len(hf) == 0


def test_signals_sync_on_another_pool_is_an_error(pool, layer, stream):
    x, ids, w = make_inputs(2, 2, seed=53)
    hf = HostFuncs("signals")
    pool.submit_on_stream(layer.prepare(x, ids, w), stream, host_funcs=hf)
    other = WorkerPool(1)
    with pytest.raises(ValueError, match="runs on another pool"):
        other.sync_on_stream(0, stream, host_funcs=hf)
    pool.sync_on_stream(0, stream, host_funcs=hf)
    stream.synchronize()
    pool.sync()
    hf.close()


def test_unknown_mechanism():
    with pytest.raises(ValueError, match="unknown stream mechanism 'pigeons'"):
        HostFuncs("pigeons")
    assert cpu.default_mechanism() == ("signals" if _C.stream_signals_available() else "callbacks")
