"""Reasoning ("thinking") in a model's output: the text between ``<think>`` and ``</think>`` goes to
``message.reasoning_content`` (streamed as ``delta.reasoning_content``), the rest to ``content``.

    parser = reasoning_parser("auto", template_text)     # None: the model does not think in tags
    open_ = parser.starts_inside(prompt_tail)            # the template opened the block itself
    reasoning, content = parser.split(text, open_)       # a whole output
    stream = parser.stream(open_); stream.push(piece) / stream.finish() -> [(kind, text)]

The families differ in who writes the opening tag: DeepSeek-R1 and V3.1 (thinking on), the Qwen3 thinking
models and MiniMax-M2 end the prompt with ``<think>`` so the output starts inside the block; Qwen3 hybrids,
Kimi-K2 Thinking and GLM-4.5 write ``<think>`` themselves. Both are read from the text: the output is inside a
block from the start when the prompt's last ``<think>`` is not closed (``starts_inside``), and a block the model
opens itself counts only at the start of its output (after whitespace). A block that never closes
(``max_tokens`` ran out) is all reasoning. With thinking switched off (``enable_thinking: false``: the template
writes an empty, closed block) the output is all content. Whitespace around the reasoning and between it and the
content is dropped.
"""

from __future__ import annotations

from typing import Optional

PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "kimi_k2", "glm45", "minimax_m2")


class ReasoningParser:
    def __init__(self, name: str, start: str = "<think>", end: str = "</think>"):
        self.name, self.start, self.end = name, start, end

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

    def push(self, piece: str) -> list:
        self.buffer += piece
        out: list = []
        while True:
            if self.state == "start":
                text = self.buffer.lstrip()
                if text.startswith(self.parser.start):
                    self.buffer, self.state, self.reasoned = text[len(self.parser.start):], "reasoning", True
                    continue
                if self.parser.start.startswith(text):  # still could be the opening tag (or only whitespace)
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
            if self.lead and self.reasoned:
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
        elif self.state == "start" or not (self.lead and self.reasoned):
            self._emit(out, "content", self.buffer)
        self.buffer = ""
        return out

    @staticmethod
    def _emit(out: list, kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def reasoning_parser(name: Optional[str], template: Optional[str] = None) -> Optional[ReasoningParser]:
    """The parser ``name`` (one of PARSERS, or "none"); with None / "auto" the think-tag parser when ``template``
    mentions ``<think>`` / ``</think>``, else None."""
    if name == "none":
        return None
    if name in (None, "auto"):
        return ReasoningParser("auto") if template and ("<think>" in template or "</think>" in template) else None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected auto, none or one of {', '.join(PARSERS)}")
    return ReasoningParser(name)
