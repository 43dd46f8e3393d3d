"""Log-probabilities (hetmoe/engine/sampler.py, sequence.py, scheduler.py, runner.py): of the generated tokens
(``SamplingParams.logprobs``: results and the scheduler's "logprobs" events) and of the prompt
(``prompt_logprobs``: every position's logits from the runner's prefill, chunked, never from a reused prefix).

References: the log_softmax of ``Runner.score``'s logits (one forward over the whole text, fp32), and
``hetmoe eval``'s per-token negative log-likelihoods (hetmoe/tools/evaluation.py ``token_nll``, float64). The
built-in model on the CPU (fp32 dense weights) on one forced engine path (tests/paths.py BEST_ROW_PATH): a chunked
prefill or a decode step differs from the one-shot forward only by the dense GEMMs' summation order, so the
log-probabilities agree to 1e-4 (measured: below 1e-5).
"""

import math

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine import scheduler as scheduler_module
from hetmoe.engine.llm import LLM
from hetmoe.engine.sampler import SamplingParams, TokenLogprob, token_logprob
from hetmoe.engine.scheduler import Request
from hetmoe.tools.evaluation import token_nll
from paths import BEST_ROW_PATH

TOL = 1e-4
PROMPT = "Write a Python function `read_lines`: Return the lines of a text file as a list."


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(device="cpu", max_context=256, max_batch=4, **BEST_ROW_PATH.options)
    return LLM(None, options, expert_cache=None, progress=False, log=lambda m: None)


def full_logprobs(llm, ids):
    """log_softmax of one forward over ``ids`` [n, V] (row i predicts ids[i + 1]); the scheduler forgets its cache."""
    try:
        return torch.log_softmax(llm.runner.score(ids).double(), -1)
    finally:
        llm.forget_cache()


def test_token_logprob_breaks_ties_for_the_chosen_token():
    logp = torch.log_softmax(torch.tensor([1.0, 3.0, 3.0, 3.0, float("-inf"), 0.5]), -1)
    for chosen in (1, 2, 3):  # tied with the two others: first, whatever order topk gives ties
        top = [t for t, _ in token_logprob(logp, chosen, 2).top]
        assert top[0] == chosen and top[1] in {1, 2, 3} - {chosen}
    assert {t for t, _ in token_logprob(logp, 0, 3).top} == {1, 2, 3}  # not among the top 3
    entry = token_logprob(logp, 5, 10)
    assert [t for t, _ in entry.top][3:] == [0, 5] and len(entry.top) == 5  # no -inf entries
    assert entry.logprob == float(logp[5]) and entry.top[-1] == (5, entry.logprob)
    assert token_logprob(logp, 1, 0).top == []


def test_generated_logprobs_match_the_full_forward(llm):
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5)
    out = llm.generate(PROMPT, params)
    assert len(out.logprobs) == out.completion_tokens == 10
    ids = llm.prompt_ids(PROMPT, chat=True)
    ref = full_logprobs(llm, ids + out.token_ids)[len(ids) - 1:-1]  # the rows that predicted each generated token
    for entry, token, row in zip(out.logprobs, out.token_ids, ref):
        assert isinstance(entry, TokenLogprob) and entry.token_id == token
        assert entry.logprob <= 0 and entry.logprob == pytest.approx(float(row[token]), abs=TOL)
        assert entry.top[0] == (token, entry.logprob)  # greedy: the chosen token is the most likely
        assert len(entry.top) == 5 and [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        want = row.topk(5)
        assert [t for t, _ in entry.top] == want.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(want.values.tolist(), abs=TOL)
    assert out.prompt_logprobs is None
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))
    assert plain.token_ids == out.token_ids and plain.logprobs is None  # asking changes nothing else


def test_the_final_stop_token_has_its_logprob(llm):
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True))
    stop = greedy.token_ids[3]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=10, stop_token_ids=[stop], logprobs=0))
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[:3] and out.completion_tokens == 4
    assert [e.token_id for e in out.logprobs] == greedy.token_ids[:4] and all(e.top == [] for e in out.logprobs)


