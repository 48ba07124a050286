"""The background services that feed one region's routing (IO around the sans-IO state).

:class:`RoutingServices` runs, for a :class:`~firstbyte.router.multiregion.RegionRouting`:
the peer polls (:class:`~firstbyte.router.peers.PeerPoller`, each peer's status over the
proxy's kept-warm pool), the backend scrapes and warmup probes
(:class:`~firstbyte.router.warmup.WarmupRunner`: load, health, warm prefixes) and the model
lists (:class:`~firstbyte.router.models.ModelLister`: each backend's ``/v1/models``). What they
learn goes into the state the chooser reads (the load tracker, the peer table, the model map,
the warmup scheduler) through the callbacks here; the decisions stay the chooser's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

from .models import ModelLister
from .peers import PeerPoller
from .upstream_h1 import H1Pool
from .upstream_metrics import BackendMetrics
from .warmup import WarmupRunner

if TYPE_CHECKING:
    from .multiregion import RegionRouting

__all__ = ["RoutingServices"]


class RoutingServices:
    """Peer polls, backend scrapes and warmup, model lists for ``routing`` (see the module
    docstring); ``client`` scrapes, warms and lists the region's backends, ``peer_client``
    polls the peers (the pool forwarded requests use, whose connections the polls keep warm)."""

    def __init__(
        self,
        routing: RegionRouting,
        client: httpx.AsyncClient,
        peer_client: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        *,
        scrape_pool: H1Pool | None = None,
    ) -> None:
        self.routing = r = routing
        config = r.config
        self.clock = clock
        self.poller = PeerPoller(
            r.peer_table, peer_client, peer_key=r.peer_key,
            interval_s=config.routing.peer_poll_interval_s, clock=clock,
            on_status=self._on_peer_status,
        )
        scraped: dict[str, str] = {}
        headers: dict[str, dict[str, str]] = {}
        for b, u in zip(r.pool.backends, config.upstreams, strict=True):
            if b.api_key:
                headers[b.name] = {"authorization": f"Bearer {b.api_key}"}
            if u.kind == "openai" and not u.models:
                continue  # no /metrics and no model list to warm with
            r.scheduler.add_backend(b.name, u.models)
            scraped[b.name] = b.url
        self.lister = ModelLister(
            r.models, client, {b.name: b.url for b in r.pool.backends},
            interval_s=config.routing.models_refresh_s, clock=clock, on_change=self._on_models,
            headers=headers,
        )
        self.runner = WarmupRunner(
            r.scheduler, client, scraped,
            poll_interval_s=config.routing.backend_metrics_interval_s, clock=clock,
            on_metrics=self._on_metrics, headers={n: headers[n] for n in scraped if n in headers},
            on_probe=self._on_probe, scrape_pool=scrape_pool,
        )
        self._started = False

    # --- lifecycle
    def start(self) -> None:
        """Start them in the running loop (idempotent)."""
        if self._started:
            return
        self._started = True
        if self.routing.peer_table.peers:
            self.poller.start()
        if self.runner.urls:
            self.runner.start()
        self.lister.start()

    async def wait_warm(self) -> bool:
        """Warm every prefix on every backend (bounded by ``warmup.startup_timeout_s``), once
        the backends' model lists were asked for (a prefix is warmed per model)."""
        r = self.routing
        if not r.prefixes or not self.runner.urls:
            return True
        await self.wait_models()
        return await self.runner.wait_all_warm(r.config.warmup.startup_timeout_s)

    async def wait_models(self) -> None:
        """Return once every backend without configured models was asked for its list (or
        after the ask's timeout)."""
        await self.lister.wait_ready(self.lister.timeout_s + 1.0)

    async def aclose(self) -> None:
        await self.lister.stop()
        await self.poller.stop()
        await self.runner.stop()

    # --- what they learn
    def _on_models(self, name: str, models: frozenset[str]) -> None:
        """``name`` lists new models: warm them there too (a prefix applies per model)."""
        scheduler = self.routing.scheduler
        if name in scheduler.backends and models:
            scheduler.set_models(name, sorted(models))

    def _on_peer_status(self, name: str) -> None:
        self.routing.peer_status_arrived(name)

    def _on_probe(self, name: str, started: bool, answered_ms: float | None) -> None:
        """A warmup probe is load on ``name`` as our requests are: a scrape that shows it
        running must not count it as someone else's once it ended (the start-up warmup's
        last scrape saw its probes, and the first request after it was refused as if the
        backend were full). An answered probe (one token) is a TTFT sample for the
        first-byte deadline, known before any user request."""
        tracker = self.routing.tracker
        if name not in tracker.backends:
            return
        if started:
            tracker.started(name, self.clock(), probe=True)
            return
        tracker.finished(name)
        if answered_ms is not None:
            tracker.observe_probe(name, answered_ms)

    def _on_metrics(self, name: str, metrics: BackendMetrics | None) -> bool:
        """A scrape's result (None: unreachable); False if ``name`` answered but stays out
        of rotation: ejected for failing requests, a scrape proves the server listens, not
        that it serves, so only one after ``backend_eject_s`` re-admits it."""
        r = self.routing
        healthy = metrics is not None
        if healthy and not r.readmit(name, self.clock()):
            return False
        came_back = healthy and not r.backends[name].healthy
        r.tracker.set_health(name, healthy)
        r.backends[name].healthy = healthy
        if healthy and (came_back or r.models.lists.get(name, ()) is None):
            # Up, and its models still unknown, or back from down: a restarted server may
            # serve other models now (its new ones were 404 until the next refresh): ask now.
            self.lister.wake()
        if metrics is not None:
            r.tracker.observe_metrics(name, metrics, self.clock())
        return healthy
