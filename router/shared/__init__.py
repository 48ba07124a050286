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
- :mod:`.keys`: the names of every key, under ``state.key_prefix``;
- :mod:`.target`: the URL and the password (from a file or the environment), redacted in
  every message;
- :mod:`.errors`: what a request gets when Redis does not answer (``503 state_unavailable``).

The client is built for bursts and outages (:func:`pool_for`): a blocking pool of
``state.max_connections``, every wait bounded by ``state.timeout_s``.

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
    from redis.asyncio import BlockingConnectionPool, Redis

    from ..config import RouterConfig
    from .admission import SharedAdmission
    from .lease import Lease
    from .streams import SharedStreams

__all__ = ["SharedState", "connect", "pool_for"]


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
        """Take the lease and start the stream writer and follower (in the running loop).
        Never raises: a Redis away now is retried by the lease's renewals, and requests get
        ``503 state_unavailable`` meanwhile."""
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
        await self.redis.connection_pool.disconnect()  # passed in: aclose leaves it open


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
    from .wire import check_shape

    problem = check_shape()  # the one redis-py internal the router leans on
    if problem is not None:
        raise RuntimeError(problem)
    redis = Redis(connection_pool=pool_for(config))
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
        write_interval_s=config.state.write_interval_ms / 1000,
    )
    admission = SharedAdmission(
        redis, keys, process, expiry_s=config.streams.max_age_s,
        affinity_ttl_s=config.routing.affinity_ttl_s, timeout_s=config.state.timeout_s,
    )
    lease.on_lapse = admission.lapsed
    return SharedState(redis, keys, process, lease, streams, admission)


def pool_for(config: RouterConfig) -> BlockingConnectionPool:
    """The connection pool of one process, sized and bounded for bursts.

    redis-py's default asyncio pool raises ``MaxConnectionsError`` the moment a burst needs
    more connections than its cap (100 in redis-py 8: 300 streams started at once got 500s);
    a blocking pool makes the burst wait its turn for one of ``state.max_connections``
    (each admission holds one for a ~0.1 ms round trip). Every wait is bounded by
    ``state.timeout_s``: connect, a free connection, a reply. The stream follower's
    ``XREAD BLOCK`` (250 ms) and the writer's batches (their own deadline) stay under it.
    """
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError

    from .target import redis_target

    state = config.state
    target = redis_target(state)  # the password from its file or variable, if not in the URL
    return BlockingConnectionPool.from_url(
        target.url,
        max_connections=state.max_connections,
        timeout=state.timeout_s,
        socket_timeout=state.timeout_s,
        socket_connect_timeout=state.timeout_s,
        socket_keepalive=True,
        health_check_interval=30,
        # Once, at once, on a broken connection (a pooled one left from before a Redis
        # restart); never on a timeout, which would double the wait past state.timeout_s.
        retry=Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
        **target.options(),
    )
