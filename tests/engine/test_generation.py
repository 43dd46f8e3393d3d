"""Tokenizer (hetmoe/tokenizer.py), sampling and stop handling (hetmoe/engine/sequence.py), and the
generation loop (hetmoe/engine/scheduler.py): one sequence's stop strings and streaming, several batched, prefix reuse
and what an interrupted step leaves behind.

No model: runners here return logits from a fixed random [V, V] table (a function of the last token, or of the whole
context a slot's cache holds) or follow a script of token ids, so every expectation is exact.
"""

import json
import shutil

import pytest
import torch

from hetmoe.engine.sampler import SamplingParams, sample
from hetmoe.engine.scheduler import Request, Scheduler
from hetmoe.engine.sequence import GenerationResult
from hetmoe.load.random_weights import _CHAT_TEMPLATE, build_tokenizer
from hetmoe.tokenizer import IncrementalDecoder, Tokenizer

VOCAB = 512
MULTIBYTE = "héllo → 日本語 🙂"


@pytest.fixture(scope="module")
def backend():
    return build_tokenizer(VOCAB)


def _write_dir(path, backend, **config):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, backend):
    return _write_dir(tmp_path_factory.mktemp("tok"), backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                      bos_token=None, chat_template=_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


class TableRunner:
    """The runner interface the scheduler drives (engine/runner.py's) over ``max_batch`` slots. Logits are a fixed
    random function of the last token; checks that positions stay inside the context and that a prefill starts
    within what its slot holds. ``pos``, ``decode_calls``: slot 0's length and decode steps since its last prefill."""

    def __init__(self, vocab=VOCAB, max_context=256, seed=0, max_batch=1, prefill_chunk=1024):
        g = torch.Generator().manual_seed(seed)
        self.table = 3 * torch.randn(vocab, vocab, generator=g)
        self.max_context, self.max_batch, self.prefill_chunk = max_context, max_batch, prefill_chunk
        self.cache = [[] for _ in range(max_batch)]  # the tokens each slot's KV cache holds
        self.decode_calls, self.starts = 0, []

    @property
    def pos(self):
        return len(self.cache[0])

    def _logits(self, slot):
        return self.table[self.cache[slot][-1]].clone()

    def prefill(self, ids, slot=0, start=0):
        assert 0 < len(ids) <= self.prefill_chunk and start + len(ids) <= self.max_context
        assert 0 <= start <= len(self.cache[slot]), "a prefill past what the slot holds"
        self.cache[slot] = self.cache[slot][:start] + list(ids)
        self.starts.append(start)
        if slot == 0:
            self.decode_calls = 0
        return self._logits(slot)

    def prefill_batch(self, chunks, slots, starts):
        return torch.stack([self.prefill(c, s, st) for c, s, st in zip(chunks, slots, starts)])

    def decode_batch(self, tokens, slots, meanwhile=None):
        if meanwhile is not None:
            meanwhile()
        rows = []
        for token, slot in zip(tokens, slots):
            assert len(self.cache[slot]) < self.max_context, "decode past the context"
            self.cache[slot].append(int(token))
            self.decode_calls += slot == 0
            rows.append(self._logits(slot))
        return torch.stack(rows)


class ContextRunner(TableRunner):
    """Logits are a function of everything the slot's cache holds: reusing a prefix the cache does not really
    hold (or no longer holds) changes the tokens."""

    def _logits(self, slot):
        return self.table[hash(tuple(self.cache[slot])) % self.table.shape[0]].clone()


class ScriptedRunner(TableRunner):
    """Greedy decoding of this runner yields ``script`` (then repeats its last token)."""

    def __init__(self, script, vocab=VOCAB, max_context=256):
        super().__init__(vocab, max_context)
        self.script = list(script)

    def _logits(self, slot):
        step = min(self.decode_calls, len(self.script) - 1)
        logits = torch.randn(self.table.shape[0])
        logits[self.script[step]] = 100.0
        return logits


def generate(runner, tok, prompt_ids, params, on_text=None):
    """One sequence through the engine's scheduler, as LLM.generate runs it."""
    return Scheduler(runner, tok).run([Request(prompt_ids, params, on_text)])[0]


def _run(runner, tok, params, prompt=(1, 2, 3)):
    pieces = []
    result = generate(runner, tok, list(prompt), params, on_text=pieces.append)
    assert "".join(pieces) == result.text and all(pieces)
    return result, pieces


# --- sampling -------------------------------------------------------------------------------------------------

def test_greedy_picks_argmax():
    logits = torch.randn(3, 100)
    assert torch.equal(sample(logits, SamplingParams()), logits.argmax(-1))
    assert int(sample(logits[1], SamplingParams())) == int(logits[1].argmax())
    assert sample(logits[1].to(torch.bfloat16), SamplingParams()).dim() == 0


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k1_and_tiny_top_p_are_greedy(temperature):
    logits = torch.randn(64, 300)
    g = torch.Generator().manual_seed(0)
    for params in (SamplingParams(temperature=temperature, top_k=1),
                   SamplingParams(temperature=temperature, top_p=1e-6)):
        assert torch.equal(sample(logits, params, g), logits.argmax(-1))


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


@pytest.mark.parametrize("kw, allowed", [
    (dict(), {0, 1, 2, 3, 4}),
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.6), {0, 1}),  # 0.4 < 0.6 <= 0.7
    (dict(top_p=0.75), {0, 1, 2}),
    (dict(top_k=3, top_p=0.5), {0, 1}),  # after top-3: 0.47, 0.35, 0.18
    (dict(top_k=4, top_p=0.95), {0, 1, 2, 3}),
])
def test_filters_never_sample_outside_the_allowed_set(kw, allowed):
    n = 20000
    logits = PROBS.log().expand(n, -1).contiguous()
    draws = sample(logits, SamplingParams(temperature=1.0, seed=0, **kw), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=5)
    assert set(torch.nonzero(counts).flatten().tolist()) == allowed
    expected = PROBS * torch.tensor([i in allowed for i in range(5)])
    expected = expected / expected.sum()
    assert torch.allclose(counts / n, expected, atol=0.015)


