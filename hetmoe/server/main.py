"""What ``hetmoe serve`` does: bind the port (a busy one fails at once, before any weight is read), load the model,
start the engine loop, serve HTTP on the bound sockets, and on SIGINT/SIGTERM shut down in order — stop accepting
connections, end the running generations (their clients get what was generated, finish_reason "length", and a clean
end of stream), wait for the handlers to write it, exit 0."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import sys
from pathlib import Path

from hetmoe.server.protocol import ServedModel, prompt_encoder

BACKLOG = 128  # connections the kernel queues while the model loads (and later between accepts)
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


def bind(host: str, port: int) -> list:
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
            sock.listen(BACKLOG)
            if port == 0:  # the other addresses of the host take the port the first one got
                port = sock.getsockname()[1]
    except OSError as e:
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sockets


def run_serve(args: argparse.Namespace) -> int:
    from hetmoe.config.flags import engine_options, expert_cache
    from hetmoe.engine.llm import LLM
    from hetmoe.server.app import create_app
    from hetmoe.server.bridge import EngineLoop

    options = engine_options(args)
    options.max_batch = args.max_batch
    if args.shape is not None and args.model is not None:
        raise ValueError("give --model or --shape, not both")
    if args.shape is None and args.layers is not None:
        raise ValueError("--layers goes with --shape")
    sockets = bind(args.host, args.port)  # before the (possibly minutes long) load: a busy port fails at once
    try:
        if args.shape is not None:
            from hetmoe.load.random_weights import build_random_model, shape_tokenizer

            loaded = build_random_model(args.shape, args.layers, options)
            llm = LLM(loaded=loaded, tokenizer=shape_tokenizer(loaded.config.vocab_size))
        else:
            llm = LLM(args.model, options, expert_cache=expert_cache(args), progress=sys.stderr.isatty())
        llm.runner.prefill([0], slot=0)  # warm-up: the first forward call pays one-time initialisation
        llm.tokenizer.chars_per_token  # the prompt-length bound reads the vocabulary once, now rather than later
        served = ServedModel(id=args.shape or model_id(args.model), prompt_ids=prompt_encoder(llm.tokenizer),
                             max_context=llm.max_context, vocab_size=llm.runner.vocab_size,
                             has_chat_template=llm.tokenizer.has_chat_template,
                             defaults=generation_defaults(llm.loaded.path or Path(".")))
        engine = EngineLoop(llm.runner, llm.tokenizer).start()
        app = create_app(served, engine, args.api_key)
        return asyncio.run(_serve(app, engine, sockets, args.host, served, args.max_batch))
    finally:
        for sock in sockets:
            sock.close()


async def _serve(app, engine, sockets: list, host: str, served: ServedModel, max_batch: int) -> int:
    from aiohttp import web

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        for sock in sockets:
            await web.SockSite(runner, sock, backlog=BACKLOG).start()
    except OSError as e:
        await runner.cleanup()
        engine.shutdown()
        raise OSError(f"cannot listen on {host}: {e.strerror or e}") from e
    port = sockets[0].getsockname()[1]
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    print(f"hetmoe serve: serving {served.id} on http://{shown}:{bound}/v1 (max batch {max_batch}, "
          f"context {served.max_context}); Ctrl-C stops", file=sys.stderr, flush=True)
    await stop.wait()
    print("hetmoe serve: shutting down", file=sys.stderr, flush=True)
    for s in list(runner.sites):  # stop accepting connections
        await s.stop()
    await asyncio.to_thread(engine.shutdown)  # running generations end; their handlers finish the responses
    await runner.cleanup()
    print("hetmoe serve: stopped", file=sys.stderr, flush=True)
    return 0
