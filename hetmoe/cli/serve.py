"""``hetmoe serve``: the OpenAI-compatible HTTP server (hetmoe/server/)."""

from __future__ import annotations

import argparse

from hetmoe.cli.options import add_shape_options
from hetmoe.config.flags import add_engine_options, port, positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models)",
        description="Serves the model over the OpenAI API: point the openai client (or any tool that speaks it) at "
        "http://HOST:PORT/v1. Up to --max-batch requests decode together (continuous batching).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=port, default=8000, help="TCP port (default: 8000; 0 = any free port, printed)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every /v1 request (default: no key)")
    p.add_argument("--max-batch", type=positive_int, default=8,
                   help="sequences that decode together, each with its own KV-cache slot (default: 8)")
    add_shape_options(p)
    add_engine_options(p)
    p.set_defaults(handler=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hetmoe.server.main import run_serve

    return run_serve(args)
