"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a translation onto the chat
path: a Messages body becomes a chat completions body (``to_chat``), validated and run as one (tools, tool
choice and thinking included), and the chat answer becomes a message (``message``) or the Messages stream's
events (``StreamTranslator``). Pure functions over JSON values: the handlers are in app.py.

    system                       -> a system message first
    user text / tool_result      -> user messages / tool messages (role "tool", tool_call_id), in order
    assistant text / tool_use    -> an assistant message with content and tool_calls (arguments as JSON text)
    assistant thinking           -> its reasoning_content; redacted_thinking is dropped (opaque to any model but
                                    Anthropic's)
    image, document, ... blocks  -> 400 naming the block
    max_tokens (required), stop_sequences, temperature (0-1), top_p, top_k, stream, metadata (ignored)
    tools [{name, description, input_schema}]  -> function tools;  tool_choice auto / any / tool / none ->
    auto / required / a named function / none;  disable_parallel_tool_use -> parallel_tool_calls false
    thinking {"type": "enabled" | "adaptive" | "between_tools", "budget_tokens"} -> chat_template_kwargs.
    enable_thinking true, {"type": "disabled"} -> false. The budget is checked (>= 1024, < max_tokens) but
    max_tokens alone bounds the thinking and the answer together.
    output_config.effort -> reasoning_effort (xhigh and max: high); output_config.format (or output_format)
    {"type": "json_schema", "schema"} -> response_format json_schema, strict

Finish reasons: stop -> end_turn, or stop_sequence with the stop sequence that ended the text; length ->
max_tokens; tool_calls -> tool_use. Usage: input_tokens are the prompt tokens computed, cache_read_input_tokens
those found in the KV cache (prefix reuse), as Anthropic splits them. Errors: ``{"type": "error", "error": {"type",
"message"}}`` with the field named in the message.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from hetmoe.server.protocol import APIError, shown

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
               413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}
MIN_THINKING_BUDGET = 1024  # Anthropic's lower bound on budget_tokens
# Fields Anthropic defines that this server does not implement: refused by name when set (other than to the
# values listed); unknown fields are ignored, metadata / user_profile_id / workspace_id (who is asking) and
# cache_control (prefix reuse is automatic) are taken as they change nothing here.
_UNSUPPORTED = {"mcp_servers": ((), "no MCP servers"), "container": ((), "no containers"),
                "context_management": ((), "none"), "diagnostics": ((), "none"), "inference_geo": ((), "none"),
                "service_tier": (("auto", "standard_only"), "only auto or standard_only"),
                "speed": (("standard",), "only standard")}
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def _bad(where: str, message: str) -> APIError:
    return APIError(400, f"{where}: {message}", param=where, code="invalid_value")


def _missing(where: str) -> APIError:
    return APIError(400, f"{where}: Field required", param=where, code="missing_required_parameter")


def _text_blocks(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, f"expected a string or an array of text blocks, got {shown(value)}")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise _bad(f"{where}.{j}", f"only text blocks are supported here, got {shown(kind or block)}")
        if not isinstance(block.get("text"), str):
            raise _bad(f"{where}.{j}.text", f"expected a string, got {shown(block.get('text'))}")
        texts.append(block["text"])
    return "".join(texts)


def _refused_block(kind: Any, where: str) -> APIError:
    what = {"image": "images are not supported (this server serves a text model)",
            "document": "documents are not supported (send their text in a text block)",
            "search_result": "search results are not supported", "server_tool_use": "no server tools",
            "web_search_tool_result": "no server tools", "container_upload": "no containers"}
    return _bad(where, what.get(kind, f"content blocks of type {shown(kind)} are not supported"))


