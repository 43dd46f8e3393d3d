"""Tool calls in a model's output, in the syntax of its family; the grammar that forces them; and how a call is
written back into a prompt.

    parser = tool_parser("auto", template_text)      # the family the chat template speaks (or a named one)
    out = parser.parse(text, tools)                  # ToolOutput(content, calls, failed)
    stream = parser.stream(tools)                    # streamed: push(piece) / finish() -> [Delta]
    fmt = parser.grammar(tools, name, parallel)      # xgrammar structural-tag format forcing calls
    parser.format_call(call)                         # a call as the model writes it

``tools`` maps each tool's name to its JSON schema (``parameters``): the XML families read the parameter types
from it (``<parameter=n>3</parameter>`` is the number 3 when the schema says so, else the string "3").

A call is a ``ToolCall(id, name, arguments)``, ``arguments`` JSON text of an object, as OpenAI's
``message.tool_calls[i].function.arguments``. The families:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     Qwen2.5/3, Hermes, ChatML
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=p>\\nv\\n</parameter>\\n</function>\\n</tool_call>
    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                  DeepSeek-V3, R1
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...     V3.1+
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
                  {...}<|tool_call_end|><|tool_calls_section_end|>
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}
    glm45         <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>    GLM-4.5/4.6
    glm47         the same without the newlines                                         GLM-4.7

Text before the first call is content; so is text after the calls. A region that starts like a call but does not
parse (broken JSON, a missing end marker, cut by max_tokens) is returned as content, and ``failed`` says so (the
server counts it); calls read whole before the broken one stay calls. Streamed, each call's name is sent once
known, then its arguments in pieces as they are generated (JSON arguments as the model writes them; the XML
families' one parameter at a time); the pieces concatenate to the arguments ``parse`` returns for the same text.
A streamed call that breaks after its name was sent stays a call (the pieces sent cannot be taken back), with
``failed`` set.

Markers that are special tokens (Kimi's, Mistral's ``[TOOL_CALLS]``) reach the parser only when the decoder keeps
special tokens in the text.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Optional

PARSERS = ("hermes", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "mistral", "glm45", "glm47")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolOutput:
    content: str
    calls: list = field(default_factory=list)  # [ToolCall]
    failed: bool = False  # something looked like a call but did not parse (it is in content)


@dataclass
class Delta:
    """A streamed change: ``kind`` "content" (``text``), "call" (call ``index`` begins: ``id``, ``name``) or
    "args" (``text`` more of call ``index``'s arguments)."""

    kind: str
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


class Malformed(ValueError):
    """The text after a call marker is not a call in the family's syntax."""


@dataclass
class _Partial:
    """A call as far as it has been generated: ``args`` is a prefix of the final arguments that no later text
    changes (all of them once ``done``)."""

    name: Optional[str] = None
    args: str = ""
    done: bool = False
    id: Optional[str] = None  # the model's own id (Kimi's functions.f:0)
    end: int = 0  # once done: where the call's text ends in the region


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _expect(text: str, pos: int, token: str, final: bool) -> Optional[int]:
    """The position after ``token`` at ``pos``; None when the text ends inside it (not final); Malformed otherwise."""
    if text.startswith(token, pos):
        return pos + len(token)
    if not final and token.startswith(text[pos:]):
        return None
    raise Malformed(f"expected {token!r} at {text[pos:pos + 20]!r}")


_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")


class _JsonScanner:
    """Where a JSON value that starts at a given position ends, resumable: a long value arriving in many pieces is
    scanned once, not once per piece."""

    def __init__(self):
        self._state: dict = {}  # start -> (position reached, depth, in a string, after a backslash)

    def end(self, text: str, start: int, final: bool) -> Optional[int]:
        """The position after the value at ``start`` (no leading whitespace), or None when the text ends first."""
        if start >= len(text):
            return None
        c = text[start]
        if c not in "{[\"":
            m = _NUMBER.match(text, start)
            for word in ("true", "false", "null"):
                if text.startswith(word, start):
                    return start + len(word)
                if not final and word.startswith(text[start:]):
                    return None
            if m is None:
                raise Malformed(f"not a JSON value at {text[start:start + 20]!r}")
            return None if m.end() == len(text) and not final else m.end()
        pos, depth, in_str, esc = self._state.get(start, (start, 0, False, False))
        while pos < len(text):
            ch = text[pos]
            pos += 1
            if in_str:
                if esc:
                    esc = False
                elif ch == "\\":
                    esc = True
                elif ch == '"':
                    in_str = False
                    if depth == 0:
                        return pos
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return pos
        self._state[start] = (pos, depth, in_str, esc)
        return None


def _json_object_text(raw: str) -> str:
    """``raw`` when it is the JSON text of an object; Malformed otherwise."""
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise Malformed(f"arguments are not JSON: {e}") from None
    if not isinstance(value, dict):
        raise Malformed("arguments are not a JSON object")
    return raw


class _Envelope:
    """``{"name": "f", "arguments": {...}}`` (or "parameters"), read as it arrives: the name once its string is
    complete, the arguments as they are scanned (when they are an object; a JSON string holding the object is
    accepted whole)."""

    ARGS = ("arguments", "parameters")

    def __init__(self, scanner: _JsonScanner):
        self.scanner = scanner

    def read(self, text: str, pos: int, final: bool) -> tuple:
        """-> (_Partial, position after the closing brace or None)."""
        call = _Partial()
        p = _expect(text, pos, "{", final)
        if p is None:
            return call, None
        first = True
        while True:
            p = _skip_ws(text, p)
            if p >= len(text):
                if final:
                    raise Malformed("the call ends inside its JSON")
                return call, None
            if text[p] == "}":
                if call.name is None:
                    raise Malformed("a call without a name")
                call.args = call.args or "{}"
                call.done = True
                return call, p + 1
            if not first:
                p = _expect(text, p, ",", final)
                if p is None:
                    return call, None
                p = _skip_ws(text, p)
            first = False
            key_end = self.scanner.end(text, p, final) if p < len(text) and text[p] == '"' else None
            if key_end is None:
                if p < len(text) and text[p] != '"':
                    raise Malformed("a JSON key expected")
                return call, None
            key = json.loads(text[p:key_end])
            p = _skip_ws(text, key_end)
            p = _expect(text, p, ":", final) if p < len(text) else None
            if p is None:
                if final:
                    raise Malformed("the call ends inside its JSON")
                return call, None
            p = _skip_ws(text, p)
            end = self.scanner.end(text, p, final)
            if key == "name":
                if end is None:
                    return call, None
                name = json.loads(text[p:end])
                if not isinstance(name, str) or not name:
                    raise Malformed("the name is not a string")
                call.name = name
            elif key in self.ARGS:
                if p < len(text) and text[p] == "{":
                    call.args = text[p:end if end is not None else len(text)]
                if end is None:
                    return call, None
                if text[p] == '"':  # arguments written as a JSON string holding the object
                    call.args = _json_object_text(json.loads(text[p:end]))
                else:
                    call.args = _json_object_text(text[p:end])
            elif end is None:
                return call, None
            p = end


# ---------------------------------------------------------------------------------------------- the families

class ToolParser:
    """One family's syntax (subclasses). ``start`` is the text that opens the tool-call region."""

    name = ""
    start = ""

    def calls(self, region: str, tools: dict, final: bool, scanner: _JsonScanner) -> tuple:
        """The calls in ``region`` (text from ``start`` on) -> ([_Partial], end): ``end`` is where the calls end
        (text after it is content), None while more calls may follow. Malformed when the region is not (the
        beginning of) calls in this syntax, its ``calls`` the ones read before; with ``final`` the region is
        complete."""
        out: list = []
        try:
            end = self._calls(region, tools, final, scanner, out)
        except Malformed as e:
            e.calls = out
            raise
        return out, end

    def _calls(self, region: str, tools: dict, final: bool, scanner: _JsonScanner, out: list) -> Optional[int]:
        """``calls``: appends to ``out`` as it reads, returns ``end``."""
        raise NotImplementedError

    def format_call(self, call: ToolCall, index: int = 0) -> str:
        raise NotImplementedError

    def tool_format(self, name: str, schema: dict) -> dict:
        """The structural tag of one call to ``name``."""
        raise NotImplementedError

    def grammar(self, tools: dict, name: Optional[str] = None, parallel: bool = True) -> dict:
        """An xgrammar structural-tag format for output that is only tool calls, at least one: to any of
        ``tools`` or, given ``name``, to that one; one call only unless ``parallel``."""
        chosen = {name: tools[name]} if name is not None else tools
        tags = [self.tool_format(n, s) for n, s in chosen.items()]
        return {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
                "stop_after_first": not parallel}

    separator = "\n"

    def new_id(self, index: int) -> str:
        return new_call_id()

    def parse(self, text: str, tools: dict) -> ToolOutput:
        """Content and calls of a whole output; a region that does not parse whole is content, ``failed``."""
        at = text.find(self.start)
        if at < 0:
            return ToolOutput(text)
        region, failed = text[at:], False
        try:
            partials, end = self.calls(region, tools, True, _JsonScanner())
        except Malformed as e:
            partials, end, failed = e.calls, None, True
        done = [p for p in partials if p.done]
        if len(done) < len(partials) or failed:  # the calls read whole stay calls; the broken rest is content
            failed, end = True, done[-1].end if done else 0
        rest = region[end:] if end is not None else ""
        content = text[:at] + (rest if rest.strip() else "")
        calls = [ToolCall(p.id or self.new_id(i), p.name, p.args) for i, p in enumerate(done)]
        return ToolOutput(content, calls, failed)

    def stream(self, tools: dict) -> "ToolStream":
        return ToolStream(self, tools)


def _args_format(schema: dict, style: str = "json") -> dict:
    """The structural tag of a call's arguments: ``schema`` in the family's style, whitespace runs of at most one
    character (a small model left free to indent loops in whitespace)."""
    return {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": 1}


def _schema_type(schema: dict, param: str):
    props = schema.get("properties") if isinstance(schema, dict) else None
    spec = props.get(param) if isinstance(props, dict) else None
    return spec.get("type") if isinstance(spec, dict) else None


def _xml_value(raw: str, kind) -> str:
    """The JSON text of an XML parameter's value: a string unless the schema's type says otherwise and the text
    parses as that."""
    if kind == "string" or kind is None:
        return json.dumps(raw, ensure_ascii=False)
    try:
        value = json.loads(raw)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)
    ok = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
          "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    if isinstance(kind, str) and kind in ok and not ok[kind](value):
        return json.dumps(raw, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _xml_args(params: list, done: bool) -> str:
    """Arguments built from (key, JSON value) pairs: a prefix that only grows as parameters complete."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in params)
    if done:
        return "{" + body + "}"
    return "{" + body if params else ""


class Hermes(ToolParser):
    name, start = "hermes", "<tool_call>"
    open, close = "<tool_call>", "</tool_call>"

    def _calls(self, region, tools, final, scanner, out):
        pos, envelope = 0, _Envelope(scanner)
        while True:
            pos = _skip_ws(region, pos)
            if pos >= len(region):
                return (pos if final else None)
            if not region.startswith(self.open, pos):
                if not final and self.open.startswith(region[pos:]):
                    return None
                return pos  # text after the calls
            pos = _skip_ws(region, pos + len(self.open))
            if pos >= len(region):
                if final:
                    raise Malformed("an empty call")
                out.append(_Partial())
                return None
            call, end = envelope.read(region, pos, final)
            out.append(call)
            if end is None:
                return None
            call.done = False
            p = _skip_ws(region, end)
            p = _expect(region, p, self.close, final) if p < len(region) else None
            if p is None:
                if final:
                    raise Malformed(f"no {self.close}")
                return None
            call.done, call.end = True, p
            pos = p

    def format_call(self, call, index=0):
        return f'{self.open}\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": ' \
               f'{call.arguments}}}\n{self.close}'

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{self.open}\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": _args_format(schema), "end": f"}}\n{self.close}"}


class Qwen3Coder(ToolParser):
    name, start = "qwen3_coder", "<tool_call>"
    _PARAM = "<parameter="

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            pos = _skip_ws(region, pos)
            if pos >= len(region):
                return (pos if final else None)
            if not region.startswith("<tool_call>", pos):
                if not final and "<tool_call>".startswith(region[pos:]):
                    return None
                return pos
            call = _Partial()
            out.append(call)
            p = _expect(region, _skip_ws(region, pos + len("<tool_call>")), "<function=", final)
            if p is None:
                return None
            gt = region.find(">", p)
            if gt < 0:
                if final or "\n" in region[p:]:
                    raise Malformed("an unterminated <function=")
                return None
            call.name = region[p:gt].strip()
            if not call.name:
                raise Malformed("a call without a name")
            schema, params, p = tools.get(call.name) or {}, [], gt + 1
            while True:
                p = _skip_ws(region, p)
                if region.startswith("</function>", p):
                    call.args = _xml_args(params, True)
                    p = _skip_ws(region, p + len("</function>"))
                    p = _expect(region, p, "</tool_call>", final) if p < len(region) else None
                    if p is None:
                        if final:
                            raise Malformed("no </tool_call>")
                        return None
                    call.done, call.end = True, p
                    break
                if p >= len(region) or (not final and "</function>".startswith(region[p:])):
                    if final:
                        raise Malformed("no </function>")
                    call.args = _xml_args(params, False)
                    return None
                q = _expect(region, p, self._PARAM, final)
                if q is None:
                    call.args = _xml_args(params, False)
                    return None
                gt = region.find(">", q)
                close = region.find("</parameter>", gt + 1) if gt >= 0 else -1
                if close < 0:
                    if final:
                        raise Malformed("an unterminated <parameter=")
                    call.args = _xml_args(params, False)
                    return None
                key, raw = region[q:gt].strip(), region[gt + 1:close]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                params.append((key, _xml_value(raw, _schema_type(schema, key))))
                p = close + len("</parameter>")
            pos = p

    def format_call(self, call, index=0):
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                         "</parameter>\n" for k, v in json.loads(call.arguments).items())
        return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
                "content": _args_format(schema, "qwen_xml"),
                "end": "</function>\n</tool_call>"}


class Glm45(ToolParser):
    name, start = "glm45", "<tool_call>"
    newline = "\n"

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            pos = _skip_ws(region, pos)
            if pos >= len(region):
                return (pos if final else None)
            if not region.startswith("<tool_call>", pos):
                if not final and "<tool_call>".startswith(region[pos:]):
                    return None
                return pos
            call = _Partial()
            out.append(call)
            p = pos + len("<tool_call>")
            ends = [i for i in (region.find("\n", p), region.find("<arg_key>", p), region.find("</tool_call>", p))
                    if i >= 0]
            if not ends:
                if final:
                    raise Malformed("an unterminated <tool_call>")
                return None
            call.name = region[p:min(ends)].strip()
            if not call.name:
                raise Malformed("a call without a name")
            schema, params, p = tools.get(call.name) or {}, [], min(ends)
            while True:
                p = _skip_ws(region, p)
                if region.startswith("</tool_call>", p):
                    call.args, call.done = _xml_args(params, True), True
                    p = call.end = p + len("</tool_call>")
                    break
                if p >= len(region) or (not final and "</tool_call>".startswith(region[p:])):
                    if final:
                        raise Malformed("no </tool_call>")
                    call.args = _xml_args(params, False)
                    return None
                q = _expect(region, p, "<arg_key>", final)
                k_end = region.find("</arg_key>", q) if q is not None else -1
                v_at = _skip_ws(region, k_end + len("</arg_key>")) if k_end >= 0 else -1
                v = _expect(region, v_at, "<arg_value>", final) if 0 <= v_at < len(region) else None
                v_end = region.find("</arg_value>", v) if v is not None else -1
                if v_end < 0:
                    if final:
                        raise Malformed("an unterminated <arg_key>/<arg_value>")
                    call.args = _xml_args(params, False)
                    return None
                key = region[q:k_end].strip()
                params.append((key, _xml_value(region[v:v_end], _schema_type(schema, key))))
                p = v_end + len("</arg_value>")
            pos = p

    def format_call(self, call, index=0):
        nl = self.newline
        args = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>"
                       f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</arg_value>{nl}"
                       for k, v in json.loads(call.arguments).items())
        return f"<tool_call>{call.name}{nl}{args}</tool_call>"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f"<tool_call>{name}{self.newline}",
                "content": _args_format(schema, "glm_xml"), "end": "</tool_call>"}


class Glm47(Glm45):
    name, newline = "glm47", ""


class _Marked(ToolParser):
    """Families whose calls sit between marker strings: ``begin`` (call_begin head head_end args args_end
    call_end)* ``end``."""

    begin = end = call_begin = head_end = call_end = ""
    args_end = ""  # text between the arguments and call_end (DeepSeek-V3's closing fence)

    def head(self, head: str) -> tuple:
        """(name, the model's own id or None) from the text between call_begin and head_end."""
        return head.strip(), None

    def _calls(self, region, tools, final, scanner, out):
        pos = _expect(region, 0, self.begin, final)
        while pos is not None:
            pos = _skip_ws(region, pos)
            if pos >= len(region):
                return (pos if final else None)
            if region.startswith(self.end, pos):
                return pos + len(self.end)
            if not region.startswith(self.call_begin, pos):
                if not final and (self.call_begin.startswith(region[pos:]) or self.end.startswith(region[pos:])):
                    return None
                raise Malformed(f"expected {self.call_begin!r}")
            call = _Partial()
            out.append(call)
            p = pos + len(self.call_begin)
            h = region.find(self.head_end, p)
            if h < 0:
                if final:
                    raise Malformed(f"no {self.head_end!r}")
                return None
            call.name, call.id = self.head(region[p:h])
            if not call.name:
                raise Malformed("a call without a name")
            a = _skip_ws(region, h + len(self.head_end))
            if a >= len(region):
                if final:
                    raise Malformed("a call without arguments")
                return None
            end = scanner.end(region, a, final)
            if region[a] == "{":
                call.args = region[a:end if end is not None else len(region)]
            if end is None:
                if final:
                    raise Malformed("the arguments end early")
                return None
            call.args = _json_object_text(region[a:end])
            p = end
            for token in (self.args_end.strip(), self.call_end):  # whitespace around the fence is free
                if token:
                    p = _skip_ws(region, p)
                    p = _expect(region, p, token, final) if p < len(region) else None
                    if p is None:
                        if final:
                            raise Malformed(f"no {token!r}")
                        return None
            call.done, call.end = True, p
            pos = p
        return None

    def format_call(self, call, index=0):
        return self.call_begin + self.head_text(call.name, index) + self.head_end + call.arguments + \
            self.args_end + self.call_end

    def head_text(self, name: str, index: int) -> str:
        return name

    def wrap(self, text: str) -> str:
        return self.begin + text + self.end

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": self.call_begin + self.head_text(name, 0) + self.head_end,
                "content": _args_format(schema), "end": self.args_end + self.call_end}

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": self.begin, "content": super().grammar(tools, name, parallel),
                "end": self.end}


_DS = {k: f"<｜{v}｜>" for k, v in (("calls_begin", "tool▁calls▁begin"), ("calls_end", "tool▁calls▁end"),
                                      ("call_begin", "tool▁call▁begin"), ("call_end", "tool▁call▁end"),
                                      ("sep", "tool▁sep"))}


class DeepSeekV31(_Marked):
    name = "deepseek_v31"
    start = begin = _DS["calls_begin"]
    end, call_begin, head_end, call_end = _DS["calls_end"], _DS["call_begin"], _DS["sep"], _DS["call_end"]
    separator = ""


class DeepSeekV3(_Marked):
    name = "deepseek_v3"
    start = begin = _DS["calls_begin"]
    end, call_begin, call_end = _DS["calls_end"], _DS["call_begin"], _DS["call_end"]
    head_end, args_end = "\n```json\n", "\n```"

    def head(self, head):
        kind, sep, name = head.partition(_DS["sep"])
        return (name.strip() if sep else ""), None

    def head_text(self, name, index):
        return f"function{_DS['sep']}{name}"


class KimiK2(_Marked):
    name = "kimi_k2"
    start = begin = "<|tool_calls_section_begin|>"
    end, call_begin = "<|tool_calls_section_end|>", "<|tool_call_begin|>"
    head_end, call_end = "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    separator = ""

    def head(self, head):
        head = head.strip()  # functions.get_weather:0 -> the name, and the whole as the call's id
        name = head.split(".", 1)[1] if head.startswith("functions.") else head
        return name.rsplit(":", 1)[0] if ":" in name else name, head

    def head_text(self, name, index):
        return f"functions.{name}:{index}"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f"{self.call_begin}functions.{name}:",
                "content": {"type": "sequence", "elements": [
                    {"type": "regex", "pattern": "[0-9]+"}, {"type": "const_string", "value": self.head_end},
                    _args_format(schema)]}, "end": self.call_end}


