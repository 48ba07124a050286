"""This region's ``GET /v1/edge/status`` document, from its routing state (what peers decide on).

The region's figures are over all its backends; ``models`` gives each model's own, over the
backends serving it (:meth:`firstbyte.router.pipeline.chooser.RouteChooser.model_status`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from firstbyte.protocol.edge import BackendStatus, EdgeStatus, PeerLink

if TYPE_CHECKING:
    from .multiregion import RegionRouting

__all__ = ["edge_status"]


def edge_status(r: RegionRouting, *, unavailable: bool = False) -> EdgeStatus:
    """The status of ``r``'s region now; unhealthy (the region's and each model's) while it
    drains or is ``unavailable`` (its shared state does not answer, or its start-up warmup
    holds requests): peers stop sending requests here that would get a 503 or wait."""
    now = r.clock()
    chooser, tracker = r.chooser, r.tracker
    out = r.draining or unavailable
    here = chooser.here(now, draining=out)
    backends = [
        BackendStatus(
            name=name, healthy=b.healthy, in_flight=b.in_flight,
            load=tracker.load(name, now), max_in_flight=b.limit,
            saturated=tracker.saturated(name, now), ttft_ms=b.ttft_ms.value,
            warm_prefixes=r.scheduler.warm(name),
        )
        for name, b in tracker.backends.items()
    ]
    wait = here.queue_wait_ms
    fresh = chooser.peers(now, None, r.sent_since())
    point = r.here_point
    return EdgeStatus(
        region=r.region, healthy=here.healthy, saturated=here.saturated,
        in_flight=tracker.in_flight(), capacity=tracker.capacity(),
        queue_wait_ms=wait if math.isfinite(wait) else 1e9,
        latitude=point.lat if point else None,
        longitude=point.lon if point else None,
        public_url=r.config.geo.public_url, ttft_ms=tracker.ttft_ms(),
        warm_prefixes=sorted(here.warm_prefixes), backends=backends,
        models=chooser.model_status(now, draining=out),
        peers=[
            PeerLink(
                name=name,
                url=url,
                up=name in fresh and fresh[name].healthy and not fresh[name].saturated,
            )
            for name, url in r.peer_urls.items()
        ],
    )
