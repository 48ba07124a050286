"""State shared by every router process of a region, through Redis or Valkey.

Without ``[state] redis_url`` none of this is used: one process keeps its streams, QUIC
tickets, affinity and limits in memory (:mod:`firstbyte.router.streams`,
:mod:`firstbyte.router.hosting.quic`, ...), the default. With it, :func:`connect` builds a
:class:`SharedState` whose parts each implement one concern over one ``redis-py`` asyncio
client:

- :mod:`.streams`: every stream is also a Redis Stream (an entry per event, its id the event's
  sequence number), readable and resumable from any process; the producing process holds a
  lease, and readers elsewhere turn a lapsed lease into a ``stream_lost`` error event;
- :mod:`.lease`: that lease, one key per process renewed while it runs;
- :mod:`.admission`: per-key limits, the affinity table and backend load, as counts per
  process that lapse with its lease;
- :mod:`.tickets`: single-use QUIC session tickets (``GETDEL``), so 0-RTT works on whichever
  process a client's next connection lands;
- :mod:`.keys`: the names of every key, under ``state.key_prefix``.

``redis`` (redis-py) is imported only here, so a router without ``redis_url`` runs without it
(the ``redis`` extra).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .keys import Keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

    from ..config import RouterConfig
    from .admission import SharedAdmission
    from .lease import Lease
    from .streams import SharedStreams

__all__ = ["SharedState", "connect"]


@dataclass
class SharedState:
    """The shared parts of one router process's state (see the package docstring)."""

    redis: Redis
    keys: Keys
    process: str
    """This process's id (``PID-RANDOM``): recorded with its streams, the name of its lease."""
    lease: Lease
    streams: SharedStreams
    admission: SharedAdmission

    async def start(self) -> None:
        """Take the lease and start the stream writer and follower (in the running loop)."""
        await self.lease.start()
        await self.admission.start()
        self.streams.start()

    async def aclose(self) -> None:
        """Flush what is queued, release the lease, close the connections."""
        with contextlib.suppress(Exception):
            await self.streams.aclose()
        with contextlib.suppress(Exception):
            await self.admission.aclose()
        with contextlib.suppress(Exception):
            await self.lease.aclose()
        await self.redis.aclose()


def connect(config: RouterConfig) -> SharedState | None:
    """The shared state for ``config`` (``None`` without ``state.redis_url``).

    Connections are made lazily, by the first command, so this needs no event loop.
    """
    url = config.state.redis_url
    if url is None:
        return None
    try:
        from redis.asyncio import Redis
    except ImportError:  # pragma: no cover - the extra is part of dev
        raise RuntimeError(
            "state.redis_url needs redis-py: pip install 'firstbyte[redis]'"
        ) from None
    from .admission import SharedAdmission
    from .lease import Lease
    from .streams import SharedStreams

    redis = Redis.from_url(url, health_check_interval=30, socket_keepalive=True)
    keys = Keys(config.state.key_prefix)
    process = f"{os.getpid()}-{secrets.token_hex(6)}"  # the pid helps an operator (and a test)
    lease = Lease(redis, keys, process, config.state.lease_s)
    streams = SharedStreams(
        redis,
        keys,
        lease,
        process,
        max_age_s=config.streams.max_age_s,
        max_events=config.state.max_events_per_stream,
        reader_grace_s=config.streams.resume_grace_s,
    )
    admission = SharedAdmission(
        redis, keys, process, expiry_s=config.streams.max_age_s,
        affinity_ttl_s=config.routing.affinity_ttl_s,
    )
    return SharedState(redis, keys, process, lease, streams, admission)
