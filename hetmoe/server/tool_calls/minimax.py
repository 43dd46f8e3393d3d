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

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import (
    Malformed,
    Partial,
    expect,
    open_block,
    schema_type,
    skip_ws,
    xml_args,
    xml_text,
    xml_value,
)

BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
PARAM, PARAM_END = "<parameter name=", "</parameter>"


def _attribute(raw: str) -> str:
    """A name attribute's value: ``"f"`` (as the model writes it), ``'f'`` or bare ``f``."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        raw = raw[1:-1]
    return raw


class MiniMaxM2(ToolParser):
    name, start = "minimax_m2", BEGIN
    markers = (BEGIN, END)
    separator = ""  # each invoke ends with its own newline

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            opened, pos = open_block(region, pos, BEGIN, final)
            if not opened:
                return pos
            pos = self._invokes(region, pos, tools, final, out)
            if pos is None:
                return None

    def _invokes(self, region, pos, tools, final, out):
        """The invokes of one block, from just after its BEGIN -> the position after its END, or None."""
        first = True
        while True:
            p = skip_ws(region, pos)
            if region.startswith(END, p):
                if first:
                    raise Malformed("a tool-call block without an <invoke>")
                return p + len(END)
            if p >= len(region) or (not final and END.startswith(region[p:])):
                if final:
                    raise Malformed(f"no {END!r}")
                return None
            q = expect(region, p, INVOKE, final)
            if q is None:
                return None
            gt = region.find(">", q)
            if gt < 0:
                if final or "\n" in region[q:]:
                    raise Malformed("an unterminated <invoke")
                return None
            call = Partial(name=_attribute(region[q:gt]))
            if not call.name:
                raise Malformed("a call without a name")
            out.append(call)
            pos, first = self._params(region, gt + 1, tools.get(call.name) or {}, final, call), False
            if pos is None:
                return None

    def _params(self, region, p, schema, final, call):
        """The parameters of one invoke, from just after its opening tag -> the position after INVOKE_END, or
        None (``call.args`` then holds the parameters read so far)."""
        params: list = []
        while True:
            p = skip_ws(region, p)
            if region.startswith(INVOKE_END, p):
                call.args, call.done = xml_args(params, True), True
                call.end = p + len(INVOKE_END)
                return call.end
            if p >= len(region) or (not final and INVOKE_END.startswith(region[p:])):
                if final:
                    raise Malformed(f"no {INVOKE_END!r}")
                call.args = xml_args(params, False)
                return None
            q = expect(region, p, PARAM, final)
            gt = region.find(">", q) if q is not None else -1
            close = region.find(PARAM_END, gt + 1) if gt >= 0 else -1
            if close < 0:
                if final:
                    raise Malformed("an unterminated <parameter")
                call.args = xml_args(params, False)
                return None
            key, raw = _attribute(region[q:gt]), region[gt + 1:close]
            if not key:
                raise Malformed("a parameter without a name")
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            params.append((key, xml_value(raw, schema_type(schema, key))))
            p = close + len(PARAM_END)

    def format_call(self, call, index=0):
        params = "".join(f'{PARAM}"{k}">{xml_text(v)}{PARAM_END}\n' for k, v in json.loads(call.arguments).items())
        return f'{INVOKE}"{call.name}">\n{params}{INVOKE_END}\n'

    def format_calls(self, calls):
        return BEGIN + "\n" + super().format_calls(calls) + END

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{INVOKE}"{name}">\n', "content": args_format(schema, "minimax_xml"),
                "end": INVOKE_END + "\n"}

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": BEGIN + "\n", "content": self.calls_format(tools, name, parallel),
                "end": END}
