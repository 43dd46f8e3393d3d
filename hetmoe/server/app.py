"""The HTTP face of the server (aiohttp): routes, API-key check, request validation, streaming.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, then "data: [DONE]")
    POST /v1/messages           POST /v1/messages/count_tokens    (Anthropic's Messages API: anthropic.py)
    GET  /v1/models             GET  /v1/models/{id}    GET /health    GET /metrics
    POST /tokenize              POST /detokenize        GET /tokenizer_info                  (as vLLM's)

Handlers validate (protocol.parse_request), queue one Request per choice on the EngineLoop and relay their events;
they never run model code. A stream's headers go out at once, and a ": keep-alive" comment (Anthropic: a ping
event) every KEEPALIVE_S while nothing else is sent (a long prompt being computed). Every error leaves as an
OpenAI error body (Anthropic's shape under /v1/messages); anything unexpected is caught by the middleware and
answered 500, so one bad request can neither crash the server nor leave a connection hanging.

Before a request is queued (limits.py has the numbers): its Host header must name this server (403; access.py),
its API key must match (401; ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, on every route but /health and
/metrics), a POST must say ``Content-Type: application/json`` (415), its body must fit the cap (413), arrive within
the body timeout (408), inflate when compressed (400: a gzip body that is not gzip; 415: another encoding) and have
a bounded JSON shape (400), parsed on a worker thread. At most ``bodies_in_flight`` bodies are read and validated
at once; the next one is answered 503 with Retry-After. CORS (cors.py) and the access log (access_log.py) when
asked for.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import traceback
from typing import Optional

from aiohttp import web

from hetmoe.server import access_log, anthropic, chat, cors, logprobs, protocol, tokens
from hetmoe.server.access import HostPolicy
from hetmoe.server.bridge import ERROR_CODE, HTTP_STATUS, EngineLoop, Request
from hetmoe.server.connections import ConnectionGuard
from hetmoe.server.limits import RETRY_AFTER_S, Limits, parse_body
from hetmoe.server.metrics import Metrics
from hetmoe.server.protocol import APIError, ServedModel, error_body

DEFAULT_MAX_BATCH = 8  # what create_app assumes for the limits when it is given none (tests)
SERVED: web.AppKey = web.AppKey("served", ServedModel)
ENGINE: web.AppKey = web.AppKey("engine", EngineLoop)
METRICS: web.AppKey = web.AppKey("metrics", Metrics)
API_KEY: web.AppKey = web.AppKey("api_key", str)
LIMITS: web.AppKey = web.AppKey("limits", Limits)
HOSTS: web.AppKey = web.AppKey("hosts", object)  # a HostPolicy, or None: every Host header is accepted
GUARD: web.AppKey = web.AppKey("guard", object)  # the ConnectionGuard (None: the app runs without one, tests)
BODIES: web.AppKey = web.AppKey("bodies", list)  # [bodies being read and validated now]
TOKEN_TEXT: web.AppKey = web.AppKey("token_text", object)  # logprobs.TokenText of the served tokenizer, or None
KEEPALIVE_S = 5.0  # a stream with nothing to send for this long gets a keep-alive comment (or an Anthropic ping)

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
              "/tokenize", "/detokenize", "/tokenizer_info", "/health", "/metrics")
_OPEN = ("/health", "/metrics")  # answered without the API key
_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 500: "server_error", 503: "server_error"}


def _json_error(status: int, message: str, type: Optional[str] = None, param=None, code=None,
                request: Optional[web.Request] = None) -> web.Response:
    type = type or _HTTP_TYPES.get(status, "invalid_request_error")
    return web.json_response(_shaped(request, error_body(message, type, param, code), status), status=status)


def _is_anthropic(request: Optional[web.Request]) -> bool:
    return request is not None and request.path.startswith("/v1/messages")


def _shaped(request: Optional[web.Request], body: dict, status: int) -> dict:
    """An OpenAI error body, or under /v1/messages the same error in Anthropic's shape."""
    return anthropic.error_body(status, body["error"]["message"]) if _is_anthropic(request) else body


