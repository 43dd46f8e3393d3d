"""Log-probabilities through the server: chat ``logprobs``/``top_logprobs``, completions ``logprobs`` + ``echo``
over text and token-id prompts (``max_tokens`` 0 included), lists of prompts and ``n`` choices, and lm-eval's
``local-completions`` loglikelihood, checked against log_softmax of the logits the same model computes directly
(``Runner.score``). One ``hetmoe serve`` of the built-in model, fp32 on the CPU, for the module.

The server's prompt log-probabilities come from prefill calls, the reference from ``Runner.score``: the same CPU
path, the same fp32 forward, chunked the same way for these short prompts, so they agree to rounding (1e-4)."""

import json
import math

import httpx
import pytest
import torch
from live_server import openai_client, serve

from hetmoe.engine.sampler import TokenLogprob
from hetmoe.server.logprobs import FLOOR, LegacyLogprobs, TokenText, chat_content
from paths import AUTO_MIXES_CLASSES

# Whole and streamed runs of one prompt: bitwise on one path, but the second request finds its prefix cached, and on
# an AMX machine that moves experts between the AMX and row-block classes (tests/paths.py): logits then agree within
# the cross-path bound, a few 1e-3 nats on this model's logits.
TOL = 2e-2 if AUTO_MIXES_CLASSES else 1e-4
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, None, "--max-batch", "4")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def llm():
    from hetmoe.config.options import EngineOptions
    from hetmoe.engine.llm import LLM

    return LLM(None, EngineOptions(device="cpu", max_batch=1), expert_cache=None, progress=False)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.tokenizer


MODEL = "hetmoe-default"


def reference(llm, ids):
    """log p(ids[i] | ids[:i]) for i = 1 .. n-1, and the argmax at each of those positions."""
    logp = torch.log_softmax(llm.runner.score(ids).double(), dim=-1)[:-1]  # row i predicts ids[i + 1]
    target = torch.tensor(ids[1:])
    return logp.gather(1, target[:, None])[:, 0].tolist(), logp.argmax(-1).tolist()


# ---------------------------------------------------------------- formatting (no server)

def test_token_bytes_join_into_the_text(tok):
    text = "héllo wörld 日本語 ✓ <|im_end|> done"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    text_of = TokenText(tok)
    split = [text_of(i) for i in ids if len(tok.decode([i])) and "\ufffd" in tok.decode([i])]
    assert split and all(t.startswith("bytes:\\x") for t, _ in split)  # partial characters, as OpenAI writes them
    assert all(bytes(b) == tok.token_bytes(i) for i in ids for _, b in [text_of(i)])


def test_legacy_shape_from_entries(tok):
    ids = tok.encode("The cat sat")
    legacy = LegacyLogprobs(TokenText(tok))
    prompt = [TokenLogprob(t, -1.5 - k, [(7, -0.25)]) for k, t in enumerate(ids[1:])]
    legacy.add_prompt(ids, prompt)
    legacy.add_entries([TokenLogprob(9, float("-inf"), [(9, float("-inf")), (4, -0.5)])], shown=1)
    out = legacy.take()
    n = len(ids) + 1
    assert len(out["tokens"]) == len(out["token_logprobs"]) == len(out["top_logprobs"]) == len(out["text_offset"]) == n
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert out["token_logprobs"][1:len(ids)] == [e.logprob for e in prompt]
    for k, e in enumerate(prompt, 1):  # the alternatives and the token itself
        assert out["top_logprobs"][k] == {TokenText(tok)(7)[0]: -0.25, out["tokens"][k]: e.logprob}
    assert out["token_logprobs"][-1] == FLOOR and list(out["top_logprobs"][-1].values()) == [FLOOR]
    assert out["text_offset"][:len(ids)] == [len(tok.decode(ids[:k])) for k in range(len(ids))]
    assert legacy.take()["tokens"] == []  # taken: the next chunk starts empty, its offsets go on
    legacy.add(5, -0.1, [])
    assert legacy.take()["text_offset"] == [len(tok.decode(ids + [9]))]


def test_chat_shape_from_entries(tok):
    [e] = chat_content([TokenLogprob(130, -0.75, [(130, -0.75), (12, -1.0)])], TokenText(tok))
    assert e["token"] == "bytes:\\x" + tok.token_bytes(130).hex() and e["bytes"] == list(tok.token_bytes(130))
    assert e["logprob"] == -0.75 and [t["logprob"] for t in e["top_logprobs"]] == [-0.75, -1.0]
    assert set(e["top_logprobs"][1]) == {"token", "logprob", "bytes"}


# ---------------------------------------------------------------- through the server

