"""Tool-call and reasoning markers that are special tokens (Kimi-K2's ``<|tool_call_begin|>`` ..., tokenizers
where ``<think>`` is special): the chat path keeps them in the text its parsers read, and the grammars see them as
text, while every other special token stays out of what the client gets (marker_model.py builds such a tokenizer
over the built-in model's weights).

Two drivers: the built-in model itself behind ``hetmoe serve`` (forced calls written with the marker tokens, a
logit bias making the model prefer them wherever the grammar allows them; a special token forced by a bias hidden
unless ``skip_special_tokens`` is false), and an engine stand-in that runs a real ``SequenceState`` over scripted
token ids (the auto mode: calls the model chose to write, reasoning, hidden tokens in between)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from live_server import InProcess, openai_client, post, read_chat_stream, serve
from marker_model import IDS, write_marker_model
from schema_check import validate

from hetmoe.engine.sequence import SequenceState
from hetmoe.tokenizer import Tokenizer

CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"enum": ["UTC", "CET"]}}, "required": ["timezone"],
    "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 12}}, "required": ["text"]}}}
TOOL_MARKERS = [IDS[m] for m in ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                                 "<|tool_call_argument_begin|>", "<|tool_call_end|>")]
HIDDEN = IDS["<|hidden|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_marker_model(tmp_path_factory.mktemp("marker") / "marker-model")


# ---------------------------------------------------------------------------------------------- the built-in model

@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serve(tmp_path_factory, model_dir, "--max-batch", "2")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def test_the_server_reads_the_family_from_the_template(server):
    assert "tool calls kimi_k2" in server.stderr and "markers are special tokens" in server.stderr


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_are_written_with_the_marker_tokens(client, choice):
    """The grammar lets the model write each marker as its one special token (the bias makes it prefer them):
    the chosen tokens are the markers, and the call is read from the text that keeps them."""
    r = client.chat.completions.create(
        model="marker-model", messages=[{"role": "user", "content": "What time is it?"}], tools=[CLOCK, NOTE],
        tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=80, logprobs=True,
        logit_bias={str(t): 100 for t in TOOL_MARKERS})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert re.fullmatch(rf"functions\.{call.function.name}:[0-9]+", call.id)  # Kimi's own id, read from the text
    validate(json.loads(call.function.arguments), {t["function"]["name"]: t["function"]["parameters"]
                                                   for t in (CLOCK, NOTE)}[call.function.name])
    tokens = [t.token for t in r.choices[0].logprobs.content]
    for marker in ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                   "<|tool_call_end|>", "<|tool_calls_section_end|>"):
        assert tokens.count(marker) == 1, tokens
    assert not message.content


def test_forced_call_streamed(client):
    chunks = client.chat.completions.create(
        model="marker-model", messages=[{"role": "user", "content": "Note that."}], tools=[CLOCK, NOTE],
        tool_choice={"type": "function", "function": {"name": "note"}}, temperature=0, max_tokens=80, stream=True,
        logit_bias={str(t): 100 for t in TOOL_MARKERS})
    _, content, calls, finish = read_chat_stream(chunks)
    assert finish == ["tool_calls"] and content == "" and list(calls) == [0] and calls[0][0] == "note"
    validate(json.loads(calls[0][1]), NOTE["function"]["parameters"])


def test_other_special_tokens_stay_hidden(client, server):
    """A special token no parser reads (forced by a bias at every step) never reaches the client, with tools or
    without; ``skip_special_tokens: false`` shows it."""
    ask = dict(model="marker-model", messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=3,
               logit_bias={str(HIDDEN): 100})
    assert client.chat.completions.create(**ask).choices[0].message.content == ""
    r = client.chat.completions.create(**ask, tools=[CLOCK])
    assert r.choices[0].message.content == "" and not r.choices[0].message.tool_calls
    shown = client.chat.completions.create(**ask, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].message.content == "<|hidden|>" * 3
    body = {"model": "marker-model", "prompt": "hi", "max_tokens": 2, "logit_bias": {str(HIDDEN): 100},
            "logprobs": 0}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    kept = post(server, "/v1/completions", {**body, "skip_special_tokens": False}).json()["choices"][0]
    assert plain["text"] == "" and kept["text"] == "<|hidden|>" * 2
    assert kept["logprobs"]["text_offset"] == [0, len("<|hidden|>")] and plain["logprobs"]["text_offset"] == [0, 0]


def test_skip_special_tokens_must_be_a_boolean(server):
    r = post(server, "/v1/chat/completions", {"model": "marker-model", "messages": [{"role": "user", "content": "x"}],
                                              "skip_special_tokens": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"


# ---------------------------------------------------------------------------------------------- scripted tokens

class TokenScript:
    """An engine stand-in: each request's output is the next scripted token ids, run through a real
    ``SequenceState`` with the request's parameters (its stop checks, its text stream, its special tokens)."""

    def __init__(self, tokenizer, metrics):
        self.tokenizer, self.metrics, self.scripts = tokenizer, metrics, []

    def submit(self, req):
        st = req.state = SequenceState(self.tokenizer, len(req.prompt_ids), req.params, 4096,
                                       lambda text: req.emit("text", text), prompt_ids=req.prompt_ids)
        for token in self.scripts.pop(0):
            if st.add(token):
                break
        st.abort()
        req.emit("done", st.finish_reason, len(req.prompt_ids), st.completion_tokens)
        return req


