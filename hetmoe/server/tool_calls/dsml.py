"""DeepSeek's DSML calls (DeepSeek-V3.2 and V4): XML-like elements whose names carry the ``｜DSML｜`` tag (full-width
bars, U+FF5C), one ``invoke`` per call inside one block, each parameter saying whether its value is raw text::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="f">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

``string="true"``: the value is the text as written (a JSON string); ``string="false"``: the value is JSON (a
number, boolean, array, object or null). A value marked JSON that does not parse is read by the tool's schema as
the other XML families read theirs. V3.2 names the block ``function_calls`` (``deepseek_v32``), V4 ``tool_calls``
(``deepseek_v4``); the rest is the same. The model writes the block after two newlines, at the end of its answer:
whitespace before the block belongs to it, not to the content (as the encoding writes the history back).
"""

from __future__ import annotations

import json
import re

from hetmoe.server.tool_calls.base import Delta, ToolParser, ToolStream, args_format
from hetmoe.server.tool_calls.scan import (
    Malformed,
    Partial,
    expect,
    open_block,
    schema_type,
    skip_ws,
    xml_args,
    xml_value,
)

DSML = "｜DSML｜"
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM, PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"
_ATTRIBUTE = re.compile(r'\s*([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|\'([^\']*)\'|([^\s"\'>]+))')
MAX_TAG = 512  # characters of an element's attributes before its ">": more is not an element


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


def dsml_value(raw: str, string, kind) -> str:
    """The JSON text of a parameter's value written ``raw`` with the ``string`` attribute (None when missing) and
    the schema's type ``kind``."""
    if string == "true":
        return json.dumps(raw, ensure_ascii=False)
    if string == "false":
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except ValueError:
            pass
    elif string is not None:
        raise Malformed(f'string="{string}": expected "true" or "false"')
    return xml_value(raw, kind)


def dsml_text(value) -> tuple:
    """(the ``string`` attribute, the text) of an argument's value as the model writes it."""
    return ("true", value) if isinstance(value, str) else ("false", json.dumps(value, ensure_ascii=False))


class DeepSeekV32(ToolParser):
    name = "deepseek_v32"
    start, end = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
    markers = (start, end, DSML)
    separator = ""  # each invoke ends with its own newline

    def _calls(self, region, tools, final, scanner, out):
        pos = 0
        while True:
            opened, pos = open_block(region, pos, self.start, final)
            if not opened:
                return pos
            pos = self._invokes(region, pos, tools, final, out)
            if pos is None:
                return None

    def _tag(self, region, p, final):
        """(attributes, the position after ``>``) of the element whose name ends at ``p``; None while the text
        ends first."""
        gt = region.find(">", p)
        if gt < 0:
            if final or len(region) - p > MAX_TAG or "\n" in region[p:]:
                raise Malformed("an unterminated DSML element")
            return None
        return read_attributes(region[p:gt]), gt + 1

    def _invokes(self, region, pos, tools, final, out):
        """The invokes of one block, from just after its opening -> the position after its end, or None."""
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
            q = expect(region, p, INVOKE, final)
            tag = self._tag(region, q, final) if q is not None else None
            if tag is None:
                return None
            attributes, q = tag
            call = Partial(name=attributes.get("name"))
            if not call.name:
                raise Malformed("a call without a name")
            out.append(call)
            pos, first = self._params(region, q, tools.get(call.name) or {}, final, call), False
            if pos is None:
                return None

    def _params(self, region, p, schema, final, call):
        """The parameters of one invoke, from just after its opening element -> the position after INVOKE_END,
        or None (``call.args`` then holds the parameters read so far)."""
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
            tag = self._tag(region, q, final) if q is not None else None
            close = region.find(PARAM_END, tag[1]) if tag is not None else -1
            if close < 0:
                if final:
                    raise Malformed("an unterminated parameter")
                call.args = xml_args(params, False)
                return None
            attributes, value_at = tag
            key = attributes.get("name")
            if not key:
                raise Malformed("a parameter without a name")
            if any(k == key for k, _ in params):
                raise Malformed(f"the parameter {key!r} twice")
            raw = region[value_at:close]
            params.append((key, dsml_value(raw, attributes.get("string"), schema_type(schema, key))))
            p = close + len(PARAM_END)

    def parse(self, text, tools):
        at = text.find(self.start)
        return super().parse(text[:at].rstrip() + text[at:] if at >= 0 else text, tools)

    def stream(self, tools):
        return DsmlStream(self, tools)

    def format_call(self, call, index=0):
        params = []
        for k, v in json.loads(call.arguments).items():
            string, text = dsml_text(v)
            params.append(f'{PARAM} name="{k}" string="{string}">{text}{PARAM_END}\n')
        return f'{INVOKE} name="{call.name}">\n' + "".join(params) + INVOKE_END + "\n"

    def format_calls(self, calls):
        return self.start + "\n" + super().format_calls(calls) + self.end

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{INVOKE} name="{name}">\n', "content": args_format(schema, "deepseek_xml"),
                "end": INVOKE_END + "\n"}

    def grammar(self, tools, name=None, parallel=True):
        """The block, after the blank line the model writes before it."""
        block = {"type": "tag", "begin": self.start + "\n", "content": self.calls_format(tools, name, parallel),
                 "end": self.end}
        return {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "const_string", "value": "\n\n"}}, block]}


class DeepSeekV4(DeepSeekV32):
    name = "deepseek_v4"
    start, end = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
    markers = (start, end, DSML)


class DsmlStream(ToolStream):
    """``ToolStream`` that holds back whitespace before the block until text other than the block follows."""

    def push(self, piece):
        if self.in_region or self.after:
            return super().push(piece)
        self.buffer += piece
        start, out = self.parser.start, []
        at = self.buffer.find(start)
        if at >= 0:
            text, self.buffer, self.in_region = self.buffer[:at].rstrip(), self.buffer[at:], True
            return ([Delta("content", text)] if text else []) + self._region(final=False)
        keep = next((k for k in range(min(len(start) - 1, len(self.buffer)), 0, -1)
                     if self.buffer.endswith(start[:k])), 0)
        head = self.buffer[:len(self.buffer) - keep]
        sent = head.rstrip()
        if sent:
            out.append(Delta("content", sent))
        self.buffer = self.buffer[len(sent):]
        return out
