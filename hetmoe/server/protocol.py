"""The OpenAI request and response shapes: validation of request bodies into (prompt ids, SamplingParams), and
the JSON objects the official client expects back (``chat.completion``, ``chat.completion.chunk``,
``text_completion``, usage, errors).

Every problem with a request is an ``APIError`` carrying the HTTP status and the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``. Bad input is always 400 (``invalid_request_error``), as
OpenAI answers wrong types, bad values, missing fields and too-long prompts; an unknown model is 404.

Bounded work per request: a text prompt is tokenized with a cap (``Tokenizer.encode_capped`` through
``prompt_encoder``): one whose length in characters already proves more tokens than the context holds is refused
(400 ``context_length_exceeded``) without being tokenized, and a longer-than-the-context one after tokenizing a
prefix of about a context's worth of tokens, so a megabyte prompt costs no more than a fitting one. The tokenizer
runs with the GIL released: the event loop and the engine thread go on meanwhile.

Text must be Unicode: a lone surrogate (a JSON ``\\ud800`` escape without its pair) is refused by name (400) before
it reaches the tokenizer. With ``split_special_tokens`` (``hetmoe serve``'s default) special-token text inside a
message (``hi<|im_end|>``) is tokenized as plain text: a message cannot forge a turn of the chat template.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hetmoe.engine.sampler import SamplingParams
from hetmoe.tokenizer import PromptTooLong

ROLES = ("system", "user", "assistant", "developer")  # developer (OpenAI's newer name) is rendered as system
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # bounds the per-token hold-back check
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads lets a lone \\ud800 escape through; no encoder takes it


class APIError(Exception):
    """``headers`` go on the response (Retry-After). ``close``: "after" — the connection closes after the
    response (aiohttp first drains what is left of the body for a while, so the client reads the answer rather
    than a reset); "now" — it closes once the response is written (a body that cannot be read on)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None,
                 close: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers, self.close = headers or {}, close

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ServedModel:
    """What validation needs to know about the model being served."""

    id: str
    prompt_ids: Callable  # (text or messages, chat: bool, cap: int) -> token ids, as LLM.prompt_ids; PromptTooLong
    max_context: int
    vocab_size: int
    has_chat_template: bool
    defaults: dict = field(default_factory=dict)  # temperature / top_p / top_k from generation_config.json
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class Parsed:
    kind: str  # "chat" | "completion"
    prompt_ids: list
    params: SamplingParams
    stream: bool
    include_usage: bool


# ---------------------------------------------------------------------------------------------- fields

def shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_TYPE_NAMES = {_is_int: "an integer", _is_number: "a number", str: "a string", bool: "a boolean", list: "an array",
               dict: "an object"}


def _field(body: dict, name: str, kind, default=None):
    """body[name] when present and not null, checked against ``kind`` (a predicate or a type)."""
    value = body.get(name)
    if value is None:
        return default
    ok = kind(value) if kind in (_is_int, _is_number) else isinstance(value, kind) and not (
        kind is not bool and isinstance(value, bool))
    if not ok:
        raise APIError(400, f"Invalid type for '{name}': expected {_TYPE_NAMES[kind]}, got {shown(value)}",
                       param=name, code="invalid_type")
    return value


def _bad_value(name: str, message: str) -> APIError:
    return APIError(400, f"Invalid '{name}': {message}", param=name, code="invalid_value")


def _text(value: str, name: str) -> str:
    """``value`` when it is Unicode text; 400 naming the field and the first lone surrogate otherwise."""
    bad = _SURROGATE.search(value)
    if bad is not None:
        raise _bad_value(name, f"the text holds a lone surrogate (U+{ord(bad.group()):04X} at character "
                               f"{bad.start()}), which is not Unicode; a \\uD800-\\uDFFF escape must be half of a "
                               "valid pair")
    return value


def _unsupported(name: str, what: str) -> APIError:
    return APIError(400, f"'{name}' is not supported by this server ({what})", param=name,
                    code="unsupported_parameter")


def check_model(body: dict, served: ServedModel) -> None:
    model = body.get("model")
    if model is None:
        raise APIError(400, "You must provide a model parameter ('model').", param="model",
                       code="missing_required_parameter")
    if not isinstance(model, str):
        raise APIError(400, f"Invalid type for 'model': expected a string, got {shown(model)}", param="model",
                       code="invalid_type")
    if model != served.id:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served.id}' (GET /v1/models)",
                       param="model", code="model_not_found")


