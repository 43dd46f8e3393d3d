"""The tool-call families against the real chat templates of the models they are for: llama.cpp keeps the published
templates in its source tree (models/templates), which these tests read from the llama.cpp source the GGUF tests use
(tests/llama_cpp_convert.py ``llama_cpp_source``; skipped without it). For each: the family read from the template,
a conversation with a tool, a call and its result rendered by the template as the chat path hands it over
(``_for_template``: arguments as mappings where the template needs them, gpt-oss's history reshaped), and the call as
the template writes it is what the parser writes (``format_calls``) and reads back."""

from __future__ import annotations

import json

import pytest
from llama_cpp_convert import llama_cpp_source

from hetmoe.server import tool_calls
from hetmoe.server.chat import ChatSupport, _for_template
from hetmoe.tokenizer import compile_template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
ARGS = {"city": "Paris", "days": 3}
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "The weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]

# template file (llama.cpp models/templates) -> the family hetmoe reads from it
TEMPLATES = {"MiniMax-M3.jinja": "minimax_m3", "MiniMax-M2.jinja": "minimax_m2",
             "deepseek-ai-DeepSeek-V4.jinja": "deepseek_v4", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "deepseek_v4",
             "deepseek-ai-DeepSeek-V3.2.jinja": "deepseek_v32", "deepseek-ai-DeepSeek-V3.1.jinja": "deepseek_v31",
             "GLM-4.7-Flash.jinja": "glm47", "GLM-4.6.jinja": "glm45", "Qwen3.5-4B.jinja": "qwen3_coder",
             "Qwen3-Coder.jinja": "qwen3_coder", "moonshotai-Kimi-K2.jinja": "kimi_k2",
             "Kimi-K2-Thinking.jinja": "kimi_k2", "Kimi-K2-Instruct.jinja": "kimi_k2",
             "openai-gpt-oss-120b.jinja": "harmony"}


@pytest.fixture(scope="module")
def templates():
    source = llama_cpp_source()
    if source is None or not (source / "models" / "templates").is_dir():
        pytest.skip("llama.cpp's source (models/templates) not found: set LLAMA_CPP_DIR")
    return source / "models" / "templates"


def _rendered(template: str) -> tuple:
    """(the parser the template's family has, the conversation as the template renders it)."""
    parser = tool_calls.tool_parser(None, template)
    support = ChatSupport(parser, None, None, tool_calls.renders_tools(template),
                          tool_calls.arguments_as_mapping(template), lambda ids: "")
    messages = _for_template(CONVERSATION, TOOLS, support)
    text = compile_template(template).render(messages=messages, tools=TOOLS, add_generation_prompt=True,
                                             bos_token="<s>", eos_token="</s>")
    return parser, text


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_call_in_the_history_is_written_as_the_parser_writes_it(templates, name):
    path = templates / name
    if not path.is_file():
        pytest.skip(f"{name} is not in this llama.cpp tree")
    template = path.read_text()
    assert tool_calls.detect(template) == TEMPLATES[name]
    parser, text = _rendered(template)
    if parser.name == "harmony":  # its history: one message per call, the recipient before the channel
        written = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
        assert written + json.dumps(ARGS) + "<|call|>" in text
        return
    ours = parser.format_calls([tool_calls.ToolCall("call_1", "get_weather", json.dumps(ARGS))]).strip()
    assert ours in text, text[-800:]
    out = parser.parse(text[text.index(ours):], {"get_weather": TOOLS[0]["function"]["parameters"]})
    assert [(c.name, json.loads(c.arguments)) for c in out.calls][:1] == [("get_weather", ARGS)]
