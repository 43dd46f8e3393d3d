"""Anthropic's Messages API: the translation onto the chat path (anthropic.py, no server), then the official
``anthropic`` SDK against ``hetmoe serve`` of the built-in model with an API key (sent as ``x-api-key``):
create, stream, stop sequences, count_tokens, a forced tool call, errors in Anthropic's shape."""

import json

import anthropic
import httpx
import pytest
from live_server import InProcess, Scripted, openai_client, serve

from hetmoe.server import anthropic as translate
from hetmoe.server.protocol import APIError

KEY = "test-key"
MODEL = "hetmoe-default"
GREEDY = {"temperature": 0, "ignore_eos": True}  # sent in extra_body: this SDK no longer names temperature


# ---------------------------------------------------------------- the translation

def _body(**kw):
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}], **kw}


def test_conversation_with_tools_becomes_a_chat_request():
    body = _body(
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Call the tool.", "signature": "abc"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}],
        tools=[{"name": "weather", "description": "The weather", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["\n\n"], top_k=5,
        temperature=0.5, stream=True, thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048,
        metadata={"user_id": "u"}, output_config={"effort": "max"})
    chat, where = translate.to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Call the tool.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    assert where == ["system", "messages.0.content", "messages.1.content", "messages.2.content.0",
                     "messages.2.content"]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "weather", "parameters": {"type": "object"}, "description": "The weather"}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["reasoning_effort"] == "high"
    assert (chat["stop"], chat["top_k"], chat["temperature"], chat["max_tokens"]) == (["\n\n"], 5, 0.5, 2048)
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    named, _ = translate.to_chat(_body(tool_choice={"type": "tool", "name": "weather"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    off, _ = translate.to_chat(_body(thinking={"type": "disabled"}))
    assert off["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize("body, where", [
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}, "model"),
    (_body(messages=[]), "messages"),
    (_body(messages=[{"role": "system", "content": "x"}]), "messages.0.role"),
    (_body(messages=[{"role": "user"}]), "messages.0.content"),
    (_body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages.0.content.0"),
    (_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "document"}]}]),
     "messages.0.content.1"),
    (_body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "messages.0.content.0.tool_use_id"),
    (_body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]}]),
     "messages.0.content.0.input"),
    (_body(system=[{"type": "image"}]), "system.0"),
    (_body(tools=[{"name": "f"}]), "tools.0.input_schema"),
    (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type"),
    (_body(tool_choice={"type": "tool"}), "tool_choice.name"),
    (_body(tool_choice="auto"), "tool_choice"),
    (_body(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (_body(thinking={"type": "enabled", "budget_tokens": 100}), "thinking.budget_tokens"),
    (_body(thinking={"type": "enabled", "budget_tokens": 2048}), "thinking.budget_tokens"),  # >= max_tokens
    (_body(thinking={"type": "adaptive", "display": "omitted"}), "thinking.display"),
    (_body(temperature=1.5), "temperature"),
    (_body(stop_sequences="x"), "stop_sequences"),
    (_body(mcp_servers=[{"url": "x"}]), "mcp_servers"),
    (_body(speed="fast"), "speed"),
    (_body(output_config={"effort": "extreme"}), "output_config.effort"),
    (_body(output_config={"format": {"type": "text"}}), "output_config.format"),
])
def test_bad_requests_name_the_field(body, where):
    with pytest.raises(APIError) as e:
        translate.to_chat(body)
    assert e.value.status == 400 and e.value.param == where and e.value.message.startswith(where)


def test_chat_errors_are_renamed():
    where = ["system", "messages.0.content", "messages.2.content"]
    e = translate.renamed(APIError(400, "Invalid 'messages[2].content': bad", param="messages[2].content"), where)
    assert e.param == "messages.2.content" and "'messages.2.content'" in e.message
    e = translate.renamed(APIError(400, "Invalid 'stop': too many", param="stop"), where)
    assert e.param == "stop_sequences" and "'stop_sequences'" in e.message
    assert translate.renamed(APIError(400, "x", param="top_p"), where).param == "top_p"


def test_chat_answers_become_messages():
    chat = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Checking.", "reasoning_content": "Think.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}}
    m = translate.message(chat, MODEL, None, cached=10)
    assert [b["type"] for b in m["content"]] == ["thinking", "text", "tool_use"]
    assert m["content"][2] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Rome"}}
    assert m["stop_reason"] == "tool_use" and m["usage"]["input_tokens"] == 20
    assert m["usage"]["cache_read_input_tokens"] == 10 and m["usage"]["output_tokens"] == 12
    assert translate.stop_reason("stop", "END") == "stop_sequence" and translate.stop_reason("stop", None) == "end_turn"
    assert translate.stop_reason("length", None) == "max_tokens"


