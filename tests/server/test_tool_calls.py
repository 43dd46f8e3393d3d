"""Tool calls: the parsers of each family over realistic model outputs, whole and streamed at every split (and in
random pieces), their grammars against their own syntax; then the server on the built-in model through the
openai client (required and named tool_choice enforced, streamed and not, a two-turn exchange, structured output,
bad input), and the chat path's assembly over scripted outputs (auto mode, an unparseable call counted)."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from live_server import InProcess, Scripted, assert_error, openai_client, post, serve
from schema_check import validate

from hetmoe.server import chat, tool_calls
from hetmoe.server.tool_calls import PARSERS, ToolCall, detect, tool_parser

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days"], "additionalProperties": False}
WRITE = {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                          "overwrite": {"type": "boolean"}, "mode": {"type": "integer"},
                                          "meta": {"type": "object"}}, "required": ["path", "content"]}
TOOLS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {"timezone": {"type": "string"}}},
         "write_file": WRITE, "noop": {"type": "object", "properties": {}}}
DS = {k: f"<｜{v}｜>" for k, v in (("B", "tool▁calls▁begin"), ("E", "tool▁calls▁end"), ("b", "tool▁call▁begin"),
                                    ("e", "tool▁call▁end"), ("s", "tool▁sep"))}

# (family, model output, expected content, expected [(name, arguments as a value)])
CASES = [
    ("hermes", 'I\'ll check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n'
               '</tool_call>', "I'll check both.\n\n",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "write_file", "arguments": {"path": "a \\"b\\".txt", "content": "x}{\\n</tool_'
               'call>", "meta": {"k": [1, {"z": null}]}}}\n</tool_call>', "",
     [("write_file", {"path": 'a "b".txt', "content": "x}{\n</tool_call>", "meta": {"k": [1, {"z": None}]}})]),
    ("hermes", '<tool_call>{"arguments": {"timezone": "UTC"}, "name": "get_time"}</tool_call>\nDone.', "Done.",
     [("get_time", {"timezone": "UTC"})]),
    ("hermes", '<tool_call>\n{"name": "noop", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("noop", {"a": 1})]),
    ("qwen3_coder", "Writing it.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/main.py\n</parameter>\n"
                    "<parameter=content>\ndef main():\n    print(\"hi\")\n\n</parameter>\n<parameter=overwrite>\ntrue\n"
                    "</parameter>\n<parameter=mode>\n644\n</parameter>\n<parameter=meta>\n{\"a\": [1]}\n</parameter>\n"
                    "</function>\n</tool_call>", "Writing it.\n",
     [("write_file", {"path": "src/main.py", "content": 'def main():\n    print("hi")\n', "overwrite": True,
                      "mode": 644, "meta": {"a": [1]}})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n"
                    "three\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n"
                    "</tool_call>", "", [("get_weather", {"city": "42", "days": "three"}), ("noop", {})]),
    ("deepseek_v3", f"Let me look.{DS['B']}{DS['b']}function{DS['s']}get_weather\n```json\n{{\"city\": \"Oslo\", "
                    f"\"days\": 3}}\n```{DS['e']}\n{DS['b']}function{DS['s']}get_time\n```json\n{{}}\n```{DS['e']}"
                    f"{DS['E']}", "Let me look.", [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]),
    ("deepseek_v31", f"{DS['B']}{DS['b']}get_weather{DS['s']}{{\"city\": \"Lima\", \"days\": 1}}{DS['e']}"
                     f"{DS['b']}noop{DS['s']}{{}}{DS['e']}{DS['E']}", "",
     [("get_weather", {"city": "Lima", "days": 1}), ("noop", {})]),
    ("kimi_k2", "Sure. <|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0 "
                "<|tool_call_argument_begin|> {\"city\": \"Kyiv\", \"days\": 5} <|tool_call_end|> "
                "<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{\"timezone\": \"UTC\"}"
                "<|tool_call_end|><|tool_calls_section_end|>", "Sure. ",
     [("get_weather", {"city": "Kyiv", "days": 5}), ("get_time", {"timezone": "UTC"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "noop", '
                '"arguments": {}}]', "", [("get_weather", {"city": "Rome", "days": 2}), ("noop", {})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]get_time[ARGS]{}', "",
     [("get_weather", {"city": "Rome", "days": 2}), ("get_time", {})]),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Bern</arg_value>\n<arg_key>days</arg_key>\n"
              "<arg_value>4</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Bern", "days": 4})]),
    ("glm47", "Checking.<tool_call>write_file<arg_key>path</arg_key><arg_value>x.md</arg_value><arg_key>content"
              "</arg_key><arg_value># Title\n\ntext</arg_value><arg_key>overwrite</arg_key><arg_value>false"
              "</arg_value></tool_call>", "Checking.",
     [("write_file", {"path": "x.md", "content": "# Title\n\ntext", "overwrite": False})]),
    ("minimax_m2", 'Let me check both.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
                   'Paris</parameter>\n<parameter name="days">2</parameter>\n<parameter name="unit">celsius'
                   '</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="timezone">Europe/Paris'
                   '</parameter>\n</invoke>\n</minimax:tool_call>', "Let me check both.\n",
     [("get_weather", {"city": "Paris", "days": 2, "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="write_file">\n<parameter name="path">a "b".txt</parameter>\n'
                   '<parameter name="content">\nx > y</invoke> <parameter name=\n</parameter>\n<parameter name='
                   '"overwrite">true</parameter>\n<parameter name="mode">644</parameter>\n<parameter name="meta">'
                   '{"k": [1, {"z": null}]}</parameter>\n</invoke>\n</minimax:tool_call>\nDone.', "Done.",
     [("write_file", {"path": 'a "b".txt', "content": "x > y</invoke> <parameter name=", "overwrite": True,
                      "mode": 644, "meta": {"k": [1, {"z": None}]}})]),
    ("minimax_m2", "<minimax:tool_call><invoke name=get_weather><parameter name='city'>42</parameter><parameter "
                   "name=\"days\">three</parameter></invoke></minimax:tool_call>\n<minimax:tool_call>\n<invoke "
                   "name=\"noop\">\n</invoke>\n</minimax:tool_call>", "",
     [("get_weather", {"city": "42", "days": "three"}), ("noop", {})]),
    ("hermes", "No tools needed: 2 + 2 = 4. A <tool_ call> is not a call.", "No tools needed: 2 + 2 = 4. A <tool_ "
                                                                           "call> is not a call.", []),
]

BROKEN = [  # (family, output): claims a call, does not parse
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'),
    ("hermes", "<tool_call>not json at all</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "argu'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    ("deepseek_v31", f"{DS['B']}oops{DS['E']}"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                "{\"city\": <|tool_call_end|>"),
    ("mistral", "[TOOL_CALLS]get_weather"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                   "</minimax:tool_call>"),
    ("minimax_m2", "<minimax:tool_call>\n</minimax:tool_call>"),
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="">\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", '<minimax:tool_call>\n<function=get_time>\n</function>\n</minimax:tool_call>'),
]


def calls_of(out) -> list:
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


def streamed(parser, text: str, pieces: list) -> tuple:
    """(content, [(name, arguments text)], failed) from a stream fed ``pieces``."""
    stream = parser.stream(TOOLS)
    deltas = [d for p in pieces for d in stream.push(p)] + stream.finish()
    return (*read_deltas(deltas), stream.failed)


def read_deltas(deltas: list) -> tuple:
    """(content, [(name, arguments text)]) that a tool-call stream's ``deltas`` add up to."""
    content, calls = "", {}
    for d in deltas:
        if d.kind == "content":
            content += d.text
        elif d.kind == "call":
            assert d.index == len(calls) and d.name and d.id  # names first, in order, once
            calls[d.index] = [d.name, ""]
        else:
            assert d.index in calls  # arguments only after the name
            calls[d.index][1] += d.text
    return content, [tuple(calls[i]) for i in sorted(calls)]


