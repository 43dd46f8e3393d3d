"""Cross-origin requests from browsers (``--cors-origins``): which web pages' scripts may call the server.

With no ``--cors-origins`` (the default) the server sends no CORS header: a page served from another origin
cannot read its answers, and cannot send it JSON at all (``Content-Type: application/json`` needs a preflight,
which is answered 405 as any OPTIONS request). The Host check (access.py) stays in force either way: CORS says
which pages may read answers, the Host check that a request names this server (DNS rebinding).

With ``--cors-origins http://localhost:3000,https://ui.example`` (or ``*``), a request whose ``Origin`` is listed
gets ``Access-Control-Allow-Origin`` on its response, errors included, and its preflight (``OPTIONS`` with
``Access-Control-Request-Method``) is answered 204 with the methods and headers it may use — before the API key is
checked, since browsers send no credentials in a preflight. A preflight from an origin not listed is answered as
before (405), without CORS headers. Credentials (cookies) are never allowed: the API key travels in a header.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from aiohttp import web

ALLOWED_METHODS = "GET, POST, OPTIONS"
DEFAULT_HEADERS = "Authorization, Content-Type, X-Api-Key, Anthropic-Version, Anthropic-Beta"
MAX_AGE_S = 600
_ORIGIN = re.compile(r"(https?)://([a-z0-9.\-]+|\[[0-9a-f:.]+\])(:\d{1,5})?", re.IGNORECASE)
_HEADER_LIST = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~\-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~\-]+)*")


def check_origin(text: str) -> str:
    """``text`` as an origin (scheme://host[:port], no path) lowercased, or ``*``; ValueError otherwise."""
    text = text.strip()
    if text == "*":
        return text
    if not _ORIGIN.fullmatch(text):
        raise ValueError(f"{text!r} is not an origin: expected scheme://host or scheme://host:port (http or https, "
                         "no path), or *")
    return text.lower()


class CorsPolicy:
    """The origins whose pages may call the server."""

    def __init__(self, origins: Iterable[str]):
        self.origins = {check_origin(o) for o in origins}
        self.any = "*" in self.origins

    def allows(self, origin: Optional[str]) -> bool:
        return bool(origin) and (self.any or origin.lower() in self.origins)

    def response_headers(self, origin: str) -> dict:
        if self.any:
            return {"Access-Control-Allow-Origin": "*", "Access-Control-Expose-Headers": "Retry-After"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin", "Access-Control-Expose-Headers": "Retry-After"}


CORS: web.AppKey = web.AppKey("cors", CorsPolicy)


def is_preflight(request: web.Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


@web.middleware
async def _preflight(request: web.Request, handler):
    """A preflight from a listed origin answered here (inside the error middleware: the Host check and the
    connection's bookkeeping apply); anything else goes on to its route (an OPTIONS request: 405)."""
    if not is_preflight(request) or not request.app[CORS].allows(request.headers.get("Origin")):
        return await handler(request)
    asked = request.headers.get("Access-Control-Request-Headers", "").strip()
    headers = {"Access-Control-Allow-Methods": ALLOWED_METHODS, "Access-Control-Max-Age": str(MAX_AGE_S),
               "Access-Control-Allow-Headers": asked if asked and _HEADER_LIST.fullmatch(asked) else DEFAULT_HEADERS}
    return web.Response(status=204, headers=headers)


async def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    origin = request.headers.get("Origin")
    policy = request.app[CORS]
    if policy.allows(origin):
        for name, value in policy.response_headers(origin).items():
            response.headers[name] = value


def install(app: web.Application, origins: Optional[Iterable[str]]) -> None:
    """CORS for ``origins`` on ``app`` (nothing when None or empty), after its other middlewares: the preflight
    answer and the response headers."""
    if not origins:
        return
    app[CORS] = CorsPolicy(origins)
    app.middlewares.append(_preflight)
    app.on_response_prepare.append(_add_headers)
