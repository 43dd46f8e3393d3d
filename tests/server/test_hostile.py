"""Hostile clients against a real ``hetmoe serve`` (the built-in model, on 127.0.0.1): big nested JSON bodies,
slowloris headers and bodies, more bodies than may be in flight, a flood past the connection cap and past the
open-file limit, bodies and headers that do not decode. Each asserts what the server must hold (/health answers,
a running stream keeps its pace, every connection is let go, nothing but short lines in the log). Timing asserts:
the slow tier. The per-rule edges are test_http_limits.py (in-process, per commit)."""

import json
import os
import resource
import selectors
import socket
import threading
import time

import httpx
import pytest
from live_server import JSON, Server, assert_error, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def start(tmp_path_factory):
    """``start(*flags, nofile=None)``: the built-in model served with ``flags`` (``nofile``: the server's
    open-file limit); stopped after the test."""
    servers = []

    def make(*flags, nofile=None):
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg"))}
        env.pop("HETMOE_API_KEY", None)
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        servers.append(Server(None, env, *flags, preexec_fn=limit))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


class Watch:
    """A streaming completion (back to back) and /health polled back to back (on new connections, or one kept
    alive), for as long as the ``with`` block runs: ``gaps`` between tokens and /health ``latencies`` (failed
    polls and a broken stream: ``failures``)."""

    def __init__(self, server, model="hetmoe-default", keepalive=False):
        self.server, self.model, self.keepalive = server, model, keepalive
        self.tokens, self.latencies, self.failures = [], [], []
        self.done, self.streaming = threading.Event(), threading.Event()

    def _stream(self):
        body = {"model": self.model, "prompt": "def main():", "max_tokens": 1000, "stream": True, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(timeout=60) as http:
            while not self.done.is_set():
                try:
                    with http.stream("POST", f"{self.server.base}/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                self.tokens.append(time.perf_counter())
                                self.streaming.set()
                            if self.done.is_set():
                                break
                except httpx.HTTPError as e:  # the stream broke: a failure of what the server must hold
                    self.failures.append(f"stream: {e!r}")

    def _health(self):
        kept = httpx.Client(timeout=10) if self.keepalive else None
        while not self.done.is_set():
            start = time.perf_counter()
            try:
                status = (kept or httpx).get(f"{self.server.base}/health", timeout=10).status_code
                (self.latencies if status == 200 else self.failures).append(time.perf_counter() - start)
            except httpx.HTTPError as e:
                self.failures.append(f"/health: {e!r}")
        if kept is not None:
            kept.close()

    def __enter__(self):
        self.threads = [threading.Thread(target=self._stream, daemon=True),
                        threading.Thread(target=self._health, daemon=True)]
        for t in self.threads:
            t.start()
        assert self.streaming.wait(60), "the stream never started"
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.end = time.perf_counter()
        self.done.set()
        for t in self.threads:
            t.join(60)

    @property
    def gaps(self):
        t = [x for x in self.tokens if self.start <= x <= self.end]
        return [b - a for a, b in zip(t, t[1:])]

    def check(self, bound=0.5):
        print(f"/health: {len(self.latencies)} polls, slowest {max(self.latencies) * 1000:.1f} ms; stream: "
              f"{len(self.gaps)} gaps, largest {max(self.gaps) * 1000:.1f} ms")
        assert not self.failures, self.failures[:5]
        assert len(self.latencies) >= 5 and max(self.latencies) < bound
        assert len(self.gaps) >= 5 and max(self.gaps) < bound


def nested(mb: float, depth: int = 32) -> bytes:
    group = b"[" * depth + b"1" + b"]" * depth
    n = int(mb * 1e6) // (len(group) + 1)
    return b'{"model": "hetmoe-default", "max_tokens": 1, "prompt": [' + b",".join([group] * n) + b"]}"


def half_open(server, n: int, head: bytes = b"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n") -> list:
    """``n`` connections that send ``head`` (``{host}``: the server's host:port) and nothing more."""
    head = head.replace(b"{host}", f"127.0.0.1:{server.port}".encode())
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(head)
        socks.append(s)
    return socks


def wait_closed(socks: list, timeout: float) -> int:
    """How many of ``socks`` the server closes (recv returns b"" or a reset) within ``timeout``."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + timeout
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            try:
                data = key.fileobj.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                closed += 1
                sel.unregister(key.fileobj)
    for s in socks:
        s.close()
    return closed


def test_big_nested_bodies_do_not_stall(start):
    """Four valid 14 MB bodies of nested arrays at once, read (a 16 MiB cap) and refused from their shape, while a
    stream runs: /health and the stream keep their pace. A 14 MB body used to stop /health for ~4 s."""
    server = start("--max-body-size", "16MiB")
    bodies = [nested(14), nested(14), nested(0.2, depth=70), nested(14)]
    answers = []

    def send(body):
        for _ in range(3):  # three rounds: a window long enough to see the stream's pace
            answers.append(httpx.post(f"{server.base}/v1/completions", content=body, headers=JSON, timeout=120))

    with Watch(server) as watch:
        senders = [threading.Thread(target=send, args=(b,)) for b in bodies]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
    codes = sorted(r.json()["error"]["code"] for r in answers)
    assert codes == ["json_too_complex"] * 9 + ["json_too_deep"] * 3
    watch.check()
    assert "Traceback" not in server.stderr


def test_default_cap_refuses_big_bodies_unread(start):
    server = start()
    with Watch(server) as watch:
        for _ in range(12):
            r = httpx.post(f"{server.base}/v1/completions", content=nested(14), headers=JSON, timeout=120)
            assert str(1 << 20) in assert_error(r, 413, code="body_too_large")["message"]
    watch.check()


def test_slowloris_headers_and_bodies_are_let_go(start):
    server = start("--header-timeout", "2", "--body-timeout", "2", "--keepalive-timeout", "2")
    with Watch(server) as watch:
        heads = half_open(server, 300)
        bodies = half_open(server, 20, b"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                                       b"application/json\r\nContent-Length: 1000\r\n\r\n{")
        for s in bodies:
            s.settimeout(30)
        answers = [s.recv(65536) for s in bodies]  # the body timeout: 408
        assert wait_closed(heads, 30) == 300
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[:3]
    assert wait_closed(bodies, 30) == 20
    watch.check()
    assert wait_for(lambda: server.metrics()["hetmoe_connections_open"] <= 1)
    assert server.metrics()['hetmoe_connections_closed_total{reason="timed_out"}'] >= 300


def test_more_bodies_than_may_be_in_flight(start):
    """--max-batch 2: 8 bodies may be read at once; 30 clients send half a body: the rest are answered 503 at once,
    the 8 get 408 at the body timeout, and /health never waits."""
    server = start("--max-batch", "2", "--body-timeout", "3")
    body = json.dumps({"model": "hetmoe-default", "prompt": "hi", "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body[:5]
    with Watch(server) as watch:
        socks = half_open(server, 30, head)
        for s in socks:
            s.settimeout(30)
        answers = [s.recv(65536).split(b"\r\n\r\n")[0] for s in socks]
    statuses = sorted(int(a.split(b" ")[1]) for a in answers)
    assert statuses == [408] * 8 + [503] * 22, statuses
    assert all(b"Retry-After: 1" in a for a in answers if b" 503 " in a)
    for s in socks:
        s.close()
    watch.check()


def test_connection_flood_past_the_cap(start):
    """--max-connections 64 and 400 connections that send nothing, opened over ~2 s: the longest-waiting ones
    make way for newer ones; the clients that keep their connection alive (a stream, a /health poller) go on."""
    server = start("--max-connections", "64")
    with Watch(server, keepalive=True) as watch:
        socks = []
        for _ in range(400):
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=30))
            time.sleep(0.005)  # pacing the flood (not a synchronization)
        assert wait_closed(socks[:300], 30) == 300
        for s in socks[300:]:
            s.close()
    watch.check()
    m = server.metrics()
    assert m['hetmoe_connections_closed_total{reason="displaced"}'] >= 400 - 64
    assert wait_for(lambda: server.metrics()["hetmoe_connections_open"] <= 1)


def test_accept_errors_past_the_open_file_limit(start):
    """The server may hold 64 files; a cap above that lets accept() fail with EMFILE: one short line per 10 s, not
    a traceback per failed call, and it serves again once the clients leave."""
    server = start("--max-connections", "100000", nofile=64)
    socks = []
    for _ in range(200):
        try:
            socks.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        except OSError:
            break
    assert wait_for(lambda: "accepting a connection failed" in server.stderr, 30)
    for s in socks:
        s.close()
    assert wait_for(lambda: httpx.get(f"{server.base}/health", timeout=5).status_code == 200, 60)
    err = server.stderr
    assert "Traceback" not in err and "Too many open files" in err
    assert err.count("accepting a connection failed") <= 2, err


def test_bad_encodings_and_headers(start):
    server = start("--api-key", "k3y")
    body = json.dumps({"model": "hetmoe-default", "prompt": "hi", "max_tokens": 1}).encode()
    auth = b"Authorization: Bearer k3y\r\n"

    def raw(head: bytes, payload: bytes = b"") -> int:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        return int(answer.split(b" ")[1])

    post = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n" % server.port
    cases = [
        (post + auth + b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n", body, 400),
        (post + auth + b"Content-Type: application/json\r\nContent-Encoding: br\r\n", body, 415),
        (post + auth + b"Content-Type: text/plain\r\n", body, 415),
        (post + b"Authorization: Bearer \xff\xfe\r\nContent-Type: application/json\r\n", body, 401),
        (post.replace(b"127.0.0.1:%d" % server.port, b"evil.example") + auth, body, 403),
        (post + auth + b"Bad Header\r\n", body, 400),
        (post + auth + b"X-Long: " + b"a" * 20000 + b"\r\n", body, 400),
        (post + auth + b"Content-Type: application/json\r\n", b'{"model": "hetmoe-default", "prompt": "\\ud800"}',
         400),
    ]
    for _ in range(25):
        for head, payload, status in cases:
            assert raw(head, payload) == status, head[:80]
    assert httpx.get(f"{server.base}/health").status_code == 200
    err = server.stderr
    assert "Traceback" not in err and err.count("malformed request") <= 2, err
