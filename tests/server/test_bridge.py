"""The server's engine thread (hetmoe/server/bridge.py, running hetmoe/engine/scheduler.py) in-process, driven from
asyncio as the HTTP handlers drive it, on a runner whose logits are a fixed random function of the last token: every
expectation is exact, and each request run alone through the engine's scheduler (one slot) is the reference."""

import asyncio
import json
import threading

import pytest
import torch

from hetmoe.engine import scheduler as engine
from hetmoe.engine.sampler import SamplingParams
from hetmoe.load.random_weights import _CHAT_TEMPLATE, build_tokenizer
from hetmoe.server.bridge import EngineLoop, Request
from hetmoe.tokenizer import Tokenizer

VOCAB = 512
POISON = 13  # a sequence fed this token makes the runner raise


class SlotRunner:
    """Runner interface of hetmoe.engine.runner.Runner over ``max_batch`` slots; logits = table[last token].
    Records its calls so tests can see how prefill chunks and decode steps interleave."""

    def __init__(self, max_batch=4, max_context=64, prefill_chunk=4, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = 3 * torch.randn(VOCAB, VOCAB, generator=g)
        self.max_batch, self.max_context, self.prefill_chunk = max_batch, max_context, prefill_chunk
        self.vocab_size = VOCAB
        self.lengths = [0] * max_batch
        self.calls = []

    def prefill(self, ids, slot=0, start=0):
        assert 0 <= start <= self.lengths[slot] and start + len(ids) <= self.max_context
        assert len(ids) <= self.prefill_chunk
        if POISON in ids:
            raise RuntimeError("poisoned prompt")
        self.calls.append(("prefill", slot, len(ids)))
        self.lengths[slot] = start + len(ids)
        return self.table[ids[-1]].clone()

    def prefill_batch(self, chunks, slots, starts):
        rows = [self.prefill(c, s, st) for c, s, st in zip(chunks, slots, starts)]
        self.calls.append(("prefill_batch", tuple(slots)))
        return torch.stack(rows)

    def decode_batch(self, tokens, slots, meanwhile=None):
        if meanwhile is not None:
            meanwhile()
        assert len(set(slots)) == len(slots)
        if POISON in tokens:
            raise RuntimeError("poisoned token")
        for s in slots:
            assert self.lengths[s] < self.max_context
            self.lengths[s] += 1
        self.calls.append(("decode", tuple(slots)))
        return self.table[list(tokens)].clone()


def alone(prompt, params, tok):
    """The reference: the request by itself, through the engine's scheduler on a one-slot runner."""
    return engine.Scheduler(SlotRunner(max_batch=1), tok).run([engine.Request(prompt, params)])[0]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": _CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(path)


async def _collect(req):
    text = []
    while True:
        event = await req.events.get()
        if event[0] == "text":
            text.append(event[1])
        else:
            return "".join(text), event


def _serve(runner, tok, jobs, cancel=()):
    """Submit (prompt, params) jobs at once; -> [(text, final event)]. Requests whose index is in ``cancel`` are
    cancelled right after submission."""
    async def main():
        sched = EngineLoop(runner, tok, log=lambda m: None).start()
        loop = asyncio.get_running_loop()
        reqs = [sched.submit(Request(p, params, loop)) for p, params in jobs]
        for i in cancel:
            reqs[i].cancel()
        try:
            return await asyncio.wait_for(asyncio.gather(*(_collect(r) for i, r in enumerate(reqs) if i not in cancel)),
                                          60)
        finally:
            sched.shutdown()

    return asyncio.run(main())


PROMPTS = [[5, 17, 300], list(range(20, 31)), [7], list(range(100, 117)), [42, 43], [9, 8, 7, 6, 5]]


def test_batched_equals_one_at_a_time(tok):
    params = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=7),
              SamplingParams(max_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.2, top_k=20, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=9, top_p=0.5, temperature=1.0, seed=5, stop=["e"]),
              SamplingParams(max_tokens=60, ignore_eos=True)]  # runs into the context limit
    runner = SlotRunner(max_batch=4)  # 6 requests, 4 slots: two wait for a free slot
    got = _serve(runner, tok, list(zip(PROMPTS, params)))
    for prompt, p, (text, event) in zip(PROMPTS, params, got):
        want = alone(prompt, p, tok)
        assert text == want.text and event == ("done", want.finish_reason, len(prompt), want.completion_tokens)
    assert got[-1][1][1] == "length" and got[-1][1][3] == 64 - len(PROMPTS[-1])


