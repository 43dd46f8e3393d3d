"""One line per request (``--access-log``, on by default) on the server's log:

    hetmoe serve: 127.0.0.1 "POST /v1/chat/completions" 200 prompt=24 completion=64 1.482s

the client's address, the method and path (no query string: it may carry secrets), the status, the tokens of a
generation (the handler leaves them in ``request["tokens"]``; "-" for other requests) and the time from the
request's headers to the end of its response (a stream's last byte). A client that left mid-response is logged
with status 499.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from aiohttp import web

# request[TOKENS] = (prompt tokens, completion tokens), set by generation handlers (a typed key where aiohttp has
# them, 3.14 on; older versions take the plain name)
TOKENS = web.RequestKey("tokens", tuple) if hasattr(web, "RequestKey") else "tokens"


class _Stderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(f"hetmoe serve: {self.format(record)}", file=sys.stderr, flush=True)  # sys.stderr as it is now


def access_logger() -> logging.Logger:
    """The logger the lines go to: "hetmoe.serve.access", on stderr after "hetmoe serve: " as the server's other
    lines (a handler of the application's own may be added to it)."""
    log = logging.getLogger("hetmoe.serve.access")
    log.setLevel(logging.INFO)
    log.propagate = False
    if not log.handlers:
        log.addHandler(_Stderr())
    return log


def middleware(log: logging.Logger):
    @web.middleware
    async def access_log(request: web.Request, handler):
        start, status = time.perf_counter(), 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except asyncio.CancelledError:
            status = 499
            raise
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            tokens = request.get(TOKENS)
            shown = f"prompt={tokens[0]} completion={tokens[1]}" if tokens else "-"
            path = request.path if request.path.isprintable() else ascii(request.path)
            log.info('%s "%s %s" %d %s %.3fs', request.remote, request.method, path, status, shown,
                     time.perf_counter() - start)

    return access_log
