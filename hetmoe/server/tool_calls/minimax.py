"""MiniMax-M2's XML calls (M2, M2.1, M2.5): one or more ``<invoke>`` elements inside a ``<minimax:tool_call>``
block, each value typed by the tool's schema::

    <minimax:tool_call>
    <invoke name="f">
    <parameter name="p">v</parameter>
    </invoke>
    </minimax:tool_call>

The template writes a string value as it is and any other value as JSON, one element a line. Parallel calls are
invokes of one block (several blocks in a row are read too).
"""

from __future__ import annotations

import json

from hetmoe.server.tool_calls.base import args_format
from hetmoe.server.tool_calls.invoke import InvokeBlocks
from hetmoe.server.tool_calls.scan import Malformed, expect, schema_type, xml_text, xml_value

BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
PARAM, PARAM_END = "<parameter name=", "</parameter>"


def _attribute(raw: str) -> str:
    """A name attribute's value: ``"f"`` (as the model writes it), ``'f'`` or bare ``f``."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        raw = raw[1:-1]
    return raw


class MiniMaxM2(InvokeBlocks):
    name, start, end = "minimax_m2", BEGIN, END
    markers = (BEGIN, END)
    invoke, invoke_end = INVOKE, INVOKE_END

    def head(self, region, q, final):
        gt = region.find(">", q)
        if gt < 0:
            if final or "\n" in region[q:]:
                raise Malformed("an unterminated <invoke")
            return None
        return _attribute(region[q:gt]), gt + 1

    def param(self, region, p, schema, final):
        q = expect(region, p, PARAM, final)
        gt = region.find(">", q) if q is not None else -1
        close = region.find(PARAM_END, gt + 1) if gt >= 0 else -1
        if close < 0:
            if final:
                raise Malformed("an unterminated <parameter")
            return None
        key, raw = _attribute(region[q:gt]), region[gt + 1:close]
        if not key:
            raise Malformed("a parameter without a name")
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        return (key, xml_value(raw, schema_type(schema, key))), close + len(PARAM_END)

    def format_call(self, call, index=0):
        params = "".join(f'{PARAM}"{k}">{xml_text(v)}{PARAM_END}\n' for k, v in json.loads(call.arguments).items())
        return f'{INVOKE}"{call.name}">\n{params}{INVOKE_END}\n'

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{INVOKE}"{name}">\n', "content": args_format(schema, "minimax_xml"),
                "end": INVOKE_END + "\n"}