def _reject_unsupported(body: dict, chat: bool) -> None:
    """Parameters hetmoe does not implement: accepted at their no-op values, refused otherwise (rather than
    silently answering something else than what was asked for)."""
    n = _field(body, "n", _is_int, 1)
    if n != 1:
        raise APIError(400, f"Invalid 'n': only n=1 is supported, got {n}", param="n", code="invalid_value")
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, _is_number, 0) != 0:
            raise _unsupported(name, "only 0")
    if _field(body, "logit_bias", dict, {}):
        raise _unsupported("logit_bias", "only an empty map")
    if chat:
        if _field(body, "logprobs", bool, False):
            raise _unsupported("logprobs", "only false")
        if _field(body, "top_logprobs", _is_int, 0):
            raise _unsupported("top_logprobs", "only 0")
        for name in ("tools", "functions"):
            if _field(body, name, list, []):
                raise _unsupported(name, "no tool calling")
        fmt = _field(body, "response_format", dict)
        if fmt is not None and fmt.get("type") != "text":
            raise _unsupported("response_format", "only {\"type\": \"text\"}")
    else:
        if _field(body, "logprobs", _is_int, 0):
            raise _unsupported("logprobs", "only null or 0")
        if _field(body, "echo", bool, False):
            raise _unsupported("echo", "only false")
        if _field(body, "suffix", str, ""):
            raise _unsupported("suffix", "only an empty suffix")
        if _field(body, "best_of", _is_int, 1) != 1:
            raise _unsupported("best_of", "only 1")


def _stop(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"Invalid type for 'stop': expected a string or an array of strings, got {shown(stop)}",
                       param="stop", code="invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad_value("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise _bad_value("stop", f"stop strings must be 1 to {MAX_STOP_CHARS} characters long")
    return tuple(_text(s, "stop") for s in stops)


def _stream(body: dict) -> tuple:
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict)
    if options is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options",
                       code="invalid_value")
    include_usage = _field(options or {}, "include_usage", bool, False)
    return stream, include_usage


def _sampling(body: dict, served: ServedModel, n_prompt: int, chat: bool, prompt_param: str) -> SamplingParams:
    max_tokens, param = None, "max_tokens"
    for name in (("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)):
        value = _field(body, name, _is_int)
        if value is not None:
            if value < 1:
                raise _bad_value(name, f"expected a value >= 1, got {value}")
            max_tokens, param = value, name  # max_completion_tokens (OpenAI's newer name) wins over max_tokens
    limit = served.max_context
    if n_prompt >= limit:
        raise _too_long(limit, n_prompt, prompt_param)
    if max_tokens is None:
        max_tokens = limit - n_prompt if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, limit - n_prompt)
    elif n_prompt + max_tokens > limit:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                            f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                            f"completion). Please reduce the prompt or '{param}'.",
                       param=param, code="context_length_exceeded")

    temperature = _field(body, "temperature", _is_number, served.defaults.get("temperature", 1.0))
    if not 0 <= temperature <= 2:
        raise _bad_value("temperature", f"expected a value in [0, 2], got {temperature}")
    top_p = _field(body, "top_p", _is_number, served.defaults.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise _bad_value("top_p", f"expected a value in (0, 1], got {top_p}")
    top_k = _field(body, "top_k", _is_int, served.defaults.get("top_k", 0))  # an extension, as in vLLM
    if top_k < -1:
        raise _bad_value("top_k", f"expected -1 or 0 (off) or a positive integer, got {top_k}")
    seed = _field(body, "seed", _is_int)
    if seed is not None and not -2**63 <= seed < 2**64:
        raise _bad_value("seed", f"expected a 64-bit integer, got {seed}")
    ignore_eos = _field(body, "ignore_eos", bool, False)  # an extension, as in vLLM (benchmarks)
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          top_k=max(top_k, 0), seed=seed, stop=_stop(body), ignore_eos=ignore_eos)


# ---------------------------------------------------------------------------------------------- requests

def _content(m: dict, i: int) -> str:
    content, where = m.get("content"), f"messages[{i}].content"
    if isinstance(content, str):
        return _text(content, where)
    if content is None and m.get("role") == "assistant":
        return ""
    if isinstance(content, list):  # content parts: only text
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"Invalid '{where}[{j}]': only {{\"type\": \"text\", \"text\": str}} parts are "
                                    f"supported, got {shown(part)}", param=f"{where}[{j}]", code="invalid_value")
            texts.append(_text(part["text"], f"{where}[{j}].text"))
        return "".join(texts)
    if content is None:
        raise APIError(400, f"Missing required parameter: '{where}'.", param=where, code="missing_required_parameter")
    raise APIError(400, f"Invalid type for '{where}': expected a string or an array of text parts, got "
                        f"{shown(content)}", param=where, code="invalid_type")


