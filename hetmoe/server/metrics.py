"""Server metrics in the Prometheus text format (``GET /metrics``), updated by both the HTTP side and the engine
thread (one lock; every update is a few additions)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque

# Time-to-first-token histogram bounds, seconds (a tiny model on a CPU answers in ms; a DeepSeek prefill in s).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0  # the tok/s gauge averages over this much recent time


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.monotonic()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.prompt_tokens = 0  # of finished requests
        self.completion_tokens = 0  # every sampled token, also of requests that are cancelled later
        self.finished = 0
        self.cancelled = 0
        self.waiting = 0
        self.running = 0
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)  # the last one is +Inf
        self.ttft_sum = 0.0
        self._recent: deque = deque()  # (monotonic time, tokens) of recent samples, for the tok/s gauge
        self.connections_open = 0
        self.connections: Counter = Counter()  # "refused" | "displaced" | "timed_out" -> count (connections.py)
        self.tool_parse_failures = 0  # outputs that began a tool call in the model's syntax that did not parse

    def on_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, int(status))] += 1

    def on_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        with self._lock:
            self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, ttft_s)] += 1
            self.ttft_sum += ttft_s

    def on_tokens(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.completion_tokens += n
            self._recent.append((now, n))
            self._trim(now)

    def on_finish(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.finished += 1

    def on_connection(self, kind: str) -> None:
        with self._lock:
            self.connections[kind] += 1

    def set_connections(self, n: int) -> None:
        with self._lock:
            self.connections_open = n

    def on_tool_parse_failure(self) -> None:
        with self._lock:
            self.tool_parse_failures += 1

    def on_cancel(self) -> None:
        with self._lock:
            self.cancelled += 1

    def set_gauges(self, waiting: int | None = None, running: int | None = None) -> None:
        with self._lock:
            if waiting is not None:
                self.waiting = waiting
            if running is not None:
                self.running = running

    def _trim(self, now: float) -> None:
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            window = min(RATE_WINDOW_S, now - self.started)
            return sum(n for _, n in self._recent) / window if window > 0 else 0.0

    def render(self) -> str:
        """The Prometheus exposition text (version 0.0.4)."""
        rate = self.tokens_per_second()
        with self._lock:
            out = []

            def metric(name, kind, help_text, samples):
                out.append(f"# HELP {name} {help_text}")
                out.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    out.append(f"{name}{labels} {value}")

            requests = sorted(self.requests.items())
            metric("hetmoe_requests_total", "counter", "HTTP requests by endpoint and status code.",
                   [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in requests])
            metric("hetmoe_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [("", self.prompt_tokens)])
            metric("hetmoe_completion_tokens_total", "counter", "Tokens generated.", [("", self.completion_tokens)])
            metric("hetmoe_requests_finished_total", "counter", "Generations that ran to a stop or length limit.",
                   [("", self.finished)])
            metric("hetmoe_requests_cancelled_total", "counter", "Generations cancelled (the client went away).",
                   [("", self.cancelled)])
            metric("hetmoe_queue_depth", "gauge", "Requests waiting for a free sequence slot.", [("", self.waiting)])
            metric("hetmoe_running_sequences", "gauge", "Sequences holding a KV-cache slot (prefilling or decoding).",
                   [("", self.running)])
            metric("hetmoe_generation_tokens_per_second", "gauge",
                   f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.", [("", f"{rate:.3f}")])
            metric("hetmoe_connections_open", "gauge", "Client connections open.", [("", self.connections_open)])
            metric("hetmoe_connections_closed_total", "counter",
                   "Connections the server closed: refused (503 at --max-connections), displaced (the longest "
                   "waiting one, for a new connection at the cap), timed_out (no request headers in time).",
                   [(f'{{reason="{k}"}}', self.connections[k]) for k in ("refused", "displaced", "timed_out")])
            metric("hetmoe_tool_call_parse_failures_total", "counter",
                   "Outputs that began a tool call the parser could not read (returned as content).",
                   [("", self.tool_parse_failures)])
            cumulative, samples = 0, []
            for bound, n in zip(TTFT_BUCKETS + (float("inf"),), self.ttft_counts):
                cumulative += n
                samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else f"{bound:g}"}"}}', cumulative))
            samples += [("_sum", f"{self.ttft_sum:.6f}"), ("_count", cumulative)]
            metric("hetmoe_time_to_first_token_seconds", "histogram",
                   "From arrival at the engine to the first sampled token.", samples)
            return "\n".join(out) + "\n"