def splits(text: str, seed: int):
    """Every split in two, characters one by one, and random pieces of 1 to 9 characters."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rnd = random.Random(seed)
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            n = rnd.randint(1, 9)
            pieces.append(text[i:i + n])
            i += n
        yield pieces


@pytest.mark.parametrize("family, text, content, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_realistic_outputs(family, text, content, expected):
    out = tool_parser(family).parse(text, TOOLS)
    assert not out.failed
    assert out.content == content
    assert calls_of(out) == expected
    assert all(c.id for c in out.calls) and len({c.id for c in out.calls}) == len(out.calls)


@pytest.mark.parametrize("family, text, content, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_streamed_pieces_reassemble_to_the_whole_parse(family, text, content, expected):
    parser = tool_parser(family)
    whole = parser.parse(text, TOOLS)
    for pieces in splits(text, seed=len(text)):
        got_content, got_calls, failed = streamed(parser, text, pieces)
        assert (got_content, failed) == (whole.content, False), pieces
        assert got_calls == [(c.name, c.arguments) for c in whole.calls], pieces


def test_arguments_stream_in_pieces_before_the_call_ends():
    """A long argument arrives in many deltas, each sent as soon as it is generated."""
    parser = tool_parser("hermes")
    text = '<tool_call>\n{"name": "write_file", "arguments": {"path": "a", "content": "' + "x" * 200 + '"}}\n'
    stream = parser.stream(TOOLS)
    deltas = [d for ch in text for d in stream.push(ch)]
    args = [d for d in deltas if d.kind == "args"]
    assert len(args) > 150 and "".join(d.text for d in args) == text[text.index('{"path"'):-2]


@pytest.mark.parametrize("family, text", BROKEN, ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)])
def test_unparseable_claimed_calls_are_content(family, text):
    parser = tool_parser(family)
    out = parser.parse(text, TOOLS)
    assert out.failed and out.calls == [] and out.content == text
    for pieces in splits(text, seed=1):
        content, calls, failed = streamed(parser, text, pieces)
        assert failed
        if not calls:  # nothing announced: all of it is content, as parse gives
            assert content == text


def test_whole_calls_before_a_broken_one_are_kept():
    text = ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"ci')
    out = tool_parser("hermes").parse(text, TOOLS)
    assert out.failed and calls_of(out) == [("get_time", {})]
    assert out.content == text[text.index("</tool_call>") + len("</tool_call>"):]


def test_minimax_invokes_read_whole_stay_calls_when_the_block_is_cut():
    """Cut by max_tokens inside a block: the invokes read whole are calls, the rest is content, ``failed`` set;
    streamed, the same calls (the broken one's name was sent, so it stays a call with what was sent of it)."""
    parser = tool_parser("minimax_m2")
    whole = ('Sure.\n<minimax:tool_call>\n<invoke name="get_time">\n<parameter name="timezone">UTC</parameter>\n'
             '</invoke>\n')
    out = parser.parse(whole, TOOLS)
    assert out.failed and calls_of(out) == [("get_time", {"timezone": "UTC"})] and out.content == "Sure.\n"
    cut = whole + '<invoke name="get_weather">\n<parameter name="city">Oslo</parameter>\n<parameter name="da'
    out = parser.parse(cut, TOOLS)
    assert out.failed and calls_of(out) == [("get_time", {"timezone": "UTC"})]
    assert out.content == "Sure.\n" + cut[len(whole) - 1:]
    for pieces in splits(cut, seed=3):
        content, calls, failed = streamed(parser, cut, pieces)
        assert failed and calls[0] == ("get_time", '{"timezone": "UTC"}') and content.startswith("Sure.\n"), pieces
        if len(calls) == 2:  # the second call's name went out before the text broke
            assert calls[1][0] == "get_weather" and '{"city": "Oslo"'.startswith(calls[1][1]), pieces


def test_minimax_arguments_stream_one_parameter_at_a_time():
    parser = tool_parser("minimax_m2")
    text = ('<minimax:tool_call>\n<invoke name="write_file">\n<parameter name="path">a.txt</parameter>\n'
            '<parameter name="content">' + "x" * 50 + '</parameter>\n<parameter name="mode">7</parameter>\n'
            "</invoke>\n</minimax:tool_call>")
    stream = parser.stream(TOOLS)
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    assert [d.kind for d in deltas] == ["call", "args", "args", "args", "args"]
    assert deltas[0].name == "write_file"
    assert [d.text for d in deltas[1:]] == ['{"path": "a.txt"', ', "content": "' + "x" * 50 + '"', ', "mode": 7', "}"]


def test_minimax_thinking_then_calls():
    """MiniMax-M2's prompt ends inside ``<think>``: the reasoning parser takes the block, the content's calls are
    read after it."""
    from hetmoe.server.reasoning import reasoning_parser

    thinking = reasoning_parser("auto", MINIMAX_TEMPLATE)
    assert thinking is not None and thinking.starts_inside("[e~[\n]~b]ai\n<think>\n")
    output = ('The user wants the weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
              '<parameter name="city">Oslo</parameter>\n<parameter name="days">1</parameter>\n</invoke>\n'
              "</minimax:tool_call>")
    reasoning, content = thinking.split(output, True)
    assert reasoning == "The user wants the weather."
    out = tool_parser("auto", MINIMAX_TEMPLATE).parse(content, TOOLS)
    assert not out.failed and out.content == "" and calls_of(out) == [("get_weather", {"city": "Oslo", "days": 1})]


def test_a_template_that_writes_arguments_with_tojson_gets_mappings():
    """Kimi-K2's first template writes ``arguments | tojson`` unconditionally (JSON text would be quoted again);
    its later ones ask ``is string`` first, and take the text as it is."""
    bare = "<|tool_call_begin|>{{ tool_call['function']['arguments'] | tojson}}<|tool_call_end|>"
    guarded = ("{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}"
               "{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}")
    assert tool_calls.arguments_as_mapping(bare) and tool_calls.arguments_as_mapping(bare.replace("['function']"
                                                                                                   "['arguments']",
                                                                                                   ".function.arguments"))
    assert not tool_calls.arguments_as_mapping(guarded)
    assert not tool_calls.arguments_as_mapping("{{ tool_call.function.name | tojson }}")


def test_templates_may_grow_their_own_lists_but_not_the_callers():
    """Templates written for llama.cpp's renderer append to lists (Kimi-K2's ``ns.ids.append(...)``): allowed, on
    copies of what the caller handed over; the sandbox still keeps Python's internals out of reach."""
    import jinja2

    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer, compile_template

    assert compile_template("{% set ns = namespace(ids=[]) %}{% set _ = ns.ids.append(1) %}{{ ns.ids }}").render() \
        == "[1]"
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_template("{{ ''.__class__.__mro__ }}").render()
    tok = Tokenizer.from_dir(default_model_path())
    tok.chat_template = "{% for m in messages %}{% set _ = m.tool_calls.append(9) %}{{ m.tool_calls }}{% endfor %}"
    tok._compiled = None
    messages = [{"role": "assistant", "content": "", "tool_calls": [1]}]
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == "[1, 9]"
    assert messages[0]["tool_calls"] == [1]


def test_minimax_history_calls_render_as_mappings():
    """The template iterates over ``_args.items()`` after ``set _args = tool_call.arguments``: the history's
    arguments must reach it as a mapping, and it renders them as the parser reads them back."""
    from hetmoe.tokenizer import compile_template

    assert tool_calls.arguments_as_mapping(MINIMAX_TEMPLATE)
    assert not tool_calls.arguments_as_mapping("{% set n = tool_call.name %}{{ n }}{% for k in names.items() %}")
    rendered = compile_template(MINIMAX_TEMPLATE).render(message={"tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}},
        {"function": {"name": "noop", "arguments": {}}}]})
    parser = tool_parser("auto", MINIMAX_TEMPLATE)
    out = parser.parse(rendered, TOOLS)
    assert not out.failed and calls_of(out) == [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})]
    written = parser.format_calls([ToolCall("a", "get_weather", '{"city": "Paris", "days": 3}'),
                                   ToolCall("b", "noop", "{}")])
    assert rendered.split("]~b]ai")[0].strip() == written


