"""What one client may cost the server before its request is queued: the body's size, the JSON's shape, the time it
takes to send headers and body, how many bodies and connections are open at once.

A request body is read within ``body_timeout`` and at most ``max_body`` bytes (64 bytes per token of the context,
at least 1 MiB: a prompt that fits the context as JSON text, with room for the other fields), then parsed on a
worker thread. The C JSON parser holds the GIL for the whole call and builds one Python object per value, so a
valid 14 MB body of nested arrays kept every thread (the event loop, the engine) waiting for seconds. ``check_json``
bounds that work before ``json.loads`` runs: nesting depth, containers (arrays and objects) and values, all counted
outside strings by vectorized passes over the bytes (numpy releases the GIL; a pass over 16 MiB takes a few ms).
A request of the API needs few containers (a message is one object) and about one value per token at most (a prompt
of token ids), so the bounds scale with the context: a body within them parses in milliseconds.

A compressed body (``Content-Encoding: gzip`` or ``deflate``) is inflated on the same worker thread, to at most
``max_body`` bytes; one that does not inflate is a 400, another encoding a 415 (aiohttp's own decoding is off: it
ran on the event loop and answered a bad body with a 500 or a bare text 400 and a logged traceback).
"""

from __future__ import annotations

import json
import resource
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from hetmoe.server.protocol import APIError

BYTES_PER_TOKEN = 64  # body cap per token of the context: JSON-escaped text of a fitting prompt, with room to spare
MIN_BODY = 1 << 20
MAX_DEPTH = 64  # nesting: a chat request needs 4 (body, messages, message, content parts)
BODIES_PER_SLOT = 4  # request bodies being read, parsed and validated at once: 4 x --max-batch
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEPALIVE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 4096  # the default cap, lowered to what the open-file limit leaves (FILES_RESERVED, a backlog)
FILES_RESERVED = 256  # file descriptors kept for everything but client connections (model files, pipes, epoll)
BACKLOG = 1024  # connections the kernel queues (while the model loads, and between accepts); capped by somaxconn
OPEN_FILES = 65536  # hetmoe serve raises its open-file soft limit up to this (never past the hard limit)
RETRY_AFTER_S = 1
_SCAN_CHUNK = 1 << 20  # bytes per vectorized pass: bounded temporaries, the GIL given back between passes


def body_cap(max_context: int) -> int:
    return max(MIN_BODY, BYTES_PER_TOKEN * max_context)


