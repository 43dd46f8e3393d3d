"""Mistral / Mixtral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (older templates) or
``[TOOL_CALLS]f[ARGS]{...}`` once per call (newer ones); ids of 9 letters or digits, as Mistral's templates
require."""

from __future__ import annotations

import json
import re
import secrets
import string

from hetmoe.server.tool_calls.base import ToolParser, args_format
from hetmoe.server.tool_calls.scan import JsonEnvelope, Malformed, Partial, expect, json_object_text, skip_ws


class Mistral(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"
    markers = ("[TOOL_CALLS]", "[ARGS]")
    separator = ", "

    def new_id(self, index):  # Mistral's templates refuse ids that are not 9 letters or digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def _calls(self, region, tools, final, scanner, out):
        envelope = JsonEnvelope(scanner)
        pos = skip_ws(region, len(self.start))
        if pos >= len(region):
            if final:
                raise Malformed("nothing after [TOOL_CALLS]")
            return None
        if region[pos] == "[":  # [{"name": ..., "arguments": ...}, ...]
            pos += 1
            while True:
                pos = skip_ws(region, pos)
                if pos >= len(region):
                    if final:
                        raise Malformed("the list of calls ends early")
                    return None
                if region[pos] == "]" and out:
                    return pos + 1
                if out:
                    pos = expect(region, pos, ",", final)
                    pos = skip_ws(region, pos) if pos is not None else None
                    if pos is None or pos >= len(region):
                        if final:
                            raise Malformed("the list of calls ends early")
                        return None
                call, end = envelope.read(region, pos, final)
                out.append(call)
                if end is None:
                    return None
                pos = call.end = end
        while True:  # name[ARGS]{...}, each call after its own [TOOL_CALLS]
            a = region.find("[ARGS]", pos)
            if a < 0:
                if final or not re.fullmatch(r"[\w.\-]*(\[[A-Z]*)?", region[pos:]):
                    raise Malformed("no [ARGS]")
                return None
            call = Partial(name=region[pos:a].strip())
            if not call.name:
                raise Malformed("a call without a name")
            out.append(call)
            s = skip_ws(region, a + len("[ARGS]"))
            end = scanner.end(region, s, final) if s < len(region) else None
            if s < len(region) and region[s] == "{":
                call.args = region[s:end if end is not None else len(region)]
            if end is None:
                if final:
                    raise Malformed("the arguments end early")
                return None
            call.args, call.done, call.end = json_object_text(region[s:end]), True, end
            pos = skip_ws(region, end)
            if region.startswith(self.start, pos):
                pos += len(self.start)
            elif not final and self.start.startswith(region[pos:]):
                return None
            else:
                return pos

    def format_call(self, call, index=0):
        return self.format_calls([call])

    def format_calls(self, calls):
        return self.start + "[" + self.separator.join(
            f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls) + "]"

    def tool_format(self, name, schema):
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "arguments": ',
                "content": args_format(schema), "end": "}"}

    def grammar(self, tools, name=None, parallel=True):
        return {"type": "tag", "begin": self.start + "[", "content": self.calls_format(tools, name, parallel),
                "end": "]"}
