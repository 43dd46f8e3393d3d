"""What ``LLM`` (hetmoe/engine/llm.py) takes as a prompt besides text: ``{"prompt_token_ids": [...]}``, and chat
conversations with tools, template variables and assistant turns without content (the tokenizer's template
rendering, hetmoe/tokenizer.py). The built-in model, greedy, on one forced engine path (tests/paths.py)."""

import copy

import pytest

from hetmoe.config.options import EngineOptions
from hetmoe.engine.llm import LLM
from hetmoe.engine.sampler import SamplingParams
from paths import BEST_ROW_PATH

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
# A Qwen3-like template: tools in a system turn, tool calls of an assistant turn, an empty thinking block when
# enable_thinking is false.
TEMPLATE = """{%- if tools %}<|im_start|>system
Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.content is defined %}{{ m.content }}{% endif %}{% for c in m.tool_calls or [] %}<tool_call>\
{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def llm():
    options = EngineOptions(device="cpu", max_context=256, max_batch=2, **BEST_ROW_PATH.options)
    return LLM(None, options, expert_cache=None, progress=False, log=lambda m: None)


@pytest.fixture
def tool_llm(llm):
    """``llm`` with a tokenizer whose chat template renders tools (its own restored afterwards)."""
    original = llm.tokenizer
    llm.tokenizer = copy.copy(original)
    llm.tokenizer.chat_template, llm.tokenizer._compiled = TEMPLATE, None
    yield llm
    llm.tokenizer = original


def test_prompt_token_ids(llm):
    text = "def read_lines(path):"
    ids = llm.tokenizer.encode(text)
    want = llm.generate(text, PARAMS, chat=False)
    got = llm.generate({"prompt_token_ids": ids}, PARAMS)
    assert got.token_ids == want.token_ids and got.prompt_tokens == len(ids)
    both = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:3]}], PARAMS)  # a list of prompts
    assert both[0].token_ids == want.token_ids and both[1].prompt_tokens == 3
    streamed = "".join(llm.stream({"prompt_token_ids": ids}, PARAMS))
    assert streamed == want.text


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": []}, "non-empty list"), ({"prompt_token_ids": "1 2"}, "non-empty list"),
    ({"prompt_token_ids": [1, -1]}, r"integers in \[0, 8192\).*-1"), ({"prompt_token_ids": [8192]}, "8192"),
    ({"prompt_token_ids": [1, "2"]}, "integers"), ({"prompt_token_ids": [True]}, "integers"),
    ({"prompt_token_ids": [1.0]}, "integers"), ({"prompt": "hi"}, "prompt_token_ids"),
    ({"prompt_token_ids": [1], "extra": 1}, "nothing else"), ({}, "prompt_token_ids"),
    (42, "a prompt is a string"),
])
def test_bad_prompts_are_refused(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, PARAMS)
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", prompt], PARAMS)
    assert not llm.scheduler.running and not llm.scheduler.waiting


def test_chat_with_tools_and_template_variables(tool_llm):
    llm, tok = tool_llm, tool_llm.tokenizer
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = tok.apply_chat_template(messages, True, tools=TOOLS, enable_thinking=False)
    assert "Tools: get_weather" in text and text.endswith("<think>\n\n</think>\n\n")
    want = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)}, PARAMS)
    got = llm.chat(messages, PARAMS, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert (got.prompt_tokens, got.token_ids) == (want.prompt_tokens, want.token_ids)
    plain = llm.chat(messages, PARAMS)
    assert plain.prompt_tokens < got.prompt_tokens
    assert llm.chat(messages, PARAMS, tools=TOOLS).prompt_tokens == len(
        tok.encode(tok.apply_chat_template(messages, True, tools=TOOLS), add_special_tokens=False))


def test_an_assistant_turn_of_tool_calls_only(tool_llm):
    llm, tok = tool_llm, tool_llm.tokenizer
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    for turn in ({"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "assistant", "tool_calls": [call]}):
        messages = [{"role": "user", "content": "Weather?"}, turn, {"role": "tool", "content": "sunny"}]
        assert "<|im_start|>assistant\n<tool_call>get_weather</tool_call><|im_end|>" in tok.apply_chat_template(
            messages, True)
        assert llm.chat(messages, PARAMS, tools=TOOLS).completion_tokens == 4
    with pytest.raises(ValueError, match=r"messages\[0\] needs a string 'content'"):
        llm.chat([{"role": "user", "content": None}], PARAMS)


@pytest.mark.parametrize("kw, match", [
    ({"tools": {"name": "x"}}, "tools must be a list"), ({"tools": ["x"]}, "tools must be a list"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs must be a dict"),
    ({"chat_template_kwargs": {1: True}}, "chat_template_kwargs must be a dict"),
    ({"chat_template_kwargs": {"tools": []}}, "may not set tools"),
    ({"chat_template_kwargs": {"messages": [], "add_generation_prompt": False}},
     "may not set add_generation_prompt, messages"),
])
def test_bad_chat_arguments_are_refused(llm, kw, match):
    with pytest.raises(ValueError, match=match):
        llm.chat([{"role": "user", "content": "hi"}], PARAMS, **kw)
