"""MiniMax-M3's calls: every element of the syntax starts with the namespace token ``]<]minimax[>[`` (a special
token), a parameter is an element named after it, and a value that is an object or an array is written as elements
in turn (an array's entries each an ``item``; the line breaks inside the invoke below are for reading only)::

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="f">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[<days>3]<]minimax[>[</days>
    ]<]minimax[>[<tags>]<]minimax[>[<item>a]<]minimax[>[</item>]<]minimax[>[</tags>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

A value without elements is a scalar, read by the tool's schema as the other XML families read theirs (a string as
written; a number, boolean or null where the schema says so). With no schema for a value, elements all named
``item`` are an array, other elements an object, and a scalar is a number, boolean or null when it reads as one.
Text may not hold the namespace token, so every element is found by it. The reasoning block is ``<mm:think>`` ...
``</mm:think>`` (reasoning.py).
"""

from __future__ import annotations

import json
import re

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.dsml import read_attributes
from hetmoe.server.tool_calls.scan import Malformed, Partial, expect, open_block, skip_ws, xml_args, xml_value

NS = "]<]minimax[>["
BEGIN, END = NS + "<tool_call>", NS + "</tool_call>"
INVOKE, INVOKE_END = NS + "<invoke", NS + "</invoke>"
ITEM = "item"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
MAX_TAG = 512


def _kind(schema) -> object:
    return schema.get("type") if isinstance(schema, dict) else None


def _children(raw: str) -> list:
    """The elements [(name, inner text)] that make up ``raw`` (whitespace between them); Malformed otherwise."""
    out, pos = [], skip_ws(raw, 0)
    while pos < len(raw):
        if not raw.startswith(NS + "<", pos):
            raise Malformed(f"text between elements: {raw[pos:pos + 20]!r}")
        name, inner, pos = _element(raw, pos + len(NS) + 1, True)
        out.append((name, inner))
        pos = skip_ws(raw, pos)
    return out


def _element(text: str, p: int, final: bool):
    """(name, inner text, the position after the closing element) of the element whose name starts at ``p`` (just
    after ``NS<``); None when the text ends first (not final)."""
    gt = text.find(">", p)
    if gt < 0:
        if final or len(text) - p > MAX_TAG:
            raise Malformed("an unterminated element")
        return None
    name = text[p:gt]
    if not _NAME.fullmatch(name):
        raise Malformed(f"not an element name: {name[:40]!r}")
    opening, closing = f"{NS}<{name}>", f"{NS}</{name}>"
    depth, pos = 1, gt + 1
    while True:  # the closing element at the same depth (an element may hold ones of its own name)
        c, o = text.find(closing, pos), text.find(opening, pos)
        if c < 0:
            if final:
                raise Malformed(f"no {closing!r}")
            return None
        if 0 <= o < c:
            depth, pos = depth + 1, o + len(opening)
            continue
        depth -= 1
        if depth == 0:
            return name, text[gt + 1:c], c + len(closing)
        pos = c + len(closing)


def m3_value(raw: str, schema):
    """The value written ``raw`` (elements or a scalar) for ``schema`` (None: none)."""
    kind = _kind(schema)
    if NS in raw:
        children = _children(raw)
        if kind == "array" or (kind != "object" and children and all(n == ITEM for n, _ in children)):
            items = schema.get("items") if isinstance(schema, dict) else None
            if any(n != ITEM for n, _ in children):
                raise Malformed("an array entry that is not an item")
            return [m3_value(v, items) for _, v in children]
        props = schema.get("properties") if isinstance(schema, dict) else None
        props = props if isinstance(props, dict) else {}
        out: dict = {}
        for n, v in children:
            if n in out:
                raise Malformed(f"the key {n!r} twice")
            out[n] = m3_value(v, props.get(n))
        return out
    if kind in ("array", "object") and not raw.strip():
        return [] if kind == "array" else {}
    if kind is None:  # a number, boolean or null as written, else the text
        try:
            value = json.loads(raw)
        except ValueError:
            return raw
        return value if value is None or isinstance(value, (bool, int, float)) else raw
    return json.loads(xml_value(raw, kind))


