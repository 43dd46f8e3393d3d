"""The rules a request meets before it is queued, each at its edge, on the server's real HTTP stack (create_app,
main.listen, the ConnectionGuard) in this process with an engine stand-in (live_server.InProcess): Content-Type
(415), the body cap (413), the JSON shape (400), bodies in flight (503), the header, body and keep-alive deadlines,
the connection cap, undecodable bodies, the Host header (403), the API key (401) and its sources, accept() errors
in the log. No timing asserts: a deadline is observed as the server closing the socket (recv returns b""), never
before the deadline; the server's state is read on its own loop."""

import gzip
import json
import random
import socket
import threading
import time
import zlib

import httpx
import pytest
from live_server import JSON, InProcess, assert_error, wait_for

from hetmoe.server import limits as limits_module
from hetmoe.server.access import HostPolicy, check_api_key
from hetmoe.server.app import BODIES
from hetmoe.server.connections import AcceptErrors
from hetmoe.server.limits import Limits, body_cap, check_json
from hetmoe.server.protocol import APIError

PROMPT = {"model": "m", "prompt": "Hello", "max_tokens": 1}


@pytest.fixture(scope="module")
def tok():
    from hetmoe.engine.llm import default_model_path
    from hetmoe.tokenizer import Tokenizer

    return Tokenizer.from_dir(default_model_path())


@pytest.fixture
def serve(tok):
    """``serve(**kw)``: an InProcess server (closed after the test); ``limits=`` fields override the defaults."""
    made = []

    def make(api_key=None, allowed_hosts=None, **fields):
        limits = Limits.for_model(256, 2, **{k: v for k, v in fields.items() if k in ("max_body", "max_connections")})
        limits = Limits(**{**limits.__dict__, **fields})
        made.append(InProcess(tok, limits, api_key=api_key, allowed_hosts=allowed_hosts))
        return made[-1]

    yield make
    for s in made:
        s.close()


def request(port, method="POST", path="/v1/completions", body=b"", headers=None, host=None, length=None,
            close=True) -> bytes:
    """A raw HTTP/1.1 request (what a client library would refuse to send); ``close``: Connection: close."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: " + (host or f"127.0.0.1:{port}").encode()]
    if close:
        lines.append(b"Connection: close")
    for k, v in (headers or {}).items():
        lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()))
    if length is not None or body:
        lines.append(b"Content-Length: %d" % (len(body) if length is None else length))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def connect(port) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def read_all(s: socket.socket) -> bytes:
    """Everything until the server closes the connection (a recv timeout fails the test)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def exchange(port, data: bytes) -> bytes:
    with connect(port) as s:
        s.sendall(data)
        return read_all(s)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def post(srv, body, headers=None, path="/v1/completions"):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.base}{path}", content=content, headers={**JSON, **(headers or {})}, timeout=30)


# ---------------------------------------------------------------- Content-Type