class Mistral(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"
    separator = ", "

    def new_id(self, index):  # Mistral's templates refuse ids that are not 9 letters or digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _calls(self, region, tools, final, scanner, out):
        envelope = _Envelope(scanner)
        pos = _skip_ws(region, len(self.start))
        if pos >= len(region):
            if final:
                raise Malformed("nothing after [TOOL_CALLS]")
            return None
        if region[pos] == "[":  # [{"name": ..., "arguments": ...}, ...]
            pos += 1
            while True:
                pos = _skip_ws(region, pos)
                if pos >= len(region):
                    if final:
                        raise Malformed("the list of calls ends early")
                    return None
                if region[pos] == "]" and out:
                    return pos + 1
                if out:
                    pos = _expect(region, pos, ",", final)
                    pos = _skip_ws(region, pos) if pos is not None else None
                    if pos is None or pos >= len(region):
                        if final:
                            raise Malformed("the list of calls ends early")
                        return None
                call, end = envelope.read(region, pos, final)
                out.append(call)
                if end is None:
                    return None
                pos = call.end = end
        while True:  # name[ARGS]{...}, each call after its own [TOOL_CALLS]
            a = region.find("[ARGS]", pos)
            if a < 0:
                if final or not re.fullmatch(r"[\w.\-]*(\[[A-Z]*)?", region[pos:]):
                    raise Malformed("no [ARGS]")
                return None
            call = _Partial(name=region[pos:a].strip())
            if not call.name:
                raise Malformed("a call without a name")
            out.append(call)
            s = _skip_ws(region, a + len("[ARGS]"))
            end = scanner.end(region, s, final) if s < len(region) else None
            if s < len(region) and region[s] == "{":
                call.args = region[s:end if end is not None else len(region)]
            if end is None:
                if final:
                    raise Malformed("the arguments end early")
                return None
            call.args, call.done, call.end = _json_object_text(region[s:end]), True, end
            pos = _skip_ws(region, end)
            if region.startswith(self.start, pos):
                pos += len(self.start)
            elif not final and self.start.startswith(region[pos:]):
                return None
            else:
                return pos

    def format_call(self, call, index=0):
        return f'{self.start}[{{"name": {json.dumps(call.name)}, "arguments": {call.arguments}}}]'

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "arguments": ',
                "content": _args_format(schema), "end": "}"}

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": self.start + "[", "content": super().grammar(tools, name, parallel),
                "end": "]"}


