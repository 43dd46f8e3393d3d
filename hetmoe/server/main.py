"""What ``hetmoe serve`` does: settle the API key, bind the port (a busy one fails at once, before any weight is
read), load the model, start the engine loop, serve HTTP on the bound sockets (each connection counted and given
deadlines: connections.py), and on SIGINT/SIGTERM shut down in order — stop accepting connections, end the running
generations (their clients get what was generated, finish_reason "length", and a clean end of stream), wait for the
handlers to write it, exit 0."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from hetmoe import envs
from hetmoe.server.access import check_api_key, is_loopback
from hetmoe.server.limits import BACKLOG, default_backlog, raise_open_file_limit
from hetmoe.server.protocol import ServedModel, prompt_encoder

SHUTDOWN_TIMEOUT_S = 5.0  # how long handlers get to write their last bytes after the engine loop stopped


def generation_defaults(path: Path) -> dict:
    """temperature / top_p / top_k that the checkpoint's generation_config.json recommends (used when a request
    does not say), as vLLM does; OpenAI's defaults (temperature 1, top_p 1) otherwise."""
    try:
        config = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is False:
        return {}
    checks = {"temperature": lambda v: 0 <= v <= 2, "top_p": lambda v: 0 < v <= 1, "top_k": lambda v: v >= 0}
    out = {}
    for name, ok in checks.items():
        v = config.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v) and (name != "top_k" or int(v) == v):
            out[name] = int(v) if name == "top_k" else float(v)
    return out


def model_id(model) -> str:
    return "hetmoe-default" if model is None else Path(model).resolve().name


def bind(host: str, port: int, backlog: int = BACKLOG) -> list:
    """Listening sockets on every address of ``host`` (as asyncio's create_server binds them), made before the
    model loads: the port is ours from then on (a socket only bound, not listening, could still be taken by
    another SO_REUSEADDR server), and clients that connect during the load wait in the backlog and are answered
    once serving starts. OSError "cannot listen on host:port: reason" when any address is taken or unknown."""
    sockets = []
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port; never a listening one
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            if port == 0:  # the other addresses of the host take the port the first one got
                port = sock.getsockname()[1]
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sockets


def api_key(args: argparse.Namespace) -> Optional[str]:
    """--api-key, --api-key-file (both checked when parsed, and exclusive), else HETMOE_API_KEY; None: no key.
    (A blank HETMOE_API_KEY reads as unset: the serving line then says that no key is required.)"""
    key = getattr(args, "api_key", None) or getattr(args, "api_key_file", None)
    if key is None and envs.HETMOE_API_KEY is not None:
        key = check_api_key(envs.HETMOE_API_KEY, "HETMOE_API_KEY")
    return key


BUILTIN_TEMPLATES = ("deepseek_v32", "deepseek_v4")  # server/templates/NAME.jinja: encodings shipped as code


def read_chat_template(path: str) -> str:
    """The Jinja chat template in ``path`` (``--chat-template``), or the built-in one named ``path`` (one of
    BUILTIN_TEMPLATES, where no such file exists), compiled once to check it; ValueError naming the file and the
    problem otherwise."""
    from hetmoe.tokenizer import compile_template

    if path in BUILTIN_TEMPLATES and not Path(path).exists():
        path = str(Path(__file__).parent / "templates" / f"{path}.jinja")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        raise ValueError(f"--chat-template: {path} is empty")
    try:
        compile_template(text)
    except Exception as e:  # jinja2's TemplateSyntaxError and kin
        line = getattr(e, "lineno", None)
        raise ValueError(f"--chat-template: {path} is not a valid Jinja template"
                         f"{f' (line {line})' if line else ''}: {e}") from None
    return text


