"""Logit processing in the sampler (hetmoe/engine/sampler.py, sequence.py, scheduler.py): logit_bias, a constraint,
repetition / presence / frequency penalties, min_p; their validation; the batched sampler's fast greedy path; seeds
per choice.

The processing is checked against a naive reference (plain Python loops over the vocabulary, float64) on random
logits, and end to end on the built-in model: greedy generation with penalties and a bias equals a loop that
recomputes the whole context (``Runner.score``) at every step and applies the naive reference. One forced engine
path (tests/paths.py BEST_ROW_PATH) for every run, fp32 dense weights (the built-in model on the CPU); what differs
between a cached decode step and a recomputed context is the dense GEMMs' summation order, far below the greedy
margins of the prompts used here.
"""

import pytest
import torch

from hetmoe.config.options import EngineOptions
from hetmoe.engine.llm import LLM
from hetmoe.engine.sampler import LogitsProcessor, SamplingParams, TokenConstraint, sample
from hetmoe.engine.sequence import SequenceState
from paths import BEST_ROW_PATH

REPETITIVE = "1, 2, 1, 2, 1, 2, 1, 2,"  # the built-in model's greedy reply repeats " 2," (chat=False)
EOS = 0  # the built-in model's eos_token_id


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(device="cpu", max_context=256, max_batch=4, **BEST_ROW_PATH.options)
    return LLM(None, options, expert_cache=None, progress=False, log=lambda m: None)


def naive_process(logits, prompt, generated, params, allowed=None):
    """The documented order, one token at a time in float64: bias, constraint, repetition, presence, frequency."""
    out = [float(v) for v in logits]
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    if allowed is not None:
        out = [v if t in allowed else float("-inf") for t, v in enumerate(out)]
    r = params.repetition_penalty
    for t in set(prompt) | set(generated):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(generated):
        out[t] -= params.presence_penalty + params.frequency_penalty * generated.count(t)
    return torch.tensor(out, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("kw, match", [
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"min_p": "0.1"}, "min_p"), ({"min_p": True}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"presence_penalty": None}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"), ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101}}, "logit_bias"), ({"logit_bias": {3: float("nan")}}, "logit_bias"),
    ({"logit_bias": {3: "1"}}, "logit_bias"), ({"logit_bias": {1.5: 1}}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.0}, "logprobs"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": "5"}, "prompt_logprobs"), ({"constraint": 5}, "constraint"),
])
def test_bad_values_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_defaults_and_normal_forms():
    old = SamplingParams(16, 0.5, 5, 0.9, 1, ("x",), (3,), True)  # today's positional callers
    assert (old.max_tokens, old.temperature, old.top_k, old.top_p, old.seed, old.stop, old.stop_token_ids,
            old.ignore_eos) == (16, 0.5, 5, 0.9, 1, ("x",), (3,), True)
    assert (old.min_p, old.repetition_penalty, old.presence_penalty, old.frequency_penalty, old.logit_bias,
            old.logprobs, old.prompt_logprobs, old.constraint) == (0.0, 1.0, 0.0, 0.0, None, None, None, None)
    assert SamplingParams().plain_greedy and not SamplingParams().processes_logits
    assert SamplingParams(logit_bias={"12": 5, 7: -100}).logit_bias == {12: 5.0, 7: -100.0}  # JSON's string keys
    assert SamplingParams(logit_bias={}).logit_bias is None
    for kw in ({"min_p": 0.1}, {"repetition_penalty": 1.1}, {"presence_penalty": -0.5}, {"frequency_penalty": 0.1},
               {"logit_bias": {1: 1}}, {"constraint": lambda: None}):
        assert SamplingParams(**kw).processes_logits and not SamplingParams(**kw).plain_greedy, kw
    assert not SamplingParams(logprobs=0).plain_greedy and not SamplingParams(temperature=1).plain_greedy


def test_for_choice_derives_the_seeds():
    params = SamplingParams(temperature=1.0, seed=7, presence_penalty=0.5)
    choices = [params.for_choice(i) for i in range(3)]
    assert [c.seed for c in choices] == [7, 8, 9] and params.seed == 7
    assert all(c.presence_penalty == 0.5 and c.temperature == 1.0 for c in choices)
    assert SamplingParams(temperature=1.0).for_choice(2).seed is None
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="choice index"):
            params.for_choice(bad)