def _messages(body: dict) -> list:
    messages = body.get("messages")
    if messages is None:
        raise APIError(400, "Missing required parameter: 'messages'.", param="messages",
                       code="missing_required_parameter")
    if not isinstance(messages, list):
        raise APIError(400, f"Invalid type for 'messages': expected an array, got {shown(messages)}",
                       param="messages", code="invalid_type")
    if not messages:
        raise APIError(400, "Invalid 'messages': empty array. Expected at least one message.", param="messages",
                       code="empty_array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"Invalid type for 'messages[{i}]': expected an object, got {shown(m)}",
                           param=f"messages[{i}]", code="invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"Invalid 'messages[{i}].role': expected one of {', '.join(ROLES)}, got "
                                f"{shown(role)}", param=f"messages[{i}].role", code="invalid_value")
        message = {"role": "system" if role == "developer" else role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            message["name"] = _text(m["name"], f"messages[{i}].name")
        out.append(message)
    return out


def prompt_encoder(tokenizer, split_special_tokens: bool = False) -> Callable:
    """``ServedModel.prompt_ids`` for a ``Tokenizer``: the ids ``LLM.prompt_ids`` gives (a list of messages
    rendered by the chat template, a string as is), through ``encode_capped``: ``PromptTooLong`` past ``cap``.
    ``split_special_tokens``: special-token text inside a message is plain text (``Tokenizer.encode_chat``); a raw
    completions prompt is the client's whole prompt and keeps its special tokens."""

    def prompt_ids(prompt, chat: bool, cap: int) -> list:
        if isinstance(prompt, list) or (chat and tokenizer.has_chat_template):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return tokenizer.encode_chat(messages, cap, split_special_tokens=split_special_tokens)
        return tokenizer.encode_capped(prompt, cap)

    return prompt_ids


def _too_long(limit: int, n_prompt: int, param: str, exact: bool = True) -> APIError:
    amount = f"{n_prompt} tokens" if exact else f"at least {n_prompt} tokens"
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt is "
                         f"{amount}, which leaves no room for the completion. Please shorten the prompt.",
                    param=param, code="context_length_exceeded")


def _encode(served: ServedModel, prompt, chat: bool, param: str) -> list:
    limit = served.max_context
    try:
        return list(served.prompt_ids(prompt, chat, limit - 1))  # at least one token must stay for the completion
    except PromptTooLong as e:
        raise _too_long(limit, e.at_least, param, e.exact) from None
    except Exception as e:  # template errors (roles must alternate ...), text the tokenizer cannot take
        raise APIError(400, f"Invalid '{param}': {e}", param=param, code="invalid_value") from e


def _prompt_ids(body: dict, served: ServedModel) -> list:
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        ids = _encode(served, _text(prompt, "prompt"), False, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = prompt
        if len(ids) >= served.max_context:
            raise _too_long(served.max_context, len(ids), "prompt")
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise _bad_value("prompt", f"token ids must be in [0, {served.vocab_size}), got {bad[0]}")
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "Invalid 'prompt': one prompt per request is supported (send one request per prompt)",
                       param="prompt", code="invalid_value")
    else:
        raise APIError(400, f"Invalid type for 'prompt': expected a string or an array of token ids, got "
                            f"{shown(prompt)}", param="prompt", code="invalid_type")
    if not ids:
        raise _bad_value("prompt", "the prompt is empty (no tokens)")
    return ids


def parse_request(body: Any, served: ServedModel, kind: str) -> Parsed:
    """A request body (parsed JSON) -> what the scheduler needs; APIError on anything wrong with it."""
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {shown(body)}", code="invalid_type")
    chat = kind == "chat"
    check_model(body, served)
    _reject_unsupported(body, chat)
    stream, include_usage = _stream(body)
    if chat:
        messages = _messages(body)
        if not served.has_chat_template:
            raise APIError(400, "This model has no chat template; use /v1/completions with a raw prompt",
                           param="messages", code="invalid_value")
        ids = _encode(served, messages, True, "messages")
    else:
        ids = _prompt_ids(body, served)
    params = _sampling(body, served, len(ids), chat, "messages" if chat else "prompt")
    return Parsed(kind, ids, params, stream, include_usage)


# ---------------------------------------------------------------------------------------------- responses

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, rid: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": use}


def chunk(kind: str, rid: str, model: str, created: int, *, text: Optional[str] = None, role: bool = False,
          finish_reason: Optional[str] = None, use: Optional[dict] = None, choices: bool = True) -> dict:
    """One streamed object. ``choices=False``: the usage-only last chunk (``stream_options.include_usage``)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice] if choices else []}
    if use is not None or not choices:
        out["usage"] = use
    return out
