"""MiniMax-M3's calls (every element behind the ``]<]minimax[>[`` namespace token, objects and arrays written as
elements) and its ``<mm:think>`` reasoning: outputs through the chat path's two streams, whole and at every split
(no marker in content or reasoning), values typed by the schema or read without one, bad calls kept as content,
the grammar (nested values, string bounds it cannot enforce), the family and reasoning parser read from a
template."""

from __future__ import annotations

import json

import pytest
from test_tool_calls import read_deltas

from hetmoe.server.reasoning import reasoning_parser
from hetmoe.server.tool_calls import ToolCall, detect, tool_parser
from hetmoe.server.tool_calls.minimax_m3 import m3_text, m3_value
from hetmoe.server.tool_calls.scan import Malformed

N = "]<]minimax[>["
ITEM_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
                                                                                   "items": {"type": "string"}}}}
TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                          "days": {"type": "integer"}}, "required": ["city"]},
         "put": {"type": "object", "properties": {"items": {"type": "array", "items": ITEM_SCHEMA},
                                                  "flag": {"type": "boolean"}, "note": {"type": "string"}},
                 "required": ["items"]},
         "noop": {"type": "object", "properties": {}}}


def el(name, inner):
    return f"{N}<{name}>{inner}{N}</{name}>"


def invoke(name, *params):
    return f'{N}<invoke name="{name}">' + "".join(params) + f"{N}</invoke>"


def block(*invokes):
    return f"{N}<tool_call>\n" + "\n".join(invokes) + f"\n{N}</tool_call>"


THINK = "<mm:think>The user wants Paris.</mm:think>\n"
# (model output, reasoning (None: none), content, [(name, arguments)])
CASES = [
    (THINK + "Checking.\n" + block(invoke("get_weather", el("city", "Paris"), el("days", "3"))), "The user wants "
     "Paris.", "Checking.\n", [("get_weather", {"city": "Paris", "days": 3})]),
    (block(invoke("put", el("items", el("item", el("id", "7") + el("tags", el("item", "a") + el("item", "12")))
                                 + el("item", el("id", "8"))), el("flag", "true"), el("note", "x <y> & 1")),
           invoke("noop")),
     None, "", [("put", {"items": [{"id": 7, "tags": ["a", "12"]}, {"id": 8}], "flag": True, "note": "x <y> & 1"}),
                ("noop", {})]),
    # the schema says string: digits stay text; an integer that is not one is kept as text
    (block(invoke("get_weather", el("city", "42"), el("days", "three"))) + "\nDone.", None, "Done.",
     [("get_weather", {"city": "42", "days": "three"})]),
    # no schema (an unknown tool): items are an array, other elements an object, scalars as they read
    (block(invoke("other", el("xs", el("item", "1") + el("item", "null")), el("o", el("k", "true") + el("s", "hi")),
                  el("item", el("item", el("item", "2"))))), None, "",
     [("other", {"xs": [1, None], "o": {"k": True, "s": "hi"}, "item": [[2]]})]),
    ("<mm:think>cut by max_tokens", "cut by max_tokens", "", []),
    ("A plain answer with ]<] in it.", None, "A plain answer with ]<] in it.", []),
]

BROKEN = [  # (output, content): claims a call, does not parse
    (block(invoke("get_weather", el("city", "Paris"), el("city", "Rome"))), "twice"),
    (f"{N}<tool_call>\n{N}<invoke name=\"get_weather\">{N}<city>Par", "cut"),
    (f"{N}<tool_call>\n{N}<invoke name=\"get_weather\">text{N}</invoke>\n{N}</tool_call>", "text"),
    (block(invoke("put", el("items", el("entry", "1")))), "not an item"),
]


def run(pieces, inside=False) -> tuple:
    thinking, calls_stream = reasoning_parser("minimax_m3").stream(inside), tool_parser("minimax_m3").stream(TOOLS)
    reasoning = ""
    parts = [p for piece in pieces for p in thinking.push(piece)] + thinking.finish()
    deltas = []
    for kind, t in parts:
        if kind == "reasoning":
            assert "mm:think" not in t
            reasoning += t
        else:
            deltas += calls_stream.push(t)
    deltas += calls_stream.finish()
    content, calls = read_deltas(deltas)
    return (reasoning if thinking.reasoned else None), content, calls, calls_stream.failed


def whole(text, inside=False) -> tuple:
    reasoning, content = reasoning_parser("minimax_m3").split(text, inside)
    out = tool_parser("minimax_m3").parse(content, TOOLS)
    return reasoning, out.content, [(c.name, c.arguments) for c in out.calls], out.failed


def splits(text: str):
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)
    yield [text[i:i + 7] for i in range(0, len(text), 7)]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES, ids=[str(i) for i in range(len(CASES))])
def test_reasoning_and_calls_whole_and_at_every_split(text, reasoning, content, calls):
    got = whole(text)
    assert got[:2] == (reasoning, content) and not got[3]
    assert [(n, json.loads(a)) for n, a in got[2]] == calls
    for pieces in splits(text):
        streamed = run(pieces)
        assert streamed == got, pieces
        if calls:
            assert N not in streamed[1], pieces


