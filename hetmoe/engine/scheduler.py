"""The one generation loop: continuous batching over the runner's KV-cache slots, with prefix reuse.

``LLM`` (the CLI's ``generate`` and ``chat``, Python users) and the server (``hetmoe/server/bridge.py``) both run
their requests through a ``Scheduler``. It is a plain synchronous object, driven by whoever calls ``step()``:

    add(request)   validate (SequenceState) and queue
    step()         admit waiting requests into free slots (0 .. max_batch-1), the slot whose cache holds the
                   longest prefix of the prompt first
                   -> one prefill call: the next chunk (<= runner.prefill_chunk tokens) of the oldest sequence
                      still prefilling, batched with those of younger ones up to PREFILL_TOKENS padded tokens;
                      a sequence whose prompt is complete samples its first token
                   -> one Runner.decode_batch step for every sequence that has a token to feed, then: one
                      batched argmax for the plain greedy rows (SamplingParams.plain_greedy), and per other
                      sequence its own SequenceState.sample (bias, constraint, penalties, log-probabilities,
                      temperature, top-k/p, min_p, its generator); stop checks, new text
                   -> finished, failed and cancelled sequences free their slot

so a long prompt joins in chunks between decode steps instead of stalling the running sequences.

Why no thread of its own: ``LLM`` drives it in the caller's thread, so an exception raised by the caller between
steps (the chat's Ctrl-C in its text callback) or inside one (a second Ctrl-C, KeyboardInterrupt) lands where it
happens, in the thread that Python delivers signals to, with no hand-over; the server, which must not block its
event loop, runs the same loop on a thread of its own (the bridge), and only ``Request.cancel`` crosses threads.

Each request receives its results through ``Request.emit`` (called in the thread that runs ``step``), as events:

    ("logprobs", [TokenLogprob, ...])                 params.logprobs set: the step's sampled token (one entry),
                                                      sent before that step's "text" event (if it has one)
    ("text", piece)                                   text that is final (stop strings already cut)
    ("done", finish_reason, prompt_tokens, completion_tokens)
    ("error", kind, message)                          kind: "invalid" | "failed" | "shutdown"; the loop goes on

Prefix reuse: each slot keeps the list of tokens its cache holds, counting only runner calls that returned. A
record is marked untrusted when a call on its slot starts and trusted again when it returns, so a call that never
returned (Ctrl-C, an error) leaves nothing for a later prompt to reuse. At least the last prompt token is always
computed, for its logits. A request that asks for ``prompt_logprobs`` reuses nothing: its prompt is computed whole,
alone in its prefill calls, in chunks of at most PROMPT_LOGPROBS_CHUNK tokens (the logits of every position are
kept for the chunk), and ``Request.prompt_logprobs`` is complete before its first "text" or "logprobs" event.

A model with recurrent layers (``runner.recurrent``: linear attention) reuses no prefix: its states fold in a whole
prompt and cannot be cut back to the part another prompt shares. Prefix reuse is then off (said once), every prompt
is computed from position 0, and a slot's states are zeroed as soon as its sequence ends (finished, failed or
cancelled).
"""

from __future__ import annotations

import itertools
import sys
import time
import traceback
from collections import deque
from typing import Callable, Optional

import torch

from hetmoe.engine.grammar import apply_bitmasks
from hetmoe.engine.sampler import SamplingParams, prompt_logprobs
from hetmoe.engine.sequence import GenerationResult, SequenceState, Timings
from hetmoe.layers.kv_cache import KVCacheFull
from hetmoe.tokenizer import Tokenizer

PREFILL_TOKENS = 512  # padded tokens one batched prefill call may hold (short prompts arriving together)
PROMPT_LOGPROBS_CHUNK = 512  # prompt tokens per prefill call when every position's logits [n, V] fp32 are kept