def test_posts_need_json_content_type(serve):
    srv = serve()
    body = json.dumps(PROMPT).encode()
    for given in (None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"):
        headers = {"Content-Type": given} if given else {}
        r = httpx.post(f"{srv.base}/v1/completions", content=body, headers=headers)
        err = assert_error(r, 415, code="unsupported_media_type")
        assert "application/json" in err["message"] and (given or "none") in err["message"]
    for given in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(f"{srv.base}/v1/completions", content=body, headers={"Content-Type": given})
        assert r.status_code == 200, r.text
    assert httpx.get(f"{srv.base}/health").status_code == 200  # a GET needs none
    assert len(srv.engine.prompts) == 3


# ---------------------------------------------------------------- the body cap


def test_body_cap_follows_the_context():
    assert body_cap(256) == 1 << 20 and body_cap(16384) == 1 << 20  # at least 1 MiB
    assert body_cap(65536) == 64 * 65536 and Limits.for_model(131072, 8).max_body == 8 << 20
    assert Limits.for_model(131072, 8, max_body=12345).max_body == 12345


def test_body_over_the_cap_is_413_naming_it(serve):
    srv = serve(max_body=4096)
    padded = json.dumps({**PROMPT, "user": " " * 4000}).encode()
    assert len(padded) < 4096 and post(srv, padded).status_code == 200
    over = json.dumps({**PROMPT, "user": " " * 4100}).encode()
    err = assert_error(post(srv, over), 413, code="body_too_large")  # refused from Content-Length
    assert "4096 bytes" in err["message"]

    def chunked():
        yield over[:2000]
        yield over[2000:]

    r = httpx.post(f"{srv.base}/v1/completions", content=chunked(), headers=JSON)  # no length: counted as read
    assert "4096 bytes" in assert_error(r, 413, code="body_too_large")["message"]


def test_max_body_size_flag():
    from hetmoe.cli import _parse

    assert _parse(["serve", "--max-body-size", "2MiB"]).max_body_size == 2 << 20
    with pytest.raises(SystemExit) as e:
        _parse(["serve", "--max-body-size", "0"])
    assert e.value.code == 2


# ---------------------------------------------------------------- the JSON shape


def reference_shape(raw: bytes) -> tuple:
    """(deepest nesting, containers, commas) outside strings, one byte at a time (check_json's reference)."""
    depth = deepest = containers = commas = 0
    in_string = escaped = False
    for b in raw:
        c = chr(b)
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            containers += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
        elif c == ",":
            commas += 1
    return deepest, containers, commas


def verdict(raw: bytes, limits: Limits):
    try:
        check_json(raw, limits)
        return None
    except APIError as e:
        return e.code


def test_json_shape_against_a_reference(monkeypatch):
    """Random JSON-like bodies (strings holding brackets, quotes and backslash runs, nesting around the limit),
    scanned in small chunks so that strings and escapes straddle chunk edges."""
    monkeypatch.setattr(limits_module, "_SCAN_CHUNK", 7)
    limits = Limits(max_body=1 << 20, max_containers=8, max_values=10, bodies_in_flight=1, max_connections=1,
                    max_depth=3)
    rng = random.Random(1)
    atoms = ['"a[b"', '"{{"', '"\\\\"', '"\\""', '"\\\\\\""', '"x\\\\\\\\"', "1", "true", "[", "]", "{", "}",
             ",", '"k":', " ", '"]]]]"', "[]", "{}", "[1,2]"]
    seen = []
    for _ in range(3000):
        raw = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 40))).encode()
        deepest, containers, commas = reference_shape(raw)
        deep = deepest > limits.max_depth
        large = containers > limits.max_containers or commas >= limits.max_values
        got = verdict(raw, limits)
        if deep and large:  # both bounds broken: the first one met, chunk by chunk, is reported
            assert got in ("json_too_deep", "json_too_complex"), raw
        else:
            assert got == ("json_too_deep" if deep else "json_too_complex" if large else None), raw
        seen.append(got)
    assert all(seen.count(v) > 100 for v in (None, "json_too_deep", "json_too_complex")), set(seen)


