"""GLM-4.5/4.6 (``glm45``: ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``) and
GLM-4.7 (``glm47``: the same without the newlines), each value typed by the tool's schema."""

from __future__ import annotations

import json

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import (
    Malformed,
    Partial,
    expect,
    open_block,
    schema_type,
    skip_ws,
    xml_params,
    xml_text,
    xml_value,
)


class Glm45(ToolParser):
    name, start = "glm45", "<tool_call>"
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    newline = "\n"

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            opened, pos = open_block(region, pos, "<tool_call>", final)
            if not opened:
                return pos
            call = Partial()
            out.append(call)
            p = pos
            ends = [i for i in (region.find("\n", p), region.find("<arg_key>", p), region.find("</tool_call>", p))
                    if i >= 0]
            if not ends:
                if final:
                    raise Malformed("an unterminated <tool_call>")
                return None
            call.name = region[p:min(ends)].strip()
            if not call.name:
                raise Malformed("a call without a name")
            schema = tools.get(call.name) or {}
            pos = xml_params(region, min(ends), "</tool_call>", lambda at: self._param(region, at, schema, final),
                             final, call)
            if pos is None:
                return None
            call.done, call.end = True, pos

    def _param(self, region, p, schema, final):
        """((key, JSON text of the value), the position after it) of the parameter at ``p``; None while the text
        ends first."""
        q = expect(region, p, "<arg_key>", final)
        k_end = region.find("</arg_key>", q) if q is not None else -1
        v_at = skip_ws(region, k_end + len("</arg_key>")) if k_end >= 0 else -1
        v = expect(region, v_at, "<arg_value>", final) if 0 <= v_at < len(region) else None
        v_end = region.find("</arg_value>", v) if v is not None else -1
        if v_end < 0:
            if final:
                raise Malformed("an unterminated <arg_key>/<arg_value>")
            return None
        key = region[q:k_end].strip()
        return (key, xml_value(region[v:v_end], schema_type(schema, key))), v_end + len("</arg_value>")

    def format_call(self, call, index=0):
        nl = self.newline
        args = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{xml_text(v)}</arg_value>{nl}"
                       for k, v in json.loads(call.arguments).items())
        return f"<tool_call>{call.name}{nl}{args}</tool_call>"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f"<tool_call>{name}{self.newline}",
                "content": args_format(schema, "glm_xml"), "end": "</tool_call>"}


class Glm47(Glm45):
    name, newline = "glm47", ""
