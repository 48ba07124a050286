"""Per-region prefix-cache warmup: a sans-IO scheduler, a warm-state registry, a thin runner.

Each warm prefix (a shared system prompt) is sent to each backend of the region as a
one-token request (``max_tokens=1``), so its KV blocks sit in the backend's prefix cache
before users need them. :class:`WarmupScheduler` decides *which (backend, prefix) to warm
when*; it never touches a socket or a clock (every method takes ``now``):

- at start and when a backend joins: every (backend, prefix) is cold, hence due;
- after a restart: a health failure followed by success, or the backend's monotonic metric
  counters (prefix-cache queries/hits) going backwards, marks the backend cold;
- eviction: every probe's answer reports ``usage.prompt_tokens_details.cached_tokens``. A
  re-probe of a prefix we warmed that comes back (mostly) uncached proves it was evicted: it
  is counted and the probe itself re-warms it. Probes repeat every ``interval_s``, and every
  ``pressure_interval_s`` while ``vllm:gpu_cache_usage_perc`` is at or above the pressure mark
  (eviction is then likely). Cached-tokens on a probe is a direct, per-prefix signal; hit
  ratios of all traffic mix in user prompts and say little about one prefix.
- never while a backend is busy (any waiting request, or more running than the threshold):
  warming would queue behind users or delay them; the task waits for a quieter moment.

:class:`WarmupRunner` is the IO: it scrapes ``/metrics`` (over the router's own HTTP/1.1 pool
when given one, :func:`firstbyte.router.upstream_h1.fetch`: a scrape a second per backend,
at a tenth of httpx's CPU), sends the probes with httpx and feeds results back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from firstbyte.protocol import paths
from firstbyte.router.observability.logs import StateChanges, describe_error
from firstbyte.router.upstream_h1 import H1Pool, Origin, fetch
from firstbyte.router.upstream_metrics import BackendMetrics, parse_backend_metrics
from firstbyte.tasks import cancel_and_wait

__all__ = [
    "WarmPrefix",
    "WarmState",
    "WarmTask",
    "WarmupRunner",
    "WarmupScheduler",
    "probe_body",
]

MAX_METRICS_BYTES = 8 * 1024 * 1024
"""The largest ``/metrics`` page a scrape reads (vLLM's are tens of KB; the sim's ~10 KB):
a larger one counts as an answer without metrics (the backend is up), read no further."""

_SCRAPE_ATTEMPTS = 3
"""Tries of a scrape whose request was lost on its connection (reset, closed before the
answer): a late loop can find several kept-alive connections closed by their server's
keep-alive timers at once. A server that is down refuses the new connection the pool opens
once those are gone, so it is still found down at the first scrape."""


class WarmState(Enum):
    COLD = "cold"
    WARMING = "warming"
    WARM = "warm"


@dataclass(frozen=True, slots=True)
class WarmPrefix:
    name: str
    text: str
    models: tuple[str, ...]
    """Models to warm it for (a backend serving none of them is skipped)."""


@dataclass(frozen=True, slots=True)
class WarmTask:
    backend: str
    prefix: str
    model: str
    reason: str
    """``cold`` (start, join, restart), ``schedule`` or ``pressure``."""


@dataclass
class _Entry:
    state: WarmState = WarmState.COLD
    warmed_at: float | None = None
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class _Backend:
    name: str
    models: tuple[str, ...]
    healthy: bool = True
    unhealthy_seen: bool = False
    busy: bool = False
    pressure: bool = False
    counters: tuple[float, ...] = ()
    entries: dict[str, _Entry] = field(default_factory=dict)


class WarmupScheduler:
    """Decides which (backend, prefix) to warm when; holds the warm-state registry."""

    def __init__(
        self,
        prefixes: Iterable[WarmPrefix],
        *,
        interval_s: float = 60.0,
        pressure_interval_s: float = 5.0,
        cache_pressure_perc: float = 0.9,
        busy_running_threshold: int = 4,
        retry_s: float = 2.0,
        evicted_ratio: float = 0.5,
    ) -> None:
        self.prefixes = {p.name: p for p in prefixes}
        self.interval_s = interval_s
        self.pressure_interval_s = pressure_interval_s
        self.cache_pressure_perc = cache_pressure_perc
        self.busy_running_threshold = busy_running_threshold
        self.retry_s = retry_s
        self.evicted_ratio = evicted_ratio
        self.backends: dict[str, _Backend] = {}
        self.warmups_total: dict[tuple[str, str], int] = {}
        self.evictions_total: dict[tuple[str, str], int] = {}
        self.restarts_total: dict[str, int] = {}

    # --- inputs
    def add_backend(self, name: str, models: Iterable[str]) -> None:
        """A backend joined the region: all its prefixes are cold."""
        self.backends[name] = _Backend(name, tuple(models))
        self._mark_cold(name)
        self.restarts_total.setdefault(name, 0)

    def set_models(self, name: str, models: Iterable[str]) -> None:
        """The models a backend serves became known: its prefixes start cold."""
        b = self.backends[name]
        b.models = tuple(models)
        self._mark_cold(name)

    def remove_backend(self, name: str) -> None:
        self.backends.pop(name, None)

    def _applies(self, backend: _Backend, prefix: WarmPrefix) -> str | None:
        """The model to warm ``prefix`` with on ``backend``, or ``None``."""
        if not prefix.models:
            return backend.models[0] if backend.models else None
        return next((m for m in prefix.models if m in backend.models), None)

    def _mark_cold(self, name: str) -> None:
        b = self.backends[name]
        b.entries = {
            p.name: _Entry() for p in self.prefixes.values() if self._applies(b, p) is not None
        }

    def health(self, name: str, ok: bool) -> None:
        """A health result: failure-then-success means the backend (probably) restarted."""
        b = self.backends[name]
        if not ok:
            b.healthy, b.unhealthy_seen = False, True
            return
        if b.unhealthy_seen:
            self._restarted(b)
        b.healthy, b.unhealthy_seen = True, False

    def _restarted(self, b: _Backend) -> None:
        self.restarts_total[b.name] = self.restarts_total.get(b.name, 0) + 1
        self._mark_cold(b.name)

    def metrics(self, name: str, m: BackendMetrics) -> None:
        """A ``/metrics`` scrape: busy-ness, cache pressure and restart detection."""
        b = self.backends[name]
        was_down = b.unhealthy_seen
        self.health(name, True)  # back after a failure: that alone counts as a restart
        counters = m.counters()
        if not was_down and b.counters and len(counters) == len(b.counters) and any(
            new < old for new, old in zip(counters, b.counters, strict=True)
        ):
            self._restarted(b)
        b.counters = counters
        b.busy = (m.waiting or 0) > 0 or (m.running or 0) > self.busy_running_threshold
        b.pressure = m.cache_usage is not None and m.cache_usage >= self.cache_pressure_perc

    def finished(
        self, task: WarmTask, now: float, *, ok: bool, prompt_tokens: int = 0,
        cached_tokens: int = 0,
    ) -> None:
        """A probe ended; its usage says whether the prefix had been evicted."""
        b = self.backends.get(task.backend)
        if b is None or task.prefix not in b.entries:
            return
        entry = b.entries[task.prefix]
        if not ok:
            entry.state, entry.warmed_at = WarmState.COLD, now - self.interval_s + self.retry_s
            return
        key = (task.backend, task.prefix)
        was_warm = entry.warmed_at is not None and task.reason != "cold"
        if was_warm and prompt_tokens and cached_tokens < self.evicted_ratio * prompt_tokens:
            self.evictions_total[key] = self.evictions_total.get(key, 0) + 1
        self.warmups_total[key] = self.warmups_total.get(key, 0) + 1
        entry.state, entry.warmed_at = WarmState.WARM, now
        entry.prompt_tokens, entry.cached_tokens = prompt_tokens, cached_tokens

    # --- outputs
    def due(self, now: float) -> list[WarmTask]:
        """Tasks to start now (marked WARMING until :meth:`finished`)."""
        tasks: list[WarmTask] = []
        for b in self.backends.values():
            if not b.healthy or b.busy:
                continue
            period = self.pressure_interval_s if b.pressure else self.interval_s
            for name, entry in b.entries.items():
                if entry.state is WarmState.WARMING:
                    continue
                if entry.state is WarmState.COLD and entry.warmed_at is None:
                    reason = "cold"
                elif entry.warmed_at is not None and now - entry.warmed_at >= period:
                    reason = "pressure" if b.pressure else "schedule"
                    if entry.state is WarmState.COLD:
                        reason = "cold"
                else:
                    continue
                model = self._applies(b, self.prefixes[name])
                assert model is not None
                entry.state = WarmState.WARMING
                tasks.append(WarmTask(b.name, name, model, reason))
        return tasks

    def next_due(self, now: float) -> float | None:
        """When :meth:`due` may next return something (ignoring busy/health changes)."""
        times: list[float] = []
        for b in self.backends.values():
            period = self.pressure_interval_s if b.pressure else self.interval_s
            for entry in b.entries.values():
                if entry.state is WarmState.WARMING:
                    continue
                times.append(now if entry.warmed_at is None else entry.warmed_at + period)
        return min(times) if times else None

    def warm(self, backend: str) -> list[str]:
        """Names of the prefixes currently warm on ``backend``."""
        b = self.backends.get(backend)
        if b is None:
            return []
        return [n for n, e in b.entries.items() if e.state is WarmState.WARM]

    def state(self, backend: str, prefix: str) -> WarmState | None:
        b = self.backends.get(backend)
        entry = b.entries.get(prefix) if b is not None else None
        return entry.state if entry is not None else None

    def all_warm(self, *, healthy_only: bool = False) -> bool:
        """Every prefix warm on every backend (or on every healthy one)."""
        return all(
            e.state is WarmState.WARM
            for b in self.backends.values()
            if b.healthy or not healthy_only
            for e in b.entries.values()
        )

    def registry(self) -> dict[str, dict[str, str]]:
        """``{backend: {prefix: state}}``, for ``/v1/edge/status``."""
        return {b.name: {n: e.state.value for n, e in b.entries.items()}
                for b in self.backends.values()}


def probe_body(prefix: WarmPrefix, model: str) -> dict[str, object]:
    """The one-token request that puts ``prefix`` into a backend's prefix cache.

    The user message is a single character so the rendered prompt is the system prompt plus
    as little as possible; the system prompt's full blocks are what later requests reuse.
    """
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": prefix.text},
            {"role": "user", "content": "."},
        ],
        "max_tokens": 1,
        "stream": False,
        "temperature": 0,
    }


class WarmupRunner:
    """IO for :class:`WarmupScheduler`: scrape metrics, send probes, report back."""

    def __init__(
        self,
        scheduler: WarmupScheduler,
        client: object,
        urls: Mapping[str, str],
        *,
        poll_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        on_metrics: Callable[[str, BackendMetrics | None], bool | None] | None = None,
        headers: Mapping[str, Mapping[str, str]] | None = None,
        on_probe: Callable[[str, bool, float | None], None] | None = None,
        scrape_pool: H1Pool | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.client = client
        self.scrape_pool = scrape_pool
        """Where scrapes go, if given (else through ``client``, as the probes do)."""
        self._origins: dict[str, Origin] = {}
        self.urls = dict(urls)
        """Backend name -> base URL (without ``/v1``)."""
        self.poll_interval_s = poll_interval_s
        self.clock = clock
        self.on_metrics = on_metrics
        self.headers = {k: dict(v) for k, v in (headers or {}).items()}
        """Per-backend extra headers for probes (e.g. the upstream's API key)."""
        self.on_probe = on_probe
        """Called with (backend, True, None) as a probe is sent and (backend, False, ms) when
        it ends, ``ms`` the time to its answer (None if it failed): a probe is load the
        backend reports in its metrics, and must be counted as ours; its time is a TTFT
        (one token) known before any user request."""
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self.changes = StateChanges(logging.getLogger("firstbyte.router"), "upstream")
        """A warning when a backend stops answering, a line when it is back (once each)."""

    async def scrape(self, name: str) -> None:
        import httpx

        base = self.urls[name].rstrip("/")
        timeout = self.poll_interval_s * 2 + 1
        try:
            for attempt in range(_SCRAPE_ATTEMPTS):
                try:
                    status, text = await self._get_metrics(base, timeout)
                    break
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
                    # A kept-alive connection the server closed as it was reused (its
                    # keep-alive timer, and this loop late to see the FIN under load): that
                    # says nothing of the server. The pool drops that connection; the next
                    # try takes another kept-alive one (a late loop sees several timers run
                    # out at once) or a new one, which a server that is down refuses.
                    if attempt == _SCRAPE_ATTEMPTS - 1:
                        raise
        except httpx.TimeoutException:
            return  # slow, not down: a busy server answers late; keep what we knew
        except httpx.HTTPError as exc:
            # Unreachable (refused, reset, timed out): down, and probably restarting.
            self.changes.down(name, describe_error(exc), url=base)
            self.scheduler.health(name, False)
            if self.on_metrics is not None:
                self.on_metrics(name, None)
            return
        # Any HTTP answer means the server is up; without metrics there is just less to know.
        metrics = parse_backend_metrics(text) if status == 200 and text is not None else (
            BackendMetrics()
        )
        if self.on_metrics is not None and self.on_metrics(name, metrics) is False:
            return  # it answers, but is held out of rotation (ejected by passive health)
        self.changes.up(name, url=base)
        self.scheduler.metrics(name, metrics)
        # A backend's models, when not configured, come from its /v1/models through
        # firstbyte.router.models.ModelLister (scheduler.set_models).

    async def _get_metrics(self, base: str, timeout_s: float) -> tuple[int, str | None]:
        """GET ``/metrics`` of the backend at ``base``: the status and the page (None: over
        :data:`MAX_METRICS_BYTES`); httpx's errors."""
        if self.scrape_pool is None:
            import httpx

            client = self.client
            assert isinstance(client, httpx.AsyncClient)
            async with client.stream("GET", base + paths.METRICS, timeout=timeout_s) as response:
                body = bytearray()
                async for part in response.aiter_bytes():
                    body += part
                    if len(body) > MAX_METRICS_BYTES:
                        return response.status_code, None
                return response.status_code, body.decode(response.encoding or "utf-8", "replace")
        origin = self._origins.get(base)
        if origin is None:
            origin = self._origins[base] = Origin.parse(base)
        answer = await fetch(
            self.scrape_pool, origin, paths.METRICS, max_bytes=MAX_METRICS_BYTES,
            timeout_s=timeout_s,
        )
        page = answer.body
        return answer.status, None if page is None else page.decode("utf-8", "replace")

    async def probe(self, task: WarmTask) -> None:
        import httpx

        client = self.client
        assert isinstance(client, httpx.AsyncClient)
        prefix = self.scheduler.prefixes[task.prefix]
        headers = self.headers.get(task.backend, {})
        if self.on_probe is not None:
            self.on_probe(task.backend, True, None)
        sent = time.perf_counter()
        answered_ms: float | None = None
        try:
            response = await client.post(
                self.urls[task.backend].rstrip("/") + paths.CHAT_COMPLETIONS,
                json=probe_body(prefix, task.model), headers=headers, timeout=60.0,
            )
            response.raise_for_status()
            answered_ms = (time.perf_counter() - sent) * 1000
            usage = response.json().get("usage") or {}
        except (httpx.HTTPError, ValueError):
            self.scheduler.finished(task, self.clock(), ok=False)
            return
        finally:
            if self.on_probe is not None:
                self.on_probe(task.backend, False, answered_ms)
        details = usage.get("prompt_tokens_details") or {}
        self.scheduler.finished(
            task, self.clock(), ok=True,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )

    async def step(self) -> None:
        """One round: scrape every backend, then start the probes that are due."""
        await asyncio.gather(*(self.scrape(n) for n in list(self.scheduler.backends)))
        for task in self.scheduler.due(self.clock()):
            probe = asyncio.create_task(self.probe(task))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)

    async def wait_all_warm(self, timeout_s: float) -> bool:
        """Run rounds until every prefix is warm on every reachable backend, or the timeout.

        A backend that is down at start-up does not hold the others back: it is warmed when
        it comes up (its failed scrape then a good one count as a restart).
        """
        deadline = self.clock() + timeout_s
        await self.step()
        while not self.scheduler.all_warm(healthy_only=True) and self.clock() < deadline:
            await self.step()
            if self._probes:
                await asyncio.wait(set(self._probes), timeout=max(0.0, deadline - self.clock()))
            else:
                await asyncio.sleep(0.05)
        return self.scheduler.all_warm(healthy_only=True)

    async def _loop(self) -> None:
        while True:
            await self.step()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval_s):
                    await self._wake.wait()
            self._wake.clear()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="warmup")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._probes) if t is not None]
        for t in tasks:
            await cancel_and_wait(t)
        self._task = None
