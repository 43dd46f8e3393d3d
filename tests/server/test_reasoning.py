"""Reasoning: the think-tag parser over the families' output shapes (the prompt opens the block: DeepSeek-R1/V3.1,
Qwen3 thinking; the model opens it: Qwen3 hybrids, Kimi-K2 Thinking, GLM; thinking switched off; a block cut by
max_tokens), whole and streamed at every split; chat_template_kwargs and reasoning_effort reaching a Qwen3-style
template; and the chat path's message and deltas over scripted outputs (reasoning, then content or a tool call)."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from live_server import InProcess, Scripted

from hetmoe.server import chat, protocol
from hetmoe.server.reasoning import PARSERS, ReasoningParser, reasoning_parser
from hetmoe.tokenizer import Tokenizer

# (the prompt's end, the output, expected reasoning (None: none), expected content)
CASES = [
    ("<｜Assistant｜><think>\n", "The user asks 2+2.\nThat is 4.\n</think>\n\nThe answer is 4.",
     "The user asks 2+2.\nThat is 4.", "The answer is 4."),
    ("<|im_start|>assistant\n<think>\n", "plan</think>Answer", "plan", "Answer"),
    ("<|im_start|>assistant\n", "<think>\nLet me see: a < b, and </thin is not the end.\n</think>\n\nHi!",
     "Let me see: a < b, and </thin is not the end.", "Hi!"),
    ("<|im_start|>assistant\n", "\n<think></think>Straight answer.", "", "Straight answer."),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Thinking is off.", None, "Thinking is off."),
    ("<|im_start|>assistant\n", "No tags here. <think> in the middle is text.", None,
     "No tags here. <think> in the middle is text."),
    ("<｜Assistant｜><think>", "cut off by max_tokens while thinking", "cut off by max_tokens while thinking", ""),
    ("<｜Assistant｜><think>", "<think>\nrepeated opening tag</think>ok", "repeated opening tag", "ok"),
    ("<|im_start|>assistant\n", "<think>\n\nfirst\n\n</think>\n\n\n  Code:\n    x = 1\n", "first",
     "Code:\n    x = 1\n"),
    ("<|im_start|>assistant\n", "", None, ""),
    ("<|im_start|>assistant\n", "<thi", None, "<thi"),
]


@pytest.fixture
def parser():
    return ReasoningParser("test")


@pytest.mark.parametrize("prompt, output, reasoning, content", CASES, ids=[str(i) for i in range(len(CASES))])
def test_split(parser, prompt, output, reasoning, content):
    assert parser.split(output, parser.starts_inside(prompt)) == (reasoning, content)


@pytest.mark.parametrize("prompt, output, reasoning, content", CASES, ids=[str(i) for i in range(len(CASES))])
def test_streamed_at_every_split_equals_the_whole(parser, prompt, output, reasoning, content):
    inside = parser.starts_inside(prompt)
    cuts = [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]
    rnd = random.Random(0)
    for _ in range(5):
        pieces, i = [], 0
        while i < len(output):
            n = rnd.randint(1, 6)
            pieces.append(output[i:i + n])
            i += n
        cuts.append(pieces)
    for pieces in cuts:
        stream = parser.stream(inside)
        parts = [p for piece in pieces for p in stream.push(piece)] + stream.finish()
        got_r = "".join(t for k, t in parts if k == "reasoning")
        got_c = "".join(t for k, t in parts if k == "content")
        assert (got_r if stream.reasoned else None, got_c) == (reasoning, content), pieces
        assert all(t for _, t in parts)  # no empty pieces


def test_reasoning_streams_before_the_block_ends(parser):
    stream = parser.stream(True)
    out = [p for ch in "step one, step two, step three" for p in stream.push(ch)]
    assert "".join(t for k, t in out if k == "reasoning") == "step one, step two, step three"[:len(
        "".join(t for _, t in out))] and len(out) > 10


def test_parser_choice():
    assert reasoning_parser("auto", "{{ '<think>' }}") is not None
    assert reasoning_parser("auto", "<|im_start|>{{ m.content }}") is None
    assert reasoning_parser("none", "<think>") is None
    for name in PARSERS:
        assert reasoning_parser(name).end == {"harmony": "<|end|>", "minimax_m3": "</mm:think>"}.get(name, "</think>")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        reasoning_parser("o1")


QWEN3_STYLE = """{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content }}
</think>
{% endif %}{{ message.content }}
{%- for tc in message.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments }}}
</tool_call>{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if reasoning_effort is defined %}effort={{ reasoning_effort }}
{% endif %}
{%- if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""


@pytest.fixture(scope="module")
def qwen3_style():
    from hetmoe.engine.llm import default_model_path

    base = Tokenizer.from_dir(default_model_path())
    return Tokenizer(base.backend, {"eos_token": "<|im_end|>"}, chat_template=QWEN3_STYLE)


def served_by(tok):
    return protocol.ServedModel(id="m", prompt_ids=protocol.prompt_encoder(tok, True), max_context=1024,
                                vocab_size=8192, has_chat_template=True, tokenizer=tok)


def prompt_text(tok, body):
    served = served_by(tok)
    parsed = protocol.parse_request({"model": "m", "max_tokens": 4, **body}, served, "chat")
    return tok.decode(parsed.prompt_ids, skip_special_tokens=False), parsed


def test_template_kwargs_reach_the_template(qwen3_style):
    messages = [{"role": "user", "content": "hi"}]
    text, parsed = prompt_text(qwen3_style, {"messages": messages,
                                             "chat_template_kwargs": {"enable_thinking": False},
                                             "reasoning_effort": "high"})
    assert text.endswith("<|im_start|>assistant\neffort=high\n<think>\n\n</think>\n\n")
    assert not parsed.chat.inside_reasoning
    text, parsed = prompt_text(qwen3_style, {"messages": messages})
    assert text.endswith("<|im_start|>assistant\n") and "effort" not in text


def test_a_template_with_tools_renders_them_and_the_history(qwen3_style):
    support = chat.support_of(served_by(qwen3_style))
    assert support.renders_tools and support.parser.name == "hermes" and support.reasoning is not None
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "reasoning_content": "I should call get_time.",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    text, _ = prompt_text(qwen3_style, {"messages": messages, "tools": [tool]})
    assert '{"type": "function", "function": {"name": "get_time"' in text
    assert "<think>\nI should call get_time.\n</think>\n" in text
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text
    text, _ = prompt_text(qwen3_style, {"messages": messages, "tools": [tool], "tool_choice": "none"})
    assert "# Tools" not in text  # tool_choice none: the tools are left out of the prompt


# ---------------------------------------------------------------------------------------------- scripted outputs

@pytest.fixture(scope="module")
def scripted(qwen3_style):
    srv = InProcess(qwen3_style, engine=Scripted(piece=2))
    srv.texts = srv.engine.texts
    yield srv
    srv.close()


TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
OUTPUT = ('<think>\nThe user wants the time.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
          '</tool_call>')


def test_message_has_reasoning_content_and_the_call(scripted):
    scripted.texts.append(OUTPUT)
    r = httpx.post(f"{scripted.base}/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "time?"}], "tools": [TOOL]})
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "The user wants the time."
    assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]


def test_streamed_reasoning_then_content(scripted):
    scripted.texts.append("<think>\nShort plan.\n</think>\n\nHello there.")
    client = openai.OpenAI(base_url=f"{scripted.base}/v1", api_key="unused", max_retries=0)
    reasoning = content = ""
    order = []
    for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True):
        if not c.choices:
            continue
        delta = c.choices[0].delta
        r = (delta.model_extra or {}).get("reasoning_content")
        if r:
            reasoning += r
            order.append("r")
        if delta.content:
            content += delta.content
            order.append("c")
    assert (reasoning, content) == ("Short plan.", "Hello there.")
    assert order == sorted(order, reverse=True) and order.count("r") > 1  # reasoning first, in several pieces


def test_no_reasoning_block_no_reasoning_field(scripted):
    scripted.texts.append("Just text.")
    r = httpx.post(f"{scripted.base}/v1/chat/completions", timeout=30, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False}})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "Just text." and "reasoning_content" not in message
    assert json.dumps(message)