# The tool-call part of MiniMax-M2's chat template, as its checkpoints ship it.
MINIMAX_TEMPLATE = """{%- set toolcall_begin_token = '<minimax:tool_call>' -%}
{%- set toolcall_end_token = '</minimax:tool_call>' -%}
{%- if message.tool_calls -%}
    {{- '\\n' ~ toolcall_begin_token ~ '\\n' }}
    {%- for tool_call in message.tool_calls -%}
        {%- if tool_call.function %}
            {%- set tool_call = tool_call.function %}
        {%- endif %}
        {{- '<invoke name="' + tool_call.name + '">' }}
        {% set _args = tool_call.arguments %}
        {%- for k, v in _args.items() %}
        {{- '<parameter name="' + k + '">' }}
        {{- v | tojson(ensure_ascii=False) if v is not string else v }}
        {{- '</parameter>' }}
        {% endfor %}
        {{- '</invoke>' ~ '\\n' }}
    {%- endfor -%}
    {{- toolcall_end_token}}
{%- endif -%}
{{- ']~b]ai' ~ '\\n' ~ '<think>' ~ '\\n' }}"""


@pytest.mark.parametrize("family", PARSERS)
def test_format_call_round_trips(family):
    parser = tool_parser(family)
    calls = [ToolCall("c0", "get_weather", '{"city": "Paris", "days": 3}'), ToolCall("c1", "noop", "{}")]
    text = parser.format_calls(calls)
    out = parser.parse(text, TOOLS)
    assert calls_of(out) == [("get_weather", {"city": "Paris", "days": 3}), ("noop", {})] and not out.failed