def _endpoint(request: web.Request) -> str:
    """The metrics label: a known route, or "other" (so random paths cannot grow the label set)."""
    path = request.path
    if path.startswith("/v1/models/"):
        return "/v1/models"
    return path if path in _ENDPOINTS else "other"


def _check_access(request: web.Request) -> None:
    hosts = request.app[HOSTS]
    if hosts is not None and not hosts.allows(request.headers.get("Host")):
        raise APIError(403, f"The Host header {protocol.shown(request.headers.get('Host', ''))} does not name this "
                            f"server; it answers to {hosts.describe()} (--allowed-hosts adds names).",
                       type="permission_error", code="host_not_allowed")
    key = request.app[API_KEY]
    if key and request.path not in _OPEN and not cors.is_preflight(request):  # browsers send no key in a preflight
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "").strip()
        if not given:
            raise APIError(401, "You didn't provide an API key: send 'Authorization: Bearer KEY' (or 'x-api-key: "
                                "KEY').", type="authentication_error", code="invalid_api_key")
        # aiohttp hands non-UTF-8 header bytes on as surrogates, which no encoder takes: not a key of ours anyway
        if not given.isascii() or not hmac.compare_digest(given.encode("ascii"), key.encode("ascii")):
            raise APIError(401, "Incorrect API key provided.", type="authentication_error",
                           code="invalid_api_key")


@web.middleware
async def _errors(request: web.Request, handler):
    """Host and API-key checks, OpenAI-shaped errors for everything, request counting, the connection's deadline
    paused while the request runs."""
    metrics, guard = request.app[METRICS], request.app[GUARD]
    if guard is not None:
        guard.request_started(request.protocol)
    try:
        _check_access(request)
        response = await handler(request)
    except APIError as e:
        response = web.json_response(_shaped(request, e.body(), e.status), status=e.status, headers=e.headers)
        if e.close:
            response.force_close()
        if e.close == "now":
            try:
                await response.prepare(request)
                await response.write_eof()
            except ConnectionError:  # the client is gone already
                pass
            request.protocol.force_close()  # the transport closes once the response is flushed
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        if e.status < 400:
            raise
        message = {404: f"Unknown route {request.method} {request.path}",
                   405: f"Method {request.method} is not allowed on {request.path}",
                   413: _too_large(request.app[LIMITS])}.get(e.status, e.reason)
        response = _json_error(e.status, message, request=request)
        if e.status == 405:
            response.headers["Allow"] = e.headers.get("Allow", "")
        if e.status == 413:
            response.force_close()
    except asyncio.CancelledError:  # the client left and aiohttp cancelled the handler: counted as a 499 too
        metrics.on_request(_endpoint(request), 499)
        raise
    except ConnectionResetError:  # the client left mid-request (its body half sent): nobody to answer, nothing to log
        response = web.Response(status=499)  # nginx's "client closed request", for the metrics
    except Exception as e:
        traceback.print_exc()
        response = _json_error(500, f"internal server error: {type(e).__name__}: {e}", request=request)
    finally:
        if guard is not None:
            guard.request_finished(request.protocol)
    metrics.on_request(_endpoint(request), response.status)
    return response


def _too_large(limits: Limits) -> str:
    return (f"The request body is larger than {limits.max_body} bytes, this server's limit (64 bytes per token of "
            "the context, at least 1 MiB, unless --max-body-size sets it).")


