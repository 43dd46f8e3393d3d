"""DeepSeek's DSML calls (V3.2's ``function_calls`` block, V4's ``tool_calls``): outputs read whole and streamed at
every split (no marker in the content), typed parameters, bad calls kept as content, the grammar; the built-in
chat templates that render the two encodings (the checkpoints ship them as Python), checked against a reference
written from the documented encoding and against its documented example; then the chat path end to end through the
openai SDK, with an engine stand-in that runs scripted token ids through a real ``SequenceState``."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from live_server import InProcess, read_chat_stream
from test_special_markers import TokenScript
from test_tool_calls import read_deltas

from hetmoe.server import chat
from hetmoe.server.main import read_chat_template
from hetmoe.server.reasoning import reasoning_parser
from hetmoe.server.tool_calls import ToolCall, detect, tool_parser
from hetmoe.server.tool_calls.scan import Malformed
from hetmoe.tokenizer import Tokenizer, compile_template

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                          "opts": {"type": "object"}}, "required": ["city"]},
         "noop": {"type": "object", "properties": {}}}
D = "｜DSML｜"
BLOCK = {"deepseek_v32": "function_calls", "deepseek_v4": "tool_calls"}
FAMILIES = tuple(BLOCK)


def invoke(name, *params):
    body = "".join(f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>\n' for k, s, v in params)
    return f'<{D}invoke name="{name}">\n{body}</{D}invoke>'


def block(family, *invokes):
    return f"<{D}{BLOCK[family]}>\n" + "\n".join(invokes) + f"\n</{D}{BLOCK[family]}>"


def cases(f):
    """(model output, content, [(name, arguments)]) of family ``f``."""
    return [
        ("Let me check.\n\n" + block(f, invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))),
         "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
        ("\n\n" + block(f, invoke("get_weather", ("city", "true", '{"a": 1} <b> & "q"\nline 2'),
                                  ("opts", "false", '{"k": [1, null, true]}')), invoke("noop")),
         "", [("get_weather", {"city": '{"a": 1} <b> & "q"\nline 2', "opts": {"k": [1, None, True]}}),
              ("noop", {})]),
        # string="true" keeps digits a string; a value marked JSON that is not JSON is read by the schema
        (block(f, invoke("get_weather", ("city", "true", "42"), ("days", "false", "three"))) + "\n\nDone.",
         "Done.", [("get_weather", {"city": "42", "days": "three"})]),
        # no string attribute, single quotes, a bare name: the schema decides
        (f"<{D}{BLOCK[f]}><{D}invoke name=get_weather><{D}parameter name='days'>4</{D}parameter>"
         f"<{D}parameter name='city'>5</{D}parameter></{D}invoke></{D}{BLOCK[f]}>", "",
         [("get_weather", {"days": 4, "city": "5"})]),
        ("No call: a ｜DSML｜ mention, <｜DSML｜invoke name=\"x\"> alone, and blank lines\n\n",
         "No call: a ｜DSML｜ mention, <｜DSML｜invoke name=\"x\"> alone, and blank lines\n\n", []),
    ]


def broken(f):
    """(model output, content): claims calls, does not parse."""
    start = f"<{D}{BLOCK[f]}>"
    return [
        ("Hm.\n\n" + start + "\n" + invoke("get_weather", ("city", "maybe", "x")), "Hm." + start + "\n" +
         invoke("get_weather", ("city", "maybe", "x"))),
        (start + f'\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par', start +
         f'\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par'),
        (start + "\nnot an invoke" + f"</{D}{BLOCK[f]}>", start + "\nnot an invoke" + f"</{D}{BLOCK[f]}>"),
        (start + f"\n</{D}{BLOCK[f]}>", start + f"\n</{D}{BLOCK[f]}>"),
        (start + "\n" + invoke("get_weather", ("city", "true", "a"), ("city", "true", "b")),
         start + "\n" + invoke("get_weather", ("city", "true", "a"), ("city", "true", "b"))),
    ]


def run(family, pieces) -> tuple:
    stream = tool_parser(family).stream(TOOLS)
    deltas = [d for p in pieces for d in stream.push(p)] + stream.finish()
    return (*read_deltas(deltas), stream.failed)


def splits(text: str):
    yield from ([text[:i], text[i:]] for i in range(len(text) + 1))
    yield list(text)
    yield [text[i:i + 5] for i in range(0, len(text), 5)]


@pytest.mark.parametrize("family, k", [(f, k) for f in FAMILIES for k in range(len(cases(f)))])
def test_calls_whole_and_streamed_at_every_split(family, k):
    text, content, calls = cases(family)[k]
    out = tool_parser(family).parse(text, TOOLS)
    assert out.content == content and not out.failed
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    whole = (out.content, [(c.name, c.arguments) for c in out.calls], False)
    for pieces in splits(text):
        got = run(family, pieces)
        assert got == whole, pieces
        if calls:
            assert D not in got[0], pieces


@pytest.mark.parametrize("family, k", [(f, k) for f in FAMILIES for k in range(len(broken(f)))])
def test_bad_calls_are_content(family, k):
    text, content = broken(family)[k]
    out = tool_parser(family).parse(text, TOOLS)
    assert (out.content, out.calls, out.failed) == (content, [], True)
    for pieces in splits(text):
        got_content, calls, failed = run(family, pieces)
        assert failed and (calls or got_content == content), pieces


def test_one_family_does_not_read_the_others_block():
    text = block("deepseek_v4", invoke("noop"))
    assert tool_parser("deepseek_v32").parse(text, TOOLS).calls == []
    assert [c.name for c in tool_parser("deepseek_v4").parse(text, TOOLS).calls] == ["noop"]


def test_the_string_attribute_is_true_or_false():
    from hetmoe.server.tool_calls.dsml import dsml_value

    assert dsml_value("3", "true", "integer") == '"3"' and dsml_value("3", "false", "string") == "3"
    assert dsml_value("3", None, "integer") == "3" and dsml_value("3", None, "string") == '"3"'
    assert dsml_value("[1,2]", "false", None) == "[1, 2]" and dsml_value("x y", "false", "integer") == '"x y"'
    with pytest.raises(Malformed):
        dsml_value("3", "yes", "integer")


def test_arguments_stream_one_parameter_at_a_time():
    text = block("deepseek_v32", invoke("get_weather", ("city", "true", "x" * 40), ("days", "false", "2")))
    stream = tool_parser("deepseek_v32").stream(TOOLS)
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    assert [d.kind for d in deltas] == ["call", "args", "args", "args"]
    assert deltas[1].text == '{"city": "' + "x" * 40 + '"' and deltas[2].text == ', "days": 2'


@pytest.mark.parametrize("family", FAMILIES)
def test_format_call_is_the_encodings_and_round_trips(family):
    parser = tool_parser(family)
    calls = [ToolCall("c0", "get_weather", '{"city": "Paris", "days": 3, "opts": {"a": [1]}}'),
             ToolCall("c1", "noop", "{}")]
    text = parser.format_calls(calls)
    assert text == block(family, invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"),
                                        ("opts", "false", '{"a": [1]}')), invoke("noop"))
    out = parser.parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in out.calls] == [(c.name, c.arguments) for c in calls]


@pytest.fixture(scope="module")
def grammars():
    from hetmoe.engine.grammar import Grammars
    from hetmoe.engine.llm import default_model_path

    return Grammars(Tokenizer.from_dir(default_model_path()), 8192)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_grammar_forces_the_block_with_typed_parameters(grammars, family):
    import xgrammar as xgr

    parser = tool_parser(family)
    good = parser.format_calls([ToolCall("c0", "get_weather", '{"city": "Paris", "days": 3}')])
    for prefix in ("", "\n\n"):
        matcher = xgr.GrammarMatcher(grammars.structural_tag(parser.grammar(TOOLS, "get_weather", False)).compiled)
        assert matcher.accept_string(prefix + good) and matcher.is_completed(), prefix
    for bad in (good.replace('string="false">3', 'string="true">3'),  # an integer written as a string
                good.replace('string="true">Paris', 'string="false">Paris'),
                good.replace(BLOCK[family], BLOCK["deepseek_v4" if family == "deepseek_v32" else "deepseek_v32"])):
        matcher = xgr.GrammarMatcher(grammars.structural_tag(parser.grammar(TOOLS, "get_weather", False)).compiled)
        assert not (matcher.accept_string(bad) and matcher.is_completed()), bad


# ------------------------------------------------------------------------------------------- the encodings

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
TEMPLATES = Path(__file__).parents[2] / "hetmoe" / "server" / "templates"


def reference_v32(messages, tools, thinking):
    """DeepSeek-V3.2's encoding (encoding_dsv32.py's encode_messages with the tools on the first system message),
    written from its description, for OpenAI-shaped messages (arguments JSON text)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out, calls, order = BOS, 0, 0
    if tools and messages[0]["role"] != "system":
        out += "\n\n" + tools_v32(tools)
    for i, m in enumerate(messages):
        if m["role"] == "system":
            out += m["content"] + ("\n\n" + tools_v32(tools) if i == 0 and tools else "")
        elif m["role"] == "user":
            out += USER + m["content"] + ASSISTANT + ("<think>" if thinking and i == last_user else "</think>")
        elif m["role"] == "assistant":
            if thinking and i > last_user:
                out += (m.get("reasoning_content") or "") + "</think>"
            out += (m.get("content") or "") + calls_text(m.get("tool_calls"), "function_calls") + EOS
            calls, order = len(m.get("tool_calls") or []), 0
        else:
            order += 1
            out += ("\n\n<function_results>" if order == 1 else "") + f"\n<result>{m['content']}</result>"
            if order == calls:
                out += "\n</function_results>\n\n" + ("<think>" if thinking and i >= last_user else "</think>")
    return out


