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

from hetmoe.server.tool_calls.base import Delta, ToolStream, args_format, partial_suffix
from hetmoe.server.tool_calls.invoke import MAX_TAG, InvokeBlocks, read_attributes
from hetmoe.server.tool_calls.scan import Malformed, expect, schema_type, xml_value

DSML = "｜DSML｜"
INVOKE, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
PARAM, PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"


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


class DeepSeekV32(InvokeBlocks):
    name = "deepseek_v32"
    start, end = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
    markers = (start, end, DSML)
    invoke, invoke_end = INVOKE, INVOKE_END
    unique_params = True

    def _tag(self, region, p, final):
        """(attributes, the position after ``>``) of the element whose name ends at ``p``; None while the text
        ends first."""
        gt = region.find(">", p)
        if gt < 0:
            if final or len(region) - p > MAX_TAG or "\n" in region[p:]:
                raise Malformed("an unterminated DSML element")
            return None
        return read_attributes(region[p:gt]), gt + 1

    def head(self, region, q, final):
        tag = self._tag(region, q, final)
        return (tag[0].get("name"), tag[1]) if tag is not None else None

    def param(self, region, p, schema, final):
        q = expect(region, p, PARAM, final)
        tag = self._tag(region, q, final) if q is not None else None
        close = region.find(PARAM_END, tag[1]) if tag is not None else -1
        if close < 0:
            if final:
                raise Malformed("an unterminated parameter")
            return None
        attributes, value_at = tag
        key = attributes.get("name")
        if not key:
            raise Malformed("a parameter without a name")
        value = dsml_value(region[value_at:close], attributes.get("string"), schema_type(schema, key))
        return (key, value), close + len(PARAM_END)

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

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{INVOKE} name="{name}">\n', "content": args_format(schema, "deepseek_xml"),
                "end": INVOKE_END + "\n"}

    def grammar(self, tools, name=None, parallel=True):
        """The block, after the blank line the model writes before it."""
        return {"type": "sequence", "elements": [
            {"type": "optional", "content": {"type": "const_string", "value": "\n\n"}},
            super().grammar(tools, name, parallel)]}


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
        sent = self.buffer[:len(self.buffer) - partial_suffix(self.buffer, start)].rstrip()
        if sent:
            out.append(Delta("content", sent))
        self.buffer = self.buffer[len(sent):]
        return out
