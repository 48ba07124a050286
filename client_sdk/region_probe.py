"""The client-side RTT probe of one region: measured on a warm connection, never estimated.

One probe is a ``GET /v1/edge/status`` that opens (or reuses) the pooled connection and tells
the router's own name for its region, then ``samples`` sequential ``GET /healthz`` on that
now-warm connection, each timed from the request to the last byte of its answer. The fastest
sample is the RTT: on a warm connection a tiny request costs one round trip plus the server's
few hundred microseconds, and the minimum is the sample least disturbed by scheduling noise
(the handshake is deliberately not part of it: a warm request never pays one). A ``/healthz``
answered ``draining`` retires its connection, and the probe runs once more on a new one: the
router process behind the first is shutting down, and a balancer may reach another.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from firstbyte.client_sdk.errors import APIError, FirstbyteError, retry_after_s
from firstbyte.client_sdk.regions import regions_from_status
from firstbyte.client_sdk.resolver import Origin
from firstbyte.client_sdk.transports.base import Session, refusal
from firstbyte.protocol import paths
from firstbyte.protocol.edge import PublicEdgeStatus

__all__ = ["RegionProbe", "discover_regions", "probe_region"]

_status = msgspec.json.Decoder(PublicEdgeStatus)


@dataclass(frozen=True, slots=True)
class RegionProbe:
    rtt_ms: float | None
    """Fastest warm ``/healthz`` round trip; None when the region could not be reached."""
    label: str | None = None
    """The region's name as its router reports it (``region`` in ``/v1/edge/status``)."""
    healthy: bool = True
    """False when ``/healthz`` answered other than 200 (e.g. 503: no healthy upstream)."""
    error: str | None = None
    retry_after_s: float | None = None
    """The ``Retry-After`` of an unhealthy ``/healthz`` answer (None: none, or healthy)."""


async def probe_region(
    session: Session, samples: int = 3, *, timeout_s: float | None = None
) -> RegionProbe:
    """Probe the origin ``session`` talks to (see the module docstring); never raises for
    network failures, which come back as ``rtt_ms=None`` with ``error`` set. A probe not done
    within ``timeout_s`` is one of them: on a warm connection to a router that stopped
    answering (stopped, wedged, a black-holed path) it would otherwise wait for ever, and
    with it ``prewarm()`` and every later re-probe."""
    if samples < 1:
        raise ValueError("samples must be at least 1")
    label: str | None = None
    try:
        async with asyncio.timeout(timeout_s):
            for retire_draining in (True, False):
                async with session.request("GET", paths.EDGE_STATUS, headers={}, body=None,
                                           recorder=None) as response:
                    body = await response.read()
                if response.status == 200:
                    # Any server may sit at a configured URL; only a well-formed status names a
                    # region.
                    try:
                        label = _status.decode(body).region
                    except msgspec.DecodeError:  # ValidationError included
                        label = None
                best = float("inf")
                draining = False
                for _ in range(samples):
                    start = time.perf_counter()
                    async with session.request("GET", paths.HEALTHZ, headers={}, body=None,
                                               recorder=None) as response:
                        answer = refusal(response, await response.read())
                        draining = retire_draining and answer is not None and answer.draining
                        if draining:
                            response.retire_connection()
                            break
                    best = min(best, (time.perf_counter() - start) * 1000.0)
                if not draining:
                    break
                # The router process behind that connection is shutting down, which says
                # nothing yet of its region: probed again on a new connection, which a
                # balancer may give another of the region's processes.
            healthy = response.status == 200
            wait_s = None if healthy else retry_after_s(response.headers.get("retry-after"))
    except TimeoutError:
        return RegionProbe(None, label, healthy=False, error=f"no answer within {timeout_s:g} s")
    except (FirstbyteError, OSError) as exc:
        return RegionProbe(None, label, healthy=False, error=str(exc) or type(exc).__name__)
    return RegionProbe(best, label, healthy=healthy, retry_after_s=wait_s)


async def discover_regions(base_url: str, **client_options: Any) -> dict[str, str]:
    """``{region: base URL}`` for the router at ``base_url`` and every peer it lists.

    Reads ``GET /v1/edge/status`` (its ``region``, ``public_url`` and ``peers``); the peers'
    URLs get ``base_url``'s path (``/v1``). Calling this is trusting that router to name the
    deployment's regions: pass the result to ``AsyncClient(...)``. ``client_options`` are
    ``AsyncClient`` options (``ca_file``, ``verify``, ``http``, ...). Raises ConnectError, or
    APIError when the router answers with an error.
    """
    from firstbyte.client_sdk.client import AsyncClient  # the client imports this module

    origin = Origin.parse(base_url)
    async with AsyncClient(base_url, **client_options) as client:
        session = client.pool.session(origin, client.http if client.transport != "websocket"
                                      else "1.1")
        async with session.request("GET", paths.EDGE_STATUS, headers={}, body=None,
                                   recorder=None) as response:
            body = await response.read()
    if response.status != 200:
        raise APIError(f"{paths.EDGE_STATUS} answered {response.status}", status=response.status)
    try:
        status = _status.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise APIError(f"{paths.EDGE_STATUS} is not an edge status document: {exc}",
                       status=response.status) from exc
    # This router at the URL the caller gave (known to work from here), then its peers.
    out: dict[str, str] = {status.region or base_url: base_url}
    for region in regions_from_status(status, base_url):
        url = region.url
        if region.name not in out:
            if not urlsplit(url).path.strip("/"):
                url = url.rstrip("/") + origin.prefix
            out[region.name] = url
    return out