def calls_text(calls, name):
    if not calls:
        return ""
    invokes = []
    for c in calls:
        params = [f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                  f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</{D}parameter>'
                  for k, v in json.loads(c["function"]["arguments"]).items()]
        invokes.append(f'<{D}invoke name="{c["function"]["name"]}">\n' + "\n".join(params) + f"\n</{D}invoke>")
    return f"\n\n<{D}{name}>\n" + "\n".join(invokes) + f"\n</{D}{name}>"


def tools_v32(tools):
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    example = (f'<{D}function_calls>\n<{D}invoke name="$FUNCTION_NAME">\n<{D}parameter name="$PARAMETER_NAME" '
               f'string="true|false">$PARAMETER_VALUE</{D}parameter>\n...\n</{D}invoke>\n<{D}invoke '
               f'name="$FUNCTION_NAME2">\n...\n</{D}invoke>\n</{D}function_calls>\n')
    return ("## Tools\nYou have access to a set of tools you can use to answer the user's question.\nYou can invoke "
            f'functions by writing a "<{D}function_calls>" block like the following as part of your reply to the '
            "user:\n" + example + "String and scalar parameters should be specified as is without any escaping or "
            "quotes, while lists and objects should use JSON format. The \"string\" attribute should be set to "
            "\"true\" for string type parameters and \"false\" for other types (numbers, booleans, arrays, "
            "objects).\nIf the thinking_mode is enabled, then after function results you should strongly consider "
            f"outputting a thinking block. Here is an example:\n<{D}function_calls>\n...\n</{D}function_calls>\n"
            "<function_results>\n...\n</function_results>\n<think>...thinking about results</think>\nHere are the "
            f"functions available in JSONSchema format:\n<functions>\n{schemas}\n</functions>\n")


