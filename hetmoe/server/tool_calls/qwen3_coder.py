"""Qwen3-Coder's XML calls: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nv\\n</parameter>\\n</function>\\n
</tool_call>``, each value typed by the tool's schema."""

from __future__ import annotations

import json

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import (
    Malformed,
    Partial,
    close_block,
    expect,
    open_block,
    schema_type,
    skip_ws,
    xml_params,
    xml_text,
    xml_value,
)


class Qwen3Coder(ToolParser):
    name, start = "qwen3_coder", "<tool_call>"
    markers = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
    _PARAM = "<parameter="

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            opened, pos = open_block(region, pos, "<tool_call>", final)
            if not opened:
                return pos
            call = Partial()
            out.append(call)
            p = expect(region, skip_ws(region, pos), "<function=", final)
            if p is None:
                return None
            gt = region.find(">", p)
            if gt < 0:
                if final or "\n" in region[p:]:
                    raise Malformed("an unterminated <function=")
                return None
            call.name = region[p:gt].strip()
            if not call.name:
                raise Malformed("a call without a name")
            schema = tools.get(call.name) or {}
            p = xml_params(region, gt + 1, "</function>", lambda at: self._param(region, at, schema, final), final,
                           call)
            p = close_block(region, p, "</tool_call>", final) if p is not None else None
            if p is None:
                return None
            call.done, call.end = True, p
            pos = p

    def _param(self, region, p, schema, final):
        """((key, JSON text of the value), the position after it) of the parameter at ``p``; None while the text
        ends first."""
        q = expect(region, p, self._PARAM, final)
        if q is None:
            return None
        gt = region.find(">", q)
        close = region.find("</parameter>", gt + 1) if gt >= 0 else -1
        if close < 0:
            if final:
                raise Malformed("an unterminated <parameter=")
            return None
        key, raw = region[q:gt].strip(), region[gt + 1:close]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        return (key, xml_value(raw, schema_type(schema, key))), close + len("</parameter>")

    def format_call(self, call, index=0):
        params = "".join(f"<parameter={k}>\n{xml_text(v)}\n</parameter>\n"
                         for k, v in json.loads(call.arguments).items())
        return f"<tool_call>\n<function={call.name}>\n{params}</function>\n</tool_call>"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
                "content": args_format(schema, "qwen_xml"),
                "end": "</function>\n</tool_call>"}