async def _body(request: web.Request):
    """The request's JSON value: Content-Type, size, time and shape checked, parsed on a worker thread."""
    limits = request.app[LIMITS]
    if request.content_type != "application/json":
        given = request.headers.get("Content-Type")
        raise APIError(415, f"A request body must be sent with 'Content-Type: application/json', got "
                            f"{protocol.shown(given) if given else 'none'}.", code="unsupported_media_type")
    if request.content_length is not None and request.content_length > limits.max_body:
        raise APIError(413, _too_large(limits), code="body_too_large", close="after")
    try:
        raw = await asyncio.wait_for(request.read(), limits.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"The request body did not arrive within {limits.body_timeout:g} s (the body "
                            "timeout).", code="body_timeout", close="now") from None
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, _too_large(limits), code="body_too_large", close="after") from None
    except web.RequestPayloadError as e:  # a broken chunked body
        detail = str(e).split("message:", 1)[-1].strip()
        raise APIError(400, f"The request body could not be read: {detail}.", code="invalid_body",
                       close="now") from None
    encoding = request.headers.get("Content-Encoding")
    return await asyncio.get_running_loop().run_in_executor(None, parse_body, raw, encoding, limits)


async def _read_and_parse(request: web.Request, parse):
    """``parse(body)`` of the request's JSON body, on a worker thread (tokenizing may take a while), within the
    bodies-in-flight cap."""
    bodies, limits = request.app[BODIES], request.app[LIMITS]
    if bodies[0] >= limits.bodies_in_flight:
        raise APIError(503, f"The server is reading and checking {limits.bodies_in_flight} request bodies, its "
                            "limit (4 x --max-batch); retry shortly.", type="server_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}, close="after")
    bodies[0] += 1
    try:
        body = await _body(request)
        return await asyncio.to_thread(parse, body)
    finally:
        bodies[0] -= 1


class Run:
    """The engine requests of one API call, one per choice (``Parsed.choices``), and their events merged in
    arrival order as (choice number, event). ``close`` cancels what is still running (the client went away)."""

    def __init__(self, engine: EngineLoop, parsed: protocol.Parsed):
        loop = asyncio.get_running_loop()
        self.choices = parsed.choices()  # [(index, Prompt, SamplingParams)]
        self.reqs = [engine.submit(Request(prompt.ids, params, loop)) for _, prompt, params in self.choices]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list = []

    async def start(self) -> None:
        """Merge the requests' events; an error the engine gave at once (the server is shutting down) is raised
        here, before a response has begun, so that it keeps its status."""
        for req in self.reqs:
            if req.finished and req.error is not None:  # failed inside submit: its event is on its way
                self.close()
                raise _error_of(await req.events.get())
        self._tasks = [asyncio.ensure_future(self._forward(i, req)) for i, req in enumerate(self.reqs)]

    async def _forward(self, i: int, req: Request) -> None:
        while True:
            event = await req.events.get()
            self._queue.put_nowait((i, event))
            if event[0] in ("done", "error"):
                return

    async def next(self, timeout: Optional[float] = None) -> Optional[tuple]:
        """The next (choice number, event); None when ``timeout`` seconds pass without one."""
        if timeout is None:
            return await self._queue.get()
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def close(self) -> None:
        for req in self.reqs:
            if not req.finished:
                req.cancel()  # the engine frees the slot at its next step
        for task in self._tasks:
            task.cancel()


class _Choice:
    """What one choice has received: text, log-probabilities (those not yet streamed in ``pending``), the end."""

    def __init__(self, index: int, prompt: protocol.Prompt, req: Request, parsed: Optional[protocol.Parsed] = None):
        self.index, self.prompt, self.req = index, prompt, req
        # a chat request's reasoning, tool calls and content (chat.py); None: the text is the content
        self.output = chat.ChatOutput(parsed.chat) if parsed is not None and parsed.chat is not None else None
        self.pieces: list = []
        self.pending: list = []  # TokenLogprob entries not yet sent (streaming) / all of them (whole)
        self.finish: Optional[str] = None
        self.prompt_tokens = self.completion_tokens = 0
        self.legacy = None  # the completions logprobs builder (LegacyLogprobs)


def _usage(choices: list, parsed: protocol.Parsed) -> dict:
    """Prompt tokens once per prompt (the first choice of each), completion tokens of every choice; completions
    answered with ``max_tokens`` 0 generated nothing the client sees, and count none."""
    firsts = [c for c in choices if c.index % parsed.n == 0]
    completion = sum(c.completion_tokens for c in choices) if parsed.generate else 0
    return protocol.usage(sum(c.prompt_tokens for c in firsts), completion,
                          cached=sum(c.req.cached_tokens for c in firsts))


def _echo_text(choice: _Choice, served: ServedModel) -> str:
    prompt = choice.prompt
    return prompt.text if prompt.text is not None else served.tokenizer.decode(
        prompt.ids, skip_special_tokens=prompt.params.skip_special_tokens)


def _legacy_start(choice: _Choice, parsed: protocol.Parsed, text_of) -> None:
    """The completions logprobs builder of ``choice``, with the prompt's tokens first when echoed."""
    choice.legacy = logprobs.LegacyLogprobs(text_of, skip_special_tokens=choice.prompt.params.skip_special_tokens)
    if parsed.echo:
        choice.legacy.add_prompt(choice.prompt.ids, choice.req.prompt_logprobs or [])


async def whole(request: web.Request, run: Run, parsed: protocol.Parsed) -> dict:
    """The response body of a call that is not streamed, once every choice has ended (``chat.completion`` or
    ``text_completion``); an error of any choice is raised."""
    served, text_of = request.app[SERVED], request.app[TOKEN_TEXT]
    choices = [_Choice(index, prompt, req, parsed) for (index, prompt, _), req in zip(run.choices, run.reqs)]
    left = len(choices)
    while left:
        i, event = await run.next()
        c = choices[i]
        if event[0] == "text":
            c.pieces.append(event[1])
        elif event[0] == "logprobs":
            c.pending.extend(event[1])
        elif event[0] == "error":
            raise _error_of(event)
        else:
            _, c.finish, c.prompt_tokens, c.completion_tokens = event
            left -= 1
    bodies = []
    for c in choices:
        text = "".join(c.pieces) if parsed.generate else ""
        finish = c.finish if parsed.generate else "length"
        lp = None
        if parsed.logprobs is not None and parsed.kind == "chat":
            lp = logprobs.chat_logprobs(c.pending, text_of)
        elif parsed.logprobs is not None:
            _legacy_start(c, parsed, text_of)
            if parsed.generate:
                c.legacy.add_entries(c.pending, parsed.logprobs)
            lp = c.legacy.take()
        if parsed.echo:
            text = _echo_text(c, served) + text
        bodies.append(protocol.choice(parsed.kind, c.index, text, finish, lp))
        if c.output is not None:
            bodies[-1]["message"], bodies[-1]["finish_reason"] = c.output.message(text, finish)
            if c.output.failed:
                request.app[METRICS].on_tool_parse_failure()
    use = _usage(choices, parsed)
    request[access_log.TOKENS] = (use["prompt_tokens"], use["completion_tokens"])
    return protocol.response_body(parsed.kind, protocol.new_id(parsed.kind), served.id, bodies, use)


async def chunks(request: web.Request, run: Run, parsed: protocol.Parsed):
    """The objects of a streamed call, as an async iterator: ``chat.completion.chunk`` / ``text_completion``
    chunks, each choice's in order (its index in each), an error object if a choice fails, the usage chunk when
    asked; None whenever KEEPALIVE_S pass with nothing to send (the caller writes a keep-alive comment)."""
    served, text_of = request.app[SERVED], request.app[TOKEN_TEXT]
    kind, model, rid, created = parsed.kind, served.id, protocol.new_id(parsed.kind), int(time.time())
    choices = [_Choice(index, prompt, req, parsed) for (index, prompt, _), req in zip(run.choices, run.reqs)]
    started = [False] * len(choices)

    def chunk(c: _Choice, text: Optional[str] = None, finish: Optional[str] = None, role: bool = False) -> dict:
        lp = None
        if parsed.logprobs is not None and (c.pending or kind == "completion" and c.legacy.tokens):
            if kind == "chat":
                lp = {"content": logprobs.chat_content(c.pending, text_of), "refusal": None}
            else:
                c.legacy.add_entries(c.pending, parsed.logprobs)
                lp = c.legacy.take()
            c.pending = []
        return protocol.chunk(kind, rid, model, created, text=text, role=role, finish_reason=finish, index=c.index,
                              logprobs=lp)

    def start(i: int) -> Optional[dict]:
        """A choice's first chunk: the role (chat), the echoed prompt (completions with echo)."""
        started[i] = True
        c = choices[i]
        if parsed.logprobs is not None and kind == "completion":
            _legacy_start(c, parsed, text_of)
        if kind == "chat":
            return chunk(c, role=True)
        if parsed.echo:
            return chunk(c, text=_echo_text(c, served))
        return None

    left = len(choices)
    while left:
        got = await run.next(KEEPALIVE_S)
        if got is None:
            yield None
            continue
        i, event = got
        c = choices[i]
        if event[0] == "error":  # after the headers: an error object in the stream, as OpenAI does
            yield _error_of(event).body()
            return
        if not started[i]:
            first = start(i)
            if first is not None:
                yield first
        if event[0] == "logprobs":
            if parsed.generate:
                c.pending.extend(event[1])
        elif event[0] == "text":
            if parsed.generate:
                if c.output is None:
                    yield chunk(c, text=event[1])
                for delta in c.output.push(event[1]) if c.output is not None else ():
                    yield _with_delta(chunk(c), delta)
        else:
            _, finish, c.prompt_tokens, c.completion_tokens = event
            left -= 1
            if c.output is not None:
                for delta in c.output.finish():
                    yield _with_delta(chunk(c), delta)
                finish = c.output.finish_reason(finish)
                if c.output.failed:
                    request.app[METRICS].on_tool_parse_failure()
            yield chunk(c, finish=finish if parsed.generate else "length")
    use = _usage(choices, parsed)
    request[access_log.TOKENS] = (use["prompt_tokens"], use["completion_tokens"])
    if parsed.include_usage:
        yield protocol.chunk(kind, rid, model, created, use=use, choices=False)


def _with_delta(obj: dict, delta: dict) -> dict:
    """A chat chunk whose delta is ``delta`` (reasoning_content, content or tool_calls; chat.ChatOutput)."""
    obj["choices"][0]["delta"] = delta
    return obj


async def open_stream(request: web.Request) -> web.StreamResponse:
    """A server-sent events response, its headers sent now (a long prefill must not leave the client without a
    byte)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)
    return response


async def start_run(request: web.Request, parsed: protocol.Parsed) -> Run:
    """The call's requests queued on the engine (``Run.start``)."""
    run = Run(request.app[ENGINE], parsed)
    await run.start()
    return run


async def _completions(request: web.Request, kind: str) -> web.StreamResponse:
    served = request.app[SERVED]
    parsed = await _read_and_parse(request, lambda body: protocol.parse_request(body, served, kind))
    run = await start_run(request, parsed)
    try:
        if not parsed.stream:
            return web.json_response(await whole(request, run, parsed))
        response = await open_stream(request)
        try:
            async for obj in chunks(request, run, parsed):
                await response.write(b": keep-alive\n\n" if obj is None else
                                     b"data: " + json.dumps(obj).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:  # the client left; run.close() cancels its sequences
            pass
        return response
    finally:
        run.close()


def _error_of(event: tuple) -> APIError:
    _, status, message, code = event
    return APIError(status, message, type="server_error", code=code)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "completion")


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's ``POST /v1/messages``: translated to a chat request (anthropic.py), run, translated back."""
    served = request.app[SERVED]

    def parse(body):
        chat, where = anthropic.to_chat(body)
        try:
            return protocol.parse_request(chat, served, "chat"), chat.get("stop") or []
        except APIError as e:
            raise anthropic.renamed(e, where) from None

    parsed, stops = await _read_and_parse(request, parse)
    run = await start_run(request, parsed)
    req = run.reqs[0]
    try:
        if not parsed.stream:
            body = await whole(request, run, parsed)
            return web.json_response(anthropic.message(body, served.id, anthropic.stop_sequence(req, stops),
                                                       req.cached_tokens))
        response = await open_stream(request)

        async def send(events: list) -> None:
            for name, data in events:
                await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

        translator = anthropic.StreamTranslator(served.id, len(parsed.prompt_ids))
        try:
            await send(translator.start() + [("ping", {"type": "ping"})])
            async for obj in chunks(request, run, parsed):
                if obj is None:
                    await send([("ping", {"type": "ping"})])
                elif "error" in obj:  # after the headers: an error event ends the stream
                    message = obj["error"]["message"]
                    await send([("error", anthropic.error_body(_error_status(obj), message))])
                    break
                else:
                    await send(translator.feed(obj))
            else:
                await send(translator.end(anthropic.stop_sequence(req, stops), req.cached_tokens))
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response
    finally:
        run.close()


STATUS_OF_CODE = {ERROR_CODE[kind]: status for kind, status in HTTP_STATUS.items()}


def _error_status(body: dict) -> int:
    """The HTTP status of an engine error event's body, by its code (bridge.py's tables)."""
    return STATUS_OF_CODE.get(body["error"].get("code"), 500)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens, as /v1/messages would render it."""
    served = request.app[SERVED]

    def parse(body):
        chat, where = anthropic.to_chat(body, count_only=True)
        try:
            return len(protocol.parse_request(chat, served, "chat").prompt_ids)
        except APIError as e:
            raise anthropic.renamed(e, where) from None

    return web.json_response({"input_tokens": await _read_and_parse(request, parse)})


async def tokenize(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    return web.json_response(await _read_and_parse(request, lambda body: tokens.tokenize(body, served)))


async def detokenize(request: web.Request) -> web.Response:
    served = request.app[SERVED]
    return web.json_response(await _read_and_parse(request, lambda body: tokens.detokenize(body, served)))


async def tokenizer_info(request: web.Request) -> web.Response:
    return web.json_response(tokens.tokenizer_info(request.app[SERVED]))


def _model_card(served: ServedModel) -> dict:
    return {"id": served.id, "object": "model", "created": served.created, "owned_by": "hetmoe",
            "max_model_len": served.max_context}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[SERVED])]})


async def model(request: web.Request) -> web.Response:
    served, name = request.app[SERVED], request.match_info["name"]
    if name not in served.names:
        raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return web.json_response(_model_card(served))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[METRICS].render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def create_app(served: ServedModel, engine: EngineLoop, api_key: Optional[str] = None, *,
               limits: Optional[Limits] = None, hosts: Optional[HostPolicy] = None,
               guard: Optional[ConnectionGuard] = None, cors_origins: Optional[list] = None,
               log_requests: bool = False) -> web.Application:
    """``cors_origins``: the origins browsers may call from (cors.py; None: none). ``log_requests``: a line per
    request on the access log (access_log.py)."""
    limits = limits or Limits.for_model(served.max_context, DEFAULT_MAX_BATCH)
    middlewares = [access_log.middleware(access_log.access_logger())] if log_requests else []
    app = web.Application(middlewares=[*middlewares, _errors], client_max_size=limits.max_body)
    app[SERVED], app[ENGINE], app[METRICS], app[API_KEY] = served, engine, engine.metrics, api_key or ""
    app[LIMITS], app[HOSTS], app[GUARD], app[BODIES] = limits, hosts, guard, [0]
    app[TOKEN_TEXT] = logprobs.TokenText(served.tokenizer) if served.tokenizer is not None else None
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)
    if served.tokenizer is not None:
        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/detokenize", detokenize)
        app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    cors.install(app, cors_origins)
    return app
