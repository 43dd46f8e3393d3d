"""gpt-oss's harmony format: the channels split into reasoning and content and the calls read from what the
reasoning parser passes on, whole and streamed at every split; bad calls kept as content; the grammar; the history
shaped for the gpt-oss template; then the chat path end to end through the openai and anthropic SDKs over a
tokenizer whose harmony markers are special tokens (``<|call|>`` and ``<|return|>`` its stop tokens), with an
engine stand-in that runs scripted token ids through a real ``SequenceState``."""

from __future__ import annotations

import json
import os

import anthropic
import httpx
import openai
import pytest
from live_server import InProcess, read_chat_stream
from test_special_markers import TokenScript
from test_tool_calls import read_deltas

from hetmoe.server import chat
from hetmoe.server.reasoning import HarmonyParser, reasoning_parser
from hetmoe.server.tool_calls import ToolCall, detect, tool_parser
from hetmoe.server.tool_calls.harmony import to_template
from hetmoe.tokenizer import Tokenizer, compile_template

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city"]},
         "noop": {"type": "object", "properties": {}}}
A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
C = "<|start|>assistant<|channel|>commentary to=functions."

# (model output, reasoning (None: none), content, [(name, arguments)])
CASES = [
    (A + "The user asks 2+2.<|end|>" + F + "It is 4.", "The user asks 2+2.", "It is 4.", []),
    (A + "Need the weather.<|end|>" + C + 'get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}',
     "Need the weather.", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"a<|b|\"}<|call|>",
     None, "", [("get_weather", {"city": "a<|b|"})]),
    (A + "x<|end|><|start|>assistant to=functions.noop<|channel|>commentary json<|message|>{}", "x", "",
     [("noop", {})]),
    ("<|channel|>commentary<|message|>Checking both.<|end|>" + C + 'get_weather json<|message|> {"city": "Oslo"} '
     "<|call|>" + C + "noop <|constrain|>json<|message|>{}<|call|>", None, "Checking both.",
     [("get_weather", {"city": "Oslo"}), ("noop", {})]),
    (A + "cut by max_tokens while thinking", "cut by max_tokens while thinking", "", []),
    ('{"answer": 4}', None, '{"answer": 4}', []),
    ("Plain text, no header.", None, "Plain text, no header.", []),
    (A + "a<|end|>" + F + "b<|return|>", "a", "b", []),
]

BROKEN = [  # (output, reasoning, content): claims a call, does not parse; the passed-on call is the content
    (A + "x<|end|>" + C + 'get_weather <|constrain|>json<|message|>{"city": ', "x",
     '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '),
    (C[len("<|start|>assistant"):] + "launch_rockets <|constrain|>json<|message|>{}", None,
     "<|channel|>commentary to=functions.launch_rockets <|constrain|>json<|message|>{}"),
    (C[len("<|start|>assistant"):] + "get_weather json<|message|>[1, 2]", None,
     "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>[1, 2]"),
]


def run(text: str, pieces: list) -> tuple:
    """(reasoning or None, content, [(name, arguments text)], failed) of ``pieces`` through the chat path's two
    streams, as ChatOutput chains them."""
    thinking, calls_stream = HarmonyParser().stream(False), tool_parser("harmony").stream(TOOLS)
    reasoning = ""
    parts = [p for piece in pieces for p in thinking.push(piece)] + thinking.finish()
    deltas = []
    for kind, t in parts:
        assert t and "<|" not in (t if kind == "reasoning" else "")
        if kind == "reasoning":
            reasoning += t
        else:
            deltas += calls_stream.push(t)
    deltas += calls_stream.finish()
    content, calls = read_deltas(deltas)
    return (reasoning if thinking.reasoned else None), content, calls, calls_stream.failed


def whole(text: str) -> tuple:
    reasoning, content = HarmonyParser().split(text, False)
    out = tool_parser("harmony").parse(content, TOOLS)
    return reasoning, out.content, [(c.name, c.arguments) for c in out.calls], out.failed


