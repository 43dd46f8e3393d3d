"""The server's bridge to the engine: one thread runs the engine's scheduler (engine/scheduler.py) for every request.

The HTTP side (asyncio) only calls ``EngineLoop.submit`` and ``Request.cancel``; everything that touches the model
happens on the engine thread, which moves submitted requests into the scheduler and calls ``Scheduler.step`` while
there is work. With nothing to do it waits on a condition variable (no CPU use). Results travel back to each
request's asyncio queue with ``loop.call_soon_threadsafe``, as events:

    ("text", piece)                                   text that is final (stop strings already cut)
    ("done", finish_reason, prompt_tokens, completion_tokens)
    ("error", http_status, message, code)             only this request failed; the loop goes on
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
from collections import deque
from typing import Optional

from hetmoe.engine import scheduler as engine
from hetmoe.engine.sampler import SamplingParams
from hetmoe.server.metrics import Metrics
from hetmoe.tokenizer import Tokenizer

# the engine's error kinds -> HTTP status and error code ("capacity": the KV cache memory is out; "memory": the
# device ran out of memory in the forward; either may succeed later)
HTTP_STATUS = {"invalid": 400, "failed": 500, "shutdown": 503, "capacity": 503, "memory": 503}
ERROR_CODE = {"invalid": "invalid_value", "failed": "engine_error", "shutdown": "shutting_down",
              "capacity": "kv_cache_full", "memory": "out_of_memory"}
SHUTTING_DOWN = "the server is shutting down"


class Request(engine.Request):
    """One generation request as both sides see it: the HTTP handler awaits ``events`` (an asyncio.Queue); the
    engine thread reads ``prompt_ids``/``params`` and the ``cancelled`` flag (set when the client goes away)."""

    def __init__(self, prompt_ids: list, params: SamplingParams, loop: asyncio.AbstractEventLoop):
        super().__init__(prompt_ids, params)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()

    def deliver(self, event: tuple) -> None:
        """Called on the engine thread: hand ``event`` to the request's event loop."""
        if event[0] == "error":
            event = ("error", HTTP_STATUS[event[1]], event[2], ERROR_CODE[event[1]])
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """The engine's scheduler over ``runner``'s ``max_batch`` cache slots, on a thread of its own."""

    def __init__(self, runner, tokenizer: Tokenizer, metrics: Optional[Metrics] = None, log=None):
        self.metrics = metrics or Metrics()
        self.log = log or (lambda msg: print(f"hetmoe serve: {msg}", file=sys.stderr, flush=True))
        self.engine = engine.Scheduler(runner, tokenizer, observer=self.metrics, log=self.log)
        self._cond = threading.Condition()
        self._submitted: deque = deque()  # Requests not yet handed to the scheduler
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="hetmoe-engine", daemon=True)
        self.metrics.set_gauges(waiting=0, running=0)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, req: Request) -> Request:
        """Queue ``req`` (thread-safe). After ``shutdown`` it fails at once with 503."""
        with self._cond:
            if self._stopping:
                req.emit("error", "shutdown", SHUTTING_DOWN)
                return req
            self._submitted.append(req)
            self.metrics.set_gauges(waiting=len(self._submitted) + len(self.engine.waiting))
            self._cond.notify()
        return req

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: running sequences end now (finish_reason "length", their text so far delivered),
        waiting requests fail with 503. Returns when the thread has exited (or after ``timeout``)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        sched = self.engine
        while True:
            with self._cond:
                while not self._stopping and not self._submitted and not sched.has_work():
                    self._cond.wait()
                if self._stopping:
                    break
                submitted, self._submitted = self._submitted, deque()
            for req in submitted:
                try:
                    sched.add(req)
                except Exception as e:  # validated by the HTTP side already; never let one request stop the loop
                    req.emit("error", "invalid", str(e))
            try:
                sched.step()
            except Exception:  # a bug outside the per-request guards: what was running failed, keep serving
                traceback.print_exc()
            self.metrics.set_gauges(waiting=len(self._submitted) + len(sched.waiting), running=len(sched.running))
        with self._cond:
            submitted, self._submitted = self._submitted, deque()
        sched.stop_all(SHUTTING_DOWN)
        for req in submitted:
            req.emit("error", "shutdown", SHUTTING_DOWN)
        self.metrics.set_gauges(waiting=0, running=0)
