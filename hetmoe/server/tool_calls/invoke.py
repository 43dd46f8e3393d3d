"""The families whose calls are ``invoke`` elements inside a block (MiniMax-M2's, MiniMax-M3's, DeepSeek's DSML): one
reader, the tokens set by each subclass, which reads an invoke's head and one parameter in its own syntax."""

from __future__ import annotations

import re

from hetmoe.server.tool_calls.base import ToolParser
from hetmoe.server.tool_calls.scan import Malformed, Partial, expect, open_block, skip_ws, xml_params

MAX_TAG = 512  # characters of an element's attributes before its ">": more is not an element
_ATTRIBUTE = re.compile(r'\s*([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|\'([^\']*)\'|([^\s"\'>]+))')


def read_attributes(text: str) -> dict:
    """The attributes of an element as written between its name and ``>``; Malformed when they do not read."""
    out, pos = {}, 0
    while pos < len(text.rstrip()):
        m = _ATTRIBUTE.match(text, pos)
        if m is None:
            raise Malformed(f"not attributes: {text[pos:pos + 20]!r}")
        value = next(v for v in m.groups()[1:] if v is not None)
        out[m.group(1)] = value
        pos = m.end()
    return out


class InvokeBlocks(ToolParser):
    """Families whose calls sit in blocks: ``start`` (``invoke`` head parameter* ``invoke_end``)+ ``end``,
    whitespace between; parallel calls are invokes of one block, and several blocks in a row are read too."""

    end = invoke = invoke_end = ""
    separator = ""  # each invoke ends with its own newline
    unique_params = False  # a parameter given twice is Malformed (else the last one counts)

    def head(self, region: str, q: int, final: bool):
        """(the call's name, the position after the head) of the invoke whose head starts at ``q`` (just after
        ``invoke``); None while the text ends first."""
        raise NotImplementedError

    def param(self, region: str, p: int, schema: dict, final: bool):
        """((key, JSON text of the value), the position after it) of the parameter at ``p``, typed by the tool's
        ``schema``; None while the text ends first."""
        raise NotImplementedError

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            opened, pos = open_block(region, pos, self.start, final)
            if not opened:
                return pos
            pos = self._invokes(region, pos, tools, final, out)
            if pos is None:
                return None

    def _invokes(self, region, pos, tools, final, out):
        """The invokes of one block, from just after ``start`` -> the position after its ``end``, or None."""
        first = True
        while True:
            p = skip_ws(region, pos)
            if region.startswith(self.end, p):
                if first:
                    raise Malformed("a tool-call block without an invoke")
                return p + len(self.end)
            if p >= len(region) or (not final and self.end.startswith(region[p:])):
                if final:
                    raise Malformed(f"no {self.end!r}")
                return None
            q = expect(region, p, self.invoke, final)
            head = self.head(region, q, final) if q is not None else None
            if head is None:
                return None
            call = Partial(name=head[0])
            if not call.name:
                raise Malformed("a call without a name")
            out.append(call)
            schema = tools.get(call.name) or {}
            pos = xml_params(region, head[1], self.invoke_end, lambda at: self.param(region, at, schema, final),
                             final, call, self.unique_params)
            if pos is None:
                return None
            call.done, call.end, first = True, pos, False

    def format_calls(self, calls):
        return self.start + "\n" + super().format_calls(calls) + self.end

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": self.start + "\n", "content": self.calls_format(tools, name, parallel),
                "end": self.end}