def reference_v4(messages, tools, thinking):
    """DeepSeek-V4's encoding (encoding_dsv4.py's encode_messages, reasoning effort left at its default): tool
    results merged into the user turn after them, sorted by call order; reasoning kept when there are tools."""
    merged, order = [], {}
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"])}
        if m["role"] in ("user", "tool"):
            part = ("tool", m) if m["role"] == "tool" else ("text", m["content"])
            if merged and merged[-1]["role"] == "user":
                merged[-1]["parts"].append(part)
            else:
                merged.append({"role": "user", "parts": [part], "order": order})
        else:
            merged.append(m)
    keep = bool(tools)
    last_user = max((i for i, m in enumerate(merged) if m["role"] == "user"), default=-1)
    out = BOS + ("\n\n" + tools_v4(tools) if tools and merged[0]["role"] != "system" else "")
    for i, m in enumerate(merged):
        if m["role"] == "system":
            out += m["content"] + ("\n\n" + tools_v4(tools) if i == 0 and tools else "")
        elif m["role"] == "user":
            results = sorted((p for p in m["parts"] if p[0] == "tool"),
                             key=lambda p: m["order"].get(p[1]["tool_call_id"], 0))
            texts = []
            for kind, p in m["parts"]:
                texts.append(p if kind == "text" else f"<tool_result>{results.pop(0)[1]['content']}</tool_result>")
            out += USER + "\n\n".join(texts)
        else:
            if thinking and (keep or i > last_user):
                out += (m.get("reasoning_content") or "") + "</think>"
            out += (m.get("content") or "") + calls_text(m.get("tool_calls"), "tool_calls") + EOS
        if m["role"] == "user" and (i + 1 == len(merged) or merged[i + 1]["role"] == "assistant"):
            out += ASSISTANT + ("<think>" if thinking and (keep or i >= last_user) else "</think>")
    return out


