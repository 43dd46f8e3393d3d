"""``hetmoe serve``: the OpenAI-compatible HTTP server (hetmoe/server/)."""

from __future__ import annotations

import argparse

from hetmoe.cli.options import add_shape_options
from hetmoe.config.flags import add_engine_options, port, positive_int, size
from hetmoe.server.reasoning import PARSERS as REASONING_PARSERS
from hetmoe.server.tool_calls import PARSERS as TOOL_PARSERS


def _api_key(text: str) -> str:
    from hetmoe.server.access import check_api_key

    try:
        return check_api_key(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _api_key_file(text: str) -> str:
    from hetmoe.server.access import read_api_key_file

    try:
        return read_api_key_file(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _body_size(text: str) -> int:
    value = size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def _hosts(text: str) -> list:
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if not hosts or not all(h.isascii() and " " not in h for h in hosts):
        raise argparse.ArgumentTypeError(f"expected a comma list of host names (name or name:port), or *, got {text}")
    return hosts


def _origins(text: str) -> list:
    from hetmoe.server.cors import check_origin

    try:
        return [check_origin(o) for o in text.split(",") if o.strip()] or [check_origin(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_name(text: str) -> str:
    if not text or not text.isprintable() or text != text.strip():
        raise argparse.ArgumentTypeError(f"expected a model name (printable, no surrounding spaces), got {text!r}")
    return text


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="OpenAI- and Anthropic-compatible HTTP server (/v1/chat/completions, /v1/completions, "
        "/v1/messages, /v1/models)",
        description="Serves the model over the OpenAI API and Anthropic's Messages API: point the openai client "
        "(or any tool that speaks it) at http://HOST:PORT/v1, the anthropic client at http://HOST:PORT. Up to "
        "--max-batch requests decode together (continuous batching). Limits and security: docs/serving.md.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (default: 8000; 0 = any free port, printed)")
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", type=_api_key, default=None, metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on every /v1 request (default: HETMOE_API_KEY if "
                      "set, else no key)")
    keys.add_argument("--api-key-file", type=_api_key_file, default=None, metavar="FILE",
                      help="as --api-key, the key read from FILE (one line), out of sight of the process list")
    p.add_argument("--allowed-hosts", type=_hosts, default=None, metavar="HOSTS",
                   help="comma list of names (name or name:port) the Host header may give besides the bind address, "
                   "localhost, 127.0.0.1 and [::1] with the port; * accepts any (default: those alone on a loopback "
                   "bind, any on other binds)")
    p.add_argument("--split-special-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="tokenize special-token text written inside chat messages (<|im_end|> ...) as plain text, "
                   "so a message cannot forge a turn; the chat template's own special tokens are kept (default: on)")
    p.add_argument("--served-model-name", type=_model_name, nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API: requests may give any of the names, /v1/models and responses "
                   "give the first (default: the --model directory's name)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the checkpoint's (checked at startup), or a built-in "
                   "one: deepseek_v32, deepseek_v4 (DeepSeek-V3.2 and V4 ship their encoding as code, no template)")
    p.add_argument("--cors-origins", type=_origins, default=None, metavar="ORIGINS",
                   help="comma list of origins (scheme://host[:port]) whose web pages may call the server, or *; "
                   "(default: none, no CORS headers)")
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="one line per request on stderr: client, method, path, status, tokens, time (default: on)")
    p.add_argument("--tool-call-parser", choices=("auto", *TOOL_PARSERS), default="auto",
                   help="the syntax the model writes tool calls in (default: auto, read from the chat template; "
                   "hermes when it renders none)")
    p.add_argument("--reasoning-parser", choices=("auto", "none", *REASONING_PARSERS), default="auto",
                   help="move <think>...</think> into reasoning_content (default: auto, when the chat template "
                   "mentions <think>)")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="sequences that decode together, each with its own KV-cache slot (default: 8)")
    p.add_argument("--max-body-size", type=_body_size, default=None, metavar="SIZE",
                   help="largest request body (default: 64 bytes per token of the context, at least 1MiB)")
    p.add_argument("--max-connections", type=positive_int, default=None, metavar="N",
                   help="open client connections (default: 4096, fewer where the open-file limit is lower)")
    p.add_argument("--header-timeout", type=_seconds, default=None, metavar="S",
                   help="a new connection's request headers must arrive within S seconds (default: 10)")
    p.add_argument("--body-timeout", type=_seconds, default=None, metavar="S",
                   help="a request body must arrive within S seconds of its headers (default: 30)")
    p.add_argument("--keepalive-timeout", type=_seconds, default=None, metavar="S",
                   help="an idle keep-alive connection is closed after S seconds (default: 5)")
    add_shape_options(p)
    add_engine_options(p)
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hetmoe.server.main import run_serve

    return run_serve(args)