def test_long_prompts_prefill_in_chunks_between_decode_steps(tok):
    runner = SlotRunner(max_batch=2, prefill_chunk=4)
    _serve(runner, tok, [([1, 2], SamplingParams(max_tokens=30, ignore_eos=True)),
                         (list(range(40, 60)), SamplingParams(max_tokens=2, ignore_eos=True))])
    chunks = [i for i, c in enumerate(runner.calls) if c[0] == "prefill" and c[1] == 1]
    assert len(chunks) == 5  # 20 prompt tokens in chunks of 4
    for a, b in zip(chunks, chunks[1:]):  # the first sequence kept decoding between the chunks
        assert any(c[0] == "decode" and 0 in c[1] for c in runner.calls[a:b])


def test_short_prompts_arriving_together_prefill_in_one_call(tok):
    runner = SlotRunner(max_batch=4, prefill_chunk=8)
    got = _serve(runner, tok, [([i + 1, i + 2, i + 3], SamplingParams(max_tokens=3, ignore_eos=True))
                               for i in range(4)])
    assert all(event[:2] == ("done", "length") for _, event in got)
    assert ("prefill_batch", (0, 1, 2, 3)) in runner.calls  # one forward call for the four prompts


def test_an_engine_error_fails_only_that_request(tok):
    runner = SlotRunner(max_batch=4)
    runner.table[:, POISON] = -1e9  # nobody samples the poison token by chance...
    runner.table[99, :] = -1e9
    runner.table[99, POISON] = 1e9  # ...except after token 99: that sequence's decode step raises
    jobs = [([5, 6], SamplingParams(max_tokens=8, ignore_eos=True)),
            ([1, 99], SamplingParams(max_tokens=8, ignore_eos=True)),  # decode fails
            ([POISON, 3], SamplingParams(max_tokens=8, ignore_eos=True)),  # prefill fails
            ([7, 8], SamplingParams(max_tokens=8, ignore_eos=True))]
    got = _serve(runner, tok, jobs)
    assert got[1][1][:2] == ("error", 500) and "poisoned token" in got[1][1][2]
    assert got[2][1][:2] == ("error", 500) and "poisoned prompt" in got[2][1][2]
    for i in (0, 3):
        assert got[i][1][:2] == ("done", "length") and got[i][1][3] == 8


class KVLimitedRunner(SlotRunner):
    """A runner whose KV memory holds ``budget`` positions over all slots (hetmoe.engine.runner.Runner's contract:
    ``reserve`` raises KVCacheFull after ``reclaim``, the scheduler's, could not free enough; ``release`` frees)."""

    def __init__(self, budget, **kw):
        super().__init__(**kw)
        self.budget, self.held = budget, [0] * self.max_batch
        self.reclaim, self.reclaimed = None, 0

    def reserve(self, slot, length):
        from hetmoe.layers.kv_cache import KVCacheFull

        def fits():
            return sum(self.held) - self.held[slot] + max(self.held[slot], length) <= self.budget

        if not fits() and self.reclaim is not None and self.reclaim():
            self.reclaimed += 1
        if not fits():
            raise KVCacheFull(f"the KV cache cannot grow to {length} positions")
        self.held[slot] = max(self.held[slot], length)

    def release(self, slot, keep=0):
        self.held[slot] = min(self.held[slot], keep)
        self.lengths[slot] = min(self.lengths[slot], keep)

    def prefill(self, ids, slot=0, start=0):
        self.release(slot, start)
        self.reserve(slot, start + len(ids))
        return super().prefill(ids, slot, start)

    def decode_batch(self, tokens, slots, meanwhile=None):
        for s in slots:
            self.reserve(s, self.lengths[s] + 1)
        return super().decode_batch(tokens, slots, meanwhile)