_FAMILIES = {c.name: c for c in (Hermes, Qwen3Coder, DeepSeekV3, DeepSeekV31, KimiK2, Mistral, Glm45, Glm47)}


def detect(template: Optional[str]) -> str:
    """The family a chat template writes tool calls in (from the markers it renders); "hermes" when it renders
    none (the format the server then describes to the model itself)."""
    t = template or ""
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if _DS["calls_begin"] in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<arg_key>" in t:
        newline = r"(\n|\\n)"  # GLM-4.5/4.6 write a newline after the name and between the arguments
        after_name = re.search(r"<tool_call>\{\{[^}]*\}\}" + newline, t)
        return "glm45" if after_name or re.search(newline + r"\s*<arg_key>", t) else "glm47"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    return "hermes"


def tool_parser(name: Optional[str], template: Optional[str] = None) -> ToolParser:
    """The parser ``name`` (one of PARSERS), or with None / "auto" the one ``template`` speaks (``detect``)."""
    if name in (None, "auto"):
        name = detect(template)
    if name not in _FAMILIES:
        raise ValueError(f"unknown tool-call parser {name!r}; expected auto or one of {', '.join(PARSERS)}")
    return _FAMILIES[name]()


def renders_tools(template: Optional[str]) -> bool:
    """Whether a chat template shows the model its tools (it reads the ``tools`` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def arguments_as_mapping(template: Optional[str]) -> bool:
    """Whether a template iterates over a call's arguments (GLM, Qwen3-Coder: ``arguments|items``), so the
    history's calls must carry them as a mapping rather than the JSON text OpenAI sends."""
    return bool(template) and re.search(r"arguments\s*(\|\s*items|\.items\(\))", template) is not None


