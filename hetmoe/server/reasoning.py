"""Reasoning ("thinking") in a model's output: the text between ``<think>`` and ``</think>`` goes to
``message.reasoning_content`` (streamed as ``delta.reasoning_content``), the rest to ``content``.

    parser = reasoning_parser("auto", template_text)     # None: the model does not think in tags
    open_ = parser.starts_inside(prompt_tail)            # the template opened the block itself
    reasoning, content = parser.split(text, open_)       # a whole output
    stream = parser.stream(open_); stream.push(piece) / stream.finish() -> [(kind, text)]

The families differ in who writes the opening tag: DeepSeek-R1, V3.1, V3.2 and V4 (thinking on), the Qwen3
thinking models and MiniMax-M2 end the prompt with ``<think>`` so the output starts inside the block; Qwen3 hybrids,
Kimi-K2 Thinking and GLM-4.5 write ``<think>`` themselves. Both are read from the text: the output is inside a
block from the start when the prompt's last ``<think>`` is not closed (``starts_inside``), and a block the model
opens itself counts only at the start of its output (after whitespace), where a lone closing tag (a block the model
chose to skip) is dropped. A block that never closes
(``max_tokens`` ran out) is all reasoning. With thinking switched off (``enable_thinking: false``: the template
writes an empty, closed block; DeepSeek-V3.2 and V4 end the prompt with ``</think>``) the output is all content.
Whitespace around the reasoning and between it and the content is dropped. MiniMax-M3 writes the same block as
``<mm:think>`` ... ``</mm:think>``.

gpt-oss (``harmony``) writes channels rather than tags: an ``analysis`` message is reasoning, a ``final`` message
(and a ``commentary`` one without a recipient, the preamble before a call) is content; a message to a recipient
(a tool call) is passed on as content in the form the harmony tool-call parser reads (tool_calls/harmony.py).
Output that starts with no message header (a grammar's JSON) is content as it is.
"""

from __future__ import annotations

import re
from typing import Optional

from hetmoe.server.tool_calls import harmony

PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v32", "deepseek_v4", "qwen3", "kimi_k2", "glm45", "minimax_m2",
           "minimax_m3", "harmony")
MM_THINK = ("<mm:think>", "</mm:think>")  # MiniMax-M3's tags


