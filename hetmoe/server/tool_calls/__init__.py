"""Tool calls in a model's output, in the syntax of its family; the grammar that forces them; and how a call is
written back into a prompt.

    parser = tool_parser("auto", template_text)      # the family the chat template speaks (or a named one)
    out = parser.parse(text, tools)                  # ToolOutput(content, calls, failed)
    stream = parser.stream(tools)                    # streamed: push(piece) / finish() -> [Delta]
    fmt = parser.grammar(tools, name, parallel)      # xgrammar structural-tag format forcing calls
    parser.format_call(call)                         # a call as the model writes it

``tools`` maps each tool's name to its JSON schema (``parameters``): the XML families read the parameter types
from it (``<parameter=n>3</parameter>`` is the number 3 when the schema says so, else the string "3").

A call is a ``ToolCall(id, name, arguments)``, ``arguments`` JSON text of an object, as OpenAI's
``message.tool_calls[i].function.arguments``. The families:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     Qwen2.5/3, Hermes, ChatML
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=p>\\nv\\n</parameter>\\n</function>\\n</tool_call>
    deepseek_v3   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>                                  DeepSeek-V3, R1
    deepseek_v31  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...     V3.1+
    kimi_k2       <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
                  {...}<|tool_call_end|><|tool_calls_section_end|>
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}]  or  [TOOL_CALLS]f[ARGS]{...}
    glm45         <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>    GLM-4.5/4.6
    glm47         the same without the newlines                                         GLM-4.7
    minimax_m2    <minimax:tool_call>\\n<invoke name="f">\\n<parameter name="p">v</parameter>\\n</invoke>\\n
                  </minimax:tool_call>                                       MiniMax-M2, M2.1, M2.5
    harmony       <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>         gpt-oss
    deepseek_v32  <｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="p" string="true">
                  v</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>             DeepSeek-V3.2
    deepseek_v4   the same in a <｜DSML｜tool_calls> block                                   DeepSeek-V4
    minimax_m3    ]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="f">]<]minimax[>[<p>v]<]minimax[>[</p>
                  ]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>       MiniMax-M3 (objects, arrays as elements)

Text before the first call is content; so is text after the calls. A region that starts like a call but does not
parse (broken JSON, a missing end marker, cut by max_tokens) is returned as content, and ``failed`` says so (the
server counts it); calls read whole before the broken one stay calls. Streamed, each call's name is sent once
known, then its arguments in pieces as they are generated (JSON arguments as the model writes them; the XML
families' one parameter at a time); the pieces concatenate to the arguments ``parse`` returns for the same text.
A streamed call that breaks after its name was sent stays a call (the pieces sent cannot be taken back), with
``failed`` set.

Markers that are special tokens (Kimi's, Mistral's ``[TOOL_CALLS]``) reach the parser because the chat path keeps
a parser's ``markers`` in the text it decodes (``SamplingParams.shown_special_ids``).

The modules: ``base`` (the types, ``ToolParser``, ``ToolStream``), ``scan`` (reading a region as it arrives), one
per family (``hermes``, ``qwen3_coder``, ``deepseek``, ``dsml``, ``kimi_k2``, ``mistral``, ``glm``, ``minimax``,
``minimax_m3``, ``harmony``; ``marked`` is the reader DeepSeek's and Kimi's share, ``invoke`` the one of the
``invoke``-element families: MiniMax-M2/M3 and DSML); this one picks the family.
"""

from __future__ import annotations

import re
from typing import Optional

from hetmoe.server.tool_calls.base import Delta, ToolCall, ToolOutput, ToolParser, ToolStream, new_call_id
from hetmoe.server.tool_calls.deepseek import DeepSeekV3, DeepSeekV31
from hetmoe.server.tool_calls.dsml import DeepSeekV4, DeepSeekV32
from hetmoe.server.tool_calls.glm import Glm45, Glm47
from hetmoe.server.tool_calls.harmony import Harmony
from hetmoe.server.tool_calls.hermes import Hermes
from hetmoe.server.tool_calls.kimi_k2 import KimiK2
from hetmoe.server.tool_calls.minimax import MiniMaxM2
from hetmoe.server.tool_calls.minimax_m3 import MiniMaxM3
from hetmoe.server.tool_calls.mistral import Mistral
from hetmoe.server.tool_calls.qwen3_coder import Qwen3Coder
from hetmoe.server.tool_calls.scan import Malformed

