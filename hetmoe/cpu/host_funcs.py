"""Stream-ordered CPU work: the owner of what ``WorkerPool.submit_on_stream`` / ``sync_on_stream`` enqueue on a
CUDA stream (``HostFuncs``), by one of two mechanisms: stream signals (``csrc/stream/signals.h``, the default where
the driver has stream memory operations) or CUDA host functions (``csrc/stream/host_funcs.h``). CPU tests use
``_C.FakeStream`` in place of a CUDA stream.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

import torch

from hetmoe import _C

if TYPE_CHECKING:
    from hetmoe.cpu import EngineJob, WorkerPool


def cuda_hooks_available() -> bool:
    """Whether the NVIDIA driver (libcuda.so.1 with cuLaunchHostFunc) was found: stream host functions need it."""
    return _C.cuda_hooks_available()


def stream_arg(stream, what: str):
    """The raw handle of ``stream`` (a torch.cuda.Stream; None: the current stream), or a ``_C.FakeStream``."""
    if isinstance(stream, _C.FakeStream):  # the stand-in the CPU tests use
        return stream
    if not _C.cuda_hooks_available():
        raise RuntimeError(f"{what} needs a CUDA device and driver: {_C.cuda_hooks_error()}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device and driver: torch sees no CUDA device")
    if stream is None:
        stream = torch.cuda.current_stream()
    elif not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"{what}: stream must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    return int(stream.cuda_stream)


def _synchronize_cuda() -> None:
    """Best effort: may run from a finalizer, even at interpreter exit."""
    try:
        # Not during a capture (the garbage collector may call this then): synchronizing would break it.
        if torch.cuda.is_available() and torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
    except Exception:
        pass


leaked_jobs: list = []  # jobs of host functions closed before their stream reached them (see HostFuncs.close)


MECHANISMS = ("signals", "callbacks")


def default_mechanism() -> str:
    """``signals`` where the driver has stream memory operations (CUDA 11.7+), else ``callbacks``."""
    return "signals" if _C.stream_signals_available() else "callbacks"


class HostFuncs:
    """Owner of the stream-ordered work enqueued by ``WorkerPool.submit_on_stream`` / ``sync_on_stream``.

    Two mechanisms, one behaviour: ``signals`` (default where available; csrc/stream/signals.h) has the GPU
    write and wait on words of pinned host memory that a watcher thread turns into pool submissions;
    ``callbacks`` (csrc/stream/host_funcs.h) enqueues CUDA host functions. Work enqueued while the stream is captured
    into a CUDA graph happens at every replay of that graph. Its payload (and the ``EngineJob`` whose buffers it
    reads) is kept here: eager ones until they have run and their job is done, captured ones until
    ``close()``. So keep a ``HostFuncs`` alive at least as long as the graphs captured through it, and close it
    (or drop it) only when no replay is in flight. Each ``WorkerPool`` has one (used when none is given) that
    lives as long as the pool; pass your own to tie captured work to a graph that may be discarded.

    ``sync(allow_pending=n)`` waits, with ``callbacks``, until at most n jobs of the pool are unfinished; with
    ``signals``, for every job submitted through this object except the newest n not yet waited for. The two
    agree whenever one owner drives the pool, as a decode step does. With ``signals`` the first submit must
    happen outside a graph capture (it maps the signal memory).
    """

    def __init__(self, mechanism: Optional[str] = None):
        mechanism = default_mechanism() if mechanism is None else mechanism
        if mechanism not in MECHANISMS:
            raise ValueError(f"unknown stream mechanism {mechanism!r}; expected one of {', '.join(MECHANISMS)}")
        self.mechanism = mechanism
        self._c = None
        self._jobs: dict = {}  # payload id -> EngineJob: its tensors must outlive the payload
        self._lock = threading.Lock()
        self._live()

    def __len__(self) -> int:
        return 0 if self._c is None else len(self._c)

    @property
    def n_captured(self) -> int:
        return 0 if self._c is None else self._c.n_captured

    def _live(self):
        if self._c is None:  # reusable after close()
            self._c = _C.StreamSignals() if self.mechanism == "signals" else _C.HostFuncs()
        return self._c

    def _release(self) -> None:
        for pid in self._c.release_finished():
            self._jobs.pop(pid, None)

    def submit(self, pool: "WorkerPool", job: "EngineJob", stream) -> None:
        with self._lock:
            c = self._live()
            self._release()
            self._jobs[c.submit(stream, pool._pool, job._job)] = job

    def sync(self, pool: "WorkerPool", allow_pending: int, stream) -> None:
        with self._lock:
            c = self._live()
            self._release()
            c.sync(stream, pool._pool, allow_pending)

    def close(self) -> None:
        """Wait for the jobs these host functions submitted and free them. Host functions not reached yet by an
        eager stream are waited for with ``torch.cuda.synchronize()``; any still not run (a stream that never
        gets there) are leaked with their job's buffers rather than freed under the driver."""
        with self._lock:
            c, self._c = self._c, None
            if c is None:
                return
            if c.n_not_run:
                _synchronize_cuda()
            leaked = set(c.close())
            leaked_jobs.extend(job for pid, job in self._jobs.items() if pid in leaked)
            self._jobs.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
