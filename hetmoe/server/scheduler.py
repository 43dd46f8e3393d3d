"""The engine loop: one thread owns the runner and serves every request through continuous batching.

The HTTP side (asyncio) only calls ``submit`` and ``Request.cancel``; everything that touches the model happens
here. Each iteration of the loop:

    admit waiting requests into free KV-cache slots (0 .. max_batch-1)
    -> one prefill call: the next chunk (<= runner.prefill_chunk tokens) of the oldest sequence still
       prefilling, batched with those of younger ones up to PREFILL_TOKENS padded tokens; a sequence whose
       prompt is complete samples its first token
    -> one Runner.decode_batch step for every sequence that has a token to feed, then per sequence: sample
       with its own SamplingParams and generator, stop checks (SequenceState), stream the new text
    -> finished, failed and cancelled sequences free their slot

so a long prompt joins in chunks between decode steps instead of stalling the running sequences. With nothing
to do the thread waits on a condition variable (no CPU use). Results travel back to each request's asyncio
queue with ``loop.call_soon_threadsafe``, as events:

    ("text", piece)                                   text that is final (stop strings already cut)
    ("done", finish_reason, prompt_tokens, completion_tokens)
    ("error", http_status, message)                   only this request failed; the loop goes on
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
import traceback
from collections import deque
from typing import Optional

import torch

from hetmoe.engine.generation import SamplingParams, SequenceState
from hetmoe.engine.tokenizer import Tokenizer
from hetmoe.server.metrics import Metrics

PREFILL_TOKENS = 512  # padded tokens one batched prefill call may hold (short prompts arriving together)


class Request:
    """One generation request as both sides see it: the HTTP handler awaits ``events``; the engine loop reads
    ``prompt_ids``/``params`` and the ``cancelled`` flag (set when the client goes away)."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list, params: SamplingParams, loop: asyncio.AbstractEventLoop):
        self.id = next(self._ids)
        self.prompt_ids, self.params, self.loop = list(prompt_ids), params, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.finished = False  # a "done" or "error" event was sent
        self.arrival = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled = True

    def emit(self, *event) -> None:
        """Called on the engine thread: hand ``event`` to the request's event loop."""
        if event[0] in ("done", "error"):
            self.finished = True
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class _Sequence:
    """A request in a slot: how much of its prompt is cached, and the token to feed at the next decode step."""

    def __init__(self, req: Request, slot: int, tokenizer: Tokenizer, max_context: int):
        self.req, self.slot = req, slot
        self.state = SequenceState(tokenizer, len(req.prompt_ids), req.params, max_context,
                                   on_text=lambda piece: req.emit("text", piece))
        self.prefilled = 0  # prompt tokens in the cache
        self.next_token: Optional[int] = None  # sampled, not yet fed to the model

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.prompt_ids)


