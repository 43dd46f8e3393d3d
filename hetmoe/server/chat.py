"""Tool calling, reasoning and structured output on the chat path: what a chat request asks for beyond messages
(``parse``: tools, tool_choice, parallel_tool_calls, a tool history, response_format, chat_template_kwargs,
reasoning_effort), the grammar that enforces it (``ChatOptions.constraint``), and the message the output becomes
(``ChatOutput``: reasoning_content, content, tool_calls, finish_reason "tool_calls").

    support = ChatSupport.build(tokenizer, vocab_size, "auto", "auto")   # once per served model
    options = parse(body, messages, support)        # 400 (APIError with param) on anything malformed
    ids = encode(options.messages, **options.template_kwargs); options.prompt_done(tail text of ids)
    params.constraint = options.constraint()        # None unless response_format / required / a named tool
    out = ChatOutput(options); out.push(piece) -> [delta]; out.finish() -> [delta]; out.message(text)

``tool_choice`` "auto" lets the model call tools in its family's syntax (tool_calls/) or answer; "required" and
a named function are enforced by the grammar, so even a small model returns a call whose arguments match the
schema; "none" leaves the tools out of the prompt. A chat template that renders no tools (the built-in model's)
is given them in a system message that shows the family's syntax, and the history's calls written in it.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hetmoe.engine import grammar
from hetmoe.server import tool_calls
from hetmoe.server.protocol import APIError, shown
from hetmoe.server.reasoning import ReasoningParser, reasoning_parser

MAX_TOOLS = 256
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
_RESERVED_KWARGS = ("messages", "tools", "add_generation_prompt", "documents")


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"Invalid '{param}': {message}", param=param, code=code)


def _missing(param: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


@dataclass
class ChatSupport:
    """What one served model brings to tool calls and reasoning: its template's habits, its parsers, and the
    grammar compiler (None when xgrammar is not installed)."""

    parser: tool_calls.ToolParser
    reasoning: Optional[ReasoningParser]
    grammars: Optional[Any]  # engine.grammar.Grammars
    renders_tools: bool  # the template reads ``tools``
    args_mapping: bool  # the template wants a call's arguments as a mapping
    tail: Callable  # prompt ids -> the text of their last few tokens, special tokens included
    # ids of the tool-call parser's and the reasoning parser's markers that are special tokens in this tokenizer
    # (Kimi-K2's, Mistral's [TOOL_CALLS]): the text the parsers read keeps them, the grammars see them as text
    tool_markers: frozenset = frozenset()
    reasoning_markers: frozenset = frozenset()

    @classmethod
    def build(cls, tokenizer, vocab_size: int, tool_parser: Optional[str] = "auto",
              reasoning: Optional[str] = "auto") -> "ChatSupport":
        template = tokenizer.chat_template or ""
        parser = tool_calls.tool_parser(tool_parser, template)
        thinking = reasoning_parser(reasoning, template)
        specials = {t.content: i for i, t in tokenizer.backend.get_added_tokens_decoder().items()
                    if t.special and i < vocab_size}
        tool_markers = frozenset(specials[m] for m in parser.markers if m in specials)
        reasoning_markers = frozenset(specials[m] for m in thinking.markers if m in specials) \
            if thinking is not None else frozenset()
        grammars = grammar.Grammars(tokenizer, vocab_size, shown_special_ids=tool_markers | reasoning_markers) \
            if grammar.available() else None
        return cls(parser, thinking, grammars, tool_calls.renders_tools(template),
                   tool_calls.arguments_as_mapping(template),
                   lambda ids: tokenizer.decode(ids[-16:], skip_special_tokens=False), tool_markers, reasoning_markers)


def support_of(served) -> ChatSupport:
    """The served model's ChatSupport (``ServedModel.chat``), built from its tokenizer when not given."""
    if served.chat is None:
        if served.tokenizer is not None:
            served.chat = ChatSupport.build(served.tokenizer, served.vocab_size)
        else:  # a test's stand-in model: no template to read, no grammar
            served.chat = ChatSupport(tool_calls.tool_parser("hermes"), None, None, False, False, lambda ids: "")
    return served.chat


