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

ROLES = ("system", "user", "assistant", "developer", "tool")  # developer (OpenAI's newer name): rendered as system
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256  # bounds the per-token hold-back check
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound; its completions stop at 5)
MAX_CHOICES = 128  # n x prompts in one request (OpenAI's bound on n)
MAX_REPETITION_PENALTY = 10.0
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
    aliases: tuple = ()  # more names a request's 'model' may give (--served-model-name); responses say ``id``
    tokenizer: Any = None  # the Tokenizer (token text for logprobs, /tokenize); None in tests that need neither
    chat: Any = None  # chat.ChatSupport (tool and reasoning parsers, grammars); None: built from the tokenizer

    @property
    def names(self) -> tuple:
        return (self.id, *self.aliases)


@dataclass
class Prompt:
    """One prompt of a request: its ids, its SamplingParams, and for /v1/completions the text to echo."""

    ids: list
    params: SamplingParams
    text: Optional[str] = None  # a text prompt as sent (echo); None: token ids, echoed decoded


@dataclass
class Parsed:
    kind: str  # "chat" | "completion"
    prompt_ids: list  # the first prompt's (the only one but for /v1/completions with a list of prompts)
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    logprobs: Optional[int] = None  # alternatives per token shown (0: the chosen token alone); None: no logprobs
    echo: bool = False  # /v1/completions: the prompt (and with logprobs its tokens' logprobs) leads each choice
    generate: bool = True  # False: max_tokens 0 with echo, the prompt alone is answered
    prompts: list = field(default_factory=list)  # [Prompt], one per prompt; choice p * n + j is prompt p's j-th
    chat: Any = None  # chat.ChatOptions of a chat request: tools, reasoning, response_format

    def choices(self) -> list:
        """[(index, Prompt, SamplingParams)] for every choice, the seeds told apart per choice."""
        prompts = self.prompts or [Prompt(self.prompt_ids, self.params)]
        return [(p * self.n + j, prompt, prompt.params.for_choice(j) if self.n > 1 else prompt.params)
                for p, prompt in enumerate(prompts) for j in range(self.n)]


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
    if model not in served.names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{served.id}' (GET /v1/models)",
                       param="model", code="model_not_found")


# Fields of OpenAI's API, and extensions of vLLM's that clients send, which hetmoe does not implement: accepted at
# their no-op values (null always), refused by name otherwise. Unknown fields are ignored, as OpenAI does.
_NO_OPS = {
    "min_tokens": ((0,), "only 0"), "use_beam_search": ((False,), "only false: no beam search"),
    "length_penalty": ((1, 1.0), "only 1: no beam search"), "include_stop_str_in_output": ((False,), "only false"),
    "spaces_between_special_tokens": ((True,), "only true"),
    "truncate_prompt_tokens": ((), "prompts are never truncated"), "bad_words": (([],), "only an empty list"),
    "allowed_token_ids": ((), "logit_bias can favour tokens"), "priority": ((0,), "only 0: requests run in order"),
    "return_tokens_as_token_ids": ((False,), "only false"),
    "prompt_logprobs": ((), "/v1/completions with echo and logprobs gives the prompt's logprobs"),
}
_CHAT_NO_OPS = {
    "modalities": ((["text"],), 'only ["text"]'), "audio": ((), "text only"), "prediction": ((), "none"),
    "web_search_options": ((), "no web search"), "echo": ((False,), "only false; /v1/completions echoes"),
    "continue_final_message": ((False,), "only false"), "add_generation_prompt": ((True,), "only true"),
    "chat_template": ((), "one template per server: --chat-template"), "documents": ((), "none"),
    "mm_processor_kwargs": ((), "text only"),
}
_COMPLETION_NO_OPS = {"suffix": (("",), "only an empty suffix"), "best_of": ((1,), "only 1")}


def _reject_unsupported(body: dict, chat: bool) -> None:
    """Parameters hetmoe does not implement: accepted at their no-op values, refused otherwise (rather than
    silently answering something else than what was asked for)."""
    for name, (no_ops, what) in {**_NO_OPS, **(_CHAT_NO_OPS if chat else _COMPLETION_NO_OPS)}.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in no_ops):
            raise _unsupported(name, what)


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


def _logprobs(body: dict, chat: bool) -> tuple:
    """(alternatives per token or None for no logprobs, echo): chat's ``logprobs`` (bool) and ``top_logprobs``,
    completions' ``logprobs`` (int) and ``echo``."""
    if chat:
        top = _field(body, "top_logprobs", _is_int)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise _bad_value("top_logprobs", f"expected a value in [0, {MAX_LOGPROBS}], got {top}")
        if not _field(body, "logprobs", bool, False):
            if top:
                raise _bad_value("top_logprobs", "'logprobs' must be true when 'top_logprobs' is used")
            return None, False
        return top or 0, False
    n = _field(body, "logprobs", _is_int)
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise _bad_value("logprobs", f"expected a value in [0, {MAX_LOGPROBS}], got {n}")
    return n, _field(body, "echo", bool, False)


