"""What the soak's hostile clients aim at, and the helpers they share.

:class:`Target` is the router's address, the hostile tenant's key and :class:`WorldHooks`: the
few things an attack on the world rather than on a socket needs (stop a sim, remove a key and
reload, count the good clients' failures).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

__all__ = ["Target", "WorldHooks", "bucket", "many", "rounds", "status_class"]


class WorldHooks(Protocol):
    """The soak's world as the fault phases see it (implemented by ``soak._World``)."""

    revoked_key: str
    """An API key of its own that :meth:`remove_key` takes out of the router's config."""

    def stop_upstream(self) -> str:
        """SIGSTOP one sim (not the one that is killed); its name."""

    def continue_upstream(self) -> None:
        """SIGCONT the stopped sim; harmless when none is stopped."""

    def good_failures(self) -> tuple[int, int]:
        """(failed tries, requests given up) of the good clients so far."""

    def good_slowest_first_token_ms(self, since: float) -> float | None:
        """The good clients' slowest first token (retries included) among the requests that
        ended after the monotonic time ``since``; None if none did."""

    def remove_key(self) -> None:
        """Rewrite the router's config without :attr:`revoked_key` and SIGHUP the router."""


@dataclass(slots=True)
class Target:
    host: str
    port: int
    ca_file: str
    key: str
    """The hostile tenant's own (valid) API key."""
    scale: int
    """1 for ``--quick``; larger runs hold more connections and send more."""
    hooks: WorldHooks
    stream_ids: list[tuple[str, str]] = field(default_factory=list)
    """(key, stream id) of the good clients' streams, for cross-key read attempts."""

    @property
    def base_url(self) -> str:
        return f"https://{self.host}:{self.port}"

    def tls(self, alpn: str) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_file)
        context.set_alpn_protocols([alpn])
        return context

    async def connect(self, alpn: str = "http/1.1") -> tuple[asyncio.StreamReader,
                                                             asyncio.StreamWriter]:
        return await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.tls(alpn),
                                    server_hostname="127.0.0.1"), 10)


def bucket(seconds: float) -> str:
    for limit in (1, 5, 15, 30, 60):
        if seconds < limit:
            return f"<{limit} s"
    return ">=60 s"


async def many(n: int, one: Callable[[], Awaitable[str]]) -> Counter[str]:
    return Counter(await asyncio.gather(*(one() for _ in range(n))))


def rounds(until: float) -> Iterator[int]:
    """0, 1, 2, ... while there is time before ``until``, and round 0 always: an attack that
    starts late (its phase's window passed while a busy machine ran other work) still runs
    once, so every attack's treatment is reported."""
    n = 0
    while n == 0 or time.monotonic() < until:
        yield n
        n += 1


def status_class(status: int, body: bytes) -> str:
    """``200``, or the status with the error body's code (``401 invalid_api_key``)."""
    if status == 200:
        return "200"
    try:
        code = msgspec.json.decode(body).get("error", {}).get("code")
    except (msgspec.DecodeError, AttributeError):
        code = None
    return f"{status} {code}" if code else str(status)
