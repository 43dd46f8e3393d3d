"""The CPU engine's worker threads: ``WorkerPool`` (pinned threads and their FIFO job queue), the process-wide pools
(``shared_pool``), ``EngineJob`` (a prepared call a pool runs) and what the machine offers (``cpu_info``).

All layers of a process share one ``WorkerPool`` per thread count; jobs of every layer run on it in submission order,
so ``submit`` / ``sync`` can keep several layers' work in flight. ``submit_on_stream`` / ``sync_on_stream`` do the
same in CUDA stream order, capturable into a CUDA graph (hetmoe/cpu/host_funcs.py; the rules they keep are in
``csrc/stream/``).
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Optional

import torch

from hetmoe import _C
from hetmoe.config.options import NumaOption
from hetmoe.cpu.host_funcs import HostFuncs, stream_arg
from hetmoe.cpu.numa import resolve_subpools

if TYPE_CHECKING:
    from hetmoe.cpu.experts import CPUExperts


def cpu_info() -> dict:
    """CPU features, the ISA levels this machine can run, and the physical cores the pool would use."""
    info = dict(_C.cpu_features())
    info["physical_cores"] = len(_C.physical_core_cpus())
    return info


# Cores the hybrid placement leaves to threads other than the expert pool's: the Python thread that launches and
# waits for the GPU work, and the stream-signal watcher (csrc/stream/signals.h), which spin while a decode step
# runs. A pool pinned to every core shares cores with them, and a worker descheduled in the middle of a parallel
# job holds the whole job up for a scheduler time slice: a decode step is many times slower
# (BENCHMARKS.md#reserved-cores).
HYBRID_RESERVED_CORES = 2


def default_threads(reserve: int = 0) -> int:
    """One thread per physical core this process may run on, less ``reserve`` (at least one)."""
    return max(1, len(_C.physical_core_cpus()) - reserve)


class WorkerPool:
    """Pinned worker threads and their FIFO job queue (shared by every layer using the same thread count).

    ``numa``: ``"off"`` (default: one pool), ``"auto"`` (one subpool per NUMA node) or N subpools
    (hetmoe/cpu/numa.py). With several, experts built on this pool are split across them; jobs are still
    submitted and synced here, through subpool 0.
    """

    def __init__(self, threads: Optional[int] = None, pin: bool = True, spin_us: int = 500, numa: NumaOption = "off"):
        threads = None if threads is None else int(threads)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.subpools = resolve_subpools(numa, threads)
        self._numa = None  # _C.NumaPools when split
        if self.subpools > 1:
            self._numa = _C.NumaPools(self.subpools, threads or 0, pin, spin_us)
            self._pool = self._numa.pool(0)
        else:
            self._pool = _C.ThreadPool(default_threads() if threads is None else threads, pin, spin_us)
        self._inflight: collections.deque = collections.deque()  # Python jobs kept alive until done
        self._lock = threading.Lock()
        self._host_funcs: Optional[HostFuncs] = None  # created by the first *_on_stream call

    @property
    def threads(self) -> int:
        return self._numa.threads if self._numa is not None else self._pool.size

    @property
    def pinned_cpus(self) -> list:
        if self._numa is not None:
            return [c for s in range(self.subpools) for c in self._numa.pool(s).pinned_cpus]
        return list(self._pool.pinned_cpus)

    @property
    def numa_plans(self) -> list:
        """Per subpool: ``{"nodes", "cpus", "threads", "memory_node"}`` (one entry when not split)."""
        if self._numa is not None:
            return self._numa.plans
        return [{"nodes": [], "cpus": self.pinned_cpus, "threads": self.threads, "memory_node": -1}]

    @property
    def numa_binding(self) -> str:
        return self._numa.binding if self._numa is not None else "one pool: first touch"

    def submit(self, job: EngineJob) -> None:
        """Enqueue a prepared job; returns at once."""
        if not isinstance(job, EngineJob):
            raise TypeError(f"submit expects a EngineJob (from CPUExperts.prepare), got {type(job).__name__}")
        with self._lock:
            self._inflight.append(job)
            self._pool.submit(job._job)

    def sync(self, allow_pending: int = 0) -> None:
        """Wait until at most ``allow_pending`` submitted jobs are unfinished; raise the first job error, also
        one of a job that a host function submitted (``submit_on_stream``), exactly once."""
        if int(allow_pending) < 0:
            raise ValueError(f"allow_pending must be >= 0, got {allow_pending}")
        try:
            self._pool.sync(int(allow_pending))
        finally:
            with self._lock:
                pending = self._pool.pending()
                while len(self._inflight) > pending:
                    self._inflight.popleft()

    def submit_on_stream(self, job: EngineJob, stream=None, *, host_funcs: Optional[HostFuncs] = None) -> None:
        """Enqueue a CUDA host function that submits ``job`` when ``stream`` reaches it; returns at once.

        ``stream``: a ``torch.cuda.Stream`` (None: the current stream). The submission happens on the driver's
        thread (no Python), once, or at every replay when the stream is being captured into a CUDA graph. Data
        the job reads must be on the host by then: copy it with ``non_blocking=True`` on the same stream before
        this call. ``host_funcs``: who keeps the host function's payload and the job (default: this pool's own).
        """
        if not isinstance(job, EngineJob):
            raise TypeError(f"submit_on_stream expects a EngineJob (from CPUExperts.prepare), got {type(job).__name__}")
        handle = stream_arg(stream, "submit_on_stream")
        self._owner(host_funcs).submit(self, job, handle)

    def sync_on_stream(self, allow_pending: int = 0, stream=None, *, host_funcs: Optional[HostFuncs] = None) -> None:
        """Enqueue a CUDA host function that blocks ``stream`` until at most ``allow_pending`` jobs of this pool
        are unfinished; returns at once. Work queued on the stream after it (an ``out.to("cuda",
        non_blocking=True)``) sees the finished jobs' results. A job's error cannot stop the stream: it is
        raised by the next ``sync()``. Put it on a side stream joined with events to keep the main stream busy.
        """
        if int(allow_pending) < 0:
            raise ValueError(f"allow_pending must be >= 0, got {allow_pending}")
        handle = stream_arg(stream, "sync_on_stream")
        self._owner(host_funcs).sync(self, int(allow_pending), handle)

    def _owner(self, host_funcs: Optional[HostFuncs]) -> HostFuncs:
        if host_funcs is not None:
            if not isinstance(host_funcs, HostFuncs):
                raise TypeError(f"host_funcs must be a HostFuncs, got {type(host_funcs).__name__}")
            return host_funcs
        with self._lock:
            if self._host_funcs is None:
                self._host_funcs = HostFuncs()
            return self._host_funcs

    def pending(self) -> int:
        return self._pool.pending()

    def __del__(self):
        host_funcs = getattr(self, "_host_funcs", None)
        if host_funcs is not None:
            host_funcs.close()
        # Jobs still queued point into tensors this object keeps alive: let them finish before both go.
        pool = getattr(self, "_pool", None)
        if pool is not None and pool.pending():
            try:
                pool.sync(0)
            except Exception:
                pass

    def read_bandwidth(self, nbytes: int = 1 << 30, repeats: int = 5, isa: Optional[str] = None) -> float:
        """STREAM-style read bandwidth of DRAM with this pool's threads, in GB/s (best of ``repeats``); with
        subpools, all of them at once, each on its own buffer."""
        owner = self._numa if self._numa is not None else self._pool
        return owner.read_bandwidth(int(nbytes), int(repeats), isa or _C.cpu_features()["best_isa"])

    def amx_peak(self, dtype: str = "int8", rounds: int = 200000) -> float:
        """The AMX tile unit's own rate with every thread of this pool: TFLOPS (2 x multiply-adds; TOPS for int8)
        of back-to-back tdpbf16ps / tdpbsud on register tiles, nothing loaded or stored: the ceiling of the AMX
        GEMM on this machine. ValueError where AMX cannot run; a pool split over NUMA nodes is not supported."""
        if dtype not in ("bf16", "int8"):
            raise ValueError(f"dtype must be bf16 or int8, got {dtype!r}")
        if self._numa is not None:
            raise ValueError("amx_peak runs on one pool; this one is split over NUMA subpools")
        return self._pool.amx_peak(dtype == "bf16", int(rounds))


_pools: dict = {}
_pools_lock = threading.Lock()


def shared_pool(threads: Optional[int] = None, numa: NumaOption = "auto") -> WorkerPool:
    """The process-wide pool with this many threads and NUMA subpools (created on first use)."""
    subpools = resolve_subpools(numa, None if threads is None else int(threads))
    threads = default_threads() if threads is None else int(threads)
    with _pools_lock:
        if (threads, subpools) not in _pools:
            _pools[threads, subpools] = WorkerPool(threads, numa=subpools)
        return _pools[threads, subpools]


def default_pool() -> WorkerPool:
    """The pool the engine's experts run on (the first shared pool made in this process), else a new shared one."""
    with _pools_lock:
        if _pools:
            return next(iter(_pools.values()))
    return shared_pool()


class EngineJob:
    """A prepared call with fixed buffers; submit it as often as needed (the buffers' contents may change)."""

    def __init__(self, job, keep: tuple, experts: "CPUExperts", out: torch.Tensor):
        self._job = job
        self._keep = keep  # tensors whose memory the C++ job points into
        self.experts = experts
        self.out = out


def job_list(jobs) -> EngineJob:
    """Prepared jobs (``EngineJob``s of experts, linears, decode blocks) run one after another as one job
    (csrc/runtime/thread_pool.h ``JobList``): one submit and one sync for a decode step's calls, the pool's threads
    going from one call to the next without a round trip through the submitting thread. ``out``: the last job's."""
    jobs = list(jobs)
    if not jobs or not all(isinstance(j, EngineJob) for j in jobs):
        raise TypeError("job_list takes a non-empty list of prepared jobs (EngineJob)")
    return EngineJob(_C.JobList([j._job for j in jobs]), tuple(jobs), None, jobs[-1].out)