def tools_v4(tools):
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools "
            f'by writing a "<{D}tool_calls>" block like the following:\n\n<{D}tool_calls>\n<{D}invoke '
            f'name="$TOOL_NAME">\n<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
            f'</{D}parameter>\n...\n</{D}invoke>\n<{D}invoke name="$TOOL_NAME2">\n...\n</{D}invoke>\n'
            f'</{D}tool_calls>\n\nString parameters should be specified as is and set `string="true"`. For all '
            "other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
            '`string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete '
            "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output "
            "directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n"
            f"{schemas}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
            "calls.\n")


def call(i, name, args):
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


TOOL_LIST = [{"type": "function", "function": {"name": n, "description": "d é", "parameters": s}}
             for n, s in TOOLS.items()]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"}, {"role": "user", "content": "1+1=?"}],
    [{"role": "user", "content": "Weather in Paris and Oslo?"},
     {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls",
      "tool_calls": [call(0, "get_weather", {"city": "Paris", "days": 2}),
                     call(1, "get_weather", {"city": "Oslo", "opts": {"u": ["c", None]}})]},
     {"role": "tool", "tool_call_id": "c1", "content": "snow"},
     {"role": "tool", "tool_call_id": "c0", "content": "sun"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "go"},
     {"role": "assistant", "content": "", "reasoning_content": "r1", "tool_calls": [call(0, "noop", {})]},
     {"role": "tool", "tool_call_id": "c0", "content": "done"},
     {"role": "assistant", "content": "All done.", "reasoning_content": "r2"}, {"role": "user", "content": "again"}],
]


