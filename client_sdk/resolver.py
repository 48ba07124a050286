"""Name resolution timed apart from TCP, with a small TTL cache.

httpcore's ``connect_tcp`` covers DNS and TCP together when given a name; the SDK resolves
first with ``loop.getaddrinfo`` (timed as the ``dns`` phase), then connects to the address
while keeping the name for SNI and Host. A cache hit is not a DNS phase (``dns_ms`` stays None).
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import ConfigurationError, ConnectError

__all__ = ["Origin", "Resolver"]


@dataclass(frozen=True, slots=True)
class Origin:
    """Scheme, host and port of a base URL, plus its path prefix (e.g. ``/v1``)."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Origin:
        """``url``'s parts; ``ConfigurationError`` naming ``url`` for anything else than an
        http(s) base URL with a host and a valid port (no whitespace around it)."""
        bad = ConfigurationError(
            "base_url", f"must be a base URL http(s)://host[:port][/path], not {url!r}")
        if not isinstance(url, str) or url != url.strip():
            raise bad
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise bad
        try:
            port = parts.port
        except ValueError:  # urllib: "Port out of range 0-65535", "could not be cast"
            port = 0
        if port == 0:
            raise ConfigurationError(
                "base_url", f"the port of {url!r} is not a number from 1 to 65535")
        if port is None:
            port = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"


class Resolver:
    """Resolves host names once per ``ttl_s`` (the first address wins, as curl does)."""

    def __init__(self, ttl_s: float = 60.0) -> None:
        self._ttl_s = ttl_s
        self._cache: dict[tuple[str, int, int], tuple[float, str]] = {}

    async def resolve(
        self,
        host: str,
        port: int,
        recorder: TimingRecorder | None = None,
        *,
        kind: socket.SocketKind = socket.SOCK_STREAM,
    ) -> str:
        """The address to connect to; times the lookup into ``recorder`` when one happens."""
        key = (host, port, int(kind))
        cached = self._cache.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        loop = asyncio.get_running_loop()
        if recorder is not None:
            recorder.feed("dns.started", time.perf_counter())
        try:
            infos = await loop.getaddrinfo(host, port, type=kind)
        except OSError as exc:
            raise ConnectError(f"cannot resolve {host}: {exc}") from exc
        if recorder is not None:
            recorder.feed("dns.complete", time.perf_counter())
        if not infos:
            raise ConnectError(f"cannot resolve {host}: no addresses")
        address = str(infos[0][4][0])
        self._cache[key] = (time.monotonic() + self._ttl_s, address)
        return address