@pytest.mark.parametrize("text, why", BROKEN, ids=[b[1] for b in BROKEN])
def test_bad_calls_are_content(text, why):
    got = whole(text)
    assert got == (None, text, [], True)
    for pieces in splits(text):
        _, content, calls, failed = run(pieces)
        assert failed and (calls or content == text), pieces


def test_a_prompt_that_opens_the_block():
    assert reasoning_parser("minimax_m3").starts_inside("<|im_start|>ai\n<mm:think>")
    assert whole("Short.</mm:think>Four.", inside=True) == ("Short.", "Four.", [], False)
    assert run(["Sh", "ort.</mm:", "think>Four."], inside=True) == ("Short.", "Four.", [], False)


def test_values_by_schema_and_without():
    assert m3_value("", {"type": "array"}) == [] and m3_value(" ", {"type": "object"}) == {}
    assert m3_value("007", {"type": "string"}) == "007" and m3_value("007", None) == "007"
    assert m3_value("1.5", None) == 1.5 and m3_value('{"a": 1}', None) == '{"a": 1}'
    assert m3_value(el("item", "x"), {"type": "object"}) == {"item": "x"}
    with pytest.raises(Malformed):
        m3_value("text" + el("a", "1"), None)
    value = {"a": [1, {"b": "c"}], "d": None}
    assert m3_value(m3_text(value), None) == value


def test_arguments_stream_one_parameter_at_a_time():
    text = block(invoke("get_weather", el("city", "x" * 30), el("days", "2")))
    stream = tool_parser("minimax_m3").stream(TOOLS)
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    assert [d.kind for d in deltas] == ["call", "args", "args", "args"]
    assert deltas[1].text == '{"city": "' + "x" * 30 + '"' and deltas[2].text == ', "days": 2'


def test_format_call_round_trips():
    parser = tool_parser("minimax_m3")
    calls = [ToolCall("c0", "put", json.dumps({"items": [{"id": 1, "tags": ["a"]}], "flag": False})),
             ToolCall("c1", "noop", "{}")]
    text = parser.format_calls(calls)
    assert text == block(invoke("put", el("items", el("item", el("id", "1") + el("tags", el("item", "a")))),
                                el("flag", "false")), invoke("noop"))
    assert [(c.name, c.arguments) for c in parser.parse(text, TOOLS).calls] == [(c.name, c.arguments) for c in calls]


@pytest.fixture(scope="module")
def grammars():
    from hetmoe.engine.grammar import Grammars
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    return Grammars(Tokenizer.from_dir(default_model_path()), 8192)


def test_the_grammar_forces_nested_typed_values(grammars):
    import xgrammar as xgr

    parser = tool_parser("minimax_m3")
    compiled = grammars.structural_tag(parser.grammar(TOOLS, "put", False)).compiled
    good = parser.format_calls([ToolCall("c0", "put", json.dumps({"items": [{"id": 1, "tags": ["a", "b"]}]}))])
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(good) and matcher.is_completed()
    for bad in (good.replace(el("id", "1"), el("id", "one")), good.replace("<item>", "<entry>", 1),
                good.replace('name="put"', 'name="noop"')):
        matcher = xgr.GrammarMatcher(compiled)
        assert not (matcher.accept_string(bad) and matcher.is_completed()), bad


def test_the_grammar_leaves_string_bounds_to_the_model(grammars):
    """xgrammar's M3 style cannot bound a string's length: the grammar builds, and takes a longer city."""
    import xgrammar as xgr

    parser = tool_parser("minimax_m3")
    compiled = grammars.structural_tag(parser.grammar(TOOLS, "get_weather", False)).compiled
    text = parser.format_calls([ToolCall("c0", "get_weather", json.dumps({"city": "x" * 30}))])
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(text) and matcher.is_completed()
    assert TOOLS["get_weather"]["properties"]["city"]["maxLength"] == 24  # the request's schema is left as it was


def test_the_family_and_the_reasoning_parser_are_read_from_the_template():
    template = ("{%- set ns_token = ']<]minimax[>[' -%}{{- ns_token ~ '<tool_call>' -}}"
                "{%- if add_generation_prompt -%}{{- '<mm:think>' -}}{%- endif -%}")
    assert detect(template) == "minimax_m3" and tool_parser("auto", template).name == "minimax_m3"
    parser = reasoning_parser("auto", template)
    assert parser.name == "minimax_m3" and parser.markers == ("<mm:think>", "</mm:think>")


def test_a_lone_closing_tag_at_the_start_skips_the_reasoning():
    """M3's adaptive mode: the model may answer at once after a closing tag; that tag is no content."""
    assert whole("</mm:think>\n\nFour.") == (None, "Four.", [], False)
    assert run(["</mm:", "think>", "\n\nFour."]) == (None, "Four.", [], False)
    assert whole("Four. </mm:think>") == (None, "Four. </mm:think>", [], False)