class Request:
    """One sequence to generate. The scheduler fills ``state`` (at ``add``), the times and ``cached_tokens``, and
    calls ``emit`` with its events; ``cancel`` may be called from any thread (the slot is freed at the next step).
    This base class keeps the events in ``events`` for its driver to hand on between steps (``drain``: the text
    to ``on_text``); the server's subclass hands them to an asyncio queue instead.

    ``prompt_logprobs``: None unless ``params.prompt_logprobs`` is set; then a list of TokenLogprob, one per
    prompt token after the first (entry i is prompt token i + 1), filled while the prompt is computed and complete
    before the first "text" / "logprobs" event."""

    _ids = itertools.count()

    def __init__(self, prompt_ids, params: SamplingParams, on_text: Optional[Callable[[str], None]] = None):
        self.id = next(self._ids)
        self.prompt_ids, self.params, self.on_text = [int(t) for t in prompt_ids], params, on_text
        self.events: deque = deque()
        self.cancelled = False
        self.finished = False  # a "done" or "error" event was sent
        self.error: Optional[str] = None  # the message of an "error" event
        self.exception: Optional[BaseException] = None  # what made it fail, when an exception did
        self.state: Optional[SequenceState] = None
        self.cached_tokens = 0  # prompt tokens found in the slot's cache (prefix reuse)
        self.prompt_logprobs: Optional[list] = None
        self.arrival = time.perf_counter()
        self.t_admitted = self.t_first = self.t_done = None

    def cancel(self) -> None:
        self.cancelled = True

    def emit(self, *event) -> None:
        if event[0] in ("done", "error"):
            self.finished = True
        if event[0] == "error":
            self.error = event[2]
        self.deliver(event)

    def deliver(self, event: tuple) -> None:
        """Where events go (the server overrides it)."""
        self.events.append(event)

    def drain(self) -> None:
        """Hand the text received since the last call to ``on_text``; raise what made the request fail."""
        while self.events:
            event = self.events.popleft()
            if event[0] == "text" and self.on_text is not None:
                self.on_text(event[1])
            elif event[0] == "error":
                raise self.exception or RuntimeError(event[2])

    def result(self) -> GenerationResult:
        """What a finished request generated, with its timings (admission to first token, then to the end)."""
        if not self.finished or self.error is not None:
            raise RuntimeError(f"request {self.id} has no result: {self.error or 'not finished'}")
        st = self.state
        t_first = self.t_first if self.t_first is not None else self.t_done
        timings = Timings(prefill_s=t_first - self.t_admitted, decode_s=self.t_done - t_first,
                          prompt_tokens=st.prompt_tokens, decode_steps=max(st.completion_tokens - 1, 0),
                          cached_tokens=self.cached_tokens)
        return GenerationResult(text=st.text, token_ids=st.token_ids, finish_reason=st.finish_reason,
                                prompt_tokens=st.prompt_tokens, completion_tokens=st.completion_tokens, timings=timings,
                                logprobs=list(st.logprobs) if self.params.logprobs is not None else None,
                                prompt_logprobs=self.prompt_logprobs)


class _NoObserver:
    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None: ...
    def on_tokens(self, n: int) -> None: ...
    def on_finish(self, prompt_tokens: int, completion_tokens: int) -> None: ...
    def on_cancel(self) -> None: ...


class _Sequence:
    """A request in a slot: how much of its prompt is cached, the token to feed at the next decode step, and the
    tokens the slot's cache holds (``kv``; ``kv_trusted`` is False while a call on the slot runs; ``keep``: a later
    prompt may reuse them once this sequence has ended)."""

    def __init__(self, req: Request, slot: int, kv: list):
        self.req, self.slot, self.state = req, slot, req.state
        self.kv, self.kv_trusted, self.keep = kv, True, True
        self.prefilled = len(kv)  # prompt tokens in the cache
        self.next_token: Optional[int] = None  # sampled, not yet fed to the model

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.req.prompt_ids)


def _prepare(batch: list) -> None:
    """The host's share of the step's sampling (each constraint's next mask: ``SequenceState.prepare``), run by
    the runner while the GPU computes the step. Errors are left for ``_sample``, which asks again and fails that
    sequence alone."""
    for seq in batch:
        if not seq.req.params.plain_greedy:
            try:
                seq.state.prepare()
            except Exception:
                pass


