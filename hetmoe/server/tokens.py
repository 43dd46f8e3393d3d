"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` in vLLM's shapes (lm-eval's remote
tokenizer uses all three, so an evaluation needs no copy of the tokenizer on the client's side):

    /tokenize     {"prompt": str, "add_special_tokens": true}                 the text as a completions prompt
                  {"messages": [...], "add_generation_prompt": true}          rendered as a chat prompt
                  -> {"tokens": [ids], "count": n, "max_model_len": context, "token_strs": null | [str]}
    /detokenize   {"tokens": [ids]} -> {"prompt": text}                      special tokens kept as text
    /tokenizer_info -> {"tokenizer_class", "eos_token", "bos_token", "pad_token", "unk_token", "chat_template",
                        "model_max_length"}

``model``, when given, must name the served model. Other fields are refused by name. A text is tokenized whole
(the body cap bounds it), whether or not it fits the context: ``count`` tells; ``messages`` (with ``tools`` and
``chat_template_kwargs`` when given) are rendered and checked as by /v1/chat/completions, which refuses a
conversation that leaves no room in the context.
"""

from __future__ import annotations

from typing import Any

from hetmoe.server import protocol
from hetmoe.server.protocol import APIError, ServedModel, shown

MAX_TOKENS = 1 << 31  # no cap of our own: the body cap bounds the text
_CHAT_FIELDS = ("messages", "tools", "chat_template_kwargs")  # rendered as the chat endpoint renders them


def _check(body: Any, served: ServedModel, allowed: tuple) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {shown(body)}", code="invalid_type")
    if body.get("model") is not None:
        protocol.check_model(body, served)
    for name in body:
        if name not in allowed and name != "model":
            raise APIError(400, f"'{name}' is not supported by this endpoint (it takes {', '.join(allowed)})",
                           param=name, code="unsupported_parameter")
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"Invalid type for '{name}': expected a boolean, got {shown(value)}", param=name,
                       code="invalid_type")
    return value


def tokenize(body: Any, served: ServedModel) -> dict:
    body = _check(body, served, ("prompt", "add_special_tokens", "add_generation_prompt", "return_token_strs",
                                 *_CHAT_FIELDS))
    tokenizer = served.tokenizer
    strs = _flag(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise APIError(400, "Give exactly one of 'prompt' (a text) and 'messages' (a conversation).",
                       param="prompt", code="invalid_value")
    if "messages" in body:
        if not _flag(body, "add_generation_prompt", True):
            raise APIError(400, "'add_generation_prompt' false is not supported (the chat prompt ends with the "
                                "assistant's turn opened)", param="add_generation_prompt", code="invalid_value")
        if _flag(body, "add_special_tokens", False):
            raise APIError(400, "'add_special_tokens' true is not supported with 'messages' (the chat template "
                                "writes the special tokens)", param="add_special_tokens", code="invalid_value")
        chat = {"model": served.id, "max_tokens": 1, **{k: body[k] for k in _CHAT_FIELDS if k in body}}
        ids = protocol.parse_request(chat, served, "chat").prompt_ids  # rendered as /v1/chat/completions does
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise APIError(400, f"Invalid type for 'prompt': expected a string, got {shown(prompt)}",
                           param="prompt", code="invalid_type")
        if _flag(body, "add_special_tokens", True):
            ids = _encode(served.prompt_ids, prompt, False, "prompt")
        else:
            ids = _encode(lambda text, chat, cap: tokenizer.encode_capped(text, cap, add_special_tokens=False),
                          prompt, False, "prompt")
    return {"tokens": ids, "count": len(ids), "max_model_len": served.max_context,
            "token_strs": [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if strs else None}


def _encode(encoder, prompt, chat: bool, param: str) -> list:
    try:
        return list(encoder(prompt, chat, MAX_TOKENS))
    except Exception as e:  # template errors, text the tokenizer cannot take
        raise APIError(400, f"Invalid '{param}': {e}", param=param, code="invalid_value") from e


def detokenize(body: Any, served: ServedModel) -> dict:
    body = _check(body, served, ("tokens",))
    ids = body.get("tokens")
    if ids is None:
        raise APIError(400, "Missing required parameter: 'tokens'.", param="tokens",
                       code="missing_required_parameter")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError(400, f"Invalid type for 'tokens': expected an array of token ids, got {shown(ids)}",
                       param="tokens", code="invalid_type")
    bad = [t for t in ids if not 0 <= t < served.vocab_size]
    if bad:
        raise APIError(400, f"Invalid 'tokens': token ids must be in [0, {served.vocab_size}), got {bad[0]}",
                       param="tokens", code="invalid_value")
    return {"prompt": served.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(served: ServedModel) -> dict:
    tok = served.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": tok.chat_template,
            "model_max_length": served.max_context}