def _logit_bias(body: dict, vocab_size: int) -> Optional[dict]:
    bias = _field(body, "logit_bias", dict)
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise _bad_value("logit_bias", f"keys must be token ids in [0, {vocab_size}) (as strings), got "
                                           f"{shown(key)}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise _bad_value("logit_bias", f"values must be numbers in [-100, 100], got {shown(value)} for token "
                                           f"{token}")
        out[token] = float(value)
    return out


def _penalties(body: dict, served: ServedModel) -> dict:
    """The SamplingParams fields beyond OpenAI's first ones, those a request sets (the others keep their
    defaults): min_p, repetition_penalty, presence_penalty, frequency_penalty, logit_bias, stop_token_ids."""
    out = {}
    for name, low, high, off in (("presence_penalty", -2, 2, 0), ("frequency_penalty", -2, 2, 0),
                                 ("min_p", 0, 1, 0)):
        value = _field(body, name, _is_number)
        if value is not None and not low <= value <= high:
            raise _bad_value(name, f"expected a value in [{low}, {high}], got {value}")
        if value is not None and value != off:
            out[name] = float(value)
    value = _field(body, "repetition_penalty", _is_number)  # an extension, as in vLLM
    if value is not None and not 0 < value <= MAX_REPETITION_PENALTY:
        raise _bad_value("repetition_penalty", f"expected a value in (0, {MAX_REPETITION_PENALTY}] (1: off), got "
                                               f"{value}")
    if value is not None and value != 1:
        out["repetition_penalty"] = float(value)
    bias = _logit_bias(body, served.vocab_size)
    if bias:
        out["logit_bias"] = bias
    ids = _field(body, "stop_token_ids", list)  # an extension, as in vLLM
    if ids:
        if len(ids) > MAX_STOP_STRINGS or not all(_is_int(t) and 0 <= t < served.vocab_size for t in ids):
            raise _bad_value("stop_token_ids", f"expected at most {MAX_STOP_STRINGS} token ids in "
                                               f"[0, {served.vocab_size}), got {shown(ids)}")
        out["stop_token_ids"] = tuple(ids)
    return out


def _sampling(body: dict, served: ServedModel, n_prompt: int, chat: bool, prompt_param: str,
              logprobs: Optional[int] = None, echo: bool = False) -> SamplingParams:
    """The SamplingParams of one prompt of ``n_prompt`` tokens. ``max_tokens`` 0 is taken with ``echo`` (the
    prompt alone is answered): the params then ask for one token, which the response leaves out."""
    max_tokens, param = None, "max_tokens"
    for name in (("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)):
        value = _field(body, name, _is_int)
        if value is not None:
            if value < 1 and not (value == 0 and echo):
                raise _bad_value(name, f"expected a value >= 1{'' if chat else ' (0 only with echo)'}, got {value}")
            max_tokens, param = max(value, 1), name  # max_completion_tokens (OpenAI's newer name) wins
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
    skip_special = _field(body, "skip_special_tokens", bool, True)  # an extension, as in vLLM
    extra = _penalties(body, served)
    if logprobs is not None:
        extra["logprobs"] = logprobs
        if echo:
            extra["prompt_logprobs"] = logprobs
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                              top_k=max(top_k, 0), seed=seed, stop=_stop(body), ignore_eos=ignore_eos,
                              skip_special_tokens=skip_special, **extra)
    except ValueError as e:  # a combination the sampler refuses
        raise APIError(400, f"Invalid sampling parameters: {e}", code="invalid_value") from None


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


def chat_path():
    """hetmoe.server.chat (tools, reasoning, response_format), which imports this module."""
    from hetmoe.server import chat

    return chat


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
        message.update(chat_path().message_fields(m, i))  # tool calls, tool results, reasoning
        out.append(message)
    return out


def prompt_encoder(tokenizer, split_special_tokens: bool = False) -> Callable:
    """``ServedModel.prompt_ids`` for a ``Tokenizer``: the ids ``LLM.prompt_ids`` gives (a list of messages
    rendered by the chat template, a string as is), through ``encode_capped``: ``PromptTooLong`` past ``cap``.
    ``split_special_tokens``: special-token text inside a message is plain text (``Tokenizer.encode_chat``); a raw
    completions prompt is the client's whole prompt and keeps its special tokens."""

    def prompt_ids(prompt, chat: bool, cap: int, template_kwargs: Optional[dict] = None) -> list:
        if isinstance(prompt, list) or (chat and tokenizer.has_chat_template):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return tokenizer.encode_chat(messages, cap, split_special_tokens=split_special_tokens,
                                         **(template_kwargs or {}))
        return tokenizer.encode_capped(prompt, cap)

    return prompt_ids


def _too_long(limit: int, n_prompt: int, param: str, exact: bool = True) -> APIError:
    amount = f"{n_prompt} tokens" if exact else f"at least {n_prompt} tokens"
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt is "
                         f"{amount}, which leaves no room for the completion. Please shorten the prompt.",
                    param=param, code="context_length_exceeded")