def test_logprobs_are_of_the_processed_logits_before_temperature(llm):
    """A bias shows in the log-probabilities; a temperature does not (sampled tokens: their logprob is the
    untempered distribution's, as in the full forward)."""
    forced = llm.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=2, logit_bias={4242: 100}))
    assert forced.token_ids == [4242] * 3 and all(-1e-3 < e.logprob <= 0 for e in forced.logprobs)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, temperature=1.5, seed=4)
    out = llm.generate(PROMPT, params)
    ids = llm.prompt_ids(PROMPT, chat=True)
    ref = full_logprobs(llm, ids + out.token_ids)[len(ids) - 1:-1]
    for entry, token, row in zip(out.logprobs, out.token_ids, ref):
        assert entry.logprob == pytest.approx(float(row[token]), abs=TOL)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()  # the untempered top 3
    assert any(e.top[0][0] != e.token_id for e in out.logprobs)  # sampled, not always the most likely


class Recording(Request):
    """Keeps every event, and how many prompt log-probabilities were there at the first text / logprobs event."""

    def __init__(self, *args):
        super().__init__(*args)
        self.log, self.prompt_entries_at_first = [], None

    def deliver(self, event):
        if event[0] in ("text", "logprobs") and self.prompt_entries_at_first is None:
            self.prompt_entries_at_first = len(self.prompt_logprobs or [])
        self.log.append(event)
        super().deliver(event)


def test_events_logprobs_before_text_and_prompt_logprobs_first(llm):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    ids = llm.prompt_ids(PROMPT, chat=True)
    req = Recording(ids, params)
    [result] = llm.scheduler.run([req])
    kinds = [e[0] for e in req.log]
    assert kinds[-1] == "done" and kinds.count("logprobs") == result.completion_tokens
    for i, kind in enumerate(kinds):
        if kind == "text":
            assert kinds[i - 1] == "logprobs"  # each step's entry right before its text
    entries = [e for ev in req.log if ev[0] == "logprobs" for e in ev[1]]
    assert entries == result.logprobs
    assert "".join(e[1] for e in req.log if e[0] == "text") == result.text
    assert req.prompt_entries_at_first == len(ids) - 1 == len(result.prompt_logprobs)
    assert req.prompt_logprobs is result.prompt_logprobs


@pytest.mark.parametrize("chunk", [512, 5, 1])  # whole, several chunks (one of a single token), token by token
def test_prompt_logprobs_match_the_full_forward_and_eval(llm, monkeypatch, chunk):
    monkeypatch.setattr(scheduler_module, "PROMPT_LOGPROBS_CHUNK", chunk)
    ids = llm.prompt_ids(PROMPT, chat=False)
    assert len(ids) > 2 * 5 and len(ids) % 5 == 1
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3))
    ref = full_logprobs(llm, ids)
    nll = token_nll(llm.runner.score(ids)[:-1], torch.tensor(ids[1:]))
    llm.forget_cache()
    assert len(out.prompt_logprobs) == len(ids) - 1
    for i, entry in enumerate(out.prompt_logprobs):
        assert entry.token_id == ids[i + 1] and entry.logprob <= 0
        assert entry.logprob == pytest.approx(float(ref[i, ids[i + 1]]), abs=TOL)
        assert entry.logprob == pytest.approx(-float(nll[i]), abs=TOL)
        assert [t for t, _ in entry.top] == ref[i].topk(3).indices.tolist()
    greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2, ignore_eos=True))
    assert out.token_ids == greedy.token_ids


def test_prompt_logprobs_are_never_served_from_a_cached_prefix(llm):
    messages = [{"role": "user", "content": "Write a function."}]
    llm.forget_cache()
    first = llm.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True))
    turn = messages + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Shorter."}]
    reused = llm.chat(turn, SamplingParams(max_tokens=4, ignore_eos=True))
    assert reused.timings.cached_tokens > 0  # without prompt_logprobs the earlier turn is reused
    llm.forget_cache()
    llm.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True))
    out = llm.chat(turn, SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=0))
    assert out.timings.cached_tokens == 0 and len(out.prompt_logprobs) == out.prompt_tokens - 1
    assert out.token_ids == reused.token_ids
    assert all(e.top == [] and math.isfinite(e.logprob) for e in out.prompt_logprobs)


def test_runner_prefill_all_logits_equals_score(llm):
    ids = llm.prompt_ids(PROMPT, chat=False)
    try:
        want = llm.runner.score(ids)
        head = llm.runner.prefill(ids[:7], slot=1, all_logits=True)
        tail = llm.runner.prefill(ids[7:], slot=1, start=7, all_logits=True)
        last = llm.runner.prefill(ids, slot=2)
    finally:
        llm.forget_cache()
    got = torch.cat([head, tail]).cpu()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last.cpu(), want[-1], rtol=1e-4, atol=1e-4)