class Scheduler:
    """Continuous batching over ``runner``'s ``max_batch`` cache slots, on a thread of its own."""

    def __init__(self, runner, tokenizer: Tokenizer, metrics: Optional[Metrics] = None, log=None):
        self.runner, self.tokenizer = runner, tokenizer
        self.metrics = metrics or Metrics()
        self.max_context = runner.max_context
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._cond = threading.Condition()
        self._waiting: deque = deque()  # Requests without a slot, oldest first
        self._running: list = []  # _Sequences, in admission order
        self._free = list(range(runner.max_batch))
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="hetmoe-engine", daemon=True)
        self.metrics.set_gauges(waiting=0, running=0)

    def start(self) -> "Scheduler":
        self._thread.start()
        return self

    def submit(self, req: Request) -> Request:
        """Queue ``req`` (thread-safe). After ``shutdown`` it fails at once with 503."""
        with self._cond:
            if self._stopping:
                req.emit("error", 503, "the server is shutting down")
                return req
            self._waiting.append(req)
            self.metrics.set_gauges(waiting=len(self._waiting))
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

    # ------------------------------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._running:
                    self._cond.wait()
                if self._stopping:
                    break
                self._admit()
            try:
                self._step()
            except Exception as e:  # a bug outside the per-request guards: fail what is running, keep serving
                traceback.print_exc()
                for seq in list(self._running):
                    self._fail(seq, f"internal error in the engine loop: {type(e).__name__}: {e}")
            self.metrics.set_gauges(waiting=len(self._waiting), running=len(self._running))
        self._stop_all()

    def _admit(self) -> None:
        """Move waiting requests into free slots (the caller holds the lock)."""
        while self._waiting and self._free:
            req = self._waiting.popleft()
            if req.cancelled:
                self.metrics.on_cancel()
                continue
            slot = self._free.pop(0)
            try:
                seq = _Sequence(req, slot, self.tokenizer, self.max_context)
            except Exception as e:  # validated by the HTTP side already; never let one request stop the loop
                self._free.insert(0, slot)
                req.emit("error", 400, str(e))
                continue
            self._running.append(seq)

    def _step(self) -> None:
        for seq in [s for s in self._running if s.req.cancelled]:
            self.metrics.on_cancel()
            self._release(seq)
        self._prefill_chunk()
        self._decode()

    def _prefill_chunk(self) -> None:
        """One prefill forward call: the next chunk of the oldest prefilling sequence, batched with the next
        chunks of younger ones while the padded batch stays within prefill_chunk tokens per row and
        PREFILL_TOKENS in all (many short prompts arriving together join in one call)."""
        chunk_len = self.runner.prefill_chunk
        group, width = [], 0
        for seq in (s for s in self._running if s.prefilling):
            n = min(len(seq.req.prompt_ids) - seq.prefilled, chunk_len)
            if group and (max(width, n) * (len(group) + 1) > PREFILL_TOKENS
                          or seq.prefilled + max(width, n) > self.max_context
                          or any(g.prefilled + max(width, n) > self.max_context for g in group)):
                break
            group.append(seq)
            width = max(width, n)
        if not group:
            return
        chunks = [s.req.prompt_ids[s.prefilled:s.prefilled + chunk_len] for s in group]
        try:
            if len(group) == 1:
                rows = [self.runner.prefill(chunks[0], slot=group[0].slot, start=group[0].prefilled)]
            else:
                rows = list(self.runner.prefill_batch(chunks, [s.slot for s in group], [s.prefilled for s in group]))
        except Exception:
            rows = self._prefill_one_by_one(group, chunks)  # find the sequence at fault; the others go on
        for seq, chunk, logits in zip(group, chunks, rows):
            if logits is None:
                continue
            seq.prefilled += len(chunk)
            if seq.prefilling:
                continue
            try:
                token = seq.state.sample(logits)
            except Exception as e:
                self._fail(seq, f"sampling failed: {type(e).__name__}: {e}")
                continue
            self.metrics.on_first_token(time.perf_counter() - seq.req.arrival, len(seq.req.prompt_ids))
            self._advance(seq, token)

    def _prefill_one_by_one(self, group: list, chunks: list) -> list:
        rows = []
        for seq, chunk in zip(group, chunks):
            try:
                rows.append(self.runner.prefill(chunk, slot=seq.slot, start=seq.prefilled))
            except Exception as e:
                traceback.print_exc()
                self._fail(seq, f"prefill failed: {type(e).__name__}: {e}")
                rows.append(None)
        return rows

    def _decode(self) -> None:
        batch = [s for s in self._running if s.next_token is not None]
        if not batch:
            return
        try:
            logits = self.runner.decode_batch([s.next_token for s in batch], [s.slot for s in batch])
        except Exception:
            logits = self._decode_one_by_one(batch)  # find the sequence at fault; the others go on
            batch = [s for s in batch if s in self._running]
            if not batch:
                return
        tokens = self._sample(batch, logits)
        for seq, token in zip(batch, tokens):
            if token is not None:
                self._advance(seq, token)

    def _decode_one_by_one(self, batch: list) -> torch.Tensor:
        rows = []
        for seq in batch:
            try:
                rows.append(self.runner.decode_batch([seq.next_token], [seq.slot])[0])
            except Exception as e:
                traceback.print_exc()
                self._fail(seq, f"decode failed: {type(e).__name__}: {e}")
        return torch.stack(rows) if rows else torch.empty(0)

    def _sample(self, batch: list, logits: torch.Tensor) -> list:
        """One token per sequence from logits [B, V]: all greedy rows with one argmax, the others one by one with
        their own parameters and generator. None where sampling failed (that sequence is failed)."""
        greedy = [i for i, s in enumerate(batch) if s.req.params.temperature == 0 or s.req.params.top_k == 1]
        tokens: list = [None] * len(batch)
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(-1).tolist()):
                tokens[i] = t
        for i, seq in enumerate(batch):
            if tokens[i] is None:
                try:
                    tokens[i] = seq.state.sample(logits[i])
                except Exception as e:
                    self._fail(seq, f"sampling failed: {type(e).__name__}: {e}")
        return tokens

    def _advance(self, seq: _Sequence, token: int) -> None:
        self.metrics.on_tokens(1)
        seq.next_token = None
        if seq.state.add(token):
            self._finish(seq)
        else:
            seq.next_token = token

    # ------------------------------------------------------------------------------------------ endings

    def _finish(self, seq: _Sequence) -> None:
        st = seq.state
        seq.req.emit("done", st.finish_reason, st.prompt_tokens, st.completion_tokens)
        self.metrics.on_finish(st.prompt_tokens, st.completion_tokens)
        self._release(seq)

    def _fail(self, seq: _Sequence, message: str) -> None:
        self.log(f"hetmoe serve: request {seq.req.id} failed: {message}")
        seq.req.emit("error", 500, message)
        self._release(seq)

    def _release(self, seq: _Sequence) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self._free.append(seq.slot)  # only this thread touches _free
            self._free.sort()

    def _stop_all(self) -> None:
        for seq in list(self._running):
            if not seq.prefilling:  # it has generated: end it like a length limit, keeping its text
                seq.state.abort("length")
                self._finish(seq)
            else:
                seq.req.emit("error", 503, "the server is shutting down")
                self._release(seq)
        with self._cond:
            while self._waiting:
                self._waiting.popleft().emit("error", 503, "the server is shutting down")
        self.metrics.set_gauges(waiting=0, running=0)