def _kind(e: BaseException) -> str:
    """The error kind of a request that a runner call failed: "capacity" when the KV cache memory is out, "memory"
    when the device ran out of memory in the forward (another process may hold it: the server answers 503 to both,
    the request may succeed later), else "failed"."""
    if isinstance(e, KVCacheFull):
        return "capacity"
    return "memory" if isinstance(e, torch.OutOfMemoryError) else "failed"


def _release_cached_memory(failures: list) -> None:
    """After a call that ran out of device memory failed (``failures``: the exception types; the exceptions, their
    tracebacks and the tensors these hold are gone), hand the allocator's cached blocks back, so the next request
    starts from what is really in use."""
    if any(issubclass(t, torch.OutOfMemoryError) for t in failures) and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Scheduler:
    """Continuous batching over ``runner``'s ``max_batch`` cache slots; see the module docstring. Not thread-safe:
    one thread calls ``add``, ``step``, ``stop_all`` (``Request.cancel`` is safe from any thread).

    ``runner``: ``prefill(ids, slot=, start=) -> logits [V]``, ``prefill_batch(chunks, slots, starts) -> [B, V]``,
    ``decode_batch(tokens, slots) -> [B, V]``, ``max_batch``, ``max_context``, ``prefill_chunk`` (``Runner``).
    ``observer``: ``on_first_token(ttft_s, prompt_tokens)``, ``on_tokens(n)``, ``on_finish(prompt, completion)``,
    ``on_cancel()`` (the server's metrics)."""

    def __init__(self, runner, tokenizer: Tokenizer, *, prefix_reuse: bool = True, observer=None,
                 log: Optional[Callable[[str], None]] = None):
        self.runner, self.tokenizer, self.prefix_reuse = runner, tokenizer, prefix_reuse
        self.max_context = runner.max_context
        self.observer = observer or _NoObserver()
        self.log = log or (lambda msg: print(f"hetmoe: {msg}", file=sys.stderr, flush=True))
        self.recurrent = bool(getattr(runner, "recurrent", False))  # states per slot that cannot be cut back
        if self.recurrent and prefix_reuse:
            self.prefix_reuse = False
            owner = getattr(runner, "state_owner", "linear-attention layers")
            what = getattr(runner, "state_what", "recurrent states")
            self.log(f"prefix reuse is off: the model's {owner} keep {what}, which cannot be cut back to a shared "
                     "prefix")
        self.waiting: deque = deque()  # Requests without a slot, oldest first
        self.running: list = []  # _Sequences, in admission order
        self._free = list(range(runner.max_batch))  # least recently used first
        self._cached: list = [[] for _ in range(runner.max_batch)]  # trusted tokens in each free slot's cache
        if hasattr(runner, "reclaim"):  # KV memory out: the free slots' cached prefixes go first
            runner.reclaim = self._reclaim

    # ------------------------------------------------------------------------------------------ the caller's side

    def add(self, req: Request) -> Request:
        """Queue ``req``. ValueError (nothing queued) when it cannot run: an empty prompt, one that leaves no
        room in the context, a logit bias beyond the model's vocabulary, a constraint factory that fails."""
        vocab = getattr(self.runner, "vocab_size", None)
        if vocab is not None:
            req.params.check_vocab(vocab)
        req.state = SequenceState(self.tokenizer, len(req.prompt_ids), req.params, self.max_context,
                                  on_text=lambda piece: req.emit("text", piece), prompt_ids=req.prompt_ids)
        if req.params.prompt_logprobs is not None:
            req.prompt_logprobs = []
        self.waiting.append(req)
        return req

    def run(self, reqs: list) -> list:
        """Add ``reqs`` and step until each has finished (whatever else is running moves on too); each one's
        ``on_text`` gets its text between steps. -> their GenerationResults, in order. An exception (a failed
        request, one raised by ``on_text``, a KeyboardInterrupt) propagates; the unfinished requests are then
        dropped, and their slots keep what their completed steps cached."""
        try:
            for req in reqs:
                self.add(req)
            while not all(req.finished for req in reqs):
                self.step()
                for req in reqs:
                    req.drain()
        finally:
            for req in reqs:
                if not req.finished:
                    self._drop(req)
        return [req.result() for req in reqs]

    def _drop(self, req: Request) -> None:
        """Cancel ``req`` and free what it holds now (between steps, or after a step that raised)."""
        req.cancel()
        self.observer.on_cancel()
        if req in self.waiting:
            self.waiting.remove(req)
        for seq in [s for s in self.running if s.req is req]:
            self._release(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def forget_cache(self) -> None:
        """Trust nothing cached: the next prompts are computed whole."""
        self._cached = [[] for _ in self._cached]
        for seq in self.running:
            seq.keep = False

    def _reclaim(self) -> bool:
        """Free the KV memory of every slot no sequence runs in (their cached prefixes are forgotten) -> whether
        there was any."""
        for slot in self._free:
            self._cached[slot] = []
            self.runner.release(slot, 0)
        return bool(self._free)

    def stop_all(self, message: str) -> None:
        """End everything now: sequences that have generated finish as a length limit (their text so far kept),
        the others and every waiting request fail with a "shutdown" error carrying ``message``."""
        for seq in list(self.running):
            if not seq.prefilling:
                seq.state.abort("length")
                self._finish(seq)
            else:
                self._fail(seq, "shutdown", message, log=False)
        while self.waiting:
            self.waiting.popleft().emit("error", "shutdown", message)

    def step(self) -> None:
        """One iteration: admit, one prefill call, one decode step. An exception that escapes it (a bug, a
        KeyboardInterrupt inside a runner call) fails every running sequence, then propagates."""
        try:
            for req in [r for r in self.waiting if r.cancelled]:
                self.observer.on_cancel()
                self.waiting.remove(req)
            for seq in [s for s in self.running if s.req.cancelled]:
                self.observer.on_cancel()
                self._release(seq)
            self._admit()
            self._prefill_chunk()
            self._decode()
        except BaseException as e:
            for seq in list(self.running):  # their state may be half updated (a call that never returned: untrusted)
                self._fail(seq, "failed", f"internal error in the engine loop: {type(e).__name__}: {e}", e,
                           log=False)
            raise

    # ------------------------------------------------------------------------------------------ the loop

    def _admit(self) -> None:
        while self.waiting and self._free:
            req = self.waiting.popleft()
            if req.cancelled:
                self.observer.on_cancel()
                continue
            slot, common = self._free[0], 0
            if self.prefix_reuse and req.params.prompt_logprobs is None:  # those need every position's logits
                for s in self._free:
                    n = _common_prefix(self._cached[s], req.prompt_ids[:-1])  # the last one is computed
                    if n > common:
                        slot, common = s, n
            self._free.remove(slot)
            kv, self._cached[slot] = self._cached[slot][:common], []
            req.cached_tokens, req.t_admitted = common, time.perf_counter()
            self.running.append(_Sequence(req, slot, kv))

    def _prefill_chunk(self) -> None:
        """One prefill forward call: the next chunk of the oldest prefilling sequence, batched with the next
        chunks of younger ones while the padded batch stays within prefill_chunk tokens per row and
        PREFILL_TOKENS in all (many short prompts arriving together join in one call). A sequence that asks for
        prompt log-probabilities is prefilled alone, in chunks of at most PROMPT_LOGPROBS_CHUNK tokens."""
        group, width = [], 0
        for seq in (s for s in self.running if s.prefilling):
            n = min(len(seq.req.prompt_ids) - seq.prefilled, self._chunk_len(seq))
            if group and (max(width, n) * (len(group) + 1) > PREFILL_TOKENS
                          or seq.prefilled + max(width, n) > self.max_context
                          or any(g.prefilled + max(width, n) > self.max_context for g in group)
                          or seq.req.params.prompt_logprobs is not None):
                break
            group.append(seq)
            width = max(width, n)
            if seq.req.params.prompt_logprobs is not None:
                break
        if not group:
            return
        chunks = [s.req.prompt_ids[s.prefilled:s.prefilled + self._chunk_len(s)] for s in group]
        for seq in group:
            seq.kv_trusted = False
        try:
            if len(group) == 1:
                rows = [self._prefill_one(group[0], chunks[0])]
            else:
                rows = list(self.runner.prefill_batch(chunks, [s.slot for s in group], [s.prefilled for s in group]))
        except Exception:
            rows = self._prefill_one_by_one(group, chunks)  # find the sequence at fault; the others go on
        for seq, chunk, logits in zip(group, chunks, rows):
            if logits is None:
                continue
            seq.prefilled += len(chunk)
            seq.kv, seq.kv_trusted = seq.req.prompt_ids[:seq.prefilled], True
            if seq.prefilling:
                continue
            try:
                token = seq.state.sample(logits)
            except Exception as e:
                self._fail(seq, "failed", f"sampling failed: {type(e).__name__}: {e}", e)
                continue
            seq.req.t_first = time.perf_counter()
            self.observer.on_first_token(seq.req.t_first - seq.req.arrival, len(seq.req.prompt_ids))
            self._advance(seq, token)

    def _chunk_len(self, seq: _Sequence) -> int:
        chunk = self.runner.prefill_chunk
        return chunk if seq.req.params.prompt_logprobs is None else min(chunk, PROMPT_LOGPROBS_CHUNK)

    def _prefill_one(self, seq: _Sequence, chunk: list) -> torch.Tensor:
        """One sequence's chunk -> the logits after its last token [V]; with prompt log-probabilities asked, the
        runner returns every position's logits [n, V], and the entries of the prompt tokens they predict (all but
        the one after the prompt's end) are added to ``Request.prompt_logprobs``."""
        req = seq.req
        if req.params.prompt_logprobs is None:
            return self.runner.prefill(chunk, slot=seq.slot, start=seq.prefilled)
        logits = self.runner.prefill(chunk, slot=seq.slot, start=seq.prefilled, all_logits=True)  # [n, V]
        targets = req.prompt_ids[seq.prefilled + 1:seq.prefilled + 1 + len(chunk)]  # what each row predicts
        if targets:
            entries = prompt_logprobs(logits[:len(targets)], torch.tensor(targets), req.params.prompt_logprobs)
            del req.prompt_logprobs[seq.prefilled:]  # a chunk computed again after a failed call: no duplicates
            req.prompt_logprobs.extend(entries)
        return logits[-1]

    def _prefill_one_by_one(self, group: list, chunks: list) -> list:
        rows, failures = [], []
        for seq, chunk in zip(group, chunks):
            try:
                rows.append(self._prefill_one(seq, chunk))
            except Exception as e:
                traceback.print_exc()
                self._fail(seq, _kind(e), f"prefill failed: {type(e).__name__}: {e}", e)
                rows.append(None)
                failures.append(type(e))
        _release_cached_memory(failures)
        return rows

    def _decode(self) -> None:
        batch = [s for s in self.running if s.next_token is not None]
        if not batch:
            return
        for seq in batch:
            seq.kv_trusted = False
        try:
            logits = self.runner.decode_batch([s.next_token for s in batch], [s.slot for s in batch],
                                              meanwhile=lambda: _prepare(batch))
        except Exception:
            logits = self._decode_one_by_one(batch)  # find the sequence at fault; the others go on
            batch = [s for s in batch if s in self.running]
            if not batch:
                return
        for seq in batch:
            seq.kv.append(seq.next_token)
            seq.kv_trusted = True
        tokens = self._sample(batch, logits)
        for seq, token in zip(batch, tokens):
            if token is not None:
                self._advance(seq, token)

    def _decode_one_by_one(self, batch: list) -> torch.Tensor:
        rows, failures = [], []
        for seq in batch:
            try:
                rows.append(self.runner.decode_batch([seq.next_token], [seq.slot])[0])
            except Exception as e:
                traceback.print_exc()
                self._fail(seq, _kind(e), f"decode failed: {type(e).__name__}: {e}", e)
                failures.append(type(e))
        _release_cached_memory(failures)
        return torch.stack(rows) if rows else torch.empty(0)

    def _sample(self, batch: list, logits: torch.Tensor) -> list:
        """One token per sequence from logits [B, V]. One argmax for the plain greedy rows (no bias, constraint,
        penalty, min_p or log-probabilities: ``SamplingParams.plain_greedy``) and the processed greedy rows
        without log-probabilities, read back at once: those rows are gathered, their constraints' host bitmasks
        (filled while the step ran: ``_prepare``) applied to all of them in one set of operations, then each
        row's bias and penalties. The others one by one through their SequenceState (log-probabilities, their own
        parameters and generator). None where sampling failed (that sequence is failed)."""
        tokens: list = [None] * len(batch)
        failed: set = set()

        def fail(i: int, e: Exception) -> None:
            failed.add(i)
            self._fail(batch[i], "failed", f"sampling failed: {type(e).__name__}: {e}", e)

        plain = [i for i, s in enumerate(batch) if s.req.params.plain_greedy]
        processed, masks = [], []
        for i, seq in enumerate(batch):
            p = seq.req.params
            if not p.plain_greedy and p.greedy and p.logprobs is None:
                try:
                    masks.append(seq.state.host_mask())
                    processed.append(i)
                except Exception as e:
                    fail(i, e)
        picks = [logits[plain].argmax(-1)] if plain else []
        if processed:
            rows = logits[processed].float()  # a copy: [R, V]
            held = [r for r, m in enumerate(masks) if m is not None]
            if held:
                words = torch.full((len(processed), masks[held[0]].shape[-1]), -1, dtype=torch.int32)
                for r in held:
                    words[r] = masks[r]
                apply_bitmasks(rows, words)
            for r, i in enumerate(processed):
                try:
                    batch[i].state.process_in_place(rows[r], masked=masks[r] is not None)
                except Exception as e:
                    fail(i, e)
            picks.append(rows.argmax(-1))
        if picks:
            for i, t in zip(plain + processed, torch.cat(picks).tolist()):
                if i not in failed:
                    tokens[i] = t
        for i, seq in enumerate(batch):
            if tokens[i] is None and i not in failed:
                try:
                    tokens[i] = seq.state.sample(logits[i])
                except Exception as e:
                    fail(i, e)
        return tokens

    def _advance(self, seq: _Sequence, token: int) -> None:
        self.observer.on_tokens(1)
        seq.next_token = None
        st = seq.state
        if st.params.logprobs is not None:
            seq.req.emit("logprobs", st.logprobs[-1:])  # before the text this token completes
        try:
            finished = st.add(token)
        except Exception as e:  # the constraint refused the token its own mask allowed (or failed)
            self._fail(seq, "failed", f"constraint: {type(e).__name__}: {e}", e)
            return
        if finished:
            self._finish(seq)
        else:
            seq.next_token = token

    # ------------------------------------------------------------------------------------------ endings

    def _finish(self, seq: _Sequence) -> None:
        st, req = seq.state, seq.req
        req.t_done = time.perf_counter()
        self._release(seq)
        req.emit("done", st.finish_reason, st.prompt_tokens, st.completion_tokens)
        self.observer.on_finish(st.prompt_tokens, st.completion_tokens)

    def _fail(self, seq: _Sequence, kind: str, message: str, exception: Optional[BaseException] = None,
              log: bool = True) -> None:
        if log:
            self.log(f"request {seq.req.id} failed: {message}")
        if isinstance(exception, torch.OutOfMemoryError):  # its traceback's frames hold the failed call's tensors
            exception = exception.with_traceback(None)
        seq.req.exception = exception
        self._release(seq)
        seq.req.emit("error", kind, message)

    def _release(self, seq: _Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self._cached[seq.slot] = seq.kv if seq.kv_trusted and seq.keep and not self.recurrent else []
            self._free.append(seq.slot)
            if self.recurrent:  # nothing to reuse: its states zeroed, its KV memory freed
                self.runner.release(seq.slot, 0)
