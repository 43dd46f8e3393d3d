"""``hetmoe bench serve``: N concurrent streaming clients against an OpenAI-compatible server for a bounded time.

Each client loops: POST /v1/completions with ``stream: true`` (a prompt of ``--prompt-tokens`` token ids,
``--max-tokens`` generated with ``ignore_eos`` so every request has the same length), read the server-sent events
to ``[DONE]``, start the next request. No new request starts after ``--duration`` seconds; those in flight finish.
Reported, over the requests that completed:

* output tok/s: completion tokens (from the usage chunk) / wall time from the first request to the last answer;
* TTFT: request sent -> first chunk with text;
* TPOT (time per output token): (last text chunk - first text chunk) / (completion tokens - 1), per request;
* ITL: the gaps between consecutive text chunks (a chunk is one token, or several when a token ends inside a UTF-8
  character or a possible stop string and its text waits for the next: tokens_per_text_chunk says how many);
* errors: non-200 answers, error events, streams that end without [DONE] or without usage (must be 0).

Constrained decoding (``--constrained N``): N of the clients POST /v1/chat/completions instead (a chat prompt of
about ``--prompt-tokens`` tokens, the same ``ignore_eos``, ``max_tokens`` and streaming). The run has two phases
against the same server, each ``--duration`` long, after a warm-up request from each client: the baseline, where
those N send no response format, and the constrained phase, where they send a ``json_schema`` one
(``CONSTRAINED_SCHEMA``: strings and a long array, so that most requests run to ``--max-tokens`` as the plain ones
do); each phase runs in two halves in the order baseline, constrained, constrained, baseline (a load that drifts
weighs on both alike). So the two phases differ in the grammar only: the chat requests' own costs (a templated
prompt, the chat endpoint's chunks) are in both. The requests of each kind are summarized apart (``streams``), with
the decode rate of one stream (tokens after its first / the time from its first text chunk to its last: 1 / TPOT)
and its ratio to the same clients' rate in the baseline (plain to plain, constrained to chat). In a batched step
every row waits for the step, so a constrained row's mask costs the plain rows of its batch as much as itself on a
CPU (the masks are computed on the engine thread).

Without ``--url`` it starts ``hetmoe serve`` itself (``--model`` and the engine options, ``--max-batch``) on a free
port and stops it with SIGTERM at the end. Only aiohttp is needed on the client side.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

import aiohttp
import numpy as np

from hetmoe import envs

STARTUP_TIMEOUT_S = 600.0
# the constrained clients' schema: free strings (the costlier masks: most tokens are allowed inside a string) and
# an array long enough that a request seldom completes the object before max_tokens
CONSTRAINED_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "minItems": 64},
    "scores": {"type": "array", "items": {"type": "integer"}}}, "required": ["title", "tags", "scores"],
    "additionalProperties": False}


def _start_server(args) -> tuple:
    """``hetmoe serve`` on port 0 with this command's engine options -> (process, base url of the API)."""
    from hetmoe.config.flags import engine_fields

    cmd = [sys.executable, "-m", "hetmoe", "serve", "--port", "0", "--max-batch", str(args.max_batch)]
    for flag, value in (("--model", args.model), ("--shape", args.shape), ("--layers", args.layers),
                        ("--expert-cache", args.expert_cache)):
        if value is not None:
            cmd += [flag, str(value)]
    for f in engine_fields():  # every engine flag, as given to this command
        flag = f.metadata["flag"]
        value = getattr(args, flag[2:].replace("-", "_"))
        if f.metadata.get("negate"):
            cmd += [flag] if value else []
        elif value is not None and value != f.default:
            cmd += [flag, str(value)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    found, lines = {}, []
    ready = threading.Event()

    def read():  # keep draining stderr for the whole run: a full pipe would stall the server
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"serving \S+ on (http://\S+/v1)", line)
            if m:
                found["url"] = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(STARTUP_TIMEOUT_S) or "url" not in found:
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(lines[-20:]))
    return proc, found["url"]


class Stats:
    def __init__(self):
        self.ttft, self.tpot, self.itl, self.stream_tok_s = [], [], [], []
        self.tokens = self.completed = self.errors = self.chunks = 0
        self.error_messages: list = []

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_messages) < 5:
            self.error_messages.append(message)