def test_chat_chunks_become_stream_events():
    t = translate.StreamTranslator(MODEL, prompt_tokens=7)

    def chunk(delta=None, finish=None):
        return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}

    events = t.start()
    for c in [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Hm"}),
              chunk({"reasoning_content": "m."}), chunk({"content": "Hi"}),
              chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                     "function": {"name": "f", "arguments": ""}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}]}),
              chunk(finish="tool_calls"), {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}]:
        events += t.feed(c)
    events += t.end(None, cached=3)
    names = [n for n, _ in events]
    assert names == ["message_start",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["thinking", "text", "tool_use", "tool_use"]
    assert [d["index"] for n, d in events if n == "content_block_start"] == [0, 1, 2, 3]
    assert starts[2]["id"] == "call_a" and starts[2]["name"] == "f"
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert [d["type"] for d in deltas[:3]] == ["thinking_delta", "thinking_delta", "signature_delta"]
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"a": 1}{}'
    final = events[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] == 9
    assert final["usage"]["input_tokens"] == 4 and final["usage"]["cache_read_input_tokens"] == 3
    assert all(json.dumps(d) for _, d in events)


# ---------------------------------------------------------------- the SDK against the server

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, None, "--api-key", KEY, "--max-batch", "4")


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai_client(server, KEY)


MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_create_matches_the_chat_path(client, chat):
    m = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", messages=MESSAGES, extra_body=GREEDY)
    c = chat.chat.completions.create(model=MODEL, max_tokens=12, extra_body={"ignore_eos": True}, temperature=0,
                                     messages=[{"role": "system", "content": "Be brief."}, *MESSAGES])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == c.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == c.usage.prompt_tokens


def test_stream_equals_create(client):
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    kinds = []
    with client.messages.stream(model=MODEL, max_tokens=12, messages=MESSAGES, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12


def test_raw_stream_events(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{server.base}/v1/messages", json=body, headers={"x-api-key": KEY},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert [d["type"] for d in data] == names  # every event's name is its data's type
    assert data[0]["message"]["usage"]["output_tokens"] == 0 and data[-2]["usage"]["output_tokens"] == 4


def test_stop_sequences(client):
    full = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, extra_body=GREEDY).content[0].text
    k = len(full) // 2
    stop = full[k:k + 3]
    m = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, stop_sequences=["\x00never", stop],
                               extra_body=GREEDY)
    assert m.content[0].text == full[:full.find(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    with client.messages.stream(model=MODEL, max_tokens=24, messages=MESSAGES, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_count_tokens(client):
    n = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=MESSAGES).input_tokens
    m = client.messages.create(model=MODEL, max_tokens=1, system="Be brief.", messages=MESSAGES)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_forced_tool_call(client):
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                               "required": ["city"], "additionalProperties": False}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=tools,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    calls = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and calls and calls[0].input["city"] in ("Paris", "Rome")
    follow = [*messages, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny"}]}]
    again = client.messages.create(model=MODEL, max_tokens=8, messages=follow, tools=tools, extra_body=GREEDY)
    assert again.stop_reason in ("max_tokens", "end_turn", "tool_use")
    wrong = [*follow[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=wrong, tools=tools)
    assert "messages.2.content.0.tool_use_id" in e.value.body["error"]["message"]


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content.0" in e.value.body["error"]["message"] and "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=8, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=10**6, messages=MESSAGES)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=MESSAGES, stop_sequences=[""])
    assert "stop_sequences" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=MESSAGES)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.base}/v1/messages", content=b"{oops", headers={
        "x-api-key": KEY, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}