__all__ = ["PARSERS", "Delta", "DeepSeekV3", "DeepSeekV31", "DeepSeekV32", "DeepSeekV4", "Glm45", "Glm47", "Harmony",
           "Hermes", "KimiK2", "Malformed", "MiniMaxM2", "MiniMaxM3", "Mistral", "Qwen3Coder", "ToolCall", "ToolOutput",
           "ToolParser", "ToolStream", "arguments_as_mapping", "detect", "new_call_id", "renders_tools", "tool_parser"]

PARSERS = ("hermes", "qwen3_coder", "deepseek_v3", "deepseek_v31", "kimi_k2", "mistral", "glm45", "glm47",
           "minimax_m2", "harmony", "deepseek_v32", "deepseek_v4", "minimax_m3")

_FAMILIES = {c.name: c for c in (Hermes, Qwen3Coder, DeepSeekV3, DeepSeekV31, KimiK2, Mistral, Glm45, Glm47,
                                 MiniMaxM2, Harmony, DeepSeekV32, DeepSeekV4, MiniMaxM3)}


def detect(template: Optional[str]) -> str:
    """The family a chat template writes tool calls in (from the markers it renders); "hermes" when it renders
    none (the format the server then describes to the model itself)."""
    t = template or ""
    if "<|channel|>" in t:  # gpt-oss's harmony channels
        return "harmony"
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if "｜DSML｜" in t:  # DeepSeek-V3.2's function_calls block, V4's tool_calls
        return "deepseek_v32" if "function_calls" in t else "deepseek_v4"
    if "]<]minimax[>[" in t:  # MiniMax-M3's namespace token
        return "minimax_m3"
    if MiniMaxM2.start in t:
        return "minimax_m2"
    if DeepSeekV3.start in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<arg_key>" in t:
        newline = r"(\n|\\n)"  # GLM-4.5/4.6 write a newline after the name and between the arguments
        after_name = re.search(r"<tool_call>\{\{[^}]*\}\}" + newline, t)
        return "glm45" if after_name or re.search(newline + r"\s*<arg_key>", t) else "glm47"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    return "hermes"


def tool_parser(name: Optional[str], template: Optional[str] = None) -> ToolParser:
    """The parser ``name`` (one of PARSERS), or with None / "auto" the one ``template`` speaks (``detect``)."""
    if name in (None, "auto"):
        name = detect(template)
    if name not in _FAMILIES:
        raise ValueError(f"unknown tool-call parser {name!r}; expected auto or one of {', '.join(PARSERS)}")
    return _FAMILIES[name]()


def renders_tools(template: Optional[str]) -> bool:
    """Whether a chat template shows the model its tools (it reads the ``tools`` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def arguments_as_mapping(template: Optional[str]) -> bool:
    """Whether a template iterates over a call's arguments (GLM, Qwen3-Coder: ``arguments|items``; MiniMax-M2:
    ``set _args = tool_call.arguments`` then ``_args.items()``) or writes them with ``tojson`` without first asking
    whether they are a string (Kimi-K2's first template: the JSON text would be quoted again), so the history's
    calls must carry them as a mapping rather than the JSON text OpenAI sends."""
    if not template:
        return False
    names = ["arguments"] + re.findall(r"set\s+(\w+)\s*=\s*[\w.\[\]'\"]*arguments\b", template)
    if any(re.search(n + r"\s*(\|\s*items|\.items\(\))", template) for n in names):
        return True
    arguments = r"arguments(?:['\"]\])?"  # .arguments or ['arguments']
    return (re.search(arguments + r"\s*\|\s*tojson", template) is not None
            and re.search(arguments + r"\s+is\s+(?:not\s+)?string", template) is None)