def run_serve(args: argparse.Namespace) -> int:
    from hetmoe.config.flags import engine_options, expert_cache
    from hetmoe.engine.llm import LLM
    from hetmoe.server.access import HostPolicy
    from hetmoe.server.app import create_app
    from hetmoe.server.bridge import EngineLoop
    from hetmoe.server.chat import ChatSupport
    from hetmoe.server.connections import ConnectionGuard
    from hetmoe.server.limits import RETRY_AFTER_S, Limits

    options = engine_options(args)
    options.max_batch = args.max_batch
    if args.shape is not None and args.model is not None:
        raise ValueError("give --model or --shape, not both")
    if args.shape is None and args.layers is not None:
        raise ValueError("--layers goes with --shape")
    key = api_key(args)
    template = read_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None
    raise_open_file_limit()  # before the limits are derived from it
    # before the (possibly minutes long) load: a busy port fails at once
    sockets = bind(args.host, args.port, default_backlog())
    try:
        if args.shape is not None:
            from hetmoe.load.random_weights import build_random_model, shape_tokenizer

            loaded = build_random_model(args.shape, args.layers, options)
            llm = LLM(loaded=loaded, tokenizer=shape_tokenizer(loaded.config.vocab_size))
        else:
            llm = LLM(args.model, options, expert_cache=expert_cache(args), progress=sys.stderr.isatty())
        if template is not None:
            llm.tokenizer.chat_template = template  # before anything was rendered with the checkpoint's
        llm.runner.prefill([0], slot=0)  # warm-up: the first forward call pays one-time initialisation
        llm.tokenizer.chars_per_token  # the prompt-length bound reads the vocabulary once, now rather than later
        split = getattr(args, "split_special_tokens", True)
        names = getattr(args, "served_model_name", None) or [args.shape or model_id(args.model)]
        served = ServedModel(id=names[0], aliases=tuple(names[1:]),
                             prompt_ids=prompt_encoder(llm.tokenizer, split_special_tokens=split),
                             max_context=llm.max_context, vocab_size=llm.runner.vocab_size,
                             has_chat_template=llm.tokenizer.has_chat_template,
                             defaults=generation_defaults(llm.loaded.path or Path(".")), tokenizer=llm.tokenizer)
        served.chat = ChatSupport.build(llm.tokenizer, llm.runner.vocab_size,
                                        getattr(args, "tool_call_parser", "auto"),
                                        getattr(args, "reasoning_parser", "auto"))
        notes_chat = _chat_notes(served.chat)
        limits = Limits.for_model(llm.max_context, args.max_batch, max_body=getattr(args, "max_body_size", None),
                                  max_connections=getattr(args, "max_connections", None),
                                  **{k: getattr(args, k, None) for k in ("header_timeout", "body_timeout",
                                                                         "keepalive_timeout")})
        hosts = HostPolicy.for_server(args.host, sockets, getattr(args, "allowed_hosts", None))
        engine = EngineLoop(llm.runner, llm.tokenizer).start()
        guard = ConnectionGuard(limits.max_connections, limits.header_timeout, limits.keepalive_timeout,
                                RETRY_AFTER_S, engine.metrics)
        app = create_app(served, engine, key, limits=limits, hosts=hosts, guard=guard,
                         cors_origins=getattr(args, "cors_origins", None),
                         log_requests=getattr(args, "access_log", True))
        notes = [f"max batch {args.max_batch}", f"context {served.max_context}",
                 "API key required" if key else "no API key", *notes_chat]
        return asyncio.run(_serve(app, engine, sockets, args.host, served, notes, limits, guard))
    finally:
        for sock in sockets:
            sock.close()


def _chat_notes(support) -> list:
    """What the serving line says of tool calls, reasoning and structured output."""
    notes = [f"tool calls {support.parser.name}"]
    if support.tool_markers:
        notes.append("its markers are special tokens, kept in the text of requests with tools")
    if support.reasoning is not None:
        notes.append(f"reasoning {support.reasoning.name}")
    if support.grammars is None:
        notes.append("no structured output (xgrammar is not installed)")
    return notes


def exposure_warning(host: str, sockets: list, has_key: bool) -> Optional[str]:
    """What to warn about when the server can be reached from other machines without a key (None: nothing)."""
    if has_key or is_loopback(sockets):
        return None
    port = sockets[0].getsockname()[1]
    return (f"{host} is reachable from other machines and no API key is set: anyone who can reach port {port} can "
            "use the model (--api-key, --api-key-file or HETMOE_API_KEY set one)")


async def listen(app, sockets: list, limits, guard) -> tuple:
    """Serve ``app`` on the bound ``sockets``, every connection through ``guard`` -> (the aiohttp runner, the
    asyncio servers). ``stop_listening`` and ``runner.cleanup()`` undo it."""
    from aiohttp import web

    from hetmoe.server.connections import http_log

    # aiohttp's own keep-alive timer (it also closes a new connection that sends nothing) is only a backstop:
    # the guard's deadlines come first. Bodies are inflated by the app (limits.decode_body), off the event loop.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                           keepalive_timeout=max(limits.header_timeout, limits.keepalive_timeout),
                           auto_decompress=False, logger=http_log())
    await runner.setup()
    loop, listening = asyncio.get_running_loop(), []
    try:
        for sock in sockets:
            listening.append(await loop.create_server(guard.protocol_factory(runner.server), sock=sock,
                                                      backlog=limits.backlog))
    except BaseException:
        stop_listening(listening)
        await runner.cleanup()
        raise
    return runner, listening


def stop_listening(listening: list) -> None:
    for server in listening:  # the listening sockets close; open connections go on
        server.close()


async def _serve(app, engine, sockets: list, host: str, served: ServedModel, notes: list, limits, guard) -> int:
    from hetmoe.server.app import API_KEY
    from hetmoe.server.connections import AcceptErrors

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(AcceptErrors())
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        runner, listening = await listen(app, sockets, limits, guard)
    except OSError as e:
        engine.shutdown()
        raise OSError(f"cannot listen on {host}: {e.strerror or e}") from e
    port = sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    warning = exposure_warning(host, sockets, bool(app[API_KEY]))
    if warning:
        print(f"hetmoe serve: warning: {warning}", file=sys.stderr, flush=True)
    print(f"hetmoe serve: serving {served.id} on http://{shown}:{port}/v1 ({', '.join(notes)}); Ctrl-C stops",
          file=sys.stderr, flush=True)
    await stop.wait()
    print("hetmoe serve: shutting down", file=sys.stderr, flush=True)
    stop_listening(listening)  # stop accepting connections
    await asyncio.to_thread(engine.shutdown)  # running generations end; their handlers finish the responses
    await runner.cleanup()
    print("hetmoe serve: stopped", file=sys.stderr, flush=True)
    return 0