@pytest.fixture(scope="module")
def grammars():
    from hetmoe.engine.grammar import Grammars
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    return Grammars(Tokenizer.from_dir(default_model_path()), 8192)


@pytest.mark.parametrize("family", PARSERS)
def test_each_grammar_accepts_its_own_syntax(grammars, family):
    """The forced-call grammar of a family accepts the calls that family's parser reads (and one named call)."""
    import xgrammar as xgr

    parser = tool_parser(family)
    one = parser.format_calls([ToolCall("c0", "get_weather", '{"city": "Paris", "days": 3}')])
    for name, parallel in ((None, True), ("get_weather", False)):
        matcher = xgr.GrammarMatcher(grammars.structural_tag(parser.grammar(TOOLS, name, parallel)).compiled)
        assert matcher.accept_string(one) and matcher.is_completed(), (family, name)
    wrong = xgr.GrammarMatcher(grammars.structural_tag(parser.grammar(TOOLS, "get_time", False)).compiled)
    assert not (wrong.accept_string(one) and wrong.is_completed())


@pytest.mark.parametrize("family", PARSERS)
def test_the_grammar_takes_the_parameters_in_the_schemas_order(grammars, family):
    """A call with every type of parameter, written in the order the schema declares them (not sorted by name),
    as models write them."""
    import xgrammar as xgr

    parser = tool_parser(family)
    args = {"path": "src/a b.py", "content": "x = 1\ny = 2", "overwrite": True, "mode": 644, "meta": {"k": [1]}}
    if family == "minimax_m3":  # its grammar takes objects with named properties only (docs/serving.md)
        del args["meta"]
    text = parser.format_calls([ToolCall("c0", "write_file", json.dumps(args))])
    matcher = xgr.GrammarMatcher(grammars.structural_tag(parser.grammar(TOOLS, "write_file", False)).compiled)
    assert matcher.accept_string(text) and matcher.is_completed(), family
    assert calls_of(parser.parse(text, TOOLS)) == [("write_file", args)]