def test_logit_bias_beyond_the_vocabulary_is_refused_when_queued(llm):
    with pytest.raises(ValueError, match="logit_bias: token id 8192 is outside the vocabulary"):
        llm.generate("Hello", SamplingParams(max_tokens=2, logit_bias={5: 1.0, 8192: 1.0}))
    assert not llm.scheduler.waiting and not llm.scheduler.running


# ---------------------------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("kw", [
    {"logit_bias": {3: 4.0, 17: -2.5, 39: 100.0}},
    {"repetition_penalty": 1.7},
    {"repetition_penalty": 0.6},  # < 1 favours repeats: positive logits grow, negative shrink toward 0
    {"presence_penalty": 1.5, "frequency_penalty": -0.75},
    {"logit_bias": {5: 3.0}, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.25},
])
def test_processor_matches_the_naive_reference(kw):
    g = torch.Generator().manual_seed(0)
    V = 41
    prompt = [1, 5, 5, 9, 30]
    params = SamplingParams(**kw)
    proc = LogitsProcessor(params, prompt)
    generated = []
    for step in range(6):
        logits = 3 * torch.randn(V, generator=g)
        want = naive_process(logits, prompt, generated, params)
        got = proc.apply(logits.clone())
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        token = [5, 12, 12, 40, 5, 0][step]  # repeats, a token of the prompt, and some new ones
        proc.record(token)
        generated.append(token)


def test_processor_with_tokens_recorded_before_its_first_use_and_a_bad_bias():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, logit_bias={2: 1.0})
    proc = LogitsProcessor(params, [4])
    proc.record(7)
    proc.record(7)
    logits = torch.linspace(-2, 2, 10)
    torch.testing.assert_close(proc.apply(logits.clone()).double(), naive_process(logits, [4], [7, 7], params))
    with pytest.raises(ValueError, match="logit_bias: token id 12 is outside the vocabulary"):
        LogitsProcessor(SamplingParams(logit_bias={12: 1.0}), []).apply(torch.zeros(10))


def test_min_p_keeps_only_tokens_near_the_most_likely():
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([2.0, 1.9, 1.0, 0.0, -1.0, 1.5])
    probs = torch.softmax(logits, -1)
    allowed = set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert allowed == {0, 1, 5}
    draws = sample(logits.expand(4000, -1), SamplingParams(temperature=1.0, min_p=0.5), g)
    assert set(draws.tolist()) == allowed  # never outside, each allowed one drawn
    ones = sample(logits.expand(100, -1), SamplingParams(temperature=1.0, min_p=1.0), g)
    assert set(ones.tolist()) == {0}


# ---------------------------------------------------------------------------------------------- the built-in model


def reference_greedy(llm, prompt_ids, params, n):
    """Greedy tokens from the whole context recomputed each step and the naive processing (leaves slot 0's cache
    rewritten: the scheduler is told to forget what it cached)."""
    generated = []
    try:
        for _ in range(n):
            logits = llm.runner.score(prompt_ids + generated)[-1]
            generated.append(int(naive_process(logits, prompt_ids, generated, params).argmax()))
    finally:
        llm.forget_cache()
    return generated


@pytest.mark.parametrize("kw", [
    {"repetition_penalty": 5.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 1.2},
    {"logit_bias": {702: -100.0}, "repetition_penalty": 1.5, "presence_penalty": 0.5},
])
def test_penalties_change_greedy_output_as_the_reference_does(llm, kw):
    ids = llm.prompt_ids(REPETITIVE, chat=False)
    plain = llm.generate(REPETITIVE, SamplingParams(max_tokens=8, ignore_eos=True), chat=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True, **kw)
    got = llm.generate(REPETITIVE, params, chat=False)
    assert got.token_ids != plain.token_ids
    assert got.token_ids == reference_greedy(llm, ids, params, 8)


def test_logit_bias_forces_a_token_and_min_p_one_is_greedy(llm):
    forced = llm.generate("Hello", SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={4242: 100}))
    assert forced.token_ids == [4242] * 5
    greedy = llm.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True))
    banned = llm.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True,
                                                  logit_bias={greedy.token_ids[0]: -100}))
    assert banned.token_ids[0] != greedy.token_ids[0]
    for seed in (1, 2):
        params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=seed, min_p=1.0)
        assert llm.generate("Hello", params).token_ids == greedy.token_ids
    sampled = llm.generate("Hello", SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=1))
    assert sampled.token_ids != greedy.token_ids  # what min_p=1 took away


