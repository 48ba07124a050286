"""Drain: how a router process stops (SIGTERM) without failing the requests it holds.

The order follows what load balancers expect (Envoy's drain: fail the health check first,
then tell clients, then close; Kubernetes sends SIGTERM after its preStop hook):

1. at once: ``/healthz`` answers 503 ``draining``, ``/v1/edge/status`` says unhealthy (peers
   stop forwarding here), and every new chat request, detached stream or WebSocket request goes
   to a peer region with room, else gets 503 ``draining`` with ``Retry-After``; a warm-up
   (``/v1/edge/warm``) and a new WebSocket upgrade get that 503 at once
   (:mod:`firstbyte.router.prewarm`, :mod:`firstbyte.router.ws`);
2. at once: every open HTTP/2 and HTTP/3 connection gets a graceful GOAWAY
   (:mod:`firstbyte.router.hosting.goaway`), so clients open their next request elsewhere;
   HTTP/1.1 has no GOAWAY: every answer begun from now on says ``connection: close`` and
   ends its connection (:class:`~firstbyte.router.app.RouterApp`);
3. the listener keeps accepting (late arrivals get the 503, not a refused connection) while
   requests and streams in flight run to their end: at least ``listen.drain_grace_s``, at
   most ``listen.drain_timeout_s`` (:func:`drain_finished`);
4. then streams still produced here end with a ``draining`` error event, the server stops
   (hypercorn's own shutdown: no new connections, a final GOAWAY) and the process exits 0.

With ``state.redis_url`` every event a stream had is in Redis, so a drained process's streams
stay readable from the region's other processes; in memory they go with the process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .app import RouterApp
    from .hosting.goaway import ConnectionRegistry

__all__ = ["drain", "drain_finished"]

log = logging.getLogger("firstbyte.router")

POLL_S = 0.05


def drain_finished(elapsed_s: float, in_flight: int, grace_s: float, timeout_s: float) -> bool:
    """May the drain end, ``elapsed_s`` after it began with ``in_flight`` requests and streams
    left? Not before ``grace_s``; as soon as nothing is in flight; at ``timeout_s`` at most."""
    if elapsed_s >= timeout_s:
        return True
    return elapsed_s >= grace_s and in_flight == 0


async def drain(
    app: RouterApp,
    connections: ConnectionRegistry | None,
    clock: Callable[[], float] = time.monotonic,
    hurry: asyncio.Event | None = None,
) -> None:
    """Steps 1 to 3 of the module docstring, then end the streams left (step 4's first
    part); the caller's server stops when this returns. ``hurry`` set (a second SIGTERM or
    SIGINT: an operator who will not wait) ends the wait at once, as the timeout would."""
    state = app.state
    started = clock()
    state.start_draining()
    told = await connections.goaway() if connections is not None else 0
    listen = state.config.listen
    # Two counts: a streamed request is both a request being answered and a stream being
    # produced (a stream whose client left is only the latter), so their sum counted it twice.
    log.warning(
        "draining: no new work; %d requests being answered and %d streams being produced get"
        " up to %g s (listen.drain_timeout_s); GOAWAY sent on %d HTTP/2 and HTTP/3 connections",
        app.requests_in_flight, len(state.store.running()), listen.drain_timeout_s, told,
    )
    while True:
        listen = state.config.listen  # a reload may change the timings meanwhile
        if drain_finished(
            clock() - started, app.in_flight(), listen.drain_grace_s, listen.drain_timeout_s
        ):
            break
        if hurry is not None and hurry.is_set():
            break
        await asyncio.sleep(POLL_S)
    ended = state.end_unfinished_streams()
    if ended:
        hurried = hurry is not None and hurry.is_set()
        log.warning(
            "drain %s: %d unfinished streams end with a 'draining' error event%s",
            "cut short by a second signal" if hurried
            else f"timed out after {listen.drain_timeout_s:g} s",
            ended,
            "" if state.region_state.readable_elsewhere
            else " (in memory: they cannot be read elsewhere)",
        )
    else:
        log.info("drained in %.1f s; stopping", clock() - started)