@pytest.fixture(scope="module")
def scripted(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    srv = InProcess(tok)
    engine = TokenScript(tok, srv.engine.metrics)
    srv.engine.submit = engine.submit
    srv.scripts, srv.tok = engine.scripts, tok
    yield srv
    srv.close()


def script(tok, *parts) -> list:
    """Token ids: strings encoded as text, marker names as their special token."""
    out = []
    for p in parts:
        out += [IDS[p]] if p in IDS else tok.encode(p, add_special_tokens=False)
    return out + [tok.eos_id]


def call_tokens(name, args):
    return ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", f"functions.{name}:0",
            "<|tool_call_argument_begin|>", json.dumps(args), "<|tool_call_end|>", "<|tool_calls_section_end|>"]


def chat(srv, ids, stream=False, **body):
    srv.scripts.append(ids)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    return httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=30)


def test_auto_mode_reads_calls_written_with_marker_tokens(scripted):
    ids = script(scripted.tok, "Sure.", "<|hidden|>", *call_tokens("get_time", {"timezone": "UTC"}))
    choice = chat(scripted, ids, tools=[CLOCK]).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
    [call] = choice["message"]["tool_calls"]
    assert call["id"] == "functions.get_time:0" and call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == {"timezone": "UTC"}


def test_auto_mode_streamed(scripted):
    ids = script(scripted.tok, "Sure.", *call_tokens("note", {"text": "a<b>"}))
    client = openai.OpenAI(base_url=f"{scripted.base}/v1", api_key="unused", max_retries=0)
    scripted.scripts.append(ids)
    content, args, finish = "", "", []
    for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                            tools=[NOTE], stream=True):
        d = c.choices[0].delta
        content += d.content or ""
        args += "".join(t.function.arguments or "" for t in d.tool_calls or ())
        finish += [c.choices[0].finish_reason] if c.choices[0].finish_reason else []
    assert content == "Sure." and json.loads(args) == {"text": "a<b>"} and finish == ["tool_calls"]


def test_reasoning_markers_that_are_special_tokens(scripted):
    ids = script(scripted.tok, "<think>", "I should ask the clock.", "</think>", "<|hidden|>",
                 *call_tokens("get_time", {"timezone": "CET"}))
    message = chat(scripted, ids, tools=[CLOCK]).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "I should ask the clock." and not message["content"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"timezone": "CET"}
    message = chat(scripted, script(scripted.tok, "<think>", "hmm", "</think>", "Fine.")).json()["choices"][0][
        "message"]
    assert message == {"role": "assistant", "content": "Fine.", "reasoning_content": "hmm"}


def test_without_tools_the_tool_markers_stay_hidden(scripted):
    """tool_choice none (or no tools): nothing reads calls, the markers are special tokens like any other."""
    ids = script(scripted.tok, "Sure.", *call_tokens("get_time", {"timezone": "UTC"}))
    for body in ({"tools": [CLOCK], "tool_choice": "none"}, {}):
        message = chat(scripted, ids, **body).json()["choices"][0]["message"]
        assert "<|" not in message["content"] and message["content"].startswith("Sure.functions.get_time:0")
        assert "tool_calls" not in message


def test_a_stop_string_after_shown_markers_is_the_anthropic_stop_sequence(scripted):
    ids = script(scripted.tok, "<think>", "x", "</think>", "Done. END more")
    scripted.scripts.append(ids)
    r = httpx.post(f"{scripted.base}/v1/messages", json={
        "model": "m", "max_tokens": 50, "stop_sequences": ["END"], "messages": [{"role": "user", "content": "hi"}]},
        timeout=30).json()
    assert r["stop_reason"] == "stop_sequence" and r["stop_sequence"] == "END"
    assert [b["type"] for b in r["content"]] == ["thinking", "text"] and r["content"][1]["text"] == "Done. "
