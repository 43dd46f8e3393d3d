"""Hostile clients against a running ``hetmoe serve`` on this machine: does the server stay responsive, and does it
let go of what they hold?

While a streaming completion runs and /health is polled back to back (a new connection each time), the script
sends ``--bodies`` valid JSON bodies of ``--body-mb`` MB of nested arrays at once (the shape that used to stop the
event loop for seconds), holds ``--half-open`` connections that send half a request header and nothing more, and
``--slow-bodies`` requests whose body trickles in a byte a second. It prints what it tried, what held (/health
latency p50/p99/max, the stream's largest inter-token gap, during the attack and in a quiet baseline before it)
and what was lost (failed /health polls, stream errors, half-open connections the server had not closed by the
header timeout + 5 s, the answers the big bodies got). Loopback only, bounded counts and time.

    hetmoe serve --port 8000 &                                   # the built-in model; any server works
    python3 bench/hostile_clients.py --url http://127.0.0.1:8000 [--bodies 4 --body-mb 14 --half-open 1100]
        [--slow-bodies 8] [--duration 10] [--header-timeout 10] [--api-key KEY] [--json out.json]

Targets (hetmoe's hardening issue): /health within 0.5 s and the stream's largest gap < 0.5 s during the attack;
every half-open connection closed afterwards. With the default body cap (1 MiB for contexts up to 16K tokens) the
big bodies are refused from their Content-Length; start the server with ``--max-body-size 16MiB`` to have them
read and their JSON checked.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import resource
import selectors
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

MAX_HALF_OPEN, MAX_BODIES, MAX_BODY_MB, MAX_DURATION_S = 4000, 16, 64, 120  # the script's own bounds


def pct(values: list, q: float):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def ms(v) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


class Target:
    def __init__(self, url: str, api_key: str | None):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        address = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][4][0]
        if not ipaddress.ip_address(address).is_loopback:
            raise SystemExit(f"hostile_clients: {url} is not on this machine (loopback only)")
        self.hostport = f"{self.host}:{self.port}"
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key
                                                                else {})}

    def connection(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def get_json(self, path: str) -> dict:
        conn = self.connection()
        try:
            conn.request("GET", path, headers=self.headers)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()


class Stream(threading.Thread):
    """Streaming completions back to back; every token's arrival time."""

    def __init__(self, target: Target, model: str, max_tokens: int):
        super().__init__(daemon=True)
        self.target, self.model, self.max_tokens = target, model, max_tokens
        self.times: list = []
        self.errors: list = []
        self.done = threading.Event()

    def run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "def main():", "max_tokens": self.max_tokens, "stream": True,
                           "temperature": 0, "ignore_eos": True}).encode()
        while not self.done.is_set():
            conn = self.target.connection(timeout=60)
            try:
                conn.request("POST", "/v1/completions", body=body, headers=self.target.headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    self.errors.append(f"HTTP {resp.status}: {resp.read()[:200]!r}")
                    self.done.wait(0.5)
                    continue
                while not self.done.is_set():
                    line = resp.readline()
                    if not line:
                        break
                    if line.startswith(b"data: {"):
                        self.times.append(time.perf_counter())
            except (OSError, http.client.HTTPException) as e:
                self.errors.append(f"{type(e).__name__}: {e}")
            finally:
                conn.close()

    def gaps(self, start: float, end: float) -> list:
        """Inter-token gaps that overlap [start, end] (a stall that began before or outlasted it included)."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if a < end and b > start]


class HealthPoller(threading.Thread):
    """GET /health back to back, each on a new connection: (start, latency or None, status or error)."""

    def __init__(self, target: Target):
        super().__init__(daemon=True)
        self.target = target
        self.samples: list = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            start = time.perf_counter()
            conn = self.target.connection(timeout=10)
            try:
                conn.request("GET", "/health")
                resp = conn.getresponse()
                resp.read()
                self.samples.append((start, time.perf_counter() - start, resp.status))
            except (OSError, http.client.HTTPException) as e:
                self.samples.append((start, None, type(e).__name__))
            finally:
                conn.close()

    def window(self, start: float, end: float) -> list:
        return [s for s in self.samples if start <= s[0] <= end]


def nested_body(model: str, mb: float) -> bytes:
    """Valid JSON of ``mb`` MB: a prompt of nested arrays, 32 deep (under the 64-level depth limit)."""
    group = b"[" * 32 + b"1" + b"]" * 32
    n = int(mb * 1e6) // (len(group) + 1)
    return b'{"model": "' + model.encode() + b'", "max_tokens": 1, "prompt": [' + b",".join([group] * n) + b"]}"


def send_body(target: Target, body: bytes, out: list) -> None:
    start = time.perf_counter()
    conn = target.connection(timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=body, headers=target.headers)
        resp = conn.getresponse()
        text = resp.read()
        try:
            code = json.loads(text)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        out.append((resp.status, code, time.perf_counter() - start))
    except (OSError, http.client.HTTPException) as e:
        out.append((type(e).__name__, None, time.perf_counter() - start))
    finally:
        conn.close()


class HalfOpen:
    """``n`` connections that send half a request header and wait; records when the server closes each."""

    def __init__(self, target: Target, n: int):
        self.target, self.sel = target, selectors.DefaultSelector()
        self.opened, self.failed, self.closed_at = 0, [], {}
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {target.hostport}\r\nContent-Type: applic".encode()
        for _ in range(n):
            try:
                s = socket.create_connection((target.host, target.port), timeout=5)
                s.sendall(head)
                s.setblocking(False)
                self.sel.register(s, selectors.EVENT_READ)
                self.opened += 1
            except OSError as e:
                self.failed.append(type(e).__name__)
        self.started = time.perf_counter()

    def watch(self, until: float) -> None:
        """Until every connection is closed by the server or ``until`` (perf_counter) passes."""
        while self.sel.get_map() and time.perf_counter() < until:
            for key, _ in self.sel.select(timeout=0.2):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the server (a 503 refusal arrives as data first, then the close)
                    self.closed_at[s.fileno()] = time.perf_counter() - self.started
                    self.sel.unregister(s)
                    s.close()

    def close(self) -> int:
        left = len(self.sel.get_map())
        for key in list(self.sel.get_map().values()):
            self.sel.unregister(key.fileobj)
            key.fileobj.close()
        return left


def window(seconds: float) -> tuple:
    """The (start, end) of ``seconds`` of measurement (the clients run meanwhile)."""
    start = time.perf_counter()
    time.sleep(seconds)
    return start, time.perf_counter()


def stats(stream: Stream, health: HealthPoller, span: tuple) -> dict:
    """/health polls started in ``span`` (a poll still hanging when it ended counts once it returns) and the
    stream's gaps overlapping it. Called after the clients stopped."""
    samples = health.window(*span)
    lat = [s[1] for s in samples if s[1] is not None and s[2] == 200]
    gaps = stream.gaps(*span)
    return {"health_n": len(samples), "health_failed": len(samples) - len(lat), "health_p50_s": pct(lat, 0.5),
            "health_p99_s": pct(lat, 0.99), "health_max_s": max(lat, default=None), "tokens": len(gaps) + 1,
            "stream_max_gap_s": max(gaps, default=None), "stream_p50_gap_s": pct(gaps, 0.5)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="default: the served one (GET /v1/models)")
    ap.add_argument("--bodies", type=int, default=4)
    ap.add_argument("--body-mb", type=float, default=14.0)
    ap.add_argument("--half-open", type=int, default=1100)
    ap.add_argument("--slow-bodies", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of attack (measured window)")
    ap.add_argument("--baseline", type=float, default=3.0, help="seconds measured before the attack")
    ap.add_argument("--header-timeout", type=float, default=10.0, help="the server's --header-timeout")
    ap.add_argument("--body-timeout", type=float, default=30.0, help="the server's --body-timeout")
    ap.add_argument("--json", default=None, help="write the numbers to this file")
    args = ap.parse_args()
    if not (0 <= args.half_open <= MAX_HALF_OPEN and 0 <= args.bodies <= MAX_BODIES and 0 < args.body_mb <= MAX_BODY_MB
            and 0 < args.duration <= MAX_DURATION_S and 0 <= args.slow_bodies <= 256):
        ap.error(f"bounds: --half-open <= {MAX_HALF_OPEN}, --bodies <= {MAX_BODIES}, --body-mb <= {MAX_BODY_MB}, "
                 f"--duration <= {MAX_DURATION_S}, --slow-bodies <= 256")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.half_open + args.slow_bodies + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    target = Target(args.url, args.api_key)
    card = target.get_json("/v1/models")["data"][0]
    model = args.model or card["id"]
    body = nested_body(model, args.body_mb)
    print(f"target {args.url} (model {model}); tries, for {args.duration:g} s: {args.bodies} x {len(body) / 1e6:.1f} "
          f"MB nested-array bodies at once, {args.half_open} half-open connections, {args.slow_bodies} bodies at a "
          f"byte a second; meanwhile one streaming completion and /health back to back (new connection each)")

    stream, health = Stream(target, model, card.get("max_model_len", 1024) - 16), HealthPoller(target)
    stream.start()
    deadline = time.perf_counter() + 60
    while not stream.times and time.perf_counter() < deadline and not stream.errors:
        time.sleep(0.05)
    if not stream.times:
        print(f"the stream did not start: {stream.errors[:3]}")
        return 1
    health.start()
    baseline_span = window(args.baseline)

    half_open = HalfOpen(target, args.half_open)
    answers: list = []
    senders = [threading.Thread(target=send_body, args=(target, body, answers), daemon=True)
               for _ in range(args.bodies)]
    slow, slow_start = [], time.perf_counter()
    for _ in range(args.slow_bodies):
        try:
            s = socket.create_connection((target.host, target.port), timeout=5)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {target.hostport}\r\nContent-Type: application/json"
                      f"\r\nContent-Length: 1000\r\n\r\n{{".encode())
            slow.append(s)
        except OSError:
            pass
    for t in senders:
        t.start()
    watcher = threading.Thread(target=half_open.watch, args=(half_open.started + args.header_timeout + 5,),
                               daemon=True)
    watcher.start()

    def trickle():
        for _ in range(int(args.duration)):
            for s in slow:
                try:
                    s.sendall(b" ")
                except OSError:
                    pass
            time.sleep(1)

    threading.Thread(target=trickle, daemon=True).start()
    attack_span = window(args.duration)
    for t in senders:
        t.join(120)
    watcher.join(args.header_timeout + 10)
    left_open = half_open.close()
    slow_answers = []
    for s in slow:  # each should have its 408 by the body timeout
        s.settimeout(max(0.1, slow_start + args.body_timeout + 3 - time.perf_counter()))
        try:
            slow_answers.append(s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace") or "closed")
        except TimeoutError:
            slow_answers.append(f"no answer {args.body_timeout + 3:g} s after the headers")
        except OSError as e:
            slow_answers.append(type(e).__name__)
        s.close()
    stream.done.set()
    health.done.set()
    health.join(30)  # a /health poll that hung in the attack counts
    stream.times.append(time.perf_counter())  # a stream that stalled until now counts too
    baseline, attack = stats(stream, health, baseline_span), stats(stream, health, attack_span)
    metrics = {}
    try:
        conn = target.connection()
        conn.request("GET", "/metrics")
        for line in conn.getresponse().read().decode().splitlines():
            if line.startswith("hetmoe_connections"):
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
        conn.close()
    except (OSError, http.client.HTTPException):
        pass
    closed = sorted(half_open.closed_at.values())
    result = {"url": args.url, "model": model, "bodies": args.bodies, "body_bytes": len(body),
              "half_open": args.half_open, "half_open_connected": half_open.opened,
              "half_open_connect_failed": len(half_open.failed), "slow_bodies": len(slow),
              "baseline": baseline, "attack": attack, "body_answers": answers,
              "half_open_closed": len(closed), "half_open_closed_p50_s": pct(closed, 0.5),
              "half_open_closed_max_s": closed[-1] if closed else None, "half_open_left": left_open,
              "slow_body_answers": slow_answers, "stream_errors": stream.errors[:5], "server_metrics": metrics}

    print("held:")
    for name, m in (("baseline", baseline), ("attack", attack)):
        print(f"  {name:8s} /health p50 {ms(m['health_p50_s'])}, p99 {ms(m['health_p99_s'])}, max "
              f"{ms(m['health_max_s'])} ({m['health_n']} polls, {m['health_failed']} failed); stream largest gap "
              f"{ms(m['stream_max_gap_s'])} (p50 {ms(m['stream_p50_gap_s'])}, {m['tokens']} tokens)")
    print(f"  big bodies answered: {[(a[0], a[1], round(a[2], 2)) for a in answers]} (status, code, s)")
    print(f"  half-open: {half_open.opened} connected, {len(closed)} closed by the server (p50 "
          f"{ms(pct(closed, 0.5))}, last {ms(closed[-1] if closed else None)} after they opened)")
    print(f"  slow bodies: {slow_answers}")
    print(f"  server: {metrics}")
    lost = []
    if attack["health_failed"]:
        lost.append(f"{attack['health_failed']} /health polls failed")
    if left_open:
        lost.append(f"{left_open} half-open connections still open {args.header_timeout + 5:g} s after they opened")
    if half_open.failed:
        lost.append(f"{len(half_open.failed)} half-open connections could not connect ({set(half_open.failed)})")
    if stream.errors:
        lost.append(f"stream errors: {stream.errors[:3]}")
    if any(not a.startswith("HTTP/1.1 408") for a in slow_answers):
        lost.append(f"slow bodies not answered 408 by the body timeout: {slow_answers}")
    print("lost: " + ("; ".join(lost) if lost else "nothing"))
    ok = (attack["health_max_s"] or 99) < 0.5 and (attack["stream_max_gap_s"] or 99) < 0.5 and not left_open
    ok = ok and all(a.startswith("HTTP/1.1 408") for a in slow_answers)
    print(f"target (/health < 0.5 s, largest gap < 0.5 s, connections released, slow bodies 408): "
          f"{'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
