"""What every family shares: the call and output types, ``ToolParser`` (a whole output parsed, its grammar, the
ids of its calls) and ``ToolStream`` (the same parse, streamed as deltas). A family subclasses ``ToolParser`` with
its ``start`` marker, its reader (``_calls``), ``format_call`` and ``tool_format``.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Optional

from hetmoe.server.tool_calls.scan import JsonScanner, Malformed


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


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolParser:
    """One family's syntax (subclasses). ``start`` is the text that opens the tool-call region; ``markers`` are
    the fixed strings of the syntax, which some tokenizers make special tokens (the server then keeps those in the
    text the parser reads)."""

    name = ""
    start = ""
    markers: tuple = ()

    def calls(self, region: str, tools: dict, final: bool, scanner: JsonScanner) -> tuple:
        """The calls in ``region`` (text from ``start`` on) -> ([Partial], end): ``end`` is where the calls end
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

    def _calls(self, region: str, tools: dict, final: bool, scanner: JsonScanner, out: list) -> Optional[int]:
        """``calls``: appends to ``out`` as it reads, returns ``end``."""
        raise NotImplementedError

    def format_call(self, call: ToolCall, index: int = 0) -> str:
        """Call number ``index`` of a turn as the model writes it."""
        raise NotImplementedError

    def format_calls(self, calls: list) -> str:
        """A turn's calls [ToolCall] as the model writes them (what ``parse`` reads back)."""
        return self.separator.join(self.format_call(c, i) for i, c in enumerate(calls))

    def tool_format(self, name: str, schema: dict) -> dict:
        """The structural tag of one call to ``name``."""
        raise NotImplementedError

    def grammar(self, tools: dict, name: Optional[str] = None, parallel: bool = True) -> dict:
        """An xgrammar structural-tag format for output that is only tool calls, at least one: to any of
        ``tools`` or, given ``name``, to that one; one call only unless ``parallel``. The output may end (the stop
        token is allowed) after every complete call, and after the separator that follows one: a model that
        writes the separator out of habit (Hermes' newline) can still stop there rather than call again."""
        calls = self.calls_format(tools, name, parallel)
        if not parallel or not self.separator:
            return calls
        return {"type": "sequence", "elements": [
            calls, {"type": "optional", "content": {"type": "const_string", "value": self.separator}}]}

    def calls_format(self, tools: dict, name: Optional[str], parallel: bool) -> dict:
        """The calls alone, one or more (just one unless ``parallel``), ``separator`` between them."""
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
            partials, end = self.calls(region, tools, True, JsonScanner())
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


def args_format(schema: dict, style: str = "json") -> dict:
    """The structural tag of a call's arguments: ``schema`` in the family's style, whitespace runs of at most one
    character (a small model left free to indent loops in whitespace)."""
    return {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": 1}


class ToolStream:
    """Streamed tool-call parsing of one output: ``push(piece)`` / ``finish()`` -> [Delta]."""

    def __init__(self, parser: ToolParser, tools: dict):
        self.parser, self.tools = parser, tools
        self.buffer = ""  # text not yet sent as content (before the region) or the region itself
        self.in_region = False
        self.after = False  # the calls have ended: the rest is content
        self.sent: list = []  # [(id, args sent)] per call announced
        self.scanner = JsonScanner()
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
                keep = partial_suffix(self.buffer, self.parser.start)
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


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