class _Messages:
    """Anthropic messages -> chat messages, with where each chat message came from (for error messages)."""

    def __init__(self):
        self.out: list = []
        self.where: list = []

    def add(self, message: dict, where: str) -> None:
        self.out.append(message)
        self.where.append(where)

    def user(self, content: Any, i: int) -> None:
        where = f"messages.{i}.content"
        if isinstance(content, str):
            self.add({"role": "user", "content": content}, where)
            return
        texts: list = []
        for j, block in enumerate(content):
            kind = block.get("type")
            if kind == "text":
                texts.append(_text_blocks([block], where))
            elif kind == "tool_result":
                if texts:  # text before a tool result stays before it
                    self.add({"role": "user", "content": "".join(texts)}, where)
                    texts = []
                self.add(self._tool_result(block, f"{where}.{j}"), f"{where}.{j}")
            else:
                raise _refused_block(kind, f"{where}.{j}")
        if texts:
            self.add({"role": "user", "content": "".join(texts)}, where)

    def _tool_result(self, block: dict, where: str) -> dict:
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise _missing(f"{where}.tool_use_id") if call_id is None else _bad(
                f"{where}.tool_use_id", f"expected a non-empty string, got {shown(call_id)}")
        content = block.get("content")
        text = "" if content is None else _text_blocks(content, f"{where}.content")
        if block.get("is_error") is True:
            text = f"Error: {text}" if text else "Error"
        return {"role": "tool", "tool_call_id": call_id, "content": text}

    def assistant(self, content: Any, i: int) -> None:
        where = f"messages.{i}.content"
        if isinstance(content, str):
            self.add({"role": "assistant", "content": content}, where)
            return
        texts, calls, thinking = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type")
            if kind == "text":
                texts.append(_text_blocks([block], where))
            elif kind == "thinking":
                if not isinstance(block.get("thinking"), str):
                    raise _bad(f"{where}.{j}.thinking", f"expected a string, got {shown(block.get('thinking'))}")
                thinking.append(block["thinking"])
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use":
                calls.append(self._tool_use(block, f"{where}.{j}"))
            else:
                raise _refused_block(kind, f"{where}.{j}")
        message: dict = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        self.add(message, where)

    @staticmethod
    def _tool_use(block: dict, where: str) -> dict:
        for name in ("id", "name"):
            if not isinstance(block.get(name), str) or not block[name]:
                raise _missing(f"{where}.{name}") if block.get(name) is None else _bad(
                    f"{where}.{name}", f"expected a non-empty string, got {shown(block.get(name))}")
        arguments = block.get("input", {})
        if not isinstance(arguments, dict):
            raise _bad(f"{where}.input", f"expected an object, got {shown(arguments)}")
        return {"id": block["id"], "type": "function",
                "function": {"name": block["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _messages(body: dict) -> tuple:
    messages = body.get("messages")
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty array of messages, got {shown(messages)}")
    out = _Messages()
    system = body.get("system")
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.add({"role": "system", "content": text}, "system")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages.{i}", f"expected an object, got {shown(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise _bad(f"messages.{i}.role", f"expected 'user' or 'assistant', got {shown(role)}")
        if content is None:
            raise _missing(f"messages.{i}.content")
        if not isinstance(content, (str, list)) or isinstance(content, list) and not all(
                isinstance(b, dict) for b in content):
            raise _bad(f"messages.{i}.content", f"expected a string or an array of content blocks, got "
                                                f"{shown(content)}")
        (out.user if role == "user" else out.assistant)(content, i)
    return out.out, out.where


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", f"expected an array, got {shown(tools)}")
        out = []
        for k, tool in enumerate(tools):
            if not isinstance(tool, dict):
                raise _bad(f"tools.{k}", f"expected an object, got {shown(tool)}")
            if tool.get("type") not in (None, "custom"):  # Anthropic's server tools (web search, code ...)
                raise _bad(f"tools.{k}.type", f"only client tools (with an input_schema) are supported, got "
                                              f"{shown(tool.get('type'))}")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise _missing(f"tools.{k}.name") if tool.get("name") is None else _bad(
                    f"tools.{k}.name", f"expected a non-empty string, got {shown(tool.get('name'))}")
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise _missing(f"tools.{k}.input_schema") if schema is None else _bad(
                    f"tools.{k}.input_schema", f"expected a JSON schema object, got {shown(schema)}")
            function = {"name": tool["name"], "parameters": schema}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            out.append({"type": "function", "function": function})
        if out:
            chat["tools"] = out
    choice = body.get("tool_choice")
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice", f"expected an object with type auto, any, tool or none, got {shown(choice)}")
    kind = choice["type"]
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise _missing("tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None:
        if not isinstance(disable, bool):
            raise _bad("tool_choice.disable_parallel_tool_use", f"expected a boolean, got {shown(disable)}")
        if kind != "none":
            chat["parallel_tool_calls"] = not disable


def _output(body: dict, chat: dict) -> None:
    """output_config {effort, format} (and the older top-level output_format) -> reasoning_effort and
    response_format json_schema."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise _bad("output_config", f"expected an object, got {shown(config)}")
    config = config or {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in EFFORTS:
            raise _bad("output_config.effort", f"expected one of {', '.join(EFFORTS)}, got {shown(effort)}")
        chat["reasoning_effort"] = EFFORTS[effort]
    for where, fmt in (("output_config.format", config.get("format")), ("output_format", body.get("output_format"))):
        if fmt is None:
            continue
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad(where, f"expected {{\"type\": \"json_schema\", \"schema\": {{...}}}}, got {shown(fmt)}")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}


def _thinking(body: dict, chat: dict) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive",
                                                                      "between_tools"):
        raise _bad("thinking", f"expected an object with type enabled, adaptive, between_tools or disabled, got "
                               f"{shown(thinking)}")
    if thinking.get("display") not in (None, "summarized"):
        raise _bad("thinking.display", f"only summarized (thinking returned as it is), got "
                                       f"{shown(thinking['display'])}")
    if thinking["type"] == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise _missing("thinking.budget_tokens") if budget is None else _bad(
                "thinking.budget_tokens", f"expected an integer, got {shown(budget)}")
        max_tokens = body.get("max_tokens")
        if budget < MIN_THINKING_BUDGET or isinstance(max_tokens, int) and budget >= max_tokens:
            raise _bad("thinking.budget_tokens", f"expected at least {MIN_THINKING_BUDGET} and less than max_tokens "
                                                 f"({shown(max_tokens)}), got {budget}")
    chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}


def to_chat(body: Any, *, count_only: bool = False) -> tuple:
    """A Messages request body -> (the chat completions body, where each chat message came from). APIError with
    the Anthropic field named. ``count_only`` (count_tokens): max_tokens and the sampling fields are not read."""
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {shown(body)}", code="invalid_type")
    if body.get("model") is None:
        raise _missing("model")
    for name, (allowed, what) in _UNSUPPORTED.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise APIError(400, f"{name}: not supported by this server ({what})", param=name,
                           code="unsupported_parameter")
    messages, where = _messages(body)
    chat: dict = {"model": body["model"], "messages": messages}
    _tools(body, chat)
    _thinking(body, chat)
    _output(body, chat)
    if count_only:
        chat["max_tokens"] = 1
        return chat, where
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise _missing("max_tokens")
    chat["max_tokens"] = max_tokens  # checked by the chat path (an integer >= 1 that fits the context)
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
        raise _bad("temperature", f"expected a value in [0, 1], got {temperature}")
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("stop_sequences", f"expected an array of strings, got {shown(stops)}")
        if stops:
            chat["stop"] = stops
    stream = body.get("stream")
    if stream is not None:
        chat["stream"] = stream
        if stream is True:
            chat["stream_options"] = {"include_usage": True}
    return chat, where


_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def renamed(e: APIError, where: list) -> APIError:
    """An error of the chat path with the Anthropic field named: ``messages[k]...`` -> the message (or system)
    it came from, ``stop`` -> ``stop_sequences``."""
    param = e.param or ""
    name = _PARAMS.get(param)
    if param.startswith("messages[") and "]" in param:
        k = param[len("messages["):param.index("]")]
        rest = param[param.index("]") + 1:]
        if rest.startswith(".content"):
            rest = rest[len(".content"):]
        else:  # a field the translation wrote (tool_call_id, tool_calls ...): the block it came from
            rest = ".tool_use_id" if rest == ".tool_call_id" else ""
        if k.isdigit() and int(k) < len(where):
            name = where[int(k)] + rest
    if name is None:
        return e
    message = e.message.replace(f"'{param}'", f"'{name}'")
    return APIError(e.status, message, type=e.type, param=name, code=e.code, headers=e.headers, close=e.close)


def new_id() -> str:
    return "msg_" + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop_reason(finish: Optional[str], stop_sequence: Optional[str]) -> str:
    if finish == "stop" and stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish or "stop", "end_turn")


def _tool_input(arguments: str):
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def message(chat: dict, model: str, stop_sequence: Optional[str], cached: int) -> dict:
    """A chat.completion body (one choice) -> a Messages ``message``."""
    choice = chat["choices"][0]
    m = choice["message"]
    content = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    for call in m.get("tool_calls") or []:
        function = call.get("function", {})
        value = _tool_input(function.get("arguments", ""))
        if value is None:  # not an object: the call is given back as the text it was
            content.append({"type": "text", "text": function.get("arguments", "")})
        else:
            content.append({"type": "tool_use", "id": call["id"], "name": function.get("name", ""), "input": value})
    use = chat["usage"]
    return {"id": new_id(), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(choice["finish_reason"], stop_sequence), "stop_sequence": stop_sequence,
            "usage": usage(use["prompt_tokens"], use["completion_tokens"], cached)}


class StreamTranslator:
    """chat.completion.chunk objects -> the Messages stream's (event, data) pairs: ``start`` (message_start),
    ``feed(chunk)`` (content_block_start / _delta / _stop as blocks open and close), ``finish`` (message_delta
    with the stop reason and usage, message_stop)."""

    def __init__(self, model: str, prompt_tokens: int):
        self.id, self.model, self.prompt_tokens = new_id(), model, prompt_tokens
        self.index = -1  # the open block's index
        self.block: Optional[str] = None  # its type: "text" | "thinking" | "tool_use"
        self.tools: dict = {}  # the chat chunks' tool call index -> its block index
        self.finish: Optional[str] = None
        self.usage: Optional[dict] = None

    def start(self) -> list:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}})]

    def _open(self, block: dict) -> list:
        events = self._close()
        self.index += 1
        self.block = block["type"]
        events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return events

    def _close(self) -> list:
        if self.block is None:
            return []
        events = []
        if self.block == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.block = None
        return events + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> tuple:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def feed(self, chunk: dict) -> list:
        if not chunk.get("choices"):
            self.usage = chunk.get("usage") or self.usage
            return []
        choice = chunk["choices"][0]
        delta, events = choice.get("delta") or {}, []
        if delta.get("reasoning_content"):
            if self.block != "thinking":
                events += self._open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.block != "text":
                events += self._open({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            k = call.get("index", 0)
            function = call.get("function") or {}
            if k not in self.tools:
                events += self._open({"type": "tool_use", "id": call.get("id") or f"toolu_{uuid.uuid4().hex}",
                                      "name": function.get("name", ""), "input": {}})
                self.tools[k] = self.index
            if function.get("arguments"):
                events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return events

    def end(self, stop_sequence: Optional[str], cached: int) -> list:
        use = self.usage or {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0}
        out = usage(use["prompt_tokens"], use["completion_tokens"], cached)
        return self._close() + [
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": stop_reason(self.finish, stop_sequence),
                                         "stop_sequence": stop_sequence},
                               "usage": out}),
            ("message_stop", {"type": "message_stop"})]


def stop_sequence(req, stops: list) -> Optional[str]:
    """The stop sequence that ended ``req`` (a finished engine Request), or None when something else did (an
    end-of-sequence token, max_tokens, a tool call): its text was cut where one of ``stops`` began."""
    st = req.state
    if not stops or st is None or st.finish_reason != "stop":
        return None
    return st.stop_string