def test_temperature_sharpens():
    logits = PROBS.log().expand(20000, -1).contiguous()
    g = torch.Generator().manual_seed(2)
    cold = torch.bincount(sample(logits, SamplingParams(temperature=0.5), g), minlength=5) / 20000
    expected = PROBS ** 2 / (PROBS ** 2).sum()
    assert torch.allclose(cold, expected, atol=0.015)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("kw", [
    dict(temperature=1e-300), dict(temperature=1e-30), dict(temperature=5e-6),  # below 1e-5: greedy
    dict(temperature=1e-300, top_p=1e-300), dict(temperature=1e-5), dict(temperature=1e-5, top_p=0.5),
    dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_p=1e-40), dict(temperature=0.7, top_p=1e-8),
])
def test_extreme_parameters_are_greedy_not_nan(kw, batch, dtype):
    """Temperatures below 1e-5 and a top_p that is 0 in fp32 (1e-300, 1e-40) give the argmax, never an fp32
    overflow (inf - inf) or an empty distribution ("invalid multinomial distribution")."""
    g = torch.Generator().manual_seed(3)  # distinct integer logits, exact in bf16: no ties for the argmax
    logits = torch.stack([torch.randperm(300, generator=g) - 150.0 for _ in range(16)]).to(dtype)
    logits[:, 7] = float("-inf")  # a masked token
    x = logits if batch else logits[5]
    for seed in range(3):
        got = sample(x, SamplingParams(seed=seed, **kw), torch.Generator().manual_seed(seed))
        assert torch.equal(got, x.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 1e4, 1e30, 1e300])
def test_large_temperatures_are_uniform_over_finite_tokens(temperature, dtype):
    """A huge temperature flattens the distribution (never NaN from -inf * 0), and a -inf token stays impossible."""
    n = 20000
    logits = PROBS.log().to(dtype).expand(n, -1).contiguous()
    logits[:, 4] = float("-inf")
    draws = sample(logits, SamplingParams(temperature=temperature), torch.Generator().manual_seed(4))
    freq = torch.bincount(draws, minlength=5) / n
    assert freq[4] == 0
    if temperature >= 1e4:
        assert torch.allclose(freq[:4], torch.full((4,), 0.25), atol=0.015)
    one = sample(logits[0], SamplingParams(temperature=temperature, top_p=0.9), torch.Generator().manual_seed(4))
    assert one.dim() == 0 and int(one) != 4


