"""gpt-oss's harmony format. The model writes messages after the prompt's ``<|start|>assistant``, each a header,
``<|message|>``, a body and an end marker::

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>
    <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant to=functions.f<|channel|>commentary json<|message|>{...}<|call|>

A message with a recipient (``to=...``) is a tool call, its body the arguments. ``<|call|>`` and ``<|return|>``
are the tokenizer's stop tokens (generation_config.json), so a call usually ends the output and its end marker is
not in the text; one more call can only follow where ``<|call|>`` is not a stop token.

The channels are split by the harmony reasoning parser (reasoning.py: analysis -> reasoning, final and a
commentary preamble -> content); it passes each call message on in one canonical form,
``<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>`` (``<|call|>`` only where the
message ended), which is what this parser reads. ``to_template`` shapes a request's history for the gpt-oss chat
template (reasoning as ``thinking``, one call per assistant message, arguments as a mapping).
"""

from __future__ import annotations

import json
import re
from typing import Optional

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import Malformed, Partial, json_args, skip_ws

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
NAMESPACE = "functions."
MAX_HEADER = 512  # characters of a header before <|message|>: more is not a header


def read_header(header: str) -> tuple:
    """(channel or None, recipient or None, content type or None) of a header as written (the text between the
    role or the output's start and ``<|message|>``)."""
    channel = re.search(re.escape(CHANNEL) + r"\s*([^\s<]+)", header)
    recipient = re.search(r"(?:^|\s|>)to=([^\s<]+)", header)
    constrain = re.search(re.escape(CONSTRAIN) + r"\s*([^\s<]+)", header)
    kind = constrain.group(1) if constrain else None
    if kind is None and channel is not None:  # "<|channel|>commentary json": the word after the channel
        rest = header[channel.end():]
        words = [w for w in re.sub(r"to=[^\s<]+", " ", rest).split() if "<|" not in w]
        kind = words[0] if words else None
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None), kind


def call_header(recipient: str, kind: Optional[str] = "json") -> str:
    """The canonical header of a call message, ``<|message|>`` included."""
    return f"{CHANNEL}commentary to={recipient}" + (f" {CONSTRAIN}{kind}" if kind else "") + MESSAGE


class Harmony(ToolParser):
    name, start = "harmony", CHANNEL
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL)
    separator = CALL + START + "assistant"  # a call ends with <|call|>; the next message starts again

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            p = skip_ws(region, pos)
            opener = START + "assistant"  # between calls (where <|call|> is no stop token)
            if region.startswith(opener, p):
                p += len(opener)
            elif not final and p < len(region) and opener.startswith(region[p:]):
                return None
            if not region.startswith(CHANNEL, p):
                if not final and CHANNEL.startswith(region[p:]):
                    return None
                return p if p >= len(region) else pos  # the calls end: what follows is content
            m = region.find(MESSAGE, p)
            if m < 0:
                if final or len(region) - p > MAX_HEADER or any(t in region[p + 1:] for t in (END, CALL, START)):
                    raise Malformed("a message header without <|message|>")
                return None
            _, recipient, _ = read_header(region[p:m])
            if recipient is None:  # a message that is no call: the calls end before it
                return pos
            pos = self._call(region, m + len(MESSAGE), recipient, tools, final, scanner, out)
            if pos is None:
                return None

    def _call(self, region, a, recipient, tools, final, scanner, out):
        """The body at ``a`` of a call to ``recipient`` -> the position after the call, or None while it is not all
        there; Malformed when it is not a call."""
        name = recipient[len(NAMESPACE):] if recipient.startswith(NAMESPACE) else recipient
        if not name or (tools and name not in tools):
            raise Malformed(f"a call to {name!r}, which is no tool of the request")
        call = Partial(name=name)
        out.append(call)
        end = json_args(region, a, final, scanner, call)
        if end is None:
            return None
        p = skip_ws(region, end)
        for token in (CALL, END):
            if region.startswith(token, p):
                call.done, call.end = True, p + len(token)
                return call.end
            if not final and p < len(region) and token.startswith(region[p:]):
                return None
        if p >= len(region) and not final:
            return None
        if p >= len(region) or region.startswith(START, p) or region.startswith(CHANNEL, p):
            call.done, call.end = True, end  # the end marker is a stop token, not in the text
            return end
        raise Malformed("text after a call's arguments")

    def format_call(self, call, index=0):
        return call_header(NAMESPACE + call.name) + call.arguments

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": call_header(NAMESPACE + name), "content": args_format(schema), "end": ""}

    def grammar(self, tools, name=None, parallel=True):
        """The calls, after an optional analysis message: gpt-oss thinks before it calls."""
        thinking = {"type": "tag", "begin": CHANNEL + "analysis" + MESSAGE, "content": {"type": "any_text"},
                    "end": END + START + "assistant"}
        return {"type": "sequence", "elements": [{"type": "optional", "content": thinking},
                                                 super().grammar(tools, name, parallel)]}


def to_template(messages: list) -> list:
    """The history as the gpt-oss chat template wants it: an assistant message's reasoning as ``thinking`` (the
    template renders it before a call; one with both reasoning and text gets them joined, which the template
    would render as the same analysis message, as it refuses both), content "" for none, arguments as a mapping
    (it writes them with ``tojson``), and one call per assistant message, each followed by its results (the
    template renders only a message's first call, and names a result after the call before it)."""
    out: list = []
    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        thinking = m.get("reasoning_content")
        calls = m.pop("tool_calls", None) or []  # the template reads any "tool_calls" key as a call
        if m.get("content") is None:
            m["content"] = ""
        if calls and thinking and m["content"]:
            thinking, m["content"] = thinking + "\n\n" + m["content"], ""
        if thinking:
            m["thinking"] = thinking
        if not calls:
            out.append(m)
            continue
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        for k, c in enumerate(calls):
            one = dict(m) if k == 0 else {"role": "assistant", "content": ""}
            args = c["function"]["arguments"]
            one["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(args) if isinstance(
                args, str) else args}}]
            out.append(one)
            out += [r for r in results if r.get("tool_call_id") == c.get("id")]
    return out