def test_kv_memory_out_frees_idle_slots_then_fails_that_request_with_503(tok):
    """Two requests leave their slots' caches (reusable prefixes); a third, larger one needs that memory: the
    scheduler frees the idle slots and it runs. One that needs more than the whole budget fails alone, 503
    kv_cache_full (it may run later), and the loop goes on."""
    runner = KVLimitedRunner(budget=24, max_batch=2, max_context=64, prefill_chunk=64)
    got = _serve(runner, tok, [([1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True)),
                               ([1, 2, 3, 5], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert all(g[1][:2] == ("done", "length") for g in got) and runner.held == [7, 7]  # both keep their caches
    got = _serve(runner, tok, [([9] * 17, SamplingParams(max_tokens=3, ignore_eos=True))])  # 19 + the other's 7
    assert got[0][1][:2] == ("done", "length") and runner.reclaimed == 1
    got = _serve(runner, tok, [([5] * 30, SamplingParams(max_tokens=2, ignore_eos=True)),
                               ([6, 7], SamplingParams(max_tokens=2, ignore_eos=True))])
    assert got[0][1][:2] == ("error", 503) and got[0][1][3] == "kv_cache_full" and "cannot grow" in got[0][1][2]
    assert got[1][1][:2] == ("done", "length")


class GatedRunner(SlotRunner):
    """Decode steps wait for ``gate``: the test decides when the running sequence may move on."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate, self.held = threading.Event(), threading.Event()

    def decode_batch(self, tokens, slots, meanwhile=None):
        self.held.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().decode_batch(tokens, slots, meanwhile)


def test_cancel_frees_the_slot(tok):
    """A cancelled sequence leaves its slot at the next step and the waiting request takes it. The first decode step
    is held until the cancel is in (GatedRunner), so the order is fixed whatever the machine's speed."""
    runner = GatedRunner(max_batch=1)
    long = SamplingParams(max_tokens=50, ignore_eos=True)

    async def main():
        sched = EngineLoop(runner, tok, log=lambda m: None).start()
        loop = asyncio.get_running_loop()
        first = sched.submit(Request([1, 2], long, loop))
        second = sched.submit(Request([3, 4], SamplingParams(max_tokens=3, ignore_eos=True), loop))
        # it holds the only slot: prefilled, first token sampled, its first decode step held
        assert await asyncio.to_thread(runner.held.wait, 30)
        first.cancel()
        runner.gate.set()  # the held step ends; the next one sees the cancel
        text, done = await asyncio.wait_for(_collect(second), 30)
        sched.shutdown()
        return first, done, sched.metrics

    first, done, metrics = asyncio.run(main())
    assert done[:2] == ("done", "length") and done[3] == 3
    assert metrics.cancelled == 1 and metrics.running == 0
    assert not first.finished  # a cancelled request gets no "done"
    # the first sequence ran exactly its one held decode step, then the second got the slot: prefill, 2 decode steps
    first_seq, second_seq = [("prefill", 0, 2), ("decode", (0,))], [("prefill", 0, 2)] + [("decode", (0,))] * 2
    assert runner.calls == first_seq + second_seq


def test_shutdown_ends_running_and_refuses_waiting(tok):
    runner = GatedRunner(max_batch=1)

    async def main():
        sched = EngineLoop(runner, tok, log=lambda m: None).start()
        loop = asyncio.get_running_loop()
        running = sched.submit(Request([1, 2], SamplingParams(max_tokens=60, ignore_eos=True), loop))
        waiting = sched.submit(Request([3, 4], SamplingParams(max_tokens=3), loop))
        assert await asyncio.to_thread(runner.held.wait, 30)  # first token sampled; its decode step is held
        stopping = asyncio.create_task(asyncio.to_thread(sched.shutdown))
        while not sched._stopping:  # shutdown has been requested ...
            await asyncio.sleep(0.001)
        runner.gate.set()  # ... before the held decode step finishes
        await stopping
        late = sched.submit(Request([5], SamplingParams(), loop))
        return await _collect(running), await _collect(waiting), await _collect(late)

    (text, done), (_, refused), (_, late) = asyncio.run(main())
    assert done[:2] == ("done", "length") and done[3] == 2  # the first token and the one held decode step
    assert refused[:2] == ("error", 503) and late[:2] == ("error", 503)


class CountingCondition(threading.Condition):
    """The scheduler's condition variable, recording every wait: its timeout and whether it returned. ``parked`` is
    set just before a wait starts, with the lock held: whoever takes the lock after it is set knows the waiter is
    inside wait() (it released the lock there)."""

    def __init__(self):
        super().__init__()
        self.timeouts, self.returned, self.parked = [], 0, threading.Event()

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        self.parked.set()
        try:
            return super().wait(timeout)
        finally:
            self.returned += 1
            self.parked.clear()


def _parked(cond, n):
    """Waits until the engine thread is inside its ``n``-th wait on ``cond``; returns (waits entered, returned)."""
    assert cond.parked.wait(30), "the engine loop never went idle"
    with cond:  # the engine thread released the lock in wait(): it is blocked there now
        assert len(cond.timeouts) == n, cond.timeouts
        return len(cond.timeouts), cond.returned


def test_idle_loop_waits_untimed_and_wakes_only_for_work(tok):
    """With nothing submitted the engine thread blocks in an untimed wait on its condition (no polling, no CPU
    use) and is woken once per submission, then parks again: counted waits, not a CPU-time budget."""
    sched = EngineLoop(SlotRunner(), tok, log=lambda m: None)
    sched._cond = cond = CountingCondition()
    sched.start()
    try:
        assert _parked(cond, 1) == (1, 0)  # idle from the start: one wait entered, none returned
        assert cond.timeouts == [None], "the idle loop must not poll with a timeout"

        async def one():
            req = sched.submit(Request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True),
                                       asyncio.get_running_loop()))
            return await asyncio.wait_for(_collect(req), 30)

        _, done = asyncio.run(one())
        assert done[:2] == ("done", "length") and done[3] == 3
        # woken once by the submission, served it, and parked again: the second wait, still untimed
        assert _parked(cond, 2) == (2, 1) and cond.timeouts == [None, None]
    finally:
        sched.shutdown()
    assert cond.returned == 2 and not sched._thread.is_alive()  # shutdown's notify was the only other wake-up


class OutOfMemoryRunner(SlotRunner):
    """A runner whose prefill runs out of device memory for prompts longer than ``limit`` tokens (another process
    took the GPU's memory, or the prompt's activations do not fit)."""

    def __init__(self, limit, **kw):
        super().__init__(**kw)
        self.limit = limit

    def prefill(self, ids, slot=0, start=0):
        if len(ids) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().prefill(ids, slot, start)


def test_out_of_memory_in_a_prefill_fails_that_request_with_503_and_the_loop_goes_on(tok):
    """A forward that runs out of device memory fails its request alone: 503 out_of_memory (it may succeed later),
    the message says what ran out; the request beside it and the next one run, and the slot is free again."""
    runner = OutOfMemoryRunner(limit=8, max_batch=2, max_context=64, prefill_chunk=64)
    got = _serve(runner, tok, [([5] * 20, SamplingParams(max_tokens=2, ignore_eos=True)),
                               ([6, 7], SamplingParams(max_tokens=2, ignore_eos=True))])
    assert got[0][1][:2] == ("error", 503) and got[0][1][3] == "out_of_memory"
    assert "OutOfMemoryError" in got[0][1][2] and "prefill failed" in got[0][1][2]
    assert got[1][1][:2] == ("done", "length")
    got = _serve(runner, tok, [([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))] * 2)
    assert all(g[1][:2] == ("done", "length") for g in got)