@pytest.mark.parametrize("top_p", [1e-300, 1e-20, 0.3, 0.5, 0.999999999, 1.0])
def test_top_p_keeps_at_least_the_top_token(top_p):
    """Every top_p in (0, 1] leaves a valid distribution that holds the most likely token."""
    logits = PROBS.log().expand(2000, -1).contiguous()
    draws = sample(logits, SamplingParams(temperature=1.0, top_p=top_p), torch.Generator().manual_seed(5))
    counts = torch.bincount(draws, minlength=5)
    assert counts[0] > 0
    if top_p <= 0.4:
        assert counts[0] == 2000


def test_scheduler_takes_tiny_temperature_as_greedy(tok):
    greedy, _ = _run(TableRunner(), tok, SamplingParams(max_tokens=10, ignore_eos=True))
    for kw in (dict(temperature=1e-300), dict(temperature=1.0, top_p=1e-300), dict(temperature=1e-300, top_p=1e-300)):
        assert SamplingParams(**kw).greedy == ("temperature" in kw and kw["temperature"] < 1e-5)
        result, _ = _run(TableRunner(), tok, SamplingParams(max_tokens=10, ignore_eos=True, seed=1, **kw))
        assert result.finish_reason == "length" and result.token_ids == greedy.token_ids


def test_bad_logits_shape():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 3, 4), SamplingParams())


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens must be"),
    (dict(max_new_tokens=0), "max_new_tokens must be"),
    (dict(max_tokens=2, max_new_tokens=2), "not both"),
    (dict(stop=("ok", "")), "stop"),
    (dict(stop=(3,)), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
])
def test_sampling_params_validation(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kw)


def test_sampling_params_normalizes():
    p = SamplingParams(stop="END", stop_token_ids=[5, 6])
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6)
    assert SamplingParams().max_tokens == 128 and SamplingParams(7) == SamplingParams(max_tokens=7)
    old = SamplingParams(max_new_tokens=9)  # the CLI's name, kept as another name of max_tokens
    assert old == SamplingParams(max_tokens=9) and old.max_new_tokens == 9


# --- generation loop ------------------------------------------------------------------------------------------

def test_seed_reproducible(tok):
    def text(seed):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        return _run(TableRunner(), tok, params)[0]

    a, b, c = text(7), text(7), text(8)
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.token_ids != c.token_ids


def test_greedy_follows_the_table(tok):
    runner = TableRunner()
    result, _ = _run(runner, tok, SamplingParams(max_tokens=10, ignore_eos=True))
    expected, last = [], 3
    for _ in range(10):
        last = int(runner.table[last].argmax())
        expected.append(last)
    assert result.token_ids == expected
    assert result.text == tok.decode(expected)


def test_max_tokens_is_length(tok):
    runner = TableRunner()
    result, _ = _run(runner, tok, SamplingParams(max_tokens=5, temperature=1.0, seed=0, ignore_eos=True))
    assert result.finish_reason == "length" and len(result.token_ids) == 5 == result.completion_tokens
    assert runner.decode_calls == 4 == result.timings.decode_steps
    assert result.prompt_tokens == 3 == result.timings.prompt_tokens
    assert result.timings.prefill_s > 0 and result.timings.decode_s > 0
    assert result.timings.prefill_tok_s > 0 and result.timings.decode_tok_s > 0


def test_context_full_is_length(tok):
    runner = TableRunner(max_context=10)
    result, _ = _run(runner, tok, SamplingParams(max_tokens=100, ignore_eos=True), prompt=range(7))
    assert result.finish_reason == "length" and len(result.token_ids) == 3  # 7 + 3 = max_context
    assert runner.pos <= runner.max_context


