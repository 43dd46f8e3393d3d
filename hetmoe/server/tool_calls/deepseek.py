"""DeepSeek-V3 and R1 (``deepseek_v3``: ``function<｜tool▁sep｜>f`` and the arguments in a ```json fence) and
DeepSeek-V3.1 and later (``deepseek_v31``: ``f<｜tool▁sep｜>{...}``), between the ``<｜tool▁calls▁begin｜>`` markers."""

from __future__ import annotations

from hetmoe.server.tool_calls.marked import Marked

_DS = {k: f"<｜{v}｜>" for k, v in (("calls_begin", "tool▁calls▁begin"), ("calls_end", "tool▁calls▁end"),
                                      ("call_begin", "tool▁call▁begin"), ("call_end", "tool▁call▁end"),
                                      ("sep", "tool▁sep"))}


class DeepSeekV31(Marked):
    name = "deepseek_v31"
    start = begin = _DS["calls_begin"]
    end, call_begin, head_end, call_end = _DS["calls_end"], _DS["call_begin"], _DS["sep"], _DS["call_end"]
    separator = ""


class DeepSeekV3(Marked):
    name = "deepseek_v3"
    start = begin = _DS["calls_begin"]
    end, call_begin, call_end = _DS["calls_end"], _DS["call_begin"], _DS["call_end"]
    head_end, args_end = "\n```json\n", "\n```"
    markers = tuple(_DS.values())

    def head(self, head):
        kind, sep, name = head.partition(_DS["sep"])
        return (name.strip() if sep else ""), None

    def head_text(self, name, index):
        return f"function{_DS['sep']}{name}"
