"""What ``hetmoe serve`` does: load the model, start the engine loop, bind the HTTP server, and on SIGINT/SIGTERM
shut down in order — stop accepting connections, end the running generations (their clients get what was
generated, finish_reason "length", and a clean end of stream), wait for the handlers to write it, exit 0."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from hetmoe.server.protocol import ServedModel

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


def run_serve(args: argparse.Namespace) -> int:
    from hetmoe.commands import engine_options
    from hetmoe.engine.llm import LLM
    from hetmoe.server.app import create_app
    from hetmoe.server.scheduler import Scheduler

    options = engine_options(args)
    options.max_batch = args.max_batch
    if args.shape is not None:
        if args.model is not None:
            raise ValueError("give --model or --shape, not both")
        from hetmoe.engine.synthetic import build_random_model, shape_tokenizer

        loaded = build_random_model(args.shape, args.layers, options)
        llm = LLM(loaded=loaded, tokenizer=shape_tokenizer(loaded.config.vocab_size))
    else:
        if args.layers is not None:
            raise ValueError("--layers goes with --shape")
        llm = LLM(args.model, options, expert_cache=None if args.expert_cache == "off" else args.expert_cache,
                  progress=sys.stderr.isatty())
    llm.runner.prefill([0], slot=0)  # warm-up: the first forward call pays one-time initialisation
    served = ServedModel(id=args.shape or model_id(args.model), prompt_ids=llm.prompt_ids, max_context=llm.max_context,
                         vocab_size=llm.runner.vocab_size, has_chat_template=llm.tokenizer.has_chat_template,
                         defaults=generation_defaults(llm.loaded.path or Path(".")))
    scheduler = Scheduler(llm.runner, llm.tokenizer).start()
    app = create_app(served, scheduler, args.api_key)
    return asyncio.run(_serve(app, scheduler, args.host, args.port, served, args.max_batch))


async def _serve(app, scheduler, host: str, port: int, served: ServedModel, max_batch: int) -> int:
    from aiohttp import web

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        scheduler.shutdown()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    bound = runner.addresses[0][1] if runner.addresses else port
    shown = f"[{host}]" if ":" in host else host
    print(f"hetmoe serve: serving {served.id} on http://{shown}:{bound}/v1 (max batch {max_batch}, "
          f"context {served.max_context}); Ctrl-C stops", file=sys.stderr, flush=True)
    await stop.wait()
    print("hetmoe serve: shutting down", file=sys.stderr, flush=True)
    for s in list(runner.sites):  # stop accepting connections
        await s.stop()
    await asyncio.to_thread(scheduler.shutdown)  # running generations end; their handlers finish the responses
    await runner.cleanup()
    print("hetmoe serve: stopped", file=sys.stderr, flush=True)
    return 0
