"""The families whose calls sit between marker strings (DeepSeek's, Kimi-K2's): one reader, the markers set by
each subclass."""

from __future__ import annotations

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import Malformed, Partial, close_block, expect, json_args, skip_ws


class Marked(ToolParser):
    """Families whose calls sit between marker strings: ``begin`` (call_begin head head_end args args_end
    call_end)* ``end``."""

    begin = end = call_begin = head_end = call_end = ""
    args_end = ""  # text between the arguments and call_end (DeepSeek-V3's closing fence)

    @property
    def markers(self) -> tuple:
        return tuple(m for m in (self.begin, self.end, self.call_begin, self.head_end, self.call_end) if m)

    def head(self, head: str) -> tuple:
        """(name, the model's own id or None) from the text between call_begin and head_end."""
        return head.strip(), None

    def _calls(self, region, tools, final, scanner, out):
        pos = expect(region, 0, self.begin, final)
        while pos is not None:
            pos = skip_ws(region, pos)
            if pos >= len(region):
                return (pos if final else None)
            if region.startswith(self.end, pos):
                return pos + len(self.end)
            if not region.startswith(self.call_begin, pos):
                if not final and (self.call_begin.startswith(region[pos:]) or self.end.startswith(region[pos:])):
                    return None
                raise Malformed(f"expected {self.call_begin!r}")
            call = Partial()
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
            p = json_args(region, h + len(self.head_end), final, scanner, call)
            if p is None:
                return None
            for token in (self.args_end.strip(), self.call_end):  # whitespace around the fence is free
                if token:
                    p = close_block(region, p, token, final)
                    if p is None:
                        return None
            call.done, call.end = True, p
            pos = p
        return None

    def format_call(self, call, index=0):
        return self.call_begin + self.head_text(call.name, index) + self.head_end + call.arguments + \
            self.args_end + self.call_end

    def head_text(self, name: str, index: int) -> str:
        return name

    def format_calls(self, calls):
        return self.begin + super().format_calls(calls) + self.end

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": self.call_begin + self.head_text(name, 0) + self.head_end,
                "content": args_format(schema), "end": self.args_end + self.call_end}

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": self.begin, "content": self.calls_format(tools, name, parallel),
                "end": self.end}
