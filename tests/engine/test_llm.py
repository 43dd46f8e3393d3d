"""``LLM``'s API (hetmoe/engine/llm.py) on the built-in model: ``generate`` with one prompt or a list (batched
through the engine's scheduler), ``chat``, ``stream``. Greedy, on one forced engine path (tests/paths.py), so that
the experts' results do not depend on how many tokens share a call; what still differs between a batch and a single
sequence (the dense layers' GEMM rounding) stays far below this model's greedy margins."""

import pytest

from hetmoe.config.options import EngineOptions
from hetmoe.engine.llm import LLM
from hetmoe.engine.sampler import SamplingParams
from paths import BEST_ROW_PATH

MAX_BATCH = 4
PROMPTS = ["def f", "Write a Python function `read_lines`: Return the lines of a text file as a list.", "import os\n",
           "class Stack:\n    def push(self, item):", "Hello"]  # five prompts for four slots: one waits
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 3, 10, 6, 5)]


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(device="cpu", max_context=128, max_batch=MAX_BATCH, **BEST_ROW_PATH.options)
    return LLM(None, options, expert_cache=None, progress=False, log=lambda m: None)


def _same(a, b):
    assert a.token_ids == b.token_ids and a.text == b.text
    assert (a.finish_reason, a.prompt_tokens, a.completion_tokens) == (b.finish_reason, b.prompt_tokens,
                                                                       b.completion_tokens)


def test_a_list_of_prompts_equals_each_alone(llm):
    alone = []
    for prompt, params in zip(PROMPTS, PARAMS):
        llm.forget_cache()  # computed whole, as on a fresh LLM
        alone.append(llm.generate(prompt, params))
    batches, decode_batch = [], llm.runner.decode_batch

    def spy(tokens, slots, meanwhile=None):
        batches.append(len(slots))
        return decode_batch(tokens, slots, meanwhile)

    llm.forget_cache()
    llm.runner.decode_batch = spy
    try:
        together = llm.generate(PROMPTS, PARAMS)
    finally:
        del llm.runner.decode_batch
    assert len(together) == len(PROMPTS)
    for a, b, params in zip(together, alone, PARAMS):
        _same(a, b)
        assert a.completion_tokens == params.max_tokens
    assert max(batches) == MAX_BATCH  # decoded together, never more than the slots
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_one_params_for_all_and_argument_errors(llm):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    both = llm.generate(PROMPTS[:2], params)
    assert [r.completion_tokens for r in both] == [2, 2]
    assert llm.generate([], params) == []
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(PROMPTS[:2], [params])
    with pytest.raises(ValueError, match="on_text streams one prompt"):
        llm.generate(PROMPTS[:2], params, on_text=print)
    with pytest.raises(ValueError, match="context holds 128"):
        llm.generate(["short", "word " * 200], params)  # nothing of the first one is left running
    assert not llm.scheduler.running and not llm.scheduler.waiting
    llm.default_params = SamplingParams(max_tokens=3, ignore_eos=True)  # what params=None means
    try:
        assert llm.generate("Hello").completion_tokens == 3
    finally:
        llm.default_params = None


def test_stream(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = llm.generate(PROMPTS[1], params)
    stream = llm.stream(PROMPTS[1], params)
    assert stream.result is None
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == want.text
    _same(stream.result, want)
    t = stream.result.timings
    assert t.prompt_tokens == len(llm.prompt_ids(PROMPTS[1], chat=True)) and t.decode_steps == 11

    early = llm.stream(PROMPTS[3], params)  # left after its first piece: the slot is freed at the next step
    assert next(early)
    early.close()
    assert list(early) == [] and early.result is None
    assert llm.generate(PROMPTS[3], SamplingParams(max_tokens=2)).completion_tokens <= 2
    assert not llm.scheduler.running
    with pytest.raises(ValueError, match="context holds 128"):
        llm.stream("word " * 200, params)


def test_chat(llm):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a function."}]
    llm.forget_cache()
    pieces = []
    first = llm.chat(messages, params, on_text=pieces.append)
    assert "".join(pieces) == first.text and first.timings.cached_tokens == 0
    assert first.prompt_tokens == len(llm.prompt_ids(messages, chat=True))
    llm.forget_cache()
    _same(llm.generate(messages, params), first)  # a conversation given to generate: the same prompt

    turn = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter."}]
    second = llm.chat(turn, params)
    assert 0 < second.timings.cached_tokens < second.prompt_tokens  # the earlier turn was not recomputed
    llm.forget_cache()
    _same(llm.chat(turn, params), second)

    llm.forget_cache()
    both = llm.chat([messages, turn], params)  # several conversations: batched, in order
    _same(both[0], first)
    _same(both[1], second)
    with pytest.raises(ValueError, match="messages"):
        llm.chat("not a conversation", params)