@pytest.mark.parametrize("n", [10, 12])
def test_prompt_too_long(tok, n):
    with pytest.raises(ValueError, match=rf"{n} tokens.*holds 10"):
        generate(TableRunner(max_context=10), tok, list(range(n)), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        generate(TableRunner(), tok, [], SamplingParams())


def test_eos_stops(tok):
    body = tok.encode("Hello, world!")
    eos = tok.token_to_id("<|im_end|>")
    result, _ = _run(ScriptedRunner(body + [eos, 7, 8]), tok, SamplingParams(max_tokens=50))
    assert result.finish_reason == "stop" and result.text == "Hello, world!"
    assert result.token_ids == body and result.completion_tokens == len(body) + 1

    result, _ = _run(ScriptedRunner(body + [eos, 7]), tok, SamplingParams(max_tokens=len(body) + 3,
                                                                           ignore_eos=True))
    assert result.finish_reason == "length" and result.token_ids == body + [eos, 7, 7]

    result, _ = _run(ScriptedRunner(body + [eos]), tok, SamplingParams(stop_token_ids=[body[2]], ignore_eos=True))
    assert result.finish_reason == "stop" and result.token_ids == body[:2]


def _script(tok, text, tail="<|im_end|>"):
    return tok.encode(text, add_special_tokens=False) + [tok.token_to_id(tail)]


def test_stop_string_single_token(tok):
    result, pieces = _run(ScriptedRunner(_script(tok, "Hello, world! How are you today?")), tok,
                          SamplingParams(stop=["How"]))
    assert result.finish_reason == "stop" and result.text == "Hello, world! "
    assert not any("H" in p for p in pieces[1:])  # nothing of the stop string was streamed


def test_stop_string_spanning_tokens(tok):
    text, stop = "Hello, world! How are you today?", ", wor"
    ids = tok.encode(text, add_special_tokens=False)
    assert not any(stop in tok.decode([i]) for i in ids)  # it really spans tokens
    result, pieces = _run(ScriptedRunner(_script(tok, text)), tok, SamplingParams(stop=[stop, "today"]))
    assert result.finish_reason == "stop" and result.text == "Hello"
    assert "".join(pieces) == "Hello" and not any("," in p for p in pieces)
    assert result.token_ids == ids[:len(result.token_ids)] and tok.decode(result.token_ids).startswith("Hello, wor")


def test_earliest_stop_string_wins(tok):
    result, _ = _run(ScriptedRunner(_script(tok, "Hello, world! How are you today?")), tok,
                     SamplingParams(stop=["today", "are", "world!"]))
    assert result.text == "Hello, "


def test_stream_holds_back_only_until_resolved(tok):
    text = "Hello, wonderful wordy world"
    seen = []
    result = generate(ScriptedRunner(_script(tok, text)), tok, [1], SamplingParams(stop=["world!"]),
                      on_text=lambda p: seen.append(p))
    assert result.finish_reason == "stop" and result.text == text  # eos, not the stop string
    assert "".join(seen) == text and len(seen) > 3
    # "world" was held back (it could have become "world!") and only released once the stream ended
    assert not seen[-1].startswith(" ") and seen[-1].endswith("world") and "world" not in "".join(seen[:-1])

    # ends inside a possible stop string because of max_tokens: the held-back text is still returned
    n = len(tok.encode(text, add_special_tokens=False))
    result, _ = _run(ScriptedRunner(_script(tok, text)), tok, SamplingParams(stop=["world!"], max_tokens=n))
    assert result.finish_reason == "length" and result.text == text


def test_streaming_multibyte(tok):
    result, pieces = _run(ScriptedRunner(_script(tok, MULTIBYTE)), tok, SamplingParams(stop=["語 🙂!"]))
    assert result.text == MULTIBYTE and not any("\ufffd" in p for p in pieces) and len(pieces) > 5


def test_result_type(tok):
    result, _ = _run(TableRunner(), tok, SamplingParams(max_tokens=3, ignore_eos=True))
    assert isinstance(result, GenerationResult)


# --- several sequences, prefix reuse, interrupted steps -------------------------------------------------------

PROMPTS = [list(range(1, 4)), list(range(10, 31)), [7], list(range(40, 49)), [5, 6]]


def _alone(prompt, params, tok):
    """The reference: the prompt by itself, on a fresh runner."""
    return generate(ContextRunner(max_batch=1, prefill_chunk=4), tok, prompt, params)


def test_batched_equals_alone(tok):
    """Five prompts of different lengths on three slots (two wait for a free one), prompts in chunks of 4 between
    decode steps, one of them sampled: each gets what it gets alone, whatever ran beside it."""
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 12, 4, 7)]
    params[2] = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    got = Scheduler(ContextRunner(max_batch=3, prefill_chunk=4), tok).run(
        [Request(p, sp) for p, sp in zip(PROMPTS, params)])
    for prompt, sp, result in zip(PROMPTS, params, got):
        want = _alone(prompt, sp, tok)
        assert result.token_ids == want.token_ids and result.text == want.text
        assert result.finish_reason == "length" and result.completion_tokens == sp.max_tokens


