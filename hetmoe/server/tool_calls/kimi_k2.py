"""Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{...}
<|tool_call_end|><|tool_calls_section_end|>``; the model's own ``functions.f:0`` is the call's id."""

from __future__ import annotations

from hetmoe.server.tool_calls.base import args_format
from hetmoe.server.tool_calls.marked import Marked


class KimiK2(Marked):
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
                    args_format(schema)]}, "end": self.call_end}
