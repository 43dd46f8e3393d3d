"""The agent API on a qwen3-shape model: a tiny random Qwen3-MoE checkpoint written by Transformers' own
``Qwen3MoeForCausalLM``, with the built-in tokenizer and a chat template in Qwen3's style (tools listed in a
``<tools>`` block, calls written as ``<tool_call>`` JSON, tool results as ``<tool_response>``, a ``<think>`` block
closed when ``enable_thinking`` is false), served by ``hetmoe serve`` and driven by the ``openai`` and
``anthropic`` clients. The model's weights are random: whatever it writes inside a call is only valid because the
grammar makes it so, and the family's parser is the one read from the template (hermes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from live_server import openai_client, serve
from schema_check import validate

from hetmoe.server.tool_calls import detect

MODEL = "qwen3-tiny"
DEFAULT = Path(__file__).resolve().parents[2] / "hetmoe" / "data" / "default_model"

TEMPLATE = r"""{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions. Their signatures are in <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object with the function name and arguments inside <tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.content %}{{ m.content }}{% endif %}
{%- for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}
<tool_call>
{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson if f.arguments is mapping else f.arguments }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"timezone": {"enum": ["UTC", "CET"]}}, "required": ["timezone"],
         "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}


def write_checkpoint(path: Path) -> None:
    """A 2-layer Qwen3-MoE (8 experts, top 2) over the built-in tokenizer's vocabulary, random weights."""
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=False, eos_token_id=0,
        pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    shutil.copy(DEFAULT / "tokenizer.json", path / "tokenizer.json")
    tok_config = json.loads((DEFAULT / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tiny")
    write_checkpoint(path)
    yield from serve(tmp_path_factory, path, "--max-batch", "4", "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def ask(client, **kwargs):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris for 2 days?"}],
              "temperature": 0, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(**kwargs)


def test_the_template_names_the_hermes_parser():
    assert detect(TEMPLATE) == "hermes"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_calls_validate_streamed_and_not(client, choice):
    r = ask(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    [call] = message.tool_calls
    assert call.function.name == "get_time" or choice == "required"
    validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    name, arguments, finish = None, "", None
    for chunk in ask(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, stream=True):
        if not chunk.choices:
            continue
        for t in chunk.choices[0].delta.tool_calls or ():
            name = t.function.name or name
            arguments += t.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, arguments, finish) == (call.function.name, call.function.arguments, "tool_calls")


def test_two_turns_with_the_tools_result(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = ask(client, messages=messages, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    again = ask(client, messages=messages, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False)
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + 10  # the call and its result were rendered
    validate(json.loads(again.choices[0].message.tool_calls[0].function.arguments), WEATHER)


def test_parse_returns_a_validated_object(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        capital: bool

    r = client.chat.completions.parse(model=MODEL, temperature=0, max_tokens=80, response_format=City,
                                      messages=[{"role": "user", "content": "Describe Paris."}])
    assert isinstance(r.choices[0].message.parsed, City)


def test_logprobs_are_consistent(client):
    r = ask(client, logprobs=True, top_logprobs=3, max_tokens=8, extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)


def test_penalties_change_greedy_output(client):
    """Random weights at temperature 0 repeat themselves: each penalty must change the continuation; min_p alone
    must not (the greedy token always passes it)."""
    def text(**kw):
        return client.completions.create(model=MODEL, prompt="The weather in Paris is", max_tokens=24,
                                         temperature=0, **kw).choices[0].text

    body = {"ignore_eos": True}
    plain = text(extra_body=body)
    assert text(extra_body={**body, "min_p": 0.5}) == plain
    changed = [text(presence_penalty=2.0, extra_body=body), text(frequency_penalty=2.0, extra_body=body),
               text(extra_body={**body, "repetition_penalty": 1.8})]
    assert all(t != plain for t in changed), (plain, changed)


def test_anthropic_tool_use(server):
    anthropic = pytest.importorskip("anthropic", reason="anthropic is not installed")
    client = anthropic.Anthropic(base_url=server.base, api_key="unused", max_retries=0, timeout=300)
    tools = [{"name": "get_weather", "description": "the forecast", "input_schema": WEATHER}]
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    m = client.messages.create(model=MODEL, max_tokens=120, tools=tools, tool_choice=choice,
                               messages=[{"role": "user", "content": "Paris?"}], extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    [block] = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "get_weather"
    validate(block.input, WEATHER)
