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

from hetmoe.server.tool_calls.base import args_format
from hetmoe.server.tool_calls.invoke import MAX_TAG, InvokeBlocks, read_attributes
from hetmoe.server.tool_calls.scan import Malformed, expect, schema_kind, schema_property, skip_ws, xml_value

NS = "]<]minimax[>["
BEGIN, END = NS + "<tool_call>", NS + "</tool_call>"
INVOKE, INVOKE_END = NS + "<invoke", NS + "</invoke>"
ITEM = "item"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


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
    kind = schema_kind(schema)
    if NS in raw:
        children = _children(raw)
        if kind == "array" or (kind != "object" and children and all(n == ITEM for n, _ in children)):
            items = schema.get("items") if isinstance(schema, dict) else None
            if any(n != ITEM for n, _ in children):
                raise Malformed("an array entry that is not an item")
            return [m3_value(v, items) for _, v in children]
        out: dict = {}
        for n, v in children:
            if n in out:
                raise Malformed(f"the key {n!r} twice")
            out[n] = m3_value(v, schema_property(schema, n))
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


class MiniMaxM3(InvokeBlocks):
    name, start, end = "minimax_m3", BEGIN, END
    markers = (NS,)
    invoke, invoke_end = INVOKE, INVOKE_END
    unique_params = True

    def head(self, region, q, final):
        gt = region.find(">", q)
        if gt < 0:
            if final or len(region) - q > MAX_TAG:
                raise Malformed("an unterminated invoke")
            return None
        return read_attributes(region[q:gt]).get("name"), gt + 1

    def param(self, region, p, schema, final):
        q = expect(region, p, NS + "<", final)
        element = _element(region, q, final) if q is not None else None
        if element is None:
            return None
        key, raw, p = element
        return (key, json.dumps(m3_value(raw, schema_property(schema, key)), ensure_ascii=False)), p

    def format_call(self, call, index=0):
        return f'{INVOKE} name="{call.name}">' + m3_text(json.loads(call.arguments)) + INVOKE_END + "\n"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{INVOKE} name="{name}">',
                "content": args_format(_relaxed(schema), "minimax_m3_xml"), "end": INVOKE_END + "\n"}

