"""The other regions' state: the ``/v1/edge/status`` document, a table with staleness, a poller.

Every router publishes :class:`~firstbyte.protocol.edge.EdgeStatus` at ``GET /v1/edge/status``;
each router polls its peers' status over one kept-warm HTTP connection per peer (the same
connection forwarded requests use, so it never goes cold) and keeps the latest in a
:class:`PeerTable`. State older than ``ttl_s`` counts as unknown: the peer is then no
candidate for forwarding or spilling.
The poll's round-trip time feeds an EWMA, the measured router-to-router RTT.

Router-to-router requests carry ``x-firstbyte-peer-key``; a forwarded request also carries
``x-firstbyte-forwarded: REGION`` so the receiving router never forwards it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from firstbyte.protocol import paths
from firstbyte.protocol.edge import EdgeStatus
from firstbyte.protocol.headers import PEER_KEY_HEADER
from firstbyte.router.backpressure import Ewma
from firstbyte.router.observability.logs import StateChanges, describe_error
from firstbyte.tasks import cancel_and_wait

__all__ = ["PeerPoller", "PeerState", "PeerTable"]


@dataclass
class PeerState:
    name: str
    url: str
    status: EdgeStatus | None = None
    received_at: float | None = None
    failures: int = 0
    rtt_ms: Ewma | None = None

    def fresh(self, now: float, ttl_s: float) -> EdgeStatus | None:
        """The latest status if younger than ``ttl_s``; otherwise ``None`` (unknown)."""
        if self.status is None or self.received_at is None:
            return None
        return self.status if now - self.received_at <= ttl_s else None


class PeerTable:
    """Latest known state of each peer (sans-IO: callers pass ``now``)."""

    def __init__(self, peers: Iterable[tuple[str, str]], ttl_s: float = 5.0) -> None:
        self.ttl_s = ttl_s
        self.peers: dict[str, PeerState] = {
            name: PeerState(name, url, rtt_ms=Ewma(0.3)) for name, url in peers
        }

    def observe(self, name: str, status: EdgeStatus, now: float, rtt_ms: float) -> None:
        peer = self.peers[name]
        peer.status, peer.received_at, peer.failures = status, now, 0
        assert peer.rtt_ms is not None
        peer.rtt_ms.add(rtt_ms)

    def failed(self, name: str, now: float) -> None:
        """A poll failed: after the TTL the old state expires by itself; mark it now too."""
        peer = self.peers[name]
        peer.failures += 1
        if peer.failures >= 2:
            peer.status = None

    def fresh(self, now: float) -> dict[str, EdgeStatus]:
        out: dict[str, EdgeStatus] = {}
        for name, peer in self.peers.items():
            status = peer.fresh(now, self.ttl_s)
            if status is not None:
                out[name] = status
        return out


class PeerPoller:
    """Polls every peer's ``/v1/edge/status`` through ``client`` (an ``httpx.AsyncClient``).

    Pass the client that also forwards requests to peers: the polls keep its connection to
    each peer warm (its keep-alive expiry must exceed the poll interval).
    """

    def __init__(
        self,
        table: PeerTable,
        client: object,
        *,
        peer_key: str | None,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        self.on_status = on_status
        self.table = table
        self.client = client
        self.peer_key = peer_key
        self.interval_s = interval_s
        self.clock = clock
        self._tasks: list[asyncio.Task[None]] = []
        self._decoder = msgspec.json.Decoder(EdgeStatus)
        self.changes = StateChanges(logging.getLogger("firstbyte.router"), "peer")
        """A warning when a peer becomes unreachable, a line when it is back (once each)."""

    async def poll_once(self, name: str) -> None:
        import httpx

        client = self.client
        assert isinstance(client, httpx.AsyncClient)
        headers = {PEER_KEY_HEADER: self.peer_key} if self.peer_key else {}
        start = self.clock()
        try:
            response = await client.get(
                self.table.peers[name].url.rstrip("/") + paths.EDGE_STATUS,
                headers=headers,
                timeout=self.interval_s * 2 + 1,
            )
            response.raise_for_status()
            status = self._decoder.decode(response.content)
        except (httpx.HTTPError, msgspec.DecodeError) as exc:
            self.table.failed(name, self.clock())
            if self.table.peers[name].status is None:  # unknown now (see PeerTable.failed)
                self.changes.down(name, describe_error(exc), url=self.table.peers[name].url)
            return
        now = self.clock()
        self.table.observe(name, status, now, (now - start) * 1000.0)
        self.changes.up(name, url=self.table.peers[name].url)
        if self.on_status is not None:
            self.on_status(name)

    async def _loop(self, name: str) -> None:
        while True:
            await self.poll_once(name)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        for name in self.table.peers:
            self._tasks.append(asyncio.create_task(self._loop(name), name=f"peer-poll-{name}"))

    async def stop(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()