def m3_text(value) -> str:
    """A value as the model writes it."""
    if isinstance(value, dict):
        return "".join(f"{NS}<{k}>{m3_text(v)}{NS}</{k}>" for k, v in value.items())
    if isinstance(value, list):
        return "".join(f"{NS}<{ITEM}>{m3_text(v)}{NS}</{ITEM}>" for v in value)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


_STRING_BOUNDS = ("pattern", "format", "minLength", "maxLength")


def _relaxed(schema):
    """``schema`` without the bounds on strings (pattern, format, length), which xgrammar's M3 style cannot combine
    with keeping the namespace token out of a string: a forced call follows the schema but for those."""
    if isinstance(schema, dict):
        return {k: _relaxed(v) for k, v in schema.items() if k not in _STRING_BOUNDS or not isinstance(v, (str, int))}
    if isinstance(schema, list):
        return [_relaxed(v) for v in schema]
    return schema


class MiniMaxM3(ToolParser):
    name, start = "minimax_m3", BEGIN
    markers = (NS,)
    separator = ""  # each invoke ends with its own newline

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            opened, pos = open_block(region, pos, BEGIN, final)
            if not opened:
                return pos
            pos = self._invokes(region, pos, tools, final, out)
            if pos is None:
                return None

    def _invokes(self, region, pos, tools, final, out):
        """The invokes of one block, from just after BEGIN -> the position after END, or None."""
        first = True
        while True:
            p = skip_ws(region, pos)
            if region.startswith(END, p):
                if first:
                    raise Malformed("a tool-call block without an invoke")
                return p + len(END)
            if p >= len(region) or (not final and END.startswith(region[p:])):
                if final:
                    raise Malformed(f"no {END!r}")
                return None
            q = expect(region, p, INVOKE, final)
            gt = region.find(">", q) if q is not None else -1
            if gt < 0:
                if final or (q is not None and len(region) - q > MAX_TAG):
                    raise Malformed("an unterminated invoke")
                return None
            call = Partial(name=read_attributes(region[q:gt]).get("name"))
            if not call.name:
                raise Malformed("a call without a name")
            out.append(call)
            pos, first = self._params(region, gt + 1, tools.get(call.name) or {}, final, call), False
            if pos is None:
                return None

    def _params(self, region, p, schema, final, call):
        """The parameters of one invoke -> the position after INVOKE_END, or None (``call.args`` then holds the
        parameters read so far)."""
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        params: list = []
        while True:
            p = skip_ws(region, p)
            if region.startswith(INVOKE_END, p):
                call.args, call.done = xml_args(params, True), True
                call.end = p + len(INVOKE_END)
                return call.end
            if p >= len(region) or (not final and INVOKE_END.startswith(region[p:])):
                if final:
                    raise Malformed(f"no {INVOKE_END!r}")
                call.args = xml_args(params, False)
                return None
            q = expect(region, p, NS + "<", final)
            element = _element(region, q, final) if q is not None else None
            if element is None:
                call.args = xml_args(params, False)
                return None
            key, raw, p = element
            if any(k == key for k, _ in params):
                raise Malformed(f"the parameter {key!r} twice")
            params.append((key, json.dumps(m3_value(raw, props.get(key)), ensure_ascii=False)))

    def format_call(self, call, index=0):
        return f'{INVOKE} name="{call.name}">' + m3_text(json.loads(call.arguments)) + INVOKE_END + "\n"

    def format_calls(self, calls):
        return BEGIN + "\n" + super().format_calls(calls) + END

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{INVOKE} name="{name}">',
                "content": args_format(_relaxed(schema), "minimax_m3_xml"), "end": INVOKE_END + "\n"}

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": BEGIN + "\n", "content": self.calls_format(tools, name, parallel), "end": END}