def open_file_limit() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_open_file_limit() -> Optional[int]:
    """Raise this process's open-file soft limit to its hard limit (at most ``OPEN_FILES``), as Go programs and
    nginx do: the common soft limit of 1024 would cap a server at a few hundred connections. The limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass
    return open_file_limit()


def default_backlog() -> int:
    """The listen backlog, which is also how many connections asyncio accepts in one go (each takes a file before
    the connection cap sees it): ``BACKLOG``, or a quarter of the files left where the open-file limit is low."""
    soft = open_file_limit()
    return BACKLOG if soft is None else max(64, min(BACKLOG, (soft - FILES_RESERVED) // 4))


def default_max_connections() -> int:
    """``MAX_CONNECTIONS``, or fewer where the open-file limit would run out first: past it accept() fails with
    EMFILE and a client waits in the backlog unanswered, at the cap it is answered. Room is kept for the files that
    are not connections and for one accept burst."""
    soft = open_file_limit()
    if soft is None:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, soft - FILES_RESERVED - default_backlog()))


@dataclass(frozen=True)
class Limits:
    """The limits ``hetmoe serve`` applies (docs/serving.md#limits); ``for_model`` gives the defaults."""

    max_body: int
    max_containers: int
    max_values: int
    bodies_in_flight: int
    max_connections: int
    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S
    keepalive_timeout: float = KEEPALIVE_TIMEOUT_S
    max_depth: int = MAX_DEPTH
    backlog: int = BACKLOG

    @classmethod
    def for_model(cls, max_context: int, max_batch: int, *, max_body: Optional[int] = None,
                  max_connections: Optional[int] = None, **timeouts) -> "Limits":
        return cls(max_body=max_body or body_cap(max_context),
                   max_containers=2 * max_context + 1024,  # a message (and its content parts) per token, and more
                   max_values=8 * max_context + 4096,  # a prompt of token ids, a message's fields, per token
                   bodies_in_flight=BODIES_PER_SLOT * max_batch,
                   max_connections=max_connections or default_max_connections(), backlog=default_backlog(),
                   **{k: v for k, v in timeouts.items() if v is not None})


def _too_complex(what: str, limit: int, code: str) -> APIError:
    return APIError(400, f"The JSON body has {what}; this server takes at most {limit}. A request of this API "
                         "needs far fewer.", code=code)


def check_json(raw: bytes, limits: Limits) -> None:
    """APIError 400 when ``raw``, read as JSON, nests deeper than ``max_depth`` or holds more than
    ``max_containers`` arrays and objects or more than ``max_values`` values (commas). Malformed JSON passes
    (json.loads says what is wrong with it); what is counted is the structure outside strings."""
    upper_containers = raw.count(b"[") + raw.count(b"{")
    if upper_containers <= limits.max_depth and raw.count(b",") < limits.max_values:
        return  # counted with string contents included, the bounds already hold
    # A backslash escapes the next byte: drop escaped pairs (left to right, as JSON reads them), so every quote
    # left delimits a string.
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    parity = 0  # 1 inside a string at the start of the chunk
    depth = deepest = containers = values = 0
    for start in range(0, len(text), _SCAN_CHUNK):
        a = np.frombuffer(text, dtype=np.uint8, count=min(_SCAN_CHUNK, len(text) - start), offset=start)
        inside = np.bitwise_xor.accumulate(a == ord('"'), dtype=np.uint8)  # [n] 1 from an opening quote on
        inside ^= parity
        parity = int(inside[-1])
        outside = inside == 0
        opens = ((a == ord("[")) | (a == ord("{"))) & outside
        closes = ((a == ord("]")) | (a == ord("}"))) & outside
        brackets = a[opens | closes]
        if len(brackets):
            steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
            levels = np.cumsum(steps, dtype=np.int64) + depth
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
            if deepest > limits.max_depth:
                raise APIError(400, f"The JSON body nests deeper than {limits.max_depth} levels, the limit of this "
                                    "server (a request of this API needs 4).", code="json_too_deep")
        containers += int(np.count_nonzero(opens))
        values += int(np.count_nonzero((a == ord(",")) & outside))
        if containers > limits.max_containers:
            raise _too_complex(f"more than {limits.max_containers} arrays and objects", limits.max_containers,
                               "json_too_complex")
        if values >= limits.max_values:
            raise _too_complex(f"more than {limits.max_values} values", limits.max_values, "json_too_complex")


def decode_body(raw: bytes, encoding: Optional[str], limits: Limits) -> bytes:
    """The body as sent before its ``Content-Encoding`` (gzip, x-gzip, deflate, identity or none), at most
    ``max_body`` bytes; APIError 400 when it does not inflate, 413 past the cap, 415 for other encodings."""
    name = (encoding or "identity").strip().lower()
    if name in ("identity", ""):
        return raw
    if name not in ("gzip", "x-gzip", "deflate"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body as is, gzip or deflate.",
                       code="unsupported_encoding")
    # deflate: zlib-wrapped as HTTP says, or raw deflate as some clients send it
    for wbits in ((31,) if name != "deflate" else (15, -15)):
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(raw, limits.max_body + 1)
        except zlib.error as e:
            error = f"{e}"
            continue
        if len(out) > limits.max_body:
            raise APIError(413, f"The request body inflates to more than {limits.max_body} bytes, this server's "
                                "limit.", code="body_too_large")
        if not inflater.eof or inflater.unused_data:
            error = "the compressed data is truncated" if not inflater.eof else "data follows the compressed stream"
            continue
        return out
    raise APIError(400, f"The request body is not valid {name} data ({error}), as its Content-Encoding says.",
                   code="invalid_body")


def parse_body(raw: bytes, encoding: Optional[str], limits: Limits) -> Any:
    """The body's JSON value: inflated (``decode_body``), its shape checked (``check_json``), parsed; APIError
    400 ``invalid_json`` when it is not JSON. Runs on a worker thread (the handler awaits it)."""
    raw = decode_body(raw, encoding, limits)
    check_json(raw, limits)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"We could not parse the JSON body of your request ({type(e).__name__}: {e}). "
                            "Send a JSON object with 'Content-Type: application/json'.", code="invalid_json")
