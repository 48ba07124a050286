"""The SDK's front door: :class:`AsyncClient` (the synchronous ``Client`` is in
:mod:`firstbyte.client_sdk.sync`). Chat is ``client.stream(...)``, a
:class:`~firstbyte.client_sdk.streams.ChatStream`; the other formats are the typed calls of
:mod:`firstbyte.client_sdk.resources` (``client.responses.stream(...)`` ...), each an
:class:`~firstbyte.client_sdk.streams.EventStream` on the same machinery (read-ahead, resume,
failover, retries: :mod:`firstbyte.client_sdk.streams`).

With several base URLs (one per region), :meth:`AsyncClient.prewarm` probes each region's
RTT on a warm connection, sends requests to the fastest and keeps a warm standby connection to
the second; a request that cannot start on one region (unreachable, 429, 502-504) is sent to
the next, so failing over to the standby costs a round trip, not a handshake. A started stream
stays on its region, since only that region's router holds it. A router's
``x-firstbyte-better-region`` hint moves later requests to that region if it is configured.
While the client is in use, the regions are probed again every ``reprobe_interval_s`` and the
warm primary and standby follow the ranking (with hysteresis, :mod:`firstbyte.client_sdk.regions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import msgspec

from firstbyte.client_sdk._core.retry import RETRY_STATUSES, RetryBudget
from firstbyte.client_sdk._core.stream import StreamDelta
from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import (
    APIError,
    ConfigurationError,
    ConnectError,
    FirstbyteError,
    RateLimitError,
    ServiceUnavailableError,
    api_error_from_response,
)
from firstbyte.client_sdk.pool import ConnectionPool
from firstbyte.client_sdk.region_probe import probe_region
from firstbyte.client_sdk.regions import Region, RegionSelector
from firstbyte.client_sdk.resolver import Origin
from firstbyte.client_sdk.resources import Completions, Embeddings, Messages, Responses
from firstbyte.client_sdk.streams import ChatStream, EventStream
from firstbyte.client_sdk.tickets import TicketStore
from firstbyte.client_sdk.tickets import ticket_store as ticket_store_for
from firstbyte.client_sdk.timings import Timings
from firstbyte.client_sdk.timings_report import TimingsReporter
from firstbyte.client_sdk.transports.base import Session, Source
from firstbyte.client_sdk.transports.longpoll import longpoll_source
from firstbyte.client_sdk.transports.sse import sse_source
from firstbyte.client_sdk.transports.websocket import WebSocketPool, websocket_source
from firstbyte.client_sdk.trust import Verify, build_ssl_context, check_trust
from firstbyte.protocol import paths
from firstbyte.protocol.events import EventFormat
from firstbyte.protocol.openai import Message

# ChatStream and EventStream from .streams, build_ssl_context from .trust: re-exported.
__all__ = ["AsyncClient", "ChatStream", "EventStream", "build_ssl_context"]

TransportName = Literal["sse", "websocket", "longpoll"]
HTTPVersion = Literal["1.1", "2", "3"]

_LABEL_PROBE_S = 60.0
"""At most one probe per minute to learn router names for a better-region hint."""

E = TypeVar("E")


def keylog_path(keylog_file: str | None) -> str | None:
    """The key log file to write: ``keylog_file``, else ``$SSLKEYLOGFILE`` (``""``: none)."""
    if keylog_file is None:
        keylog_file = os.environ.get("SSLKEYLOGFILE")
    return keylog_file or None


class AsyncClient:
    """Streams chat completions over a prewarmed connection (see the README's SDK section).

    ``transport`` is ``"sse"``, ``"websocket"`` or ``"longpoll"``; ``http`` is ``"1.1"``,
    ``"2"`` or ``"3"`` (default ``"2"`` over https, ``"1.1"`` over plain http and for
    WebSocket). ``idle_timeout_s`` is the watchdog: the longest wait for the next event,
    heartbeats excluded. ``base_url`` may be a list of regional base URLs, or a mapping of
    region name to base URL: before the first probe (:meth:`probe_regions`, done by
    :meth:`prewarm`) they are tried in the order given; after it, fastest first.
    ``reprobe_interval_s`` (several regions only; None: never) is how often the regions are
    probed again while the client is in use (see :meth:`reprobe`). ``verify`` is True, False,
    a CA bundle path (as in httpx) or an ``ssl.SSLContext``; ``ca_file`` is a CA bundle path. A
    file that is missing or holds no certificate raises ``ConfigurationError`` here.
    ``ticket_store`` keeps HTTP/3 session tickets for 0-RTT: None (in memory, lost at exit), a
    file path (0-RTT across restarts; read the replay caveat in :mod:`.tickets`) or a
    :class:`~firstbyte.client_sdk.tickets.TicketStore` of the application's own.
    ``keylog_file`` (default ``$SSLKEYLOGFILE``; ``""``: none) is where the TLS secrets of
    every connection, TCP and QUIC alike, are appended for Wireshark/tshark to decrypt a
    capture (``tls.keylog_file``); it holds session keys, so keep it private.
    ``report_timings`` (default False) sends each finished stream's ``Timings`` (phases and
    offsets only, never text) to the router that served it, batched in the background every
    ``report_interval_s`` (:mod:`~firstbyte.client_sdk.timings_report`); the operator then
    sees the TTFT users felt per country next to the router's own.
    ``retries`` and ``retry_budget_s`` (default 2 and 5 s; 0 retries: off) bound how a request
    refused before its stream started (``429``, ``503``) is sent again after the server's
    ``Retry-After``, and a stream that ended with ``draining`` before any token is sent
    again (:mod:`~firstbyte.client_sdk._core.retry`); with several regions the others are
    tried first, at once.
    """

    def __init__(
        self,
        base_url: str | Sequence[str] | Mapping[str, str],
        api_key: str | None = None,
        *,
        transport: TransportName = "sse",
        http: HTTPVersion | None = None,
        verify: Verify = True,
        ca_file: str | None = None,
        idle_timeout_s: float = 30.0,
        max_resumes: int = 5,
        stall_retries: int = 1,
        resume_backoff_s: float = 0.05,
        keepalive_expiry_s: float = 120.0,
        keepalive_interval_s: float = 15.0,
        connect_timeout_s: float = 10.0,
        poll_wait_s: float = 10.0,
        reprobe_interval_s: float | None = 60.0,
        ticket_store: TicketStore | str | os.PathLike[str] | None = None,
        keylog_file: str | None = None,
        report_timings: bool = False,
        report_interval_s: float = 10.0,
        retries: int = 2,
        retry_budget_s: float = 5.0,
    ) -> None:
        checked, ca_file = check_trust(verify, ca_file)
        if retries < 0:
            raise ConfigurationError("retries", f"must be 0 or more, not {retries!r}")
        if retry_budget_s < 0:
            raise ConfigurationError("retry_budget_s", f"must be 0 or more, not {retry_budget_s!r}")
        tickets = ticket_store_for(ticket_store)
        if transport not in ("sse", "websocket", "longpoll"):
            raise ConfigurationError(
                "transport", f"must be sse, websocket or longpoll, not {transport!r}")
        if isinstance(base_url, str):
            named = {base_url: base_url}
        elif isinstance(base_url, Mapping):
            named = dict(base_url)
        else:
            named = {url: url for url in base_url}
        if not named:
            raise ConfigurationError("base_url", "give at least one URL")
        urls = list(named.values())
        if len(set(urls)) != len(urls):
            raise ConfigurationError("base_url", "the same URL is given for two regions")
        self.origins = [Origin.parse(url) for url in urls]
        self.origin = self.origins[0]
        """The preferred region; :meth:`prewarm` warms it."""
        self.regions = RegionSelector(Region(name, url) for name, url in named.items())
        """Region state: measured RTTs (lowest first), better-region hints, and failover (a
        region that refused with 429 / 5xx or was unreachable is set aside for its
        ``Retry-After`` or a growing backoff, so later requests skip it)."""
        self._origin_by_name = {name: origin for name, origin in zip(named, self.origins,
                                                                     strict=True)}
        self._background: set[asyncio.Task[None]] = set()
        self._label_probe_at = -float("inf")
        self._regions_lock = asyncio.Lock()
        """Held by prewarm and re-probe: one probe-and-switch at a time."""
        self._primary_connections = 1
        """``prewarm(connections)``: what a new primary gets when a re-probe switches."""
        self._busy: Counter[str] = Counter()
        """Streams reading from each region now: a re-probe does not close their connections."""
        if http is None:
            # HTTP/2 is negotiated with TLS (ALPN); over plain http it would need prior knowledge.
            plain = not all(origin.tls for origin in self.origins)
            http = "1.1" if transport == "websocket" or plain else "2"
        if http not in ("1.1", "2", "3"):
            raise ConfigurationError("http", f"must be '1.1', '2' or '3', not {http!r}")
        if transport == "websocket" and http != "1.1":
            raise ConfigurationError("http", "WebSocket runs over HTTP/1.1; use http='1.1'")
        if http == "3" and not all(origin.tls for origin in self.origins):
            raise ConfigurationError("http", "HTTP/3 needs an https:// base URL")
        self.transport: TransportName = transport
        self.http: HTTPVersion = http
        self.idle_timeout_s = idle_timeout_s
        self.max_resumes = max_resumes
        self.stall_retries = stall_retries
        self.resume_backoff_s = resume_backoff_s
        self.poll_wait_s = poll_wait_s
        self.retries = retries
        self.retry_budget_s = retry_budget_s
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        keylog = keylog_path(keylog_file)
        self.pool = ConnectionPool(
            build_ssl_context(checked, ca_file, keylog), verify=checked, ca_file=ca_file,
            keepalive_expiry_s=keepalive_expiry_s, keepalive_interval_s=keepalive_interval_s,
            connect_timeout_s=connect_timeout_s, tickets=tickets, keylog_file=keylog,
        )
        self.timings_reporter: TimingsReporter[Origin] | None = None
        """With ``report_timings``: the queue of finished streams' timings and its sender."""
        if report_timings:
            if report_interval_s <= 0:
                raise ConfigurationError("report_interval_s", "must be positive")
            self.timings_reporter = TimingsReporter(self._post_timings,
                                                    interval_s=report_interval_s)
        self.completions = Completions(self)
        """``completions.stream(...)``, ``completions.create(...)``: ``POST /v1/completions``."""
        self.responses = Responses(self)
        """``responses.stream(...)``, ``responses.create(...)``: OpenAI's Responses API."""
        self.messages = Messages(self)
        """``messages.stream(...)``, ``messages.create(...)``: Anthropic's Messages API."""
        self.embeddings = Embeddings(self)
        """``embeddings.create(...)``: ``POST /v1/embeddings``."""
        self._reprobing = False
        if reprobe_interval_s is not None and len(self.origins) > 1:
            self._reprobing = True
            # From the pool's keep-warm loop: only while the client is in use.
            self.pool.every(reprobe_interval_s, self.reprobe)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        tasks, self._background = self._background, set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.timings_reporter is not None:
            await self.timings_reporter.aclose()  # on the pooled connections: before closing
        await self.pool.aclose()

    async def _post_timings(self, origin: Origin, body: bytes) -> int:
        """Send one timings report to ``origin``'s router; its HTTP status."""
        session = self.pool.session(origin, self._probe_http)
        headers = {**self.headers, "content-type": "application/json"}
        path = paths.at_base(paths.EDGE_TIMINGS, origin.prefix)
        async with session.request("POST", path, headers=headers, body=body,
                                   recorder=None) as response:
            await response.finish()
        return response.status

    def _target(self, origin: Origin | None = None) -> Session | WebSocketPool:
        origin = origin or self.origin
        if self.transport == "websocket":
            return self.pool.websockets(origin, self.headers)
        return self.pool.session(origin, self.http)

    async def prewarm(self, connections: int = 1) -> None:
        """Open connections for the configured transport and HTTP version and keep them warm.

        With several regions: :meth:`probe_regions` first, then ``connections`` to the fastest
        region and one standby connection to the second, both kept warm (so a failover costs
        no handshake); the probe's connections to any other region are closed.
        """
        self._primary_connections = connections
        if len(self.origins) == 1:
            await self.pool.prewarm(self._target(), connections)
            return
        async with self._regions_lock:
            await self.probe_regions()
            await self._settle_regions()

    async def reprobe(self) -> None:
        """Probe every region again and move the warm primary and standby if the ranking
        changed by more than noise (:meth:`RegionSelector.proposal`).

        Run every ``reprobe_interval_s`` while the client is in use. The same probe as
        :meth:`probe_regions`: on the primary's and standby's warm connections (with
        WebSocket, their probe HTTP connections stay open for it); a region not connected
        costs a handshake, then its connection is closed again. A region that fails
        the probe is set aside as a failed request would set it (and so is no longer chosen
        until its backoff ends and a probe reaches it). A new primary or standby gets its
        warm connection before requests are sent there, so failover stays one round trip.
        Never raises for network failures.
        """
        async with self._regions_lock:
            await self.probe_regions()
            with contextlib.suppress(FirstbyteError, OSError):
                await self._settle_regions()

    async def _settle_regions(self) -> None:
        """Warm the proposed primary and standby, then make them the kept ones, then close
        the connections to regions neither kept nor hinted (unless a stream is reading)."""
        now = time.monotonic()
        chosen = self.regions.proposal(now) or [self.regions.regions[0]]
        primary = chosen[0]
        try:
            await self.pool.prewarm(self._target(self._origin_by_name[primary.name]),
                                    self._primary_connections)
        except (FirstbyteError, OSError):
            if self.regions.available(primary.name, time.monotonic()):  # else: already
                self.regions.failed(primary.name, time.monotonic())
            raise
        for standby in chosen[1:]:
            await self._warm_region(standby)
        # Only now do requests go there: their connections are open.
        self.regions.keep(chosen)
        self.origin = self._origin_by_name[primary.name]
        keep = {r.name for r in (*chosen, *self.regions.ranked(time.monotonic())[:1])}
        for region in self.regions.regions:
            origin = self._origin_by_name[region.name]
            if region.name in keep:
                if self.transport == "websocket" and not self._reprobing:
                    # WebSocket requests do not use the probe's HTTP session; only the
                    # re-probe would (kept, it measures on a warm connection, not a new one).
                    await self.pool.release(origin, self._probe_http)
            elif not self._busy[region.name]:
                await self.pool.release(origin)

    @property
    def _probe_http(self) -> str:
        return "1.1" if self.transport == "websocket" else self.http

    async def probe_regions(self, samples: int = 3) -> dict[str, float | None]:
        """Measure each region's RTT on a warm connection (all regions at once) and rank them.

        Returns ``{region name: RTT in ms}`` (None: unreachable, and set aside like a failed
        request). The RTT is the fastest of ``samples`` cheap requests (``GET /healthz``) on
        a connection opened first; it feeds the region ranking, and the router's own name
        for each region (from ``GET /v1/edge/status``) is learned so that better-region hints
        can name it.
        """
        regions = self.regions.regions
        probes = await asyncio.gather(*(
            probe_region(self.pool.session(self._origin_by_name[r.name], self._probe_http),
                         samples)
            for r in regions
        ))
        now = time.monotonic()
        result: dict[str, float | None] = {}
        for region, probe in zip(regions, probes, strict=True):
            if probe.label is not None:
                self.regions.learn_label(region.name, probe.label)
            if probe.rtt_ms is None or not probe.healthy:
                self.regions.failed(region.name, now)
            else:
                self.regions.succeeded(region.name)
            if probe.rtt_ms is not None:
                self.regions.observe_rtt(region.name, probe.rtt_ms)
            result[region.name] = probe.rtt_ms
        return result

    async def _warm_region(self, region: Region) -> None:
        """One kept-warm connection to ``region``; a failure sets the region aside."""
        try:
            await self.pool.prewarm(self._target(self._origin_by_name[region.name]), 1)
        except (FirstbyteError, OSError):
            self.regions.failed(region.name, time.monotonic())

    def _note_hint(self, timings: Timings) -> None:
        """Act on a response's ``x-firstbyte-better-region``: prefer and prewarm that region
        if it is one of ours. Router names are learned by a probe; if some are unknown yet,
        probe first (in the background) and match again."""
        name = timings.better_region
        if not name or len(self.origins) == 1:
            return
        url = timings.better_region_url
        now = time.monotonic()
        region = self.regions.hint(name, url, now)
        if region is None:
            # Not a configured region (never follow a URL from a header), unless a region
            # whose router name we do not know yet is that one: probe to learn (not too often,
            # a server without /v1/edge/status never tells).
            if not self.regions.unlabelled() or now - self._label_probe_at < _LABEL_PROBE_S:
                return
            self._label_probe_at = now

        async def act(region: Region | None) -> None:
            if region is None:
                await self.probe_regions()
                region = self.regions.hint(name, url, time.monotonic())
                if region is None:
                    return
            await self._warm_region(region)

        task = asyncio.get_running_loop().create_task(act(region))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stream(
        self,
        *,
        model: str,
        messages: Sequence[Message | dict[str, Any]],
        max_tokens: int | None = None,
        on_first_token: Callable[[StreamDelta], object] | None = None,
        **options: Any,
    ) -> ChatStream:
        """A streamed chat completion; ``options`` are further request fields (``tools``, ...).

        ``on_first_token`` is called with the first content delta; the time it returns is
        ``timings.render_ms`` (hand the token to the UI there).
        """
        body: dict[str, Any] = {"model": model, "messages": list(messages), "stream": True,
                                "stream_options": {"include_usage": True}}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        body.update(options)
        return ChatStream(self, msgspec.json.encode(body), on_first_token)

    def _event_stream(
        self, events: EventFormat[E], body: dict[str, Any],
        on_first_token: Callable[[E], object] | None,
    ) -> EventStream[E]:
        return EventStream(self, events, msgspec.json.encode(body), on_first_token)

    def _plan(self) -> list[int]:
        """The regions to try, by index, best first; set-aside ones last (better a retry
        than no answer)."""
        ranked = [r.url for r in self.regions.ranked(time.monotonic())]
        urls = [r.url for r in self.regions.regions]
        return [urls.index(u) for u in ranked] + [
            i for i, u in enumerate(urls) if u not in ranked]

    async def _post_json(self, path: str, body: dict[str, Any]) -> bytes:
        """``POST`` a non-streamed request (``path`` under ``/v1``) and return the answer's
        body; raises its :class:`~firstbyte.client_sdk.errors.APIError`.

        Over HTTP (HTTP/1.1 with the WebSocket transport), on the pooled connections. A region
        that cannot take it (unreachable, ``429``, ``502``-``504``) is set aside and the next
        one tried, as for a stream that has not started; when every region refused with
        ``429`` or ``503``, the request is sent again after the ``Retry-After`` within
        ``retries`` and ``retry_budget_s``, as a stream's first request is."""
        self.pool.touch()
        data = msgspec.json.encode(body)
        headers = {**self.headers, "content-type": "application/json",
                   "accept": "application/json"}
        retry = RetryBudget(self.retries, self.retry_budget_s)
        while True:
            refused = await self._post_once(path, data, headers)
            if isinstance(refused, bytes):
                return refused
            wait = None
            if isinstance(refused, APIError) and refused.status in RETRY_STATUSES:
                wait = retry.delay(getattr(refused, "retry_after", None))
            if wait is None:
                raise refused
            await asyncio.sleep(wait)

    async def _post_once(
        self, path: str, data: bytes, headers: dict[str, str]
    ) -> bytes | FirstbyteError:
        """One pass over the regions, best first: the first answer's body, or the last
        refusal (every region refused or was unreachable). Raises any other error."""
        refused: FirstbyteError | None = None
        for index in self._plan():
            name, origin = self.regions.regions[index].name, self.origins[index]
            session = self.pool.session(origin, self._probe_http)
            try:
                async with session.request("POST", paths.at_base(path, origin.prefix),
                                           headers=headers, body=data,
                                           recorder=None) as response:
                    raw = await response.read()
            except ConnectError as exc:
                self.regions.failed(name, time.monotonic())
                refused = exc
                continue
            if response.status == 200:
                self.regions.succeeded(name)
                return raw
            error = api_error_from_response(response.status, raw,
                                            retry_after=response.headers.get("retry-after"))
            if not isinstance(error, RateLimitError | ServiceUnavailableError):
                raise error
            retry_after = error.retry_after if isinstance(error, RateLimitError) else None
            self.regions.failed(name, time.monotonic(), retry_after)
            refused = error
        assert refused is not None
        return refused

    def _source(
        self, body: bytes | None, stream_id: str | None, after: int, recorder: TimingRecorder,
        origin: Origin, events: EventFormat[Any] | None = None,
    ) -> Source:
        """A source for one attempt: a new stream (``body`` in the format of ``events``;
        None: chat) or a resume of ``stream_id`` after ``after``."""
        self.pool.touch()
        target = self._target(origin)
        endpoint = None if events is None else events.name
        if isinstance(target, WebSocketPool):
            return websocket_source(target, body=body, stream_id=stream_id, after=after,
                                    recorder=recorder, endpoint=endpoint)
        prefix = origin.prefix
        if self.transport == "longpoll":
            return longpoll_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                                   after=after, recorder=recorder, wait_s=self.poll_wait_s,
                                   endpoint=endpoint)
        if events is None:
            return sse_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                              after=after, recorder=recorder)
        return sse_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                          after=after, recorder=recorder, path=events.path,
                          ends=events.terminal)