def test_prefix_reuse_computes_only_the_new_part(tok):
    runner = ContextRunner(max_batch=2, prefill_chunk=4)
    sched = Scheduler(runner, tok)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt = list(range(1, 11))
    first = sched.run([Request(prompt, params)])[0]
    assert first.timings.cached_tokens == 0 and first.timings.new_prompt_tokens == 10
    turn = prompt + first.token_ids + [7, 8]  # the conversation so far and a new message
    runner.starts.clear()
    second = sched.run([Request(turn, params)])[0]
    cached = 10 + 4  # the prompt and the generated tokens fed back (the last one never was)
    assert second.timings.cached_tokens == cached and second.timings.new_prompt_tokens == len(turn) - cached
    assert runner.starts[0] == cached
    assert second.token_ids == _alone(turn, params, tok).token_ids
    third = sched.run([Request(turn, params)])[0]  # again: all but the last token, computed for its logits
    assert third.timings.cached_tokens == len(turn) - 1 and third.token_ids == second.token_ids
    sched.forget_cache()
    assert sched.run([Request(turn, params)])[0].timings.cached_tokens == 0
    running = sched.add(Request(turn, params))  # forgotten while it runs: nothing it caches is reused either
    sched.step()
    sched.forget_cache()
    while not running.finished:
        sched.step()
    assert sched.run([Request(turn, params)])[0].timings.cached_tokens == 0


def test_each_conversation_finds_its_slot(tok):
    """Two conversations in two slots: each next turn goes to the slot that holds its earlier turns."""
    sched = Scheduler(ContextRunner(max_batch=2), tok)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a, b = list(range(1, 9)), list(range(50, 62))
    ra, rb = sched.run([Request(a, params), Request(b, params)])
    for prompt, reply in ((b, rb), (a, ra)):
        turn = prompt + reply.token_ids + [3]
        got = sched.run([Request(turn, params)])[0]
        assert got.timings.cached_tokens == len(prompt) + 3 and got.token_ids == _alone(turn, params, tok).token_ids


@pytest.mark.parametrize("where", ["prefill", "decode_batch"])
def test_an_interrupted_step_is_not_reused(tok, where):
    """A runner call stopped part way (a second Ctrl-C, an error) may have overwritten cache positions of the earlier
    turn: nothing of its slot is reused afterwards, and the next turn gets what a fresh runner gives."""
    runner = ContextRunner(max_batch=1)
    sched = Scheduler(runner, tok)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 11))
    first = sched.run([Request(prompt, params)])[0]
    call = getattr(runner, where)

    def interrupted(*args, **kwargs):
        call(*args, **kwargs)  # the call's cache writes happen, then the interrupt arrives
        raise KeyboardInterrupt

    setattr(runner, where, interrupted)
    with pytest.raises(KeyboardInterrupt):  # another prompt sharing the first 3 tokens, then overwriting
        sched.run([Request(prompt[:3] + [99] * 5, params)])
    delattr(runner, where)
    assert not sched.running  # the interrupted sequence has left its slot
    again = prompt + first.token_ids + [7]
    got = sched.run([Request(again, params)])[0]
    assert got.timings.cached_tokens == 0 and got.token_ids == _alone(again, params, tok).token_ids


class _Stop(Exception):
    pass


def test_stopping_between_steps_keeps_the_cache(tok):
    """An exception from on_text (the chat's first Ctrl-C) stops the sequence between two steps: it is dropped, its
    slot freed, and what its completed steps cached is reused."""
    sched = Scheduler(ContextRunner(max_batch=1), tok)
    prompt, pieces = list(range(1, 11)), []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            raise _Stop

    req = Request(prompt, SamplingParams(max_tokens=50, ignore_eos=True), on_text)
    with pytest.raises(_Stop):
        sched.run([req])
    assert req.cancelled and not req.finished and not sched.running
    generated = req.state.token_ids
    turn = prompt + generated + [7]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    got = sched.run([Request(turn, params)])[0]
    assert got.timings.cached_tokens == len(prompt) + len(generated) - 1
    assert got.token_ids == _alone(turn, params, tok).token_ids and not sched.running


def test_a_failed_request_raises_its_error(tok):
    runner = ContextRunner(max_batch=2)

    def broken(tokens, slots, meanwhile=None):
        raise RuntimeError("decode exploded")

    runner.decode_batch = broken
    sched = Scheduler(runner, tok, log=lambda m: None)
    with pytest.raises(RuntimeError, match="decode exploded"):
        sched.run([Request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))])
    assert not sched.running and not sched.waiting


