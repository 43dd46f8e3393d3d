"""The HTTP face of the server (aiohttp): routes, API-key check, request validation, streaming.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events, then "data: [DONE]")
    GET  /v1/models             GET  /v1/models/{id}    GET /health    GET /metrics

Handlers validate (protocol.parse_request), queue a Request on the EngineLoop and relay its events; they never
run model code. Every error leaves as an OpenAI error body; anything unexpected is caught by the middleware and
answered 500, so one bad request can neither crash the server nor leave a connection hanging.

Before a request is queued (limits.py has the numbers): its Host header must name this server (403; access.py),
its API key must match (401), a POST must say ``Content-Type: application/json`` (415), its body must fit the cap
(413), arrive within the body timeout (408), inflate when compressed (400: a gzip body that is not gzip; 415:
another encoding) and have a bounded JSON shape (400), parsed on a worker thread. At most ``bodies_in_flight``
bodies are read and validated at once; the next one is answered 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import traceback
from typing import Optional

from aiohttp import web

from hetmoe.server import protocol
from hetmoe.server.access import HostPolicy
from hetmoe.server.bridge import EngineLoop, Request
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

_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 500: "server_error", 503: "server_error"}


def _json_error(status: int, message: str, type: Optional[str] = None, param=None, code=None) -> web.Response:
    type = type or _HTTP_TYPES.get(status, "invalid_request_error")
    return web.json_response(error_body(message, type, param, code), status=status)


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
    if key and request.path.startswith("/v1/"):
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not given:
            raise APIError(401, "You didn't provide an API key: send 'Authorization: Bearer KEY'.",
                           type="authentication_error", code="invalid_api_key")
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
        response = web.json_response(e.body(), status=e.status, headers=e.headers)
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
        response = _json_error(e.status, message)
        if e.status == 405:
            response.headers["Allow"] = e.headers.get("Allow", "")
        if e.status == 413:
            response.force_close()
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:  # the client left mid-request (its body half sent): nobody to answer, nothing to log
        response = web.Response(status=499)  # nginx's "client closed request", for the metrics
    except Exception as e:
        traceback.print_exc()
        response = _json_error(500, f"internal server error: {type(e).__name__}: {e}")
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


async def _completions(request: web.Request, kind: str) -> web.StreamResponse:
    served, bodies, limits = request.app[SERVED], request.app[BODIES], request.app[LIMITS]
    if bodies[0] >= limits.bodies_in_flight:
        raise APIError(503, f"The server is reading and checking {limits.bodies_in_flight} request bodies, its "
                            "limit (4 x --max-batch); retry shortly.", type="server_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}, close="after")
    bodies[0] += 1
    try:
        body = await _body(request)
        parsed = await asyncio.to_thread(protocol.parse_request, body, served, kind)  # tokenizing may take a while
        del body  # not held while the request runs
    finally:
        bodies[0] -= 1
    req = request.app[ENGINE].submit(Request(parsed.prompt_ids, parsed.params, asyncio.get_running_loop()))
    try:
        if parsed.stream:
            return await _stream(request, req, parsed, served.id)
        return await _whole(req, parsed, served.id)
    finally:
        if not req.finished:
            req.cancel()  # the client went away (or the handler failed): the engine frees the slot


def _error_of(event: tuple) -> APIError:
    _, status, message, code = event
    return APIError(status, message, type="server_error", code=code)


async def _whole(req: Request, parsed: protocol.Parsed, model: str) -> web.Response:
    pieces = []
    while True:
        event = await req.events.get()
        if event[0] == "text":
            pieces.append(event[1])
        elif event[0] == "error":
            raise _error_of(event)
        else:
            _, finish, n_prompt, n_completion = event
            body = protocol.response(parsed.kind, protocol.new_id(parsed.kind), model, "".join(pieces), finish,
                                     protocol.usage(n_prompt, n_completion))
            return web.json_response(body)


async def _stream(request: web.Request, req: Request, parsed: protocol.Parsed, model: str) -> web.StreamResponse:
    kind, rid, created = parsed.kind, protocol.new_id(parsed.kind), int(time.time())
    event = await req.events.get()
    if event[0] == "error":  # nothing sent yet: a plain error response with its status
        raise _error_of(event)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)

    async def send(obj) -> None:
        await response.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    try:
        if kind == "chat":
            await send(protocol.chunk(kind, rid, model, created, role=True))
        while True:
            if event[0] == "text":
                await send(protocol.chunk(kind, rid, model, created, text=event[1]))
            elif event[0] == "error":  # after the headers: an error object in the stream, as OpenAI does
                err = _error_of(event)
                await send(err.body())
                break
            else:
                _, finish, n_prompt, n_completion = event
                await send(protocol.chunk(kind, rid, model, created, finish_reason=finish))
                if parsed.include_usage:
                    await send(protocol.chunk(kind, rid, model, created, use=protocol.usage(n_prompt, n_completion),
                                              choices=False))
                break
            event = await req.events.get()
        await send(b"[DONE]")
        await response.write_eof()
    except ConnectionResetError:  # the client left; the finally of _completions cancels the sequence
        pass
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _completions(request, "completion")


def _model_card(served: ServedModel) -> dict:
    return {"id": served.id, "object": "model", "created": served.created, "owned_by": "hetmoe",
            "max_model_len": served.max_context}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[SERVED])]})


async def model(request: web.Request) -> web.Response:
    served, name = request.app[SERVED], request.match_info["name"]
    if name != served.id:
        raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return web.json_response(_model_card(served))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[METRICS].render(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def create_app(served: ServedModel, engine: EngineLoop, api_key: Optional[str] = None, *,
               limits: Optional[Limits] = None, hosts: Optional[HostPolicy] = None,
               guard: Optional[ConnectionGuard] = None) -> web.Application:
    limits = limits or Limits.for_model(served.max_context, DEFAULT_MAX_BATCH)
    app = web.Application(middlewares=[_errors], client_max_size=limits.max_body)
    app[SERVED], app[ENGINE], app[METRICS], app[API_KEY] = served, engine, engine.metrics, api_key or ""
    app[LIMITS], app[HOSTS], app[GUARD], app[BODIES] = limits, hosts, guard, [0]
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