class ReasoningParser:
    def __init__(self, name: str, start: str = "<think>", end: str = "</think>"):
        self.name, self.start, self.end = name, start, end

    @property
    def markers(self) -> tuple:
        """The strings this parser reads that a tokenizer may make special tokens (kept in the text it reads)."""
        return (self.start, self.end)

    def starts_inside(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in ``prompt_tail`` leaves a reasoning block open."""
        at = prompt_tail.rfind(self.start)
        return at >= 0 and prompt_tail.find(self.end, at) < 0

    def split(self, text: str, inside: bool) -> tuple:
        """(reasoning or None, content) of a whole output."""
        stream = self.stream(inside)
        parts = stream.push(text) + stream.finish()
        reasoning = "".join(t for k, t in parts if k == "reasoning")
        return (reasoning if stream.reasoned else None), "".join(t for k, t in parts if k == "content")

    def stream(self, inside: bool) -> "ReasoningStream":
        return ReasoningStream(self, inside)


class ReasoningStream:
    """``push(piece)`` / ``finish()`` -> [("reasoning" | "content", text)]: text is held back only while it could
    still be the start of a tag, or whitespace that may turn out to end the reasoning."""

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.parser = parser
        self.state = "reasoning" if inside else "start"  # start -> reasoning -> content, or start -> content
        self.reasoned = inside  # a reasoning block was seen (reasoning_content is then a string, maybe empty)
        self.buffer = ""
        self.lead = True  # at the start of the current part: leading whitespace is dropped
        self.skipped = False  # the output began with a closing tag alone

    def push(self, piece: str) -> list:
        self.buffer += piece
        out: list = []
        while True:
            if self.state == "start":
                text = self.buffer.lstrip()
                if text.startswith(self.parser.start):
                    self.buffer, self.state, self.reasoned = text[len(self.parser.start):], "reasoning", True
                    continue
                if text.startswith(self.parser.end):  # reasoning skipped (MiniMax-M3's adaptive mode): no content
                    self.buffer, self.state, self.skipped = text[len(self.parser.end):], "content", True
                    continue
                if self.parser.start.startswith(text) or self.parser.end.startswith(text):  # maybe a tag, or blank
                    return out
                self.state = "content"
                continue
            if self.state == "reasoning":
                if self.lead:
                    self.buffer = self.buffer.lstrip()
                    if not self.buffer:
                        return out
                    if self.buffer.startswith(self.parser.start):  # the template's tag repeated by the model
                        self.buffer = self.buffer[len(self.parser.start):]
                        continue
                    if self.parser.start.startswith(self.buffer):  # maybe that tag, not all there yet
                        return out
                    self.lead = False
                at = self.buffer.find(self.parser.end)
                if at >= 0:
                    self._emit(out, "reasoning", self.buffer[:at].rstrip())
                    self.buffer, self.state, self.lead = self.buffer[at + len(self.parser.end):], "content", True
                    continue
                keep = _partial_suffix(self.buffer, self.parser.end)  # the tag's beginning, and whitespace before
                tail = self.buffer[:len(self.buffer) - keep]
                keep += len(tail) - len(tail.rstrip())
                self._emit(out, "reasoning", self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            if self.lead and (self.reasoned or self.skipped):
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
            self.lead = False
            self._emit(out, "content", self.buffer)
            self.buffer = ""
            return out

    def finish(self) -> list:
        out: list = []
        if self.state == "reasoning":
            self._emit(out, "reasoning", self.buffer.rstrip())
        elif self.state == "start" or not (self.lead and (self.reasoned or self.skipped)):
            self._emit(out, "content", self.buffer)
        self.buffer = ""
        return out

    @staticmethod
    def _emit(out: list, kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


class HarmonyParser(ReasoningParser):
    """gpt-oss's channels (the module's docstring)."""

    def __init__(self, name: str = "harmony"):
        super().__init__(name, harmony.CHANNEL + "analysis" + harmony.MESSAGE, harmony.END)

    @property
    def markers(self) -> tuple:
        return (harmony.START, harmony.CHANNEL, harmony.MESSAGE, harmony.CONSTRAIN, harmony.END, harmony.CALL,
                harmony.RETURN)

    def starts_inside(self, prompt_tail: str) -> bool:
        return False  # the template's generation prompt ends before the first header (<|start|>assistant)

    def stream(self, inside: bool) -> "HarmonyStream":
        return HarmonyStream()


_BODY_ENDS = (harmony.END, harmony.CALL, harmony.RETURN, harmony.START)
_HEADER_STARTS = (harmony.CHANNEL, harmony.START, " to=", "to=")


class HarmonyStream:
    """``push(piece)`` / ``finish()`` -> [("reasoning" | "content", text)] over harmony messages: a header is held
    until its ``<|message|>``, a body is sent as it comes but for the beginning of an end marker."""

    def __init__(self):
        self.state = "start"  # start -> header -> body -> between -> header ...; start -> plain (no headers)
        self.reasoned = False
        self.buffer = ""
        self.kind = "content"  # the current body's: "reasoning", "content" or "call" (passed on as content)

    def push(self, piece: str) -> list:
        self.buffer += piece
        out: list = []
        while self.buffer:
            if self.state == "plain":
                out.append(("content", self.buffer))
                self.buffer = ""
            elif self.state in ("start", "between"):
                text = self.buffer.lstrip() if self.state == "between" else self.buffer
                if any(text.startswith(s) for s in _HEADER_STARTS):
                    self.buffer, self.state = text, "header"
                elif any(s.startswith(text) for s in _HEADER_STARTS):
                    return out  # maybe a header, not all there yet
                elif self.state == "start":
                    self.state = "plain"
                else:  # text after an end marker with no header: content up to the next message
                    self.buffer, self.state, self.kind = text, "body", "content"
            elif self.state == "header":
                at = self.buffer.find(harmony.MESSAGE)
                if at < 0:
                    if len(self.buffer) > harmony.MAX_HEADER:  # not a header after all
                        self.state = "plain"
                        continue
                    return out
                header, self.buffer = self.buffer[:at], self.buffer[at + len(harmony.MESSAGE):]
                if header.startswith(harmony.START):  # <|start|>assistant ...: the role is no part of the header
                    header = re.sub(r"^\S+?(?=\s|<\||$)", "", header[len(harmony.START):])
                channel, recipient, kind = harmony.read_header(header)
                self.state = "body"
                if recipient is not None:
                    self.kind = "call"
                    out.append(("content", harmony.call_header(recipient, kind)))
                elif channel == "analysis":
                    self.kind, self.reasoned = "reasoning", True
                else:
                    self.kind = "content"
            else:  # body
                ends = [(self.buffer.find(t), t) for t in _BODY_ENDS]
                found = [(at, t) for at, t in ends if at >= 0]
                if found:
                    at, marker = min(found)
                    self._body(out, self.buffer[:at])
                    if self.kind == "call":
                        out.append(("content", harmony.CALL))
                    keep = marker == harmony.START  # the next message's own start
                    self.buffer = self.buffer[at if keep else at + len(marker):]
                    self.state = "between"
                    continue
                keep = max(_partial_suffix(self.buffer, t) for t in _BODY_ENDS)
                self._body(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
        return out

    def finish(self) -> list:
        out: list = []
        if self.state == "body":
            self._body(out, self.buffer)
        elif self.state in ("start", "plain"):
            ReasoningStream._emit(out, "content", self.buffer)
        self.buffer = ""  # an unfinished header, or whitespace after the last message, says nothing
        return out

    def _body(self, out: list, text: str) -> None:
        ReasoningStream._emit(out, "reasoning" if self.kind == "reasoning" else "content", text)


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def reasoning_parser(name: Optional[str], template: Optional[str] = None) -> Optional[ReasoningParser]:
    """The parser ``name`` (one of PARSERS, or "none"); with None / "auto" the harmony parser when ``template``
    writes gpt-oss's channels, MiniMax-M3's when it writes ``<mm:think>``, the think-tag parser when it mentions
    ``<think>`` / ``</think>``, else None."""
    if name == "none":
        return None
    if name == "harmony" or (name in (None, "auto") and template and harmony.CHANNEL in template):
        return HarmonyParser()
    if name == "minimax_m3" or (name in (None, "auto") and template and MM_THINK[0] in template):
        return ReasoningParser("minimax_m3", *MM_THINK)
    if name in (None, "auto"):
        return ReasoningParser("auto") if template and ("<think>" in template or "</think>" in template) else None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected auto, none or one of {', '.join(PARSERS)}")
    return ReasoningParser(name)
