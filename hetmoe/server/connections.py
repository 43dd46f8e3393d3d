"""Client connections: a cap on how many are open, a deadline for each request's headers and for an idle keep-alive
connection, and failed accept() calls logged once in a while instead of once per call.

Every connection's protocol is a ``Connection`` around aiohttp's own (``web.Server()`` makes it): it counts the
connection, arms the deadline and passes every event through. A connection is *waiting* from when it opens, or
its previous response ends, until the app sees a request's headers complete (``request_started``): a waiting
connection is closed ``header_timeout`` after it opened, ``keepalive_timeout`` after its previous response. At
``max_connections`` a new connection first displaces the connection that has been waiting longest among those
that never sent a request (a slowloris client holds nothing a working client needs), else the longest idle
keep-alive one; when every connection is inside a request it is answered 503 with ``Retry-After`` and closed.

asyncio's accept loop reports each failed accept() (EMFILE: out of file descriptors) with a traceback, and
retries up to the backlog's count per wake-up: a flood of connections past the open-file limit printed thousands
of tracebacks a second. ``AcceptErrors``, the loop's exception handler, prints one line per interval with the count.
aiohttp logs every malformed request (a bad request line or header, which it answers 400 itself) with a traceback
too; ``http_log()`` is the logger the server gives it, where those are also one line per interval.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Callable, Optional

from hetmoe.server.protocol import error_body

REFUSED_LINGER_S = 1.0  # a refused client's request is read (and dropped) this long, so it gets the 503, not a reset


def _refusal(max_connections: int, retry_after: int) -> bytes:
    body = json.dumps(error_body(f"The server has {max_connections} connections open, its limit "
                                 "(--max-connections), all of them inside a request; retry shortly.",
                                 "server_error", None, "too_many_connections")).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % (retry_after, len(body))) + body


class ConnectionGuard:
    """The open connections of one server and their deadlines (one event loop: no locks)."""

    def __init__(self, max_connections: int, header_timeout: float, keepalive_timeout: float,
                 retry_after: int = 1, metrics=None):
        self.max_connections = max_connections
        self.header_timeout, self.keepalive_timeout = header_timeout, keepalive_timeout
        self.refusal = _refusal(max_connections, retry_after)
        self.metrics = metrics
        self.open = 0
        self.counts = {"refused": 0, "displaced": 0, "timed_out": 0}
        self._fresh: dict = {}  # Connection -> None: waiting for a first request, the one waiting longest first
        self._idle: dict = {}  # Connection -> None: waiting between requests (keep-alive), likewise
        self._by_handler: dict = {}  # aiohttp's protocol -> its Connection

    def protocol_factory(self, make_handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """What ``loop.create_server`` takes: each connection's ``Connection`` around ``make_handler()``."""
        return lambda: Connection(self, make_handler)

    def request_started(self, handler) -> None:
        """The app got a request's headers on ``handler``'s connection (from the middleware)."""
        conn = self._by_handler.get(handler)
        if conn is not None:
            conn.busy()

    def request_finished(self, handler) -> None:
        conn = self._by_handler.get(handler)
        if conn is not None:
            conn.wait(self.keepalive_timeout)

    def _count(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.metrics is not None:
            self.metrics.on_connection(kind)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.set_connections(self.open)

    def _admit(self, conn: "Connection") -> bool:
        if self.open >= self.max_connections:
            waiting = self._fresh or self._idle
            if not waiting:
                self._count("refused")
                return False
            self._count("displaced")
            next(iter(waiting)).drop()
        self.open += 1
        self._gauge()
        return True

    def waiting(self, conn: "Connection") -> bool:
        return conn in self._fresh or conn in self._idle

    def _gone(self, conn: "Connection") -> None:
        self.open -= 1
        self._fresh.pop(conn, None)
        self._idle.pop(conn, None)
        self._by_handler.pop(conn.handler, None)
        self._gauge()


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol (``handler``) inside, counted and given deadlines."""

    def __init__(self, guard: ConnectionGuard, make_handler: Callable[[], asyncio.Protocol]):
        self.guard, self._make_handler = guard, make_handler
        self.handler: Optional[asyncio.Protocol] = None
        self.transport: Optional[asyncio.Transport] = None
        self._timer: Optional[asyncio.TimerHandle] = None
        self._counted = False
        self._served = False  # a request has begun on it

    # ---------------------------------------------------------------- deadlines

    def wait(self, timeout: float) -> None:
        """No request on this connection now: it must send one's headers within ``timeout``."""
        if not self._counted:
            return
        queue = self.guard._idle if self._served else self.guard._fresh
        queue.pop(self, None)
        queue[self] = None
        self._cancel_timer()
        self._timer = asyncio.get_running_loop().call_later(timeout, self._expire)

    def busy(self) -> None:
        self._served = True
        self.guard._fresh.pop(self, None)
        self.guard._idle.pop(self, None)
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.guard.waiting(self):
            self.guard._count("timed_out")
            self.drop()

    def drop(self) -> None:
        """Close now (a waiting connection: no response is under way). It stops counting at once."""
        if self._counted:
            self._counted = False
            self.guard._gone(self)
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if not self.guard._admit(self):
            transport.write(self.guard.refusal)
            if transport.can_write_eof():
                transport.write_eof()
            asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)
            return
        self._counted = True
        self.handler = self._make_handler()
        self.guard._by_handler[self.handler] = self
        self.wait(self.guard.header_timeout)
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            self.handler.data_received(data)

    def eof_received(self):
        if self.handler is None:
            if self.transport is not None:
                self.transport.close()
            return None
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self._counted:
            self._counted = False
            self.guard._gone(self)
        self._cancel_timer()
        self.transport = None
        if self.handler is not None:
            self.handler.connection_lost(exc)


