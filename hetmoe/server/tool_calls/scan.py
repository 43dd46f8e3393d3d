"""Reading a tool-call region as it arrives, the pieces every family's parser is made of: whitespace and fixed
tokens (``skip_ws``, ``expect``; a call block's opening and closing token, ``open_block`` and ``close_block``), where
a JSON value ends (``JsonScanner``, resumable), Hermes' and Mistral's ``{"name": ..., "arguments": ...}`` envelope
(``JsonEnvelope``), a call's arguments written as a bare JSON object (``json_args``), and the XML families' parameters
(``xml_params``, read one by one to a closing tag; ``xml_value`` types a value by the tool's schema, ``xml_args``,
``xml_text``). A reader that meets text which cannot be a call raises ``Malformed``; one whose text ends early (not
``final``) answers None, to be asked again with more text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional


class Malformed(ValueError):
    """The text after a call marker is not a call in the family's syntax."""


@dataclass
class Partial:
    """A call as far as it has been generated: ``args`` is a prefix of the final arguments that no later text
    changes (all of them once ``done``)."""

    name: Optional[str] = None
    args: str = ""
    done: bool = False
    id: Optional[str] = None  # the model's own id (Kimi's functions.f:0)
    end: int = 0  # once done: where the call's text ends in the region


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def expect(text: str, pos: int, token: str, final: bool) -> Optional[int]:
    """The position after ``token`` at ``pos``; None when the text ends inside it (not final); Malformed otherwise."""
    if text.startswith(token, pos):
        return pos + len(token)
    if not final and token.startswith(text[pos:]):
        return None
    raise Malformed(f"expected {token!r} at {text[pos:pos + 20]!r}")


def open_block(text: str, pos: int, token: str, final: bool) -> tuple:
    """The next call block, opened by ``token`` after whitespace at ``pos`` -> (True, the position after ``token``),
    or (False, what the reader answers: where the text after the calls starts, or None while more text may still
    open a block)."""
    pos = skip_ws(text, pos)
    if text.startswith(token, pos):
        return True, pos + len(token)
    if pos >= len(text):
        return False, (pos if final else None)
    if not final and token.startswith(text[pos:]):
        return False, None
    return False, pos


def close_block(text: str, pos: int, token: str, final: bool) -> Optional[int]:
    """The position after the closing ``token`` that follows whitespace at ``pos``; None when the text ends first
    (not final); Malformed otherwise."""
    pos = skip_ws(text, pos)
    end = expect(text, pos, token, final) if pos < len(text) else None
    if end is None and final:
        raise Malformed(f"no {token!r}")
    return end


_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")


class JsonScanner:
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


def json_object_text(raw: str) -> str:
    """``raw`` when it is the JSON text of an object; Malformed otherwise."""
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise Malformed(f"arguments are not JSON: {e}") from None
    if not isinstance(value, dict):
        raise Malformed("arguments are not a JSON object")
    return raw


def json_args(text: str, pos: int, final: bool, scanner: JsonScanner, call: Partial) -> Optional[int]:
    """Reads ``call``'s arguments, a JSON object after whitespace at ``pos`` -> the position after it, or None while
    the text ends first (``call.args`` then holds what has arrived of the object); Malformed when they are not one."""
    a = skip_ws(text, pos)
    if a >= len(text):
        if final:
            raise Malformed("a call without arguments")
        return None
    end = scanner.end(text, a, final)
    if text[a] == "{":
        call.args = text[a:end if end is not None else len(text)]
    if end is None:
        if final:
            raise Malformed("the arguments end early")
        return None
    call.args = json_object_text(text[a:end])
    return end


class JsonEnvelope:
    """``{"name": "f", "arguments": {...}}`` (or "parameters"), read as it arrives: the name once its string is
    complete, the arguments as they are scanned (when they are an object; a JSON string holding the object is
    accepted whole)."""

    ARGS = ("arguments", "parameters")

    def __init__(self, scanner: JsonScanner):
        self.scanner = scanner

    def read(self, text: str, pos: int, final: bool) -> tuple:
        """-> (Partial, position after the closing brace or None)."""
        call = Partial()
        p = expect(text, pos, "{", final)
        if p is None:
            return call, None
        first = True
        while True:
            p = skip_ws(text, p)
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
                p = expect(text, p, ",", final)
                if p is None:
                    return call, None
                p = skip_ws(text, p)
            first = False
            key_end = self.scanner.end(text, p, final) if p < len(text) and text[p] == '"' else None
            if key_end is None:
                if p < len(text) and text[p] != '"':
                    raise Malformed("a JSON key expected")
                return call, None
            key = json.loads(text[p:key_end])
            p = skip_ws(text, key_end)
            p = expect(text, p, ":", final) if p < len(text) else None
            if p is None:
                if final:
                    raise Malformed("the call ends inside its JSON")
                return call, None
            p = skip_ws(text, p)
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
                    call.args = json_object_text(json.loads(text[p:end]))
                else:
                    call.args = json_object_text(text[p:end])
            elif end is None:
                return call, None
            p = end


def schema_kind(schema):
    """The ``type`` a value's ``schema`` gives (None: none)."""
    return schema.get("type") if isinstance(schema, dict) else None


def schema_property(schema, param: str):
    """The schema of property ``param`` in an object's ``schema`` (None: none)."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props.get(param) if isinstance(props, dict) else None


def schema_type(schema, param: str):
    """The ``type`` the tool's ``schema`` gives parameter ``param`` (None: none)."""
    return schema_kind(schema_property(schema, param))


def xml_value(raw: str, kind) -> str:
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


def xml_text(value) -> str:
    """An argument's value as the XML families write it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def xml_args(params: list, done: bool) -> str:
    """Arguments built from (key, JSON value) pairs: a prefix that only grows as parameters complete."""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in params)
    if done:
        return "{" + body + "}"
    return "{" + body if params else ""


def xml_params(text: str, pos: int, close: str, read, final: bool, call: Partial,
               unique: bool = False) -> Optional[int]:
    """Reads one XML call's parameters from ``pos`` up to its ``close`` tag into ``call.args`` -> the position after
    ``close``, or None while the text ends first (``call.args`` then holds the parameters read so far).
    ``read(p)``: the parameter at ``p`` -> ((key, JSON text of its value), the position after it), or None while the
    text ends first. ``unique``: a key given twice is Malformed (else the last one counts, as JSON reads it)."""
    params: list = []
    while True:
        pos = skip_ws(text, pos)
        if text.startswith(close, pos):
            call.args = xml_args(params, True)
            return pos + len(close)
        if pos >= len(text) or (not final and close.startswith(text[pos:])):
            if final:
                raise Malformed(f"no {close!r}")
            call.args = xml_args(params, False)
            return None
        param = read(pos)
        if param is None:
            call.args = xml_args(params, False)
            return None
        (key, value), pos = param
        if unique and any(k == key for k, _ in params):
            raise Malformed(f"the parameter {key!r} twice")
        params.append((key, value))