def splits(text: str):
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)
    yield [text[i:i + 3] for i in range(0, len(text), 3)]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES, ids=[str(i) for i in range(len(CASES))])
def test_channels_and_calls(text, reasoning, content, calls):
    got = whole(text)
    assert got[:2] == (reasoning, content) and not got[3]
    assert [(n, json.loads(a)) for n, a in got[2]] == calls
    for pieces in splits(text):  # streamed at every split: the same, and no marker in content or reasoning
        streamed = run(text, pieces)
        assert streamed == got, pieces
        assert "<|" not in streamed[1], pieces


@pytest.mark.parametrize("text, reasoning, content", BROKEN, ids=[str(i) for i in range(len(BROKEN))])
def test_bad_calls_are_content(text, reasoning, content):
    got = whole(text)
    assert got == (reasoning, content, [], True)
    for pieces in splits(text):
        r, c, calls, failed = run(text, pieces)
        assert failed and r == reasoning and (calls or c == content), pieces


def test_arguments_stream_before_the_call_ends():
    text = A + "ok<|end|>" + C + 'get_weather <|constrain|>json<|message|>{"city": "' + "x" * 60 + '"}'
    thinking, calls_stream = HarmonyParser().stream(False), tool_parser("harmony").stream(TOOLS)
    deltas = [d for ch in text for _, t in thinking.push(ch) for d in calls_stream.push(t) if _ == "content"]
    assert deltas[0].kind == "call" and deltas[0].name == "get_weather"
    assert sum(d.kind == "args" for d in deltas) > 50


def test_the_family_and_the_reasoning_parser_are_read_from_the_template():
    assert detect(TEMPLATE) == "harmony" and tool_parser("auto", TEMPLATE).name == "harmony"
    assert isinstance(reasoning_parser("auto", TEMPLATE), HarmonyParser)
    assert isinstance(reasoning_parser("harmony"), HarmonyParser) and reasoning_parser("none", TEMPLATE) is None


def test_format_call_and_the_grammar_with_an_analysis_message_first():
    import xgrammar as xgr

    from hetmoe.engine.grammar import Grammars
    from hetmoe.engine.llm import default_model_path

    parser = tool_parser("harmony")
    calls = [ToolCall("a", "get_weather", '{"city": "Rome", "days": 1}'), ToolCall("b", "noop", "{}")]
    text = parser.format_calls(calls)
    assert [(c.name, c.arguments) for c in parser.parse(text, TOOLS).calls] == [(c.name, c.arguments) for c in calls]
    grammars = Grammars(Tokenizer.from_dir(default_model_path()), 8192)
    compiled = grammars.structural_tag(parser.grammar(TOOLS, "get_weather", False)).compiled
    for output in (parser.format_call(calls[0]), A + "Rome, one day.<|end|><|start|>assistant" +
                   parser.format_call(calls[0])):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(output) and m.is_completed(), output
    m = xgr.GrammarMatcher(compiled)
    assert not m.accept_string(A + "x<|end|><|start|>assistant<|channel|>final<|message|>no call")


