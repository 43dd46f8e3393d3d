"""Hermes / Qwen2.5 / Qwen3 (ChatML): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, one block
per call."""

from __future__ import annotations

import json

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import JsonEnvelope, Malformed, Partial, close_block, open_block, skip_ws


class Hermes(ToolParser):
    name, start = "hermes", "<tool_call>"
    open, close = "<tool_call>", "</tool_call>"
    markers = (open, close)

    def _calls(self, region, tools, final, scanner, out):
        pos, envelope = 0, JsonEnvelope(scanner)
        while True:
            opened, pos = open_block(region, pos, self.open, final)
            if not opened:
                return pos  # where the text after the calls starts, or None
            pos = skip_ws(region, pos)
            if pos >= len(region):
                if final:
                    raise Malformed("an empty call")
                out.append(Partial())
                return None
            call, end = envelope.read(region, pos, final)
            out.append(call)
            if end is None:
                return None
            call.done = False
            p = close_block(region, end, self.close, final)
            if p is None:
                return None
            call.done, call.end = True, p
            pos = p

    def format_call(self, call, index=0):
        return f'{self.open}\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": ' \
               f'{call.arguments}}}\n{self.close}'

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{self.open}\n{{"name": {json.dumps(name)}, "arguments": ',
                "content": args_format(schema), "end": f"}}\n{self.close}"}