def test_json_depth_limit_is_64(serve):
    limits = Limits.for_model(256, 2)
    assert limits.max_depth == 64
    assert verdict(b"[" * 64 + b"]" * 64, limits) is None
    assert verdict(b"[" * 65 + b"]" * 65, limits) == "json_too_deep"
    assert verdict(json.dumps(["[" * 1000, "{" * 1000]).encode(), limits) is None  # inside strings
    srv = serve()
    err = assert_error(post(srv, b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}"), 400, code="json_too_deep")
    assert "64 levels" in err["message"]
    err = assert_error(post(srv, b"[" + b",".join([b"[]"] * 2000) + b"]"), 400, code="json_too_complex")
    assert str(limits.max_containers) in err["message"]
    err = assert_error(post(srv, b"[" + b",".join([b"0"] * 7000) + b"]"), 400, code="json_too_complex")
    assert str(limits.max_values) in err["message"]
    assert_error(post(srv, b"{not json"), 400, code="invalid_json")
    ids = {**PROMPT, "prompt": list(range(1, 255))}  # a prompt of token ids near the context is far within
    assert post(srv, ids).status_code == 200 and srv.engine.prompts[-1] == ids["prompt"]


def test_json_is_parsed_off_the_event_loop(serve, monkeypatch):
    from hetmoe.server import app as app_module

    threads = []

    def recording(raw, encoding, limits):
        threads.append(threading.get_ident())
        return limits_module.parse_body(raw, encoding, limits)

    monkeypatch.setattr(app_module, "parse_body", recording)
    srv = serve()
    assert post(srv, PROMPT).status_code == 200
    assert threads and threads[0] != srv.call(threading.get_ident)


# ---------------------------------------------------------------- bodies in flight


def test_bodies_in_flight_are_bounded(serve):
    srv = serve(bodies_in_flight=2)
    body = json.dumps(PROMPT).encode()
    slow = [connect(srv.port) for _ in range(2)]
    for s in slow:  # headers and half the body: each holds a body slot
        s.sendall(request(srv.port, body=body[:10], headers=JSON, length=len(body)))
    assert wait_for(lambda: srv.call(lambda: srv.app[BODIES][0]) == 2)
    r = post(srv, PROMPT)
    err = assert_error(r, 503, code="server_busy")
    assert r.headers["Retry-After"] == "1" and "2 request bodies" in err["message"]
    for s in slow:  # the rest of the bodies: both answered
        s.sendall(body[10:])
    answers = [s.recv(65536) for s in slow]
    assert all(status_of(a) == 200 for a in answers), answers
    for s in slow:
        s.close()
    assert srv.call(lambda: srv.app[BODIES][0]) == 0 and post(srv, PROMPT).status_code == 200


def test_a_client_leaving_mid_body_is_counted_not_logged(serve, capfd):
    srv = serve()
    with connect(srv.port) as s:
        s.sendall(request(srv.port, body=b'{"model"', headers=JSON, length=1000))
        assert wait_for(lambda: srv.call(lambda: srv.app[BODIES][0]) == 1)
    assert wait_for(lambda: srv.call(lambda: srv.app[BODIES][0]) == 0)  # the slot is freed
    assert wait_for(lambda: 'status="499"' in httpx.get(f"{srv.base}/metrics").text)
    assert "Traceback" not in capfd.readouterr().err


def test_a_client_leaving_a_cancelled_handler_is_counted(serve, capfd, monkeypatch):
    """A client that leaves while its handler awaits is cancelled by aiohttp (handler_cancellation) before any read
    fails: the request is counted as a 499 all the same (which of the two happens first depends on the machine)."""
    import asyncio

    from hetmoe.server import app as app_module

    entered = threading.Event()

    async def stuck(request):
        entered.set()
        await asyncio.Event().wait()  # until cancelled

    monkeypatch.setattr(app_module, "_body", stuck)
    srv = serve()
    with connect(srv.port) as s:
        s.sendall(request(srv.port, body=b'{"model": "m"}', headers=JSON))
        assert entered.wait(30)
    assert wait_for(lambda: 'status="499"' in httpx.get(f"{srv.base}/metrics").text)
    assert "Traceback" not in capfd.readouterr().err


# ---------------------------------------------------------------- deadlines


def test_header_timeout_closes_a_slow_connection(serve):
    srv = serve(header_timeout=0.3, keepalive_timeout=60)
    with connect(srv.port) as silent, connect(srv.port) as slow:
        start = time.monotonic()
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finishes its headers
        assert read_all(silent) == b"" and read_all(slow) == b""  # closed by the server, nothing sent
        assert time.monotonic() - start >= 0.3
    assert srv.guard.counts["timed_out"] == 2
    assert wait_for(lambda: srv.call(lambda: srv.guard.open) == 0)


def test_keepalive_timeout_closes_an_idle_connection(serve):
    srv = serve(header_timeout=60, keepalive_timeout=0.3)
    with connect(srv.port) as s:
        s.sendall(request(srv.port, "GET", "/health", close=False))
        answer = s.recv(65536)
        assert status_of(answer) == 200 and answer.endswith(b'{"status": "ok"}')
        idle = time.monotonic()
        s.sendall(request(srv.port, "GET", "/health", close=False))  # the same connection serves a second one
        assert status_of(s.recv(65536)) == 200
        assert read_all(s) == b"" and time.monotonic() - idle >= 0.3
    assert srv.guard.counts["timed_out"] == 1


def test_body_timeout_answers_408_and_closes(serve):
    srv = serve(body_timeout=0.3)
    with connect(srv.port) as s:
        s.sendall(request(srv.port, body=b'{"model": ', headers=JSON, length=100))
        answer = read_all(s)
    assert status_of(answer) == 408 and body_of(answer)["error"]["code"] == "body_timeout"
    assert b"0.3 s" in answer
    assert srv.call(lambda: srv.app[BODIES][0]) == 0


# ---------------------------------------------------------------- the connection cap


def test_connection_cap_displaces_the_longest_waiting(serve):
    srv = serve(max_connections=3)
    idle = [connect(srv.port) for _ in range(3)]
    assert wait_for(lambda: srv.call(lambda: srv.guard.open) == 3)
    assert httpx.get(f"{srv.base}/health").status_code == 200  # a 4th connection gets in
    assert read_all(idle[0]) == b""  # ... in place of the first one, which had sent nothing
    assert srv.guard.counts["displaced"] >= 1
    for s in idle:
        s.close()
    assert wait_for(lambda: srv.call(lambda: srv.guard.open) == 0)  # every connection released


def test_connection_cap_keeps_keepalive_connections_over_fresh_ones(serve):
    """At the cap, a connection that never sent a request makes way before an idle keep-alive one."""
    srv = serve(max_connections=3)
    with httpx.Client(base_url=srv.base) as client:  # one keep-alive connection, idle between its requests
        assert client.get("/health").status_code == 200
        fresh = [connect(srv.port) for _ in range(2)]
        assert wait_for(lambda: srv.call(lambda: srv.guard.open) == 3)
        newer = []
        for s in fresh:  # each newer connection displaces the oldest fresh one; the keep-alive one stays
            newer.append(connect(srv.port))
            assert read_all(s) == b""
        assert srv.guard.counts["displaced"] == 2 and srv.call(lambda: srv.guard.open) == 3
        assert client.get("/health").status_code == 200
    for s in fresh + newer:
        s.close()


def test_connection_cap_refuses_503_when_every_connection_is_busy(serve):
    srv = serve(max_connections=2)
    body = json.dumps(PROMPT).encode()
    busy = [connect(srv.port) for _ in range(2)]
    for s in busy:
        s.sendall(request(srv.port, body=body[:5], headers=JSON, length=len(body)))
    assert wait_for(lambda: srv.call(lambda: srv.app[BODIES][0]) == 2)
    answer = exchange(srv.port, request(srv.port, "GET", "/health"))
    assert status_of(answer) == 503 and b"Retry-After: 1\r\n" in answer
    assert body_of(answer)["error"]["code"] == "too_many_connections"
    assert srv.guard.counts["refused"] == 1
    for s in busy:
        s.sendall(body[5:])
        assert status_of(s.recv(65536)) == 200
        s.close()
    assert wait_for(lambda: srv.call(lambda: srv.guard.open) == 0)
    assert httpx.get(f"{srv.base}/metrics").text.count('hetmoe_connections_closed_total{reason="refused"} 1') == 1


@pytest.mark.parametrize("soft, backlog, cap", [(20000, 1024, 4096), (1024, 192, 576), (600, 86, 258),
                                                (64, 64, 16), (None, 1024, 4096)])
def test_connection_defaults_follow_the_open_file_limit(monkeypatch, soft, backlog, cap):
    """The cap leaves room for the files that are not connections and for one accept burst (asyncio accepts up to
    the backlog's count at once, before the cap sees them): past the limit a client waits unanswered."""
    import resource

    infinity = resource.RLIM_INFINITY
    monkeypatch.setattr(limits_module.resource, "getrlimit", lambda _: (infinity if soft is None else soft, infinity))
    assert limits_module.default_backlog() == backlog and limits_module.default_max_connections() == cap
    limits = Limits.for_model(256, 2)
    assert (limits.backlog, limits.max_connections) == (backlog, cap)


def test_accept_errors_are_one_line_per_interval():
    lines, now = [], [100.0]
    handler = AcceptErrors(lines.append, interval=10.0, clock=lambda: now[0])

    class Loop:
        passed = []

        def default_exception_handler(self, context):
            self.passed.append(context)

    context = {"message": AcceptErrors.MESSAGE, "exception": OSError(24, "Too many open files")}
    for _ in range(1900):  # a second of a flood past the open-file limit
        handler(Loop(), context)
    now[0] += 10.0
    handler(Loop(), context)
    assert len(lines) == 2 and "Too many open files" in lines[0] and "(1 times" in lines[0]
    assert "(1900 times" in lines[1] and handler.total == 1901
    handler(Loop(), {"message": "something else"})
    assert Loop.passed == [{"message": "something else"}] and len(lines) == 2


# ---------------------------------------------------------------- bodies that do not decode


@pytest.mark.parametrize("encoding, status, code", [
    ("gzip", 400, "invalid_body"), ("x-gzip", 400, "invalid_body"), ("deflate", 400, "invalid_body"),
    ("br", 415, "unsupported_encoding"), ("zstd", 415, "unsupported_encoding"), ("gzip, gzip", 415, None)])
def test_undecodable_body_is_4xx(serve, capfd, encoding, status, code):
    srv = serve()
    body = json.dumps(PROMPT).encode()
    answer = exchange(srv.port, request(srv.port, body=body, headers={**JSON, "Content-Encoding": encoding}))
    assert status_of(answer) == status and body_of(answer)["error"]["code"] == (code or "unsupported_encoding")
    assert "Traceback" not in capfd.readouterr().err


def test_compressed_bodies(serve):
    srv = serve(max_body=4096)
    body = json.dumps(PROMPT).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body)),
                           ("deflate", zlib.compress(body)[2:-4]), ("identity", body)):  # zlib-wrapped or raw deflate
        r = post(srv, data, headers={"Content-Encoding": encoding})
        assert r.status_code == 200, (encoding, r.text)
    assert srv.engine.prompts[0] == srv.engine.prompts[-1]
    bomb = gzip.compress(json.dumps({**PROMPT, "user": " " * 10**6}).encode())  # 1 KB that inflates to 1 MB
    assert len(bomb) < 4096
    err = assert_error(post(srv, bomb, headers={"Content-Encoding": "gzip"}), 413, code="body_too_large")
    assert "4096 bytes" in err["message"]
    truncated = gzip.compress(body)[:-10]
    assert_error(post(srv, truncated, headers={"Content-Encoding": "gzip"}), 400, code="invalid_body")