@dataclass
class ChatOptions:
    support: ChatSupport
    messages: list  # as the template gets them
    template_kwargs: dict
    tools: dict = field(default_factory=dict)  # name -> parameters schema
    tool_choice: str = "auto"  # "none" | "auto" | "required" | "function" (named)
    tool_name: Optional[str] = None
    parallel: bool = True
    response_format: Optional[dict] = None  # {"type": "json_object" | "json_schema", ...}
    inside_reasoning: bool = False  # the prompt leaves a reasoning block open

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none" and self.response_format is None

    def prompt_done(self, prompt_ids: list) -> None:
        """Note where the prompt leaves the model: inside a reasoning block or not."""
        r = self.support.reasoning
        self.inside_reasoning = r is not None and r.starts_inside(self.support.tail(prompt_ids))

    @property
    def forces_output(self) -> bool:
        """Whether a grammar shapes the output (``response_format``, a required or named tool call)."""
        return self.response_format is not None or self.tool_choice in ("required", "function")

    def shown_special_ids(self) -> frozenset:
        """The special tokens this request's text keeps (``SamplingParams.shown_special_ids``): the markers its
        parsers read; under a grammar all the markers the grammars see as text, so that the text and the grammar
        agree."""
        s = self.support
        if self.forces_output:
            return s.tool_markers | s.reasoning_markers
        return (s.tool_markers if self.parses_tools else frozenset()) | s.reasoning_markers

    def constraint(self) -> Optional[Callable]:
        """The grammar this request's output must follow (a ``TokenConstraint`` factory), or None. APIError 400
        naming the field when it cannot be built; 503 when the compiler stays busy."""
        if not self.forces_output:
            return None
        param = "response_format" if self.response_format is not None else "tool_choice"
        grammars = self.support.grammars
        if grammars is None:
            raise APIError(400, f"'{param}' needs constrained decoding, which needs the xgrammar package on the "
                                "server (pip install 'hetmoe[serve]')", param=param, code="unsupported_parameter")
        after = self.support.reasoning.end if self.inside_reasoning else None
        try:
            if self.response_format is not None:
                if self.response_format["type"] == "json_object":
                    return grammars.json_schema({"type": "object"}, after=after)
                param = "response_format.json_schema.schema"
                return grammars.json_schema(self.response_format["schema"], after=after)
            param = "tools"
            fmt = self.support.parser.grammar(self.tools, self.tool_name, self.parallel)
            return grammars.structural_tag(fmt, after=after)
        except grammar.GrammarBusy as e:
            raise APIError(503, f"{e}; retry shortly", type="server_error", code="server_busy",
                           headers={"Retry-After": "1"}) from None
        except grammar.GrammarError as e:
            raise _bad(param, f"the grammar cannot be built: {e}", "invalid_schema") from None


# ---------------------------------------------------------------------------------------------- requests