# ---------------------------------------------------------------- thinking and tool_use through the SDK, scripted

@pytest.fixture(scope="module")
def scripted():
    from hetmoe.engine.llm import default_model_path
    from hetmoe.server.chat import ChatSupport
    from hetmoe.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    srv = InProcess(tok, engine=Scripted(piece=3))
    srv.served.chat = ChatSupport.build(tok, srv.served.vocab_size, "hermes", "qwen3")  # a thinking model's parsers
    srv.script = srv.engine
    srv.client = anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0, timeout=60)
    yield srv
    srv.close()


WEATHER = [{"name": "get_weather", "description": "The weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
THOUGHT_AND_CALLS = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": '
                     '"get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": '
                     '"get_weather", "arguments": {"city": "Rome, \\"IT\\""}}\n</tool_call>')


def _blocks(message) -> list:
    return [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input))
            for b in message.content]


def test_thinking_text_and_tool_use_blocks(scripted):
    scripted.script.texts[:] = [THOUGHT_AND_CALLS]  # what the next request answers
    m = scripted.client.messages.create(model="m", max_tokens=100, messages=[{"role": "user", "content": "Weather?"}],
                                        tools=WEATHER, thinking={"type": "adaptive"})
    assert _blocks(m) == [("thinking", "The user wants the weather."), ("text", "Let me check.\n"),
                          ("tool_use", ("get_weather", {"city": "Paris"})),
                          ("tool_use", ("get_weather", {"city": 'Rome, "IT"'}))]
    assert m.stop_reason == "tool_use" and all(b.id for b in m.content if b.type == "tool_use")


def test_thinking_and_tool_use_streamed(scripted):
    scripted.script.texts[:] = [THOUGHT_AND_CALLS]  # what the next request answers
    deltas = []
    with scripted.client.messages.stream(model="m", max_tokens=100, tools=WEATHER,
                                         messages=[{"role": "user", "content": "Weather?"}]) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                deltas.append(event.delta.type)
        final = stream.get_final_message()
    assert _blocks(final) == [("thinking", "The user wants the weather."), ("text", "Let me check.\n"),
                              ("tool_use", ("get_weather", {"city": "Paris"})),
                              ("tool_use", ("get_weather", {"city": 'Rome, "IT"'}))]
    assert final.stop_reason == "tool_use"
    kinds = [k for i, k in enumerate(deltas) if i == 0 or deltas[i - 1] != k]
    assert kinds == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta"]
    assert deltas.count("input_json_delta") > 4  # the arguments in pieces, as they were generated


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_without_text_has_no_text_block(scripted, stream):
    """The chat answer's content is None (only calls): the message has no text block, streamed or not."""
    text = '<think>x</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    scripted.script.texts[:] = [text]  # what the next request answers
    kwargs = dict(model="m", max_tokens=100, tools=WEATHER, messages=[{"role": "user", "content": "Weather?"}])
    if stream:
        with scripted.client.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = scripted.client.messages.create(**kwargs)
    assert _blocks(m) == [("thinking", "x"), ("tool_use", ("get_weather", {"city": "Oslo"}))]
    assert m.stop_reason == "tool_use"


def test_thinking_without_calls_ends_the_turn(scripted):
    scripted.script.texts[:] = ["<think>Easy.</think>Four."]  # what the next request answers
    m = scripted.client.messages.create(model="m", max_tokens=50, messages=[{"role": "user", "content": "2+2?"}])
    assert _blocks(m) == [("thinking", "Easy."), ("text", "Four.")] and m.stop_reason == "end_turn"