def allowed(matcher, ids):
    """Which of ``ids`` the matcher allows next."""
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, 8192)
    matcher.fill_next_token_bitmask(mask)
    return {i for i in ids if (int(mask[0, i // 32]) >> (i % 32)) & 1}


@pytest.mark.parametrize("family", PARSERS)
def test_the_output_may_end_after_each_complete_call(grammars, family):
    """Parallel calls: the stop token is allowed after every complete call (and after the separator that follows
    one at the top level), never inside one; one call only: after the first, the stop token alone."""
    import xgrammar as xgr

    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    stops = sorted(Tokenizer.from_dir(default_model_path()).eos_ids)
    parser = tool_parser(family)
    calls = [ToolCall("c0", "get_weather", '{"city": "Paris", "days": 3}'), ToolCall("c1", "noop", "{}"),
             ToolCall("c2", "get_time", "{}")]
    compiled = grammars.structural_tag(parser.grammar(TOOLS)).compiled
    for n in (1, 2, 3):
        text = parser.format_calls(calls[:n])
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(text[:-1]), (family, n)
        assert not allowed(matcher, stops), (family, n)  # a character short: not complete
        assert matcher.accept_string(text[-1]) and allowed(matcher, stops) == set(stops), (family, n)
        if parser.separator and not hasattr(parser, "end") and family != "mistral":
            assert matcher.accept_string(parser.separator) and allowed(matcher, stops) == set(stops), (family, n)
    one = xgr.GrammarMatcher(grammars.structural_tag(parser.grammar(TOOLS, parallel=False)).compiled)
    assert one.accept_string(parser.format_calls(calls[:1]))
    assert allowed(one, range(8192)) == set(stops)


@pytest.mark.parametrize("template, family", [
    ("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}{{- '\\n</tool_call>' }}", "hermes"),
    ("<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ k }}>", "qwen3_coder"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
     "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
     "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}", "deepseek_v31"),
    ("<|tool_calls_section_begin|>{% for tool_call in message['tool_calls'] %}", "kimi_k2"),
    ("[TOOL_CALLS][{{ tool_calls | tojson }}]", "mistral"),
    ("<tool_call>{{ tc.name }}\n{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>", "glm45"),
    ("<tool_call>{{ tc.name }}{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>", "glm47"),
    ("{%- set toolcall_begin_token = '<minimax:tool_call>' -%}{{- '<invoke name=\"' + tool_call.name + '\">' }}"
     "{{- '<parameter name=\"' + k + '\">' }}", "minimax_m2"),
    ("{% for message in messages %}<|im_start|>{{ message['role'] }}{% endfor %}", "hermes"),
    ("{%- set dsml_token = '｜DSML｜' -%}{{ '<' + dsml_token + 'function_calls>' }}", "deepseek_v32"),
    ("{{ '<｜DSML｜tool_calls>\\n<｜DSML｜invoke name=\"' + tc.name + '\">' }}", "deepseek_v4"),
    ("{%- set ns_token = ']<]minimax[>[' -%}{{- ns_token ~ '<tool_call>' -}}<mm:think>", "minimax_m3"),
])
def test_the_family_is_read_from_the_template(template, family):
    assert detect(template) == family
    assert tool_parser("auto", template).name == family


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_parser("llama9")


# ---------------------------------------------------------------------------------------------- the live server

FORECAST = {"type": "function", "function": {"name": "get_weather", "description": "the forecast for a city",
                                             "parameters": WEATHER}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"enum": ["UTC", "CET"]}}, "required": ["timezone"],
    "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK["function"]["parameters"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory, None, "--max-batch", "4")


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, timeout=300)


def ask(client, stream=False, **kwargs):
    kwargs = {"model": "hetmoe-default", "messages": [{"role": "user", "content": "Weather in Paris for 2 days?"}],
              "temperature": 0, "max_tokens": 160, **kwargs}
    return client.chat.completions.create(stream=stream, **kwargs)


def stream_message(chunks) -> tuple:
    """(content, {index: [id, name, arguments]}, finish reasons) of a streamed chat completion."""
    content, calls, finish = "", {}, []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or ():
            if t.id is not None:
                assert t.index not in calls and t.function.name  # the name comes first, once
                calls[t.index] = [t.id, t.function.name, t.function.arguments or ""]
            else:
                calls[t.index][2] += t.function.arguments or ""
        if c.choices[0].finish_reason:
            finish.append(c.choices[0].finish_reason)
    return content, calls, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_valid(client, choice):
    r = ask(client, tools=[FORECAST, CLOCK], tool_choice=choice, parallel_tool_calls=False)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_streamed(client, choice):
    content, calls, finish = stream_message(ask(client, stream=True, tools=[FORECAST, CLOCK], tool_choice=choice,
                                                parallel_tool_calls=False))
    assert finish == ["tool_calls"] and content == "" and list(calls) == [0]
    _, name, arguments = calls[0]
    validate(json.loads(arguments), SCHEMAS[name])
    whole = ask(client, tools=[FORECAST, CLOCK], tool_choice=choice, parallel_tool_calls=False)
    assert whole.choices[0].message.tool_calls[0].function.arguments == arguments  # temperature 0: the same call


def test_parallel_calls_each_valid(client):
    r = ask(client, tools=[FORECAST, CLOCK], tool_choice="required", max_tokens=300)
    message = r.choices[0].message
    assert message.tool_calls
    for call in message.tool_calls:  # a call cut by max_tokens is not returned as a call
        validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parallel_required_calls_end_with_tool_calls(client):
    """tool_choice required with parallel_tool_calls at its default (true): the grammar lets the output end after
    any complete call. The built-in model (a small code model) would rather write the same call again and again
    until max_tokens (its stop token is e^-8 less likely than a newline after a call); a frequency penalty makes it
    stop, and the answer is its calls with finish_reason "tool_calls", streamed or not."""
    kwargs = dict(tools=[FORECAST, CLOCK], tool_choice="required", max_tokens=400, frequency_penalty=1.0)
    r = ask(client, **kwargs)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls, r
    for call in message.tool_calls:
        validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    content, calls, finish = stream_message(ask(client, stream=True, **kwargs))
    assert finish == ["tool_calls"] and not content
    assert [(name, args) for _, name, args in calls.values()] == [(c.function.name, c.function.arguments)
                                                                  for c in message.tool_calls]


def test_two_turn_exchange(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = ask(client, messages=messages, tools=[FORECAST], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    second = ask(client, messages=messages, tools=[FORECAST], max_tokens=20)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    forced = ask(client, messages=messages, tools=[FORECAST], tool_choice="required", parallel_tool_calls=False)
    validate(json.loads(forced.choices[0].message.tool_calls[0].function.arguments), WEATHER)


def test_structured_output_parse(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**9)
        capital: bool

    r = client.chat.completions.parse(model="hetmoe-default", temperature=0, max_tokens=200, response_format=City,
                                      messages=[{"role": "user", "content": "Describe Paris."}])
    city = r.choices[0].message.parsed
    assert isinstance(city, City)
    validate(json.loads(r.choices[0].message.content), City.model_json_schema())


def test_json_object(client):
    r = ask(client, response_format={"type": "json_object"}, max_tokens=400)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert r.choices[0].message.content.startswith("{")
    content, _, finish = stream_message(ask(client, stream=True, response_format={"type": "json_object"},
                                            max_tokens=400))
    assert content == r.choices[0].message.content and finish == [r.choices[0].finish_reason]


def test_template_kwargs_and_reasoning_effort_are_accepted(client):
    r = ask(client, max_tokens=4, reasoning_effort="low",
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content is not None


def _nest(depth):
    s = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


def _tool(params, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _json_schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


MSG = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD = [
    ({"tools": [_tool({})], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [_tool({})], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": "f"}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [_tool({}), _tool({})]}, "tools[1].function.name"),
    ({"tools": [_tool({}, name="bad name!")]}, "tools[0].function.name"),
    ({"tools": [_tool({"type": "array"})]}, "tools[0].function.parameters"),
    ({"tools": [_tool(_nest(25))]}, "tools[0].function.parameters"),
    ({"tools": [_tool({"type": "object", "properties": {"a": {"type": "strin"}}})], "tool_choice": "required"},
     "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": _json_schema({"type": "strin"})}, "response_format.json_schema.schema"),
    ({"response_format": _json_schema(_nest(25))}, "response_format.json_schema.schema"),
    ({"response_format": _json_schema({"enum": list(range(5000))})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "tools": [_tool({})], "tool_choice": "required"},
     "response_format"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"messages": MSG + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": MSG + [{"role": "tool", "tool_call_id": "call_1", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": MSG + [{"role": "assistant", "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call_2", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": MSG + [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": MSG + [{"role": "assistant", "tool_calls": [{"type": "function", "function": CALL["function"]}]}]},
     "messages[1].tool_calls[0].id"),
    ({"messages": MSG + [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[1].tool_calls"),
    ({"messages": MSG + [{"role": "assistant", "content": None, "function_call": {"name": "f"}}]},
     "messages[1].function_call"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[b[1] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(server, extra, param):
    body = {"model": "hetmoe-default", "messages": MSG, "max_tokens": 4, **extra}
    assert_error(post(server, "/v1/chat/completions", body), 400, param=param)


def test_a_history_with_tool_calls_renders(server):
    messages = MSG + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = post(server, "/v1/chat/completions", {"model": "hetmoe-default", "messages": messages, "max_tokens": 2,
                                               "tools": [_tool({})]})
    assert r.status_code == 200, r.text


def test_metrics_list_the_parse_failures(server):
    assert "hetmoe_tool_call_parse_failures_total" in server.metrics()


# ---------------------------------------------------------------------------------------------- scripted outputs

@pytest.fixture(scope="module")
def scripted():
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    srv = InProcess(Tokenizer.from_dir(default_model_path()), engine=Scripted(piece=3))
    srv.texts = srv.engine.texts
    yield srv
    srv.close()


def scripted_chat(srv, text, **body):
    srv.texts.append(text)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [FORECAST, CLOCK], **body}
    return httpx.post(f"{srv.base}/v1/chat/completions", json=body, timeout=30)


def test_auto_mode_returns_the_models_calls(scripted):
    text = CASES[0][1]
    r = scripted_chat(scripted, text)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I'll check both.\n\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]] \
        == CASES[0][3]


def test_auto_mode_streamed(scripted):
    scripted.texts.append(CASES[0][1])
    client = openai.OpenAI(base_url=f"{scripted.base}/v1", api_key="unused", max_retries=0)
    content, calls, finish = stream_message(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=[FORECAST, CLOCK], stream=True))
    assert finish == ["tool_calls"] and content == "I'll check both.\n\n"
    assert [(name, json.loads(args)) for _, name, args in calls.values()] == CASES[0][3]


def test_parallel_false_keeps_one_call(scripted):
    r = scripted_chat(scripted, CASES[0][1], parallel_tool_calls=False)
    assert [c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]] == ["get_weather"]


def test_tool_choice_none_leaves_the_text_alone(scripted):
    r = scripted_chat(scripted, CASES[0][1], tool_choice="none")
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == CASES[0][1] and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_an_unparseable_call_is_content_and_counted(scripted):
    before = scripted.engine.metrics.tool_parse_failures
    r = scripted_chat(scripted, BROKEN[0][1])
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["message"]["content"] == BROKEN[0][1]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert scripted.engine.metrics.tool_parse_failures == before + 1
    assert "hetmoe_tool_call_parse_failures_total" in scripted.engine.metrics.render()


def test_forced_calls_need_a_grammar_engine(scripted):
    """Without a grammar compiler (xgrammar not installed), what needs one is refused by name."""
    import dataclasses

    support = chat.support_of(scripted.served)
    scripted.served.chat = dataclasses.replace(support, grammars=None)
    try:
        for extra, param in (({"tool_choice": "required"}, "tool_choice"),
                             ({"response_format": {"type": "json_object"}}, "response_format")):
            r = scripted_chat(scripted, "", **extra)
            assert "xgrammar" in assert_error(r, 400, param=param)["message"]
            scripted.texts.clear()
    finally:
        scripted.served.chat = support


def test_a_template_without_tools_is_shown_them(scripted):
    """The built-in template renders no tools: a system message shows them, and past calls are written in the
    parser's syntax (what the grammar makes the model write)."""
    support = chat.support_of(scripted.served)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    options = chat.parse({"tools": [_tool({})]}, messages, support)
    assert options.messages[0]["role"] == "system" and '"name": "f"' in options.messages[0]["content"]
    assert tool_calls.Hermes().format_call(ToolCall("call_1", "f", "{}")) in options.messages[2]["content"]
    assert "tools" not in options.template_kwargs