def test_malformed_requests_are_answered_and_logged_briefly(serve, capfd):
    srv = serve()
    bad = [b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
           b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
           b"GET /\x00 HTTP/1.1\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n"]
    for _ in range(20):
        for data in bad:
            assert status_of(exchange(srv.port, data)) == 400
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("malformed request answered 400") == 1, err
    assert httpx.get(f"{srv.base}/health").status_code == 200


# ---------------------------------------------------------------- Host


@pytest.mark.parametrize("header, ok", [
    ("127.0.0.1:{port}", True), ("localhost:{port}", True), ("LOCALHOST:{port}", True), ("[::1]:{port}", True),
    ("localhost:1", False), ("localhost", False), ("evil.example:{port}", False), ("127.0.0.1.nip.io:{port}", False),
    ("localhost.:{port}", False), ("[::1]", False), ("", False), ("localhost:{port}x", False),
])
def test_host_header_on_a_loopback_bind(header, ok):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    try:
        port = s.getsockname()[1]
        policy = HostPolicy.for_server("127.0.0.1", [s], None)
        assert policy.allows(header.format(port=port)) is ok
    finally:
        s.close()


def test_allowed_hosts_and_non_loopback_binds():
    loop_sock, any_sock = socket.socket(), socket.socket()
    loop_sock.bind(("127.0.0.1", 0))
    any_sock.bind(("0.0.0.0", 0))
    try:
        assert HostPolicy.for_server("0.0.0.0", [any_sock], None) is None  # names it cannot know: no check
        assert HostPolicy.for_server("127.0.0.1", [loop_sock], ["*"]) is None
        policy = HostPolicy.for_server("0.0.0.0", [any_sock], ["api.example.com", "other.example:8443"])
        assert policy.allows("api.example.com") and policy.allows("API.example.com:443")
        assert policy.allows("other.example:8443") and not policy.allows("other.example:8444")
        assert not policy.allows("evil.example")
    finally:
        loop_sock.close()
        any_sock.close()