def message_fields(m: dict, i: int) -> dict:
    """The tool-related fields of messages[i] (assistant ``tool_calls`` and ``reasoning_content``, a tool
    message's ``tool_call_id``), checked; arguments stay JSON text."""
    out: dict = {}
    role, where = m.get("role"), f"messages[{i}]"
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is None:
            raise _missing(f"{where}.tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"{where}.tool_call_id", f"expected a non-empty string, got {shown(call_id)}")
        out["tool_call_id"] = call_id
    elif m.get("tool_call_id") is not None:
        raise _bad(f"{where}.tool_call_id", "only a message with role 'tool' answers a tool call")
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise _bad(f"{where}.tool_calls", "only an assistant message makes tool calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise _bad(f"{where}.tool_calls", f"expected an array, got {shown(calls)}")
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if m.get("function_call") is not None:
        raise _bad(f"{where}.function_call", "the deprecated function_call is not supported; use tool_calls")
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None:
        if role != "assistant" or not isinstance(reasoning, str):
            raise _bad(f"{where}.reasoning_content", "expected a string, on an assistant message")
        out["reasoning_content"] = reasoning
    return out


def _history_call(call: Any, where: str) -> dict:
    if not isinstance(call, dict):
        raise _bad(where, f"expected an object, got {shown(call)}")
    if call.get("type", "function") != "function":
        raise _bad(f"{where}.type", f"only 'function' tool calls are supported, got {shown(call.get('type'))}")
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        raise _missing(f"{where}.id") if call_id is None else _bad(f"{where}.id", "expected a non-empty string")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise _missing(f"{where}.function") if fn is None else _bad(f"{where}.function", "expected an object")
    name, args = fn.get("name"), fn.get("arguments")
    if not isinstance(name, str) or not name:
        raise _missing(f"{where}.function.name") if name is None else _bad(f"{where}.function.name",
                                                                          "expected a non-empty string")
    if isinstance(args, dict):  # some clients send the object itself
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise _missing(f"{where}.function.arguments") if args is None else _bad(
            f"{where}.function.arguments", f"expected a string of JSON, got {shown(args)}")
    try:
        value = json.loads(args)
    except ValueError:
        raise _bad(f"{where}.function.arguments", f"not JSON: {shown(args)}") from None
    if not isinstance(value, dict):
        raise _bad(f"{where}.function.arguments", f"expected a JSON object, got {shown(args)}")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _check_history(messages: list) -> None:
    """Each tool message answers a call of the assistant message just before (tool messages in between)."""
    open_ids: set = set()
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if m["tool_call_id"] not in open_ids:
                raise _bad(f"messages[{i}].tool_call_id", f"{shown(m['tool_call_id'])} answers no tool call of the "
                           "assistant message before it")
            open_ids.discard(m["tool_call_id"])
        else:
            open_ids = {c["id"] for c in m.get("tool_calls") or ()}


def _tools(body: dict) -> tuple:
    """(name -> parameters schema, the tools as the template gets them)."""
    tools = body.get("tools")
    if tools is None:
        return {}, []
    if not isinstance(tools, list):
        raise APIError(400, f"Invalid type for 'tools': expected an array, got {shown(tools)}", param="tools",
                       code="invalid_type")
    if len(tools) > MAX_TOOLS:
        raise _bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    schemas, listed = {}, []
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise _bad(where, f"expected an object, got {shown(tool)}")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f"only 'function' tools are supported, got {shown(tool.get('type'))}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _missing(f"{where}.function") if fn is None else _bad(f"{where}.function", "expected an object")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise _missing(f"{where}.function.name") if name is None else _bad(
                f"{where}.function.name", f"expected 1 to 128 letters, digits, '_', '-', '.' or ':', got {shown(name)}")
        if name in schemas:
            raise _bad(f"{where}.function.name", f"two tools are named {shown(name)}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad(f"{where}.function.parameters", f"expected a JSON schema object, got {shown(params)}")
        if params.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters", "a tool's parameters schema must describe an object")
        try:
            grammar.check_source(params)
        except grammar.GrammarError as e:
            raise _bad(f"{where}.function.parameters", str(e), "invalid_schema") from None
        for key in ("description",):
            if fn.get(key) is not None and not isinstance(fn[key], str):
                raise _bad(f"{where}.function.{key}", "expected a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", "expected a boolean")
        schemas[name] = params
        listed.append({"type": "function", "function": {k: v for k, v in (
            ("name", name), ("description", fn.get("description")), ("parameters", params)) if v is not None}})
    return schemas, listed


def _tool_choice(body: dict, tools: dict) -> tuple:
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if not tools:
        raise _bad("tool_choice", "'tool_choice' is only allowed when 'tools' are specified")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"expected 'none', 'auto', 'required' or a named function, got {shown(choice)}")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"),
                                                                                          dict):
        raise _bad("tool_choice", 'expected {"type": "function", "function": {"name": ...}}, got ' + shown(choice))
    name = choice["function"].get("name")
    if name not in tools:
        raise _bad("tool_choice.function.name", f"no tool is named {shown(name)} (tools: "
                   f"{', '.join(sorted(tools))[:200]})")
    return "function", name