def _text_of(event: dict) -> str:
    """The text a streamed chunk carries: a completion's ``text`` or a chat delta's ``content``."""
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _one_request(session, url: str, body: dict, stats: Stats) -> None:
    start = time.perf_counter()
    times, usage, done = [], None, False
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                stats.error(f"HTTP {r.status}: {(await r.text())[:200]}")
                return
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    stats.error(f"error event: {event['error'].get('message')}")
                    return
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices") and _text_of(event):
                    times.append(time.perf_counter())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        stats.error(f"{type(e).__name__}: {e}")
        return
    if not done or usage is None:
        stats.error("the stream ended without usage and [DONE]")
        return
    n = usage["completion_tokens"]
    stats.completed += 1
    stats.tokens += n
    stats.chunks += len(times)
    if times:
        stats.ttft.append(times[0] - start)
        stats.itl.extend(np.diff(times).tolist())
        if n > 1 and times[-1] > times[0]:
            stats.tpot.append((times[-1] - times[0]) / (n - 1))
            stats.stream_tok_s.append((n - 1) / (times[-1] - times[0]))


async def _client(i: int, session, api: str, model: str, args, deadline: float, stats: Stats,
                  chat: bool, schema: bool = True, requests: float = math.inf) -> None:
    """Client ``i``'s requests until ``deadline`` (or ``requests`` of them): chat ones (with the json_schema
    response format when ``schema``) or plain completions."""
    rng = random.Random(args.seed * 1000 + i)
    while time.perf_counter() < deadline and requests > 0:
        requests -= 1
        body = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True}
        if chat:  # a chat prompt of about --prompt-tokens tokens (one number a token or two)
            words = " ".join(str(rng.randrange(1000)) for _ in range(max(args.prompt_tokens // 2, 1)))
            body["messages"] = [{"role": "user", "content": f"Describe these as JSON: {words}"}]
            if schema:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "bench", "schema": CONSTRAINED_SCHEMA}}
            await _one_request(session, f"{api}/chat/completions", body, stats)
        else:
            body["prompt"] = [rng.randrange(10, 256) for _ in range(args.prompt_tokens)]
            await _one_request(session, f"{api}/completions", body, stats)


async def _phase(session, api: str, model: str, args, chats: int, duration: float, schema: bool = True) -> tuple:
    """Every client for ``duration`` seconds, the first ``chats`` of them on the chat endpoint (constrained when
    ``schema``) -> (the stats of the plain ones, of the chat ones, seconds)."""
    plain, chat = Stats(), Stats()
    start = time.perf_counter()
    deadline = start + duration
    await asyncio.gather(*(_client(i, session, api, model, args, deadline, chat if i < chats else plain,
                                   i < chats, schema) for i in range(args.clients)))
    return plain, chat, time.perf_counter() - start


def _merged(a: Stats, b: Stats) -> Stats:
    out = Stats()
    for s in (a, b):
        out.ttft += s.ttft
        out.tpot += s.tpot
        out.itl += s.itl
        out.stream_tok_s += s.stream_tok_s
        out.tokens, out.completed, out.errors, out.chunks = (out.tokens + s.tokens, out.completed + s.completed,
                                                            out.errors + s.errors, out.chunks + s.chunks)
        out.error_messages += s.error_messages
    return out


async def _run(api: str, args) -> dict:
    key = args.api_key or envs.HETMOE_API_KEY  # the key the server it starts requires (hetmoe/envs.py)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    connector = aiohttp.TCPConnector(limit=args.clients + 4)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        async with session.get(f"{api}/models") as r:
            if r.status != 200:
                raise RuntimeError(f"GET {api}/models: HTTP {r.status} {(await r.text())[:200]}")
            model = (await r.json())["data"][0]["id"]
        baseline = None
        if not args.constrained:
            plain, forced, elapsed = await _phase(session, api, model, args, 0, args.duration)
        else:  # a warm-up request from each client (not counted), then halves in the order A B B A (A: the chat
            # clients without a response format), so that a load that drifts during the run weighs on both alike
            await asyncio.gather(*(_client(i, session, api, model, args, math.inf, Stats(), i < args.constrained,
                                           requests=1) for i in range(args.clients)))
            a, b = [Stats(), Stats(), 0.0], [Stats(), Stats(), 0.0]
            for kind in (a, b, b, a):
                got = await _phase(session, api, model, args, args.constrained, args.duration / 2,
                                   schema=kind is b)
                kind[:] = [_merged(kind[0], got[0]), _merged(kind[1], got[1]), kind[2] + got[2]]
            baseline = _summary(_merged(a[0], a[1]), a[2], model, api, args)
            baseline["streams"] = {name: _stream(s) for name, s in (("plain", a[0]), ("chat", a[1]))}
            plain, forced, elapsed = b
    result = _summary(_merged(plain, forced), elapsed, model, api, args)
    result["constrained"] = args.constrained
    if baseline is not None:
        result["baseline"] = baseline
        result["streams"] = {}
        for name, s, same in (("plain", plain, "plain"), ("constrained", forced, "chat")):
            result["streams"][name] = _stream(s)
            rate, base = _median(s.stream_tok_s), baseline["streams"][same]["decode_tok_s_per_stream_p50"]
            result["streams"][name]["vs_baseline"] = rate / base if rate is not None and base else None
    return result


def _stream(s: Stats) -> dict:
    """One kind of request's summary: count, tokens, decode rate of one stream (p50), TPOT p50."""
    return {"requests_completed": s.completed, "completion_tokens": s.tokens,
            "decode_tok_s_per_stream_p50": _median(s.stream_tok_s), "tpot_ms_p50": _pct(s.tpot, 50)}


def _pct(values: list, q: float) -> Optional[float]:
    return float(np.percentile(values, q)) * 1e3 if values else None


def _median(values: list) -> Optional[float]:
    return float(np.median(values)) if values else None


def _summary(stats: Stats, elapsed: float, model: str, api: str, args) -> dict:
    return {
        "url": api, "model": model, "clients": args.clients, "duration_s": args.duration, "elapsed_s": elapsed,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "max_batch": None if args.url else args.max_batch,
        "requests_completed": stats.completed, "errors": stats.errors, "error_messages": stats.error_messages,
        "completion_tokens": stats.tokens, "output_tok_s": stats.tokens / elapsed,
        "tokens_per_text_chunk": stats.tokens / stats.chunks if stats.chunks else None,
        "decode_tok_s_per_stream_p50": _median(stats.stream_tok_s),
        "ttft_ms_p50": _pct(stats.ttft, 50), "ttft_ms_p99": _pct(stats.ttft, 99),
        "tpot_ms_p50": _pct(stats.tpot, 50), "tpot_ms_p99": _pct(stats.tpot, 99),
        "itl_ms_p50": _pct(stats.itl, 50), "itl_ms_p99": _pct(stats.itl, 99),
    }


def _fmt(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def run_serve_bench(args) -> int:
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json == "-" else print
    if not 0 <= args.constrained <= args.clients:
        raise SystemExit(f"hetmoe bench serve: --constrained {args.constrained} must be between 0 and --clients "
                         f"({args.clients})")
    proc = None
    if args.url:
        api = args.url.rstrip("/")
        api = api if api.endswith("/v1") else api + "/v1"
    else:
        proc, api = _start_server(args)
    try:
        say(f"hetmoe bench serve: {args.clients} streaming clients for {args.duration:g} s against {api} "
            f"(prompt {args.prompt_tokens} tokens, {args.max_tokens} generated per request)"
            + (f"; {args.constrained} of them on the chat endpoint, without a response format, then with a "
               f"json_schema one"
               if args.constrained else ""))
        result = asyncio.run(_run(api, args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    say(f"model {result['model']}: {result['requests_completed']} requests completed in {result['elapsed_s']:.1f} s, "
        f"{result['errors']} errors")
    say(f"{'output tok/s':>14} {result['output_tok_s']:.1f}  ({_fmt(result['tokens_per_text_chunk'], 2)} tokens per "
        f"text chunk)")
    for name in ("ttft", "tpot", "itl"):
        say(f"{name.upper() + ' ms':>14} p50 {_fmt(result[f'{name}_ms_p50'])}  p99 {_fmt(result[f'{name}_ms_p99'])}")
    if result.get("baseline"):
        base = result["baseline"]["streams"]
        say(f"decode tok/s of one stream (p50), baseline: plain {_fmt(base['plain']['decode_tok_s_per_stream_p50'])}"
            f", chat without a response format {_fmt(base['chat']['decode_tok_s_per_stream_p50'])}")
        for name, s in result["streams"].items():
            say(f"{'':>14} {name:>11} {_fmt(s['decode_tok_s_per_stream_p50'])}  ({_fmt(s['vs_baseline'], 3)} x, "
                f"{s['requests_completed']} requests)")
    for message in result["error_messages"] + (result.get("baseline") or {}).get("error_messages", []):
        say(f"error: {message}")
    if args.json:
        from hetmoe.bench.machine import git_commit, write_json

        result.update(commit=git_commit(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), host=os.uname().nodename)
        write_json(args.json, result, say)
    return 1 if result["errors"] or (result.get("baseline") or {}).get("errors") else 0