def test_greedy_rows_take_the_batched_argmax(llm, monkeypatch):
    """In a decode step the plain greedy rows and the processed greedy rows without log-probabilities share one
    argmax: no row goes through SequenceState.sample one by one (only the first token, after the prefill, does);
    the processed rows still go through their processor each token, and the result is the one-by-one result."""
    calls = {"sample": [], "process_in_place": []}
    originals = {name: getattr(SequenceState, name) for name in calls}

    def counting(name):
        def wrapper(self, logits, **kwargs):
            calls[name].append(self.params)
            return originals[name](self, logits, **kwargs)
        return wrapper

    for name in calls:
        monkeypatch.setattr(SequenceState, name, counting(name))
    plain, biased = SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(
        max_tokens=6, ignore_eos=True, logit_bias={5: 0.5})
    batched = llm.generate(["Hello", "def f"], [plain, biased])
    assert sum(p is plain for p in calls["sample"]) == 1 and sum(p is biased for p in calls["sample"]) == 1
    assert not any(p is plain for p in calls["process_in_place"])
    assert sum(p is biased for p in calls["process_in_place"]) == 5  # every decoded token through the processor
    alone = llm.generate("def f", biased)
    assert batched[1].token_ids == alone.token_ids


class FixedTokens:
    """A TokenConstraint allowing exactly ``tokens`` in order; then terminated, or (``then_eos``) only eos."""

    def __init__(self, tokens, then_eos=False, lie_at=None):
        self.tokens, self.then_eos, self.lie_at, self.i = list(tokens), then_eos, lie_at, 0

    def _allowed(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else EOS

    def mask(self, logits):
        keep = logits[self._allowed()].clone()
        logits.fill_(float("-inf"))
        logits[self._allowed()] = keep

    def accept(self, token):
        if token != self._allowed() or self.i == self.lie_at:
            raise ValueError(f"token {token} is not allowed here")
        self.i += 1

    def is_terminated(self):
        return not self.then_eos and self.i == len(self.tokens)


def test_a_constraint_decides_the_tokens_and_the_end(llm):
    assert isinstance(FixedTokens([1]), TokenConstraint)
    want = [300, 1200, 45, 7]
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=3, constraint=lambda: FixedTokens(want))
        out = llm.generate("Hello", params)
        assert out.token_ids == want and out.finish_reason == "stop" and out.completion_tokens == 4
        assert out.text == llm.tokenizer.decode(want)
    params = SamplingParams(max_tokens=20, constraint=lambda: FixedTokens(want[:2], then_eos=True))
    out = llm.generate("Hello", params)  # the eos the grammar allows stops the sequence too
    assert out.token_ids == want[:2] and out.finish_reason == "stop" and out.completion_tokens == 3
    params = SamplingParams(max_tokens=2, constraint=lambda: FixedTokens(want))
    out = llm.generate("Hello", params)
    assert out.token_ids == want[:2] and out.finish_reason == "length"


class AllowsNothing(FixedTokens):
    def mask(self, logits):
        logits.fill_(float("-inf"))


@pytest.mark.parametrize("factory, match", [
    (lambda: FixedTokens([300, 1200], lie_at=1), "token 1200 is not allowed here"),  # its own exception
    (lambda: AllowsNothing([300]), "the constraint allows no token"),
])
def test_a_failing_constraint_fails_its_request_only(llm, factory, match):
    good = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", "def f"], [SamplingParams(max_tokens=4, constraint=factory), good])
    assert not llm.scheduler.running and not llm.scheduler.waiting
    assert llm.generate("def f", good).completion_tokens == 4  # the engine goes on
    with pytest.raises(ValueError, match="constraint"):
        llm.generate("Hello", SamplingParams(constraint=lambda: "not a constraint"))


def test_mixed_batch_equals_each_alone(llm):
    prompts = ["Hello", REPETITIVE, "def f", "import os\n", "class Stack:"]
    params = [
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True, repetition_penalty=3.0, presence_penalty=1.0),
        SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, min_p=0.05, seed=5),
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, logit_bias={11: 2.0}, frequency_penalty=0.5),
        SamplingParams(max_tokens=8, constraint=lambda: FixedTokens([300, 1200, 45])),
    ]
    alone = []
    for prompt, p in zip(prompts, params):
        llm.forget_cache()
        alone.append(llm.generate(prompt, p, chat=False))
    llm.forget_cache()
    together = llm.generate(prompts, params, chat=False)  # five for four slots: one waits
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert [e.token_id for e in together[3].logprobs] == together[3].token_ids
    for x, y in zip(together[3].logprobs, alone[3].logprobs):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