def test_echo_of_token_id_prompts_with_max_tokens_0(server, llm, tok):
    """lm-eval's request: a list of token-id prompts, echo, logprobs 1; max_tokens 0 answers the prompt alone."""
    prompts = [tok.encode(t) for t in ("def forward(self, x):", "The quick brown fox jumps", "import os")]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = httpx.post(f"{server.base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts)) and out["usage"]["completion_tokens"] == 0
    for c, ids in zip(out["choices"], prompts):
        lp = c["logprobs"]
        assert c["text"] == tok.decode(ids) and c["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        want, argmax = reference(llm, ids)
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want)) < TOL
        for k, top in enumerate(lp["top_logprobs"][1:]):  # the most likely token, and the one written
            best = TokenText(tok)(argmax[k])[0]
            assert best in top and top[best] >= lp["token_logprobs"][k + 1] - TOL and len(top) <= 2


def test_echo_of_a_text_prompt_then_generation(client, llm, tok):
    prompt = "Once upon a time"
    c = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2, **GREEDY)
    choice, ids = c.choices[0], tok.encode(prompt)
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.token_logprobs[0] is None
    want, _ = reference(llm, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < TOL
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(prompt)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **GREEDY)
    assert choice.text == prompt + plain.choices[0].text


def test_completion_logprobs_greedy_streamed_and_not(client):
    kw = dict(model=MODEL, prompt="for i in range(", max_tokens=8, logprobs=3, **GREEDY)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) <= 3 and top[token] == logprob == max(top.values())  # greedy: the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for chunk in client.completions.create(**kw, stream=True):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            for k in merged:
                merged[k] += getattr(chunk.choices[0].logprobs, k)
    assert text == whole.text and merged["tokens"] == lp.tokens and merged["text_offset"] == lp.text_offset
    # the second request reuses the first's cached prompt: the same tokens, logprobs within rounding
    assert all(math.isclose(a, b, abs_tol=TOL) for a, b in zip(merged["token_logprobs"], lp.token_logprobs))
    assert [sorted(t) for t in merged["top_logprobs"]] == [sorted(t) for t in lp.top_logprobs]


def test_chat_logprobs(client):
    messages = [{"role": "user", "content": "Write some code."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 10
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy: top-1
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, logprobs=True,
                                                top_logprobs=3, stream=True, **GREEDY):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=TOL) for a, b in zip(streamed, content))
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_n_choices_and_prompt_lists(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert texts == [c.text for c in b.choices]  # seeded: the same choices again
    assert len(set(texts)) > 1  # each choice has its own seed
    assert a.usage.prompt_tokens == client.completions.create(**{**kw, "n": 1}).usage.prompt_tokens
    assert a.usage.completion_tokens == 36

    prompts = ["def main():", "The weather today"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5, **GREEDY)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, **GREEDY).choices[0].text
             for p in prompts]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0], alone[0], alone[1], alone[1]]  # choice p * n + j

    got, finished = {}, []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                                max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                **GREEDY):
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.append(c.index)
    assert sorted(finished) == [0, 1] and got[0] == got[1] and chunk.usage.completion_tokens == 12


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": ["x", 5]}, "prompt"),
    ("/v1/completions", {"prompt": ["x", ""]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10**6]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": ["x"] * 129}, "prompt"),
    ("/v1/completions", {"prompt": ["x"] * 65, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
])
def test_bad_logprob_requests(server, path, body, param):
    r = httpx.post(f"{server.base}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_lm_eval_loglikelihood_equals_a_direct_computation(server, llm, tok):
    """lm-eval's local-completions model (its remote tokenizer: /tokenizer_info, /tokenize) with batch size 4:
    each request's loglikelihood is the sum of the continuation tokens' log-probabilities the model gives
    directly, and is_greedy says whether each of them is the argmax."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model=MODEL, base_url=f"{server.url}/completions", tokenizer_backend="remote",
                             batch_size=4, max_length=1024, max_retries=1, num_concurrent=1)
    pairs = [("The color of the sky is", " blue"), ("The color of the sky is", " green"),
             ("def main():\n    print(", "'hello')"), ("import numpy as", " np"), ("for i in range(", "10):"),
             ("Once upon a time", " there was a princess")]
    requests = [Instance("loglikelihood", {}, pair, k) for k, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ctx = tok.encode(context, add_special_tokens=False)  # lm-eval's split: the context's tokens, then the
        ids = ctx + tok.encode(context + continuation, add_special_tokens=False)[len(ctx):]  # rest of the whole's
        want, argmax = reference(llm, ids)
        cont = range(len(ctx) - 1, len(ids) - 1)  # positions predicting the continuation's tokens
        assert math.isclose(logprob, sum(want[i] for i in cont), abs_tol=TOL * len(cont)), (context, continuation)
        assert greedy == all(argmax[i] == ids[i + 1] for i in cont)
    assert json.dumps(got)  # plain floats and booleans