class AcceptErrors:
    """The event loop's exception handler: accept() failing for want of resources (EMFILE, ENFILE, ENOBUFS,
    ENOMEM) is one line per ``interval`` seconds with how often it happened; anything else goes to asyncio's
    default handler."""

    MESSAGE = "socket.accept() out of system resource"  # asyncio's words (selector_events._accept_connection)

    def __init__(self, say: Optional[Callable[[str], None]] = None, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.say = say or (lambda msg: print(f"hetmoe serve: {msg}", file=sys.stderr, flush=True))
        self.interval, self.clock = interval, clock
        self.total = 0
        self._since_line = 0
        self._next_line = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") != self.MESSAGE:
            loop.default_exception_handler(context)
            return
        self.total += 1
        self._since_line += 1
        now = self.clock()
        if now >= self._next_line:
            exc = context.get("exception")
            reason = getattr(exc, "strerror", None) or exc or "out of resources"
            self.say(f"accepting a connection failed: {reason} ({self._since_line} times since the last such line; "
                     f"at most one line per {self.interval:g} s); those clients wait in the listen backlog. "
                     "Raise the open-file limit (ulimit -n) or lower --max-connections.")
            self._since_line = 0
            self._next_line = now + self.interval


class _Stderr(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(f"hetmoe serve: {self.format(record)}", file=sys.stderr, flush=True)  # sys.stderr as it is now


class MalformedRequests(logging.Filter):
    """Records of requests aiohttp could not parse (an ``HttpProcessingError``, answered 400 by aiohttp): one
    line per ``interval`` with the count, no traceback. Anything else passes unchanged."""

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.interval, self.clock = interval, clock
        self.total = 0
        self._since_line = 0
        self._next_line = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.total += 1
        self._since_line += 1
        now = self.clock()
        if now < self._next_line:
            return False
        record.msg = (f"malformed request answered {exc.code}: {exc.message} ({self._since_line} such requests "
                      f"since the last line; at most one line per {self.interval:g} s)")
        record.args, record.exc_info, record.exc_text = (), None, None
        self._since_line = 0
        self._next_line = now + self.interval
        return True


def http_log(interval: float = 10.0) -> logging.Logger:
    """The logger the aiohttp server writes to: stderr, "hetmoe serve: " first, malformed requests condensed."""
    log = logging.getLogger("hetmoe.serve.http")
    log.propagate = False
    if not log.handlers:
        log.addHandler(_Stderr())
    log.filters = [MalformedRequests(interval)]
    return log