class ToolStream:
    """Streamed tool-call parsing of one output: ``push(piece)`` / ``finish()`` -> [Delta]."""

    def __init__(self, parser: ToolParser, tools: dict):
        self.parser, self.tools = parser, tools
        self.buffer = ""  # text not yet sent as content (before the region) or the region itself
        self.in_region = False
        self.after = False  # the calls have ended: the rest is content
        self.sent: list = []  # [(id, args sent)] per call announced
        self.scanner = _JsonScanner()
        self.failed = False
        self.calls: list = []  # [ToolCall] announced, arguments as sent so far

    def push(self, piece: str) -> list:
        self.buffer += piece
        if self.after:
            return self._after()
        out: list = []
        if not self.in_region:
            at = self.buffer.find(self.parser.start)
            if at < 0:
                keep = _partial_suffix(self.buffer, self.parser.start)
                if len(self.buffer) > keep:
                    out.append(Delta("content", self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if at:
                out.append(Delta("content", self.buffer[:at]))
            self.buffer, self.in_region = self.buffer[at:], True
        return out + self._region(final=False)

    def finish(self) -> list:
        if self.after:  # whitespace alone after the calls is dropped, as parse does
            self.buffer = ""
            return []
        if not self.in_region:
            text, self.buffer = self.buffer, ""
            return [Delta("content", text)] if text else []
        return self._region(final=True)

    def _region(self, final: bool) -> list:
        try:
            partials, end = self.parser.calls(self.buffer, self.tools, final, self.scanner)
            broken = final and not all(p.done for p in partials)
        except Malformed as e:
            partials, end, broken = e.calls, None, True
        if broken:  # as parse: the calls read whole stay calls, the rest is content
            self.failed = self.after = True
            done = [p for p in partials if p.done]
            if len(self.sent) > len(done):  # a call announced but broken: what was sent of it stays sent
                self.buffer = ""
                return self._announce(partials)
            out = self._announce(done)
            text, self.buffer = self.buffer[done[-1].end if done else 0:], ""
            return out + ([Delta("content", text)] if text.strip() else [])
        out = self._announce(partials)
        if end is not None:
            self.buffer, self.after = self.buffer[end:], True
            out += self._after()
        return out

    def _announce(self, partials: list) -> list:
        """Deltas for what ``partials`` add to the calls sent: new names, more arguments."""
        out = []
        for i, p in enumerate(partials):
            if p.name is None:
                break
            if i == len(self.sent):
                call = ToolCall(p.id or self.parser.new_id(i), p.name, "")
                self.sent.append(call)
                self.calls.append(call)
                out.append(Delta("call", index=i, id=call.id, name=call.name))
            call = self.sent[i]
            if len(p.args) > len(call.arguments):
                out.append(Delta("args", p.args[len(call.arguments):], index=i))
                call.arguments = p.args
        return out

    def _after(self) -> list:
        """Text after the calls: content, once it is more than whitespace."""
        if not self.buffer.strip():
            return []
        text, self.buffer = self.buffer, ""
        return [Delta("content", text)]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