def _encode(served: ServedModel, prompt, chat: bool, param: str, template_kwargs: Optional[dict] = None) -> list:
    """``template_kwargs``: variables for the chat template (tools, enable_thinking ...)."""
    limit = served.max_context
    extra = {"template_kwargs": template_kwargs} if template_kwargs else {}
    try:
        return list(served.prompt_ids(prompt, chat, limit - 1, **extra))  # one token must stay for the completion
    except PromptTooLong as e:
        raise _too_long(limit, e.at_least, param, e.exact) from None
    except Exception as e:  # template errors (roles must alternate ...), text the tokenizer cannot take
        raise APIError(400, f"Invalid '{param}': {e}", param=param, code="invalid_value") from e


def _one_prompt(prompt, served: ServedModel, param: str) -> tuple:
    """(ids, text) of one completions prompt: a string (its text kept for echo) or a list of token ids."""
    if isinstance(prompt, str):
        ids, text = _encode(served, _text(prompt, param), False, param), prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids, text = prompt, None
        if len(ids) >= served.max_context:
            raise _too_long(served.max_context, len(ids), param)
        bad = [t for t in ids if not 0 <= t < served.vocab_size]
        if bad:
            raise _bad_value(param, f"token ids must be in [0, {served.vocab_size}), got {bad[0]}")
    else:
        raise APIError(400, f"Invalid type for '{param}': expected a string or an array of token ids, got "
                            f"{shown(prompt)}", param=param, code="invalid_type")
    if not ids:
        raise _bad_value(param, "the prompt is empty (no tokens)")
    return ids, text


def _prompts(body: dict, served: ServedModel) -> list:
    """[(ids, text, param)]: ``prompt`` is a string, an array of token ids, or an array of either (one choice per
    prompt, in order)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise _bad_value("prompt", f"at most {MAX_CHOICES} prompts per request, got {len(prompt)}")
        many = len(prompt) > 1
        return [(*_one_prompt(p, served, f"prompt[{i}]" if many else "prompt"), f"prompt[{i}]" if many else "prompt")
                for i, p in enumerate(prompt)]
    return [(*_one_prompt(prompt, served, "prompt"), "prompt")]


def parse_request(body: Any, served: ServedModel, kind: str) -> Parsed:
    """A request body (parsed JSON) -> what the scheduler needs; APIError on anything wrong with it."""
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {shown(body)}", code="invalid_type")
    chat = kind == "chat"
    check_model(body, served)
    _reject_unsupported(body, chat)
    stream, include_usage = _stream(body)
    n = _field(body, "n", _is_int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise _bad_value("n", f"expected a value in [1, {MAX_CHOICES}], got {n}")
    logprobs, echo = _logprobs(body, chat)
    options = None
    if chat:
        messages = _messages(body)
        if not served.has_chat_template:
            raise APIError(400, "This model has no chat template; use /v1/completions with a raw prompt, or start "
                                "the server with --chat-template FILE (DeepSeek-V3.2 and V4, which ship their "
                                "encoding as code: --chat-template deepseek_v32 or deepseek_v4)",
                           param="messages", code="invalid_value")
        options = chat_path().parse(body, messages, chat_path().support_of(served))
        ids = _encode(served, options.messages, True, "messages", options.template_kwargs)
        options.prompt_done(ids)
        prompts = [(ids, None, "messages")]
    else:
        prompts = _prompts(body, served)
    if n * len(prompts) > MAX_CHOICES:
        raise _bad_value("n", f"n x prompts must be at most {MAX_CHOICES}, got {n} x {len(prompts)}")
    parsed = [Prompt(ids, _sampling(body, served, len(ids), chat, param, logprobs, echo), text)
              for ids, text, param in prompts]
    generate = body.get("max_tokens") != 0  # 0 is only taken with echo (_sampling)
    if options is not None:
        constraint = options.constraint()  # compiled now (or found in the cache): a bad schema is a 400 here
        markers = options.shown_special_ids()  # the parsers' markers that are special tokens stay in the text
        for p in parsed:
            p.params.constraint, p.params.shown_special_ids = constraint, markers
    return Parsed(kind, parsed[0].ids, parsed[0].params, stream, include_usage, n=n, logprobs=logprobs, echo=echo,
                  generate=generate, prompts=parsed, chat=options)


# ---------------------------------------------------------------------------------------------- responses

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int, cached: Optional[int] = None) -> dict:
    """OpenAI's usage object; ``cached``: prompt tokens found in the KV cache (prefix reuse), not computed again."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def choice(kind: str, index: int, text: str, finish_reason: str, logprobs: Optional[dict] = None) -> dict:
    """One choice of a response that is not streamed."""
    if kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def response_body(kind: str, rid: str, model: str, choices: list, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": use}


def chunk(kind: str, rid: str, model: str, created: int, *, text: Optional[str] = None, role: bool = False,
          finish_reason: Optional[str] = None, use: Optional[dict] = None, choices: bool = True, index: int = 0,
          logprobs: Optional[dict] = None) -> dict:
    """One streamed object. ``choices=False``: the usage-only last chunk (``stream_options.include_usage``)."""
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice] if choices else []}
    if use is not None or not choices:
        out["usage"] = use
    return out