# A harmony template of the same shape as gpt-oss's: tools in a developer message, reasoning of a call's message
# as ``thinking``, one call per message (arguments with tojson), results named after the call before them.
TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}{{ t.function.name }}\n{% endfor %}"
    "<|end|>{% endif %}{% set last = namespace(name=none) %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% if m.tool_calls %}{% if m.content and m.thinking %}{{ raise_exception('both content and thinking') }}"
    "{% endif %}{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% set c = m.tool_calls[0].function %}<|start|>assistant to=functions.{{ c.name }}<|channel|>commentary json"
    "<|message|>{{ c.arguments | tojson }}<|call|>{% set last.name = c.name %}"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_history_renders_one_call_per_message_with_its_results():
    calls = [{"id": f"c{k}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"city": city})}} for k, city in ((1, "Oslo"), (2, "Rome"))]
    messages = [{"role": "user", "content": "Weather in Oslo and Rome?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": "sun"},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    rendered = compile_template(TEMPLATE).render(messages=to_template(messages), add_generation_prompt=True)
    assert rendered == (
        "<|start|>user<|message|>Weather in Oslo and Rome?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Two cities.\n\nChecking.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"rain"<|end|>'
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sun"<|end|><|start|>assistant')
    assert messages[1]["content"] == "Checking." and "thinking" not in messages[1]  # the request's own untouched


# ---------------------------------------------------------------------------------------------- end to end

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|hidden|>"]
FIRST = 8192 - len(MARKERS)
IDS = {m: FIRST + k for k, m in enumerate(MARKERS)}


def write_harmony_model(path):
    """The built-in model's files with a tokenizer whose last ids are harmony's markers (special tokens),
    ``<|return|>`` and ``<|call|>`` its stop tokens, and TEMPLATE its chat template."""
    from hetmoe.engine.llm import default_model_path

    src = default_model_path()
    path.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            os.symlink(f, path / f.name)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    gone = {t for t, i in vocab.items() if i >= FIRST}
    spec["model"]["vocab"] = {t: i for t, i in vocab.items() if i < FIRST}
    spec["model"]["merges"] = [[a, b] for a, b in spec["model"]["merges"] if a + b not in gone]
    spec["added_tokens"] += [{"id": IDS[m], "content": m, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for m in MARKERS]
    (path / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    config = json.loads((src / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    generation = json.loads((src / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(
        {**generation, "eos_token_id": [generation["eos_token_id"], IDS["<|return|>"], IDS["<|call|>"]]}))
    return path


class Recording(TokenScript):
    def submit(self, req):
        self.prompts.append(list(req.prompt_ids))
        return super().submit(req)


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    tok = Tokenizer.from_dir(write_harmony_model(tmp_path_factory.mktemp("harmony") / "harmony-model"))
    assert {IDS["<|call|>"], IDS["<|return|>"]} <= tok.eos_ids
    srv = InProcess(tok)
    engine = Recording(tok, srv.engine.metrics)
    engine.prompts = []
    srv.engine.submit = engine.submit
    srv.scripts, srv.tok, srv.prompts = engine.scripts, tok, engine.prompts
    srv.client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=30)
    yield srv
    srv.close()


def script(tok, *parts) -> list:
    out = []
    for p in parts:
        out += [IDS[p]] if p in IDS else tok.encode(p, add_special_tokens=False)
    return out


def call_script(name, args, recipient_first=False):
    if recipient_first:
        return ["<|start|>", f"assistant to=functions.{name}", "<|channel|>", "commentary json", "<|message|>",
                json.dumps(args), "<|call|>"]
    return ["<|start|>", "assistant", "<|channel|>", f"commentary to=functions.{name} ", "<|constrain|>", "json",
            "<|message|>", json.dumps(args), "<|call|>"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": TOOLS["get_weather"]}}
THINK_AND_CALL = ("<|channel|>", "analysis", "<|message|>", "The user wants Oslo's weather.", "<|end|>",
                  *call_script("get_weather", {"city": "Oslo"}), "after the stop token")


def test_a_call_is_read_and_the_output_stops_at_call(harmony):
    harmony.scripts.append(script(harmony.tok, *THINK_AND_CALL))
    r = harmony.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Oslo?"}],
                                               tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.reasoning_content == "The user wants Oslo's weather."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert r.usage.completion_tokens == len(script(harmony.tok, *THINK_AND_CALL[:-1]))  # <|call|> ended it


def test_a_call_streamed(harmony):
    harmony.scripts.append(script(harmony.tok, "<|channel|>", "analysis", "<|message|>", "Hmm.", "<|end|>",
                                  *call_script("get_weather", {"city": "Rome", "days": 3}, recipient_first=True)))
    reasoning, content, calls, finish = read_chat_stream(harmony.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Rome?"}], tools=[WEATHER], stream=True))
    assert reasoning == "Hmm." and content == "" and finish == ["tool_calls"]
    assert list(calls) == [0] and calls[0][0] == "get_weather" and json.loads(calls[0][1]) == {"city": "Rome",
                                                                                                "days": 3}


def test_a_final_answer_and_the_history_sent_back(harmony):
    harmony.scripts.append(script(harmony.tok, "<|channel|>", "analysis", "<|message|>", "Rain, so say so.",
                                  "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>",
                                  "It rains in Oslo.", "<|return|>", "never read"))
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    r = harmony.client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and message.content == "It rains in Oslo."
    assert message.reasoning_content == "Rain, so say so." and not message.tool_calls
    prompt = harmony.tok.decode(harmony.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Ask the tool.<|end|><|start|>assistant to=functions."
        'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|><|start|>functions.get_weather '
        'to=assistant<|channel|>commentary<|message|>"rain"<|end|><|start|>assistant')


def test_without_tools_the_channels_still_split(harmony):
    harmony.scripts.append(script(harmony.tok, "<|channel|>", "analysis", "<|message|>", "Easy.", "<|end|>",
                                  "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Four.",
                                  "<|return|>"))
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
    message = httpx.post(f"{harmony.base}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four.", "reasoning_content": "Easy."}


def test_a_broken_call_is_content_and_counted(harmony):
    harmony.scripts.append(script(harmony.tok, *call_script("get_weather", {"city": "Oslo"})[:-2], '{"city": '))
    message = harmony.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Oslo?"}], tools=[WEATHER]).choices[0].message
    assert not message.tool_calls and message.content == (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": ')


def test_thinking_and_tool_use_through_the_anthropic_sdk(harmony):
    client = anthropic.Anthropic(base_url=harmony.base, api_key="unused", max_retries=0, timeout=30)
    tools = [{"name": "get_weather", "input_schema": TOOLS["get_weather"]}]
    for stream in (False, True):
        harmony.scripts.append(script(harmony.tok, *THINK_AND_CALL))
        kwargs = dict(model="m", max_tokens=100, tools=tools, messages=[{"role": "user", "content": "Oslo?"}])
        if stream:
            with client.messages.stream(**kwargs) as s:
                m = s.get_final_message()
        else:
            m = client.messages.create(**kwargs)
        assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use", stream
        assert m.content[0].thinking == "The user wants Oslo's weather."
        assert (m.content[1].name, m.content[1].input) == ("get_weather", {"city": "Oslo"})


def test_the_chat_support_keeps_the_markers(harmony):
    support = chat.ChatSupport.build(harmony.tok, 8192)
    assert support.parser.name == "harmony" and isinstance(support.reasoning, HarmonyParser)
    assert {IDS[m] for m in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")} <= support.reasoning_markers
    assert {IDS["<|constrain|>"], IDS["<|call|>"]} <= support.tool_markers and IDS["<|hidden|>"] not in (
        support.tool_markers | support.reasoning_markers)


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forced_call_grammar_over_the_marker_tokens(harmony, parallel):
    """The grammar takes the markers as the special tokens the model writes, an analysis message first, and lets
    ``<|call|>`` (a stop token) end the output once the call is complete, not before."""
    import xgrammar as xgr

    support = chat.ChatSupport.build(harmony.tok, 8192)
    compiled = support.grammars.structural_tag(support.parser.grammar(TOOLS, "get_weather", parallel)).compiled
    ids = script(harmony.tok, *THINK_AND_CALL[:-2])
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, 8192)
    for k, token in enumerate(ids):
        matcher.fill_next_token_bitmask(mask)
        may_stop = (int(mask[0, IDS["<|call|>"] // 32]) >> (IDS["<|call|>"] % 32)) & 1
        assert not may_stop, k
        assert matcher.accept_token(token), (k, harmony.tok.decode([token], skip_special_tokens=False))
    matcher.fill_next_token_bitmask(mask)
    assert (int(mask[0, IDS["<|call|>"] // 32]) >> (IDS["<|call|>"] % 32)) & 1


def test_a_forced_call_end_to_end(harmony):
    harmony.scripts.append(script(harmony.tok, *THINK_AND_CALL))
    r = harmony.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Oslo?"}],
                                               tools=[WEATHER], tool_choice="required")
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.reasoning_content.startswith("The user")
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}
