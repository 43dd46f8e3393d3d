"""Who may use the server: the API key (``--api-key``, ``--api-key-file`` or ``HETMOE_API_KEY``) and the names a
request's ``Host`` header may give.

The Host check closes DNS rebinding (the class of Ollama's CVE-2024-28224): a web page on evil.example whose name
the attacker re-points at 127.0.0.1 makes the victim's browser send requests to the loopback server as a "same
origin" — with ``Host: evil.example``. A loopback server therefore answers only requests that name it: the bind
address, ``localhost``, ``127.0.0.1`` or ``[::1]`` with the served port, or an ``--allowed-hosts`` entry (403
otherwise). A server bound to other addresses is reached under names it cannot know, so it checks only when
``--allowed-hosts`` is given; ``--allowed-hosts '*'`` turns the check off.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Iterable, Optional

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def check_api_key(key: str, source: str = "") -> str:
    """``key`` when it can be an API key; ValueError (naming ``source``) otherwise. It travels in an HTTP header,
    so it must be printable ASCII without spaces, and an empty key reads as a mistake, never as "no key"."""
    where = f"{source}: " if source else ""
    if not key:
        raise ValueError(f"{where}the API key is empty; give a non-empty key (or no key option at all for a server "
                         "without one)")
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{where}the API key must be printable ASCII without spaces (it is sent in an HTTP header)")
    return key


def read_api_key_file(path: str) -> str:
    """The key in ``path``: its one line, surrounding whitespace (the final newline) dropped."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4096 + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the API key file {path}: {getattr(e, 'strerror', None) or e}") from None
    if len(text) > 4096:
        raise ValueError(f"the API key file {path} is longer than 4096 characters; it should hold the key alone")
    return check_api_key(text.strip(), f"the API key file {path}")


def is_loopback(sockets: Iterable[socket.socket]) -> bool:
    """Whether every listening socket is bound to a loopback address (reachable from this machine only)."""
    addresses = [s.getsockname()[0] for s in sockets]
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def _split_host(value: str) -> tuple:
    """``Host`` header (or an --allowed-hosts entry) -> (name, port or None), the name lowercased, an IPv6 literal
    kept in its brackets."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value.partition("]")
        name += "]"
        port = rest[1:] if rest.startswith(":") else (None if not rest else "?")
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, None
    if port is not None and not port.isdigit():
        return name, -1  # names no port of ours
    return name, None if port is None else int(port)


class HostPolicy:
    """Which ``Host`` headers name this server. ``None`` from ``for_server`` means every Host is accepted."""

    def __init__(self, names: Iterable[str], port: int, extra: Iterable[str] = ()):
        self.port = port
        self.names = {n.lower() for n in names}  # with the served port (or none when it is 80)
        self.extra = [_split_host(e) for e in extra]  # an entry without a port matches any port

    @classmethod
    def for_server(cls, host: str, sockets: list, allowed: Optional[list]) -> Optional["HostPolicy"]:
        if allowed is not None and "*" in allowed:
            return None
        if allowed is None and not is_loopback(sockets):
            return None
        port = sockets[0].getsockname()[1]
        bind = f"[{host}]" if ":" in host and not host.startswith("[") else host
        return cls([*LOOPBACK_NAMES, bind], port, allowed or ())

    def allows(self, header: Optional[str]) -> bool:
        if not header or not header.isascii():
            return False
        name, port = _split_host(header)
        if name in self.names and (port == self.port or (port is None and self.port == 80)):
            return True
        return any(name == n and (p is None or p == port) for n, p in self.extra)

    def describe(self) -> str:
        names = sorted(self.names) + [n if p is None else f"{n}:{p}" for n, p in self.extra]
        return f"{', '.join(sorted(self.names))} (port {self.port})" + (
            f", {', '.join(names[len(self.names):])}" if self.extra else "")