def test_host_check_through_http(serve):
    srv = serve(allowed_hosts=None)
    answer = exchange(srv.port, request(srv.port, "GET", "/health", host="evil.example:%d" % srv.port))
    assert status_of(answer) == 403 and body_of(answer)["error"]["code"] == "host_not_allowed"
    assert b"localhost" in answer  # it says which names it answers to
    assert status_of(exchange(srv.port, request(srv.port, "GET", "/health", host=f"localhost:{srv.port}"))) == 200
    srv2 = serve(allowed_hosts=["my.host"])
    assert status_of(exchange(srv2.port, request(srv2.port, "GET", "/health", host="my.host"))) == 200


# ---------------------------------------------------------------- the API key


@pytest.mark.parametrize("auth", [b"Bearer \xff\xfe", "Bearer cl\u00e9".encode(), b"Bearer \xc3", b"bearer  ",
                                  b"Basic dXNlcjpwYXNz", b"Bearer secret-key-\xe9"])
def test_bad_authorization_headers_are_401(serve, auth):
    srv = serve(api_key="secret-key")
    answer = exchange(srv.port, request(srv.port, body=json.dumps(PROMPT).encode(),
                                        headers={**JSON, "Authorization": auth}))
    assert status_of(answer) == 401 and body_of(answer)["error"]["code"] == "invalid_api_key", answer
    r = post(srv, PROMPT, headers={"Authorization": "Bearer secret-key"})
    assert r.status_code == 200