def _response_format(body: dict) -> Optional[dict]:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, f"Invalid type for 'response_format': expected an object, got {shown(fmt)}",
                       param="response_format", code="invalid_type")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise _bad("response_format.type", f"expected 'text', 'json_object' or 'json_schema', got {shown(kind)}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _missing("response_format.json_schema") if spec is None else _bad("response_format.json_schema",
                                                                                "expected an object")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", name)):
        raise _bad("response_format.json_schema.name", f"expected 1 to 64 letters, digits, '_' or '-', got "
                                                       f"{shown(name)}")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise _bad("response_format.json_schema.schema", f"expected a JSON schema object, got {shown(schema)}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad("response_format.json_schema.strict", "expected a boolean")
    return {"type": "json_schema", "schema": schema}


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    out = {}
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise APIError(400, f"Invalid type for 'chat_template_kwargs': expected an object, got {shown(kwargs)}",
                           param="chat_template_kwargs", code="invalid_type")
        for key in kwargs:
            if key in _RESERVED_KWARGS or not key.isidentifier():
                raise _bad(f"chat_template_kwargs.{key}", "this name is set by the server, or is not a name")
        out.update(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise _bad("reasoning_effort", f"expected one of {', '.join(REASONING_EFFORTS)}, got {shown(effort)}")
        out.setdefault("reasoning_effort", effort)
    return out


def parse(body: dict, messages: list, support: ChatSupport) -> ChatOptions:
    """The chat options of a request whose ``messages`` were checked (``message_fields`` included)."""
    tools, listed = _tools(body)
    choice, name = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(400, f"Invalid type for 'parallel_tool_calls': expected a boolean, got {shown(parallel)}",
                       param="parallel_tool_calls", code="invalid_type")
    fmt = _response_format(body)
    if fmt is not None and choice in ("required", "function"):
        raise _bad("response_format", "cannot be combined with a 'tool_choice' that forces a tool call")
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise APIError(400, f"'{legacy}' is not supported by this server (deprecated by OpenAI): use 'tools' and "
                                "'tool_choice'", param=legacy, code="unsupported_parameter")
    _check_history(messages)
    kwargs = _template_kwargs(body)
    shown_tools = listed if choice != "none" else []
    rendered = _for_template(messages, shown_tools, support)
    if shown_tools and support.renders_tools:
        kwargs["tools"] = shown_tools
    return ChatOptions(support, rendered, kwargs, tools, choice, name, parallel is not False, fmt)


def _for_template(messages: list, tools: list, support: ChatSupport) -> list:
    """The messages as the chat template gets them: calls' arguments as mappings where the template iterates
    them; for a template that renders no tools, the tools described in a system message and the calls written
    into the assistant's text in the parser's syntax."""
    out = [dict(m) for m in messages]
    for m in out:  # (a template that renders no tools gets the calls written into the text, below)
        if m.get("tool_calls") and support.args_mapping and support.renders_tools:
            m["tool_calls"] = [copy.deepcopy(c) for c in m["tool_calls"]]
            for c in m["tool_calls"]:
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    if support.renders_tools:
        return tool_calls.harmony.to_template(out) if support.parser.name == "harmony" else out
    parser = support.parser
    for m in out:
        calls = m.pop("tool_calls", None)
        if calls:
            written = parser.format_calls([tool_calls.ToolCall(c["id"], c["function"]["name"],
                                                               c["function"]["arguments"]) for c in calls])
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + written
        m.pop("tool_call_id", None)
        m.pop("reasoning_content", None)
    if tools:
        example = parser.format_calls([tool_calls.ToolCall("call_0", "NAME", '{"ARGUMENT": "VALUE"}')])
        text = ("You can call these tools (JSON schemas of their arguments):\n"
                + "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
                + f"\n\nTo call a tool, answer with:\n{example}")
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


# ---------------------------------------------------------------------------------------------- responses

class ChatOutput:
    """One choice's output turned into the chat message: reasoning, content and tool calls, streamed as deltas
    (``push`` / ``finish``: dicts for ``choices[0].delta``) or whole (``message``)."""

    def __init__(self, options: ChatOptions):
        self.options = options
        support = options.support
        self.reasoning = support.reasoning.stream(options.inside_reasoning) if support.reasoning else None
        self.tools = support.parser.stream(options.tools) if options.parses_tools else None
        self.failed = False

    @property
    def called(self) -> bool:
        return bool(self.tools is not None and self.tools.calls)

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.called and reason == "stop" else reason

    def push(self, piece: str) -> list:
        parts = self.reasoning.push(piece) if self.reasoning else [("content", piece)]
        return self._deltas(parts, final=False)

    def finish(self) -> list:
        parts = self.reasoning.finish() if self.reasoning else []
        return self._deltas(parts, final=True)

    def _deltas(self, parts: list, final: bool) -> list:
        out = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self.tools is None:
                out.append({"content": text})
            else:
                out += [_delta(d) for d in self.tools.push(text) if self._shown(d)]
        if final and self.tools is not None:
            out += [_delta(d) for d in self.tools.finish() if self._shown(d)]
            self.failed = self.tools.failed
        return _merge(out)

    def _shown(self, d: tool_calls.Delta) -> bool:
        return d.kind == "content" or self.options.parallel or d.index == 0

    def message(self, text: str, finish: str) -> tuple:
        """(the choice's message, its finish_reason) for a whole output."""
        reasoning, content = None, text
        if self.options.support.reasoning is not None:
            reasoning, content = self.options.support.reasoning.split(text, self.options.inside_reasoning)
        calls = []
        if self.options.parses_tools:
            parsed = self.options.support.parser.parse(content, self.options.tools)
            content, calls, self.failed = parsed.content, parsed.calls, parsed.failed
            if not self.options.parallel:
                calls = calls[:1]
        message = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, ("tool_calls" if calls and finish == "stop" else finish)


def _delta(d: tool_calls.Delta) -> dict:
    if d.kind == "content":
        return {"content": d.text}
    if d.kind == "call":
        return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function",
                                "function": {"name": d.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]}


def _merge(deltas: list) -> list:
    """Adjacent content (or reasoning) deltas joined: one chunk per kind of change."""
    out: list = []
    for d in deltas:
        if not any(d.values()) and "tool_calls" not in d:
            continue
        prev = out[-1] if out else None
        key = next(iter(d))
        if prev is not None and key in ("content", "reasoning_content") and set(prev) == {key}:
            prev[key] += d[key]
        else:
            out.append(d)
    return out