# --- tokenizer ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["def forward(self, x): return x", MULTIBYTE, ""])
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_incremental_decoder(tok):
    ids = tok.encode(MULTIBYTE + " and some ascii, 🙂🙂")
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # characters really are split across tokens
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids)

    dec = IncrementalDecoder(tok)  # stopped inside a character: flush hands back the partial tail
    partial = "".join(dec.push(i) for i in ids[:2])
    assert partial + dec.flush() == tok.decode(ids[:2])


def test_special_tokens_and_eos_ids(tmp_path, backend):
    d = _write_dir(tmp_path, backend, eos_token={"content": "<|im_end|>", "special": True},
                   chat_template=[{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEF"}])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token == "<|im_end|>" and t.eos_ids == {0, 1, 2}
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "DEF"
    assert t.decode(t.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    assert t.decode(t.encode("<|im_start|>hi"), skip_special_tokens=False) == "<|im_start|>hi"

    (d / "chat_template.jinja").write_text("FILE {{ messages[0].content }}")  # the separate file wins
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE x"


def test_chat_template_matches_transformers(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from hetmoe.load.random_weights import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("ckpt"), "qwen3_moe")
    ours, theirs = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 日本"},
            {"role": "assistant", "content": "Hi!\n"}, {"role": "user", "content": "Again"}]
    for add in (True, False):
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(chat, add_generation_prompt=add) == expected
    prompt = ours.apply_chat_template(chat)
    assert ours.encode(prompt) == theirs(prompt).input_ids
    assert ours.eos_ids >= {theirs.eos_token_id}

    # a template with the features real ones use: namespace, loop controls, tojson, raise_exception, tools
    rich = (
        "{% set ns = namespace(sys='You are helpful.') %}"
        "{% if messages[0]['role'] == 'system' %}{% set ns.sys = messages[0]['content'] %}{% endif %}"
        "<|im_start|>system\n{{ ns.sys }}{% if tools %}\n{{ tools | tojson }}{% endif %}<|im_end|>\n"
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    rich_dir = tmp_path_factory.mktemp("rich")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, rich_dir / f)
    (rich_dir / "chat_template.jinja").write_text(rich)
    ours, theirs = Tokenizer.from_dir(rich_dir), transformers.AutoTokenizer.from_pretrained(rich_dir)
    tools = [{"type": "function", "function": {"name": "f", "description": "<a & b>"}}]
    for kw in (dict(), dict(tools=tools), dict(enable_thinking=False)):
        expected = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(chat, **kw) == expected
    with pytest.raises(ValueError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


BOS = "<｜begin▁of▁sentence｜>"


@pytest.mark.parametrize("post_processor", [False, True])
def test_deepseek_style_bos(tmp_path, post_processor):
    from tokenizers import processors

    backend = build_tokenizer(VOCAB)
    backend.add_special_tokens([BOS, "<｜end▁of▁sentence｜>"])
    bos_id = backend.token_to_id(BOS)
    if post_processor:  # DeepSeek-V3's tokenizer.json adds the bos itself too
        backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
                "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")
    d = _write_dir(tmp_path, backend, add_bos_token=True, add_eos_token=False, chat_template=template,
                   bos_token={"__type": "AddedToken", "content": BOS, "lstrip": False, "normalized": True,
                              "rstrip": False, "single_word": False},
                   eos_token={"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>"})
    t = Tokenizer.from_dir(d)
    assert t.bos_id == bos_id and t.add_bos_token is True
    prompt = t.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == f"{BOS}<｜User｜>Hi<｜Assistant｜>"
    ids = t.encode(prompt)
    assert ids[0] == bos_id and ids.count(bos_id) == 1
    assert t.decode(ids) == "<｜User｜>Hi<｜Assistant｜>"
    assert t.encode("Hi")[0] == bos_id and t.encode("Hi").count(bos_id) == 1
    assert bos_id not in t.encode("Hi", add_special_tokens=False)
    assert t.encode(BOS + BOS + "Hi").count(bos_id) == 2  # written twice by the caller: kept as written
    assert t.eos_ids == {backend.token_to_id("<｜end▁of▁sentence｜>")}


def test_missing_or_broken_files(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    t = Tokenizer.from_dir(tmp_path)
    assert not t.has_chat_template and t.eos_ids == set()
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages", [
    [], "hi", ["hi"], [{"role": "user"}], [{"content": "x"}], [{"role": "user", "content": None}],
    [{"role": "user", "content": ["a"]}], [{"role": "", "content": "x"}], None,
])
def test_malformed_messages(tok, messages):
    assert tok.has_chat_template
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)