def render(name, messages, tools, **kwargs):
    template = compile_template(read_chat_template(name))
    shaped = [dict(m) for m in messages]
    for m in shaped:  # as the chat path hands them to a template that iterates arguments|items
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
    return template.render(messages=shaped, tools=tools, bos_token=BOS, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("tools", [None, TOOL_LIST], ids=["no-tools", "tools"])
@pytest.mark.parametrize("switch", [{}, {"thinking": True}, {"thinking": False}, {"enable_thinking": True},
                                    {"enable_thinking": False}, {"reasoning_effort": "none"},
                                    {"reasoning_effort": "high", "enable_thinking": False}], ids=str)
def test_the_templates_render_the_documented_encodings(k, tools, switch):
    messages = CONVERSATIONS[k]
    asked = switch.get("thinking", switch.get("enable_thinking"))
    assert render("deepseek_v32", messages, tools, **switch) == reference_v32(messages, tools, bool(asked))
    on = asked if asked is not None else switch.get("reasoning_effort") != "none"  # V4 thinks unless told not to
    assert render("deepseek_v4", messages, tools, **switch) == reference_v4(messages, tools, on)


def test_the_v32_template_renders_the_documentations_example():
    """encoding_dsv32.py's example conversation, thinking on: earlier reasoning dropped, the prompt ends inside a
    new block."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
                {"role": "user", "content": "1+1=?"}]
    assert render("deepseek_v32", messages, None, thinking=True) == (
        f"{BOS}You are a helpful assistant.{USER}hello{ASSISTANT}</think>Hello! I am DeepSeek.{EOS}{USER}1+1=?"
        f"{ASSISTANT}<think>")


def test_the_templates_are_read_by_name_and_detected():
    for name in FAMILIES:
        text = read_chat_template(name)
        assert text == (TEMPLATES / f"{name}.jinja").read_text()
        assert detect(text) == name and tool_parser("auto", text).name == name
        assert reasoning_parser("auto", text).name == "auto" and reasoning_parser(name).name == name
    with pytest.raises(ValueError, match="deepseek_v5"):
        read_chat_template("deepseek_v5")


# ------------------------------------------------------------------------------------------ end to end

@pytest.fixture(scope="module")
def dsml():
    yield from scripted_server("deepseek_v32")


@pytest.fixture(scope="module")
def dsml_v4():
    yield from scripted_server("deepseek_v4")


def scripted_server(template):
    from hetmoe.engine.llm import default_model_path
    from hetmoe.server.limits import Limits

    tok = Tokenizer.from_dir(default_model_path())
    tok.chat_template = read_chat_template(template)
    srv = InProcess(tok, limits=Limits.for_model(4096, 2))
    srv.served.max_context = 4096
    engine = TokenScript(tok, srv.engine.metrics)
    engine.prompts = []

    def submit(req):
        engine.prompts.append(list(req.prompt_ids))
        return engine.submit(req)

    srv.engine.submit = submit
    srv.scripts, srv.tok, srv.prompts = engine.scripts, tok, engine.prompts
    srv.client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused", max_retries=0, timeout=30)
    yield srv
    srv.close()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": TOOLS["get_weather"]}}
THOUGHT_AND_CALL = "The user wants Oslo.</think>\n\n" + block(
    "deepseek_v32", invoke("get_weather", ("city", "true", "Oslo"), ("days", "false", "2")))


def ask(srv, output, stream=False, **kwargs):
    srv.scripts.append(srv.tok.encode(output, add_special_tokens=False) + sorted(srv.tok.eos_ids)[:1])
    body = dict(model="m", messages=[{"role": "user", "content": "Oslo?"}], tools=[WEATHER],
                extra_body={"chat_template_kwargs": {"thinking": True}})
    body.update(kwargs)
    return srv.client.chat.completions.create(stream=stream, **body)


def test_a_thought_and_a_call(dsml):
    r = ask(dsml, THOUGHT_AND_CALL)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not message.content
    assert message.reasoning_content == "The user wants Oslo."
    [c] = message.tool_calls
    assert c.function.name == "get_weather" and json.loads(c.function.arguments) == {"city": "Oslo", "days": 2}
    prompt = dsml.tok.decode(dsml.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(f"{USER}Oslo?{ASSISTANT}<think>") and f"<{D}function_calls>" in prompt


def test_a_thought_and_a_call_streamed(dsml):
    reasoning, content, calls, finish = read_chat_stream(ask(dsml, THOUGHT_AND_CALL, stream=True))
    assert reasoning == "The user wants Oslo." and content == "" and finish == ["tool_calls"]
    assert calls[0][0] == "get_weather" and json.loads(calls[0][1]) == {"city": "Oslo", "days": 2}


def test_the_history_goes_back_in_the_encoding(dsml):
    messages = [{"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": None, "reasoning_content": "Ask.",
                 "tool_calls": [call(0, "get_weather", {"city": "Oslo", "days": 2})]},
                {"role": "tool", "tool_call_id": "c0", "content": "rain"}]
    r = ask(dsml, "It rains.</think>It rains in Oslo.", messages=messages)
    message = r.choices[0].message
    assert message.content == "It rains in Oslo." and message.reasoning_content == "It rains."
    prompt = dsml.tok.decode(dsml.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(f"{USER}Oslo?{ASSISTANT}<think>Ask.</think>" + calls_text(messages[1]["tool_calls"],
                           "function_calls") + f"{EOS}\n\n<function_results>\n<result>rain</result>\n"
                           "</function_results>\n\n<think>")


def test_thinking_off_and_a_forced_call(dsml):
    r = ask(dsml, "\n\n" + block("deepseek_v32", invoke("get_weather", ("city", "true", "Rome"))),
            tool_choice="required", extra_body={"chat_template_kwargs": {"thinking": False}})
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Rome"}
    assert dsml.tok.decode(dsml.prompts[-1], skip_special_tokens=False).endswith(f"{ASSISTANT}</think>")


def test_the_chat_support_picks_the_family(dsml):
    support = chat.ChatSupport.build(dsml.tok, 8192)
    assert support.parser.name == "deepseek_v32" and support.reasoning is not None
    assert support.renders_tools and support.args_mapping


def test_v4_a_call_then_its_results_in_call_order(dsml_v4):
    output = "Two cities.</think>\n\n" + block("deepseek_v4", invoke("get_weather", ("city", "true", "Oslo")),
                                                  invoke("get_weather", ("city", "true", "Rome")))
    r = ask(dsml_v4, output, extra_body={})
    message = r.choices[0].message
    assert message.reasoning_content == "Two cities." and r.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in message.tool_calls] == ["Oslo", "Rome"]
    history = [{"role": "user", "content": "Oslo?"}, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": message.tool_calls[1].id, "content": "sun"},
               {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "rain"}]
    r = ask(dsml_v4, "Done.</think>Rain in Oslo, sun in Rome.", messages=history, extra_body={})
    assert r.choices[0].message.content == "Rain in Oslo, sun in Rome."
    prompt = dsml_v4.tok.decode(dsml_v4.prompts[-1], skip_special_tokens=False)
    assert prompt.endswith(f"{EOS}{USER}<tool_result>rain</tool_result>\n\n<tool_result>sun</tool_result>"
                           f"{ASSISTANT}<think>")
    assert f"{ASSISTANT}<think>Two cities.</think>\n\n<{D}tool_calls>" in prompt