def test_api_key_sources(tmp_path, monkeypatch, capsys):
    from hetmoe.cli import _parse
    from hetmoe.server.main import api_key

    def usage_error(*argv):
        with pytest.raises(SystemExit) as e:
            _parse(["serve", *argv])
        assert e.value.code == 2
        return capsys.readouterr().err

    assert "empty" in usage_error("--api-key", "")
    assert "printable ASCII" in usage_error("--api-key", "two words")
    keyfile = tmp_path / "key"
    keyfile.write_text("from-file\n")
    assert "not allowed with" in usage_error("--api-key", "k", "--api-key-file", str(keyfile))
    (tmp_path / "empty").write_text("\n")
    assert "empty" in usage_error("--api-key-file", str(tmp_path / "empty"))
    assert "cannot read" in usage_error("--api-key-file", str(tmp_path / "missing"))
    monkeypatch.setenv("HETMOE_API_KEY", "from-env")
    assert api_key(_parse(["serve", "--api-key-file", str(keyfile)])) == "from-file"
    assert api_key(_parse(["serve", "--api-key", "flag"])) == "flag"
    assert api_key(_parse(["serve"])) == "from-env"
    monkeypatch.setenv("HETMOE_API_KEY", "bad key")
    with pytest.raises(ValueError, match="HETMOE_API_KEY"):
        api_key(_parse(["serve"]))
    monkeypatch.delenv("HETMOE_API_KEY")
    assert api_key(_parse(["serve"])) is None
    assert check_api_key("k3y-_.~") == "k3y-_.~"


def test_warning_for_an_exposed_server_without_a_key():
    from hetmoe.server.main import exposure_warning

    exposed, local = socket.socket(), socket.socket()
    exposed.bind(("0.0.0.0", 0))
    local.bind(("127.0.0.1", 0))
    try:
        assert "no API key" in exposure_warning("0.0.0.0", [exposed], has_key=False)
        assert exposure_warning("0.0.0.0", [exposed], has_key=True) is None
        assert exposure_warning("127.0.0.1", [local], has_key=False) is None
    finally:
        exposed.close()
        local.close()


def test_split_special_tokens_flag():
    from hetmoe.cli import _parse

    assert _parse(["serve"]).split_special_tokens is True
    assert _parse(["serve", "--no-split-special-tokens"]).split_special_tokens is False
