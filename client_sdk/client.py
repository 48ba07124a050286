"""The SDK's front door: :class:`AsyncClient` (the synchronous ``Client`` is in
:mod:`firstbyte.client_sdk.sync`). Chat is ``client.stream(...)``; the other formats are the
typed calls of :mod:`firstbyte.client_sdk.resources` (``client.responses.stream(...)`` ...),
whose :class:`EventStream` runs on the same machinery as :class:`ChatStream`.

``client.stream(...)`` returns a :class:`ChatStream`: an async context manager (the request is
sent and the response accepted on entry, so HTTP errors raise there) and an async iterator of
:class:`~firstbyte.client_sdk._core.stream.StreamDelta`. Behind it, one reader task pumps the
transport's items (a batch of events per network read) into a queue bounded in events; the
iterator hands out a batch's events one at a time and waits on the queue, with the idle
watchdog, only when the batch is used up, so heartbeats (which never become events) do not
count as progress. A cut connection or a sequence gap resumes from the last delivered event
(the rest of its batch is dropped: the resume sends it again); a stall resumes once on fresh
connections, then raises. A stall before the router answered (no stream id) on a region that
still answers a probe is waited out instead: the router holds the request, and sending it
again would run the model twice.
With several base URLs (one per region), :meth:`AsyncClient.prewarm` probes each region's
RTT on a warm connection, sends requests to the fastest and keeps a warm standby connection to
the second; a request that cannot start on one region (unreachable, 429, 502-504, or silent
for the idle timeout) is sent to the next, so failing over to the standby costs a round trip,
not a handshake. A started stream stays on its region, since only that region's router holds
it. A router's ``x-firstbyte-better-region`` hint moves later requests to that region if it is
configured.
While the client is in use, the regions are probed again every ``reprobe_interval_s`` and the
warm primary and standby follow the ranking (with hysteresis, :mod:`firstbyte.client_sdk.regions`),
and a region whose ``/healthz`` refuses a keep-warm ping or a prewarm (``503`` draining, ...)
is set aside as a refused request would set it, before a request pays for the refusal.
A ``503`` ``draining`` (to a request, a prompt warm-up, a keep-warm ping, a prewarm or a probe)
is first taken as the word of
one router process, not of its region: its connection is dropped and the same region asked
again at once on a new one, which a balancer gives another of its processes; only a second
``draining`` sets the region aside.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, Protocol, Self, TypeVar

import msgspec

from firstbyte.client_sdk._core.compression import CompressMode, should_compress
from firstbyte.client_sdk._core.events import EventAssembler
from firstbyte.client_sdk._core.resume import ResumePolicy
from firstbyte.client_sdk._core.retry import RETRY_STATUSES, RetryBudget
from firstbyte.client_sdk._core.stream import SequenceGapError, StreamAssembler, StreamDelta
from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import (
    APIError,
    ConfigurationError,
    ConnectError,
    FirstbyteError,
    RateLimitError,
    ServiceUnavailableError,
    StreamBrokenError,
    StreamHistoryTrimmedError,
    StreamLostError,
    StreamStalledError,
)
from firstbyte.client_sdk.pool import ConnectionPool
from firstbyte.client_sdk.region_probe import probe_region
from firstbyte.client_sdk.regions import Region, RegionSelector
from firstbyte.client_sdk.resolver import Origin
from firstbyte.client_sdk.resources import (
    Completions,
    Embeddings,
    Messages,
    Responses,
    message_list,
)
from firstbyte.client_sdk.tickets import TicketStore
from firstbyte.client_sdk.tickets import ticket_store as ticket_store_for
from firstbyte.client_sdk.timings import Timings
from firstbyte.client_sdk.timings_report import TimingsReporter
from firstbyte.client_sdk.transports.base import (
    Batch,
    Event,
    Item,
    Opened,
    Refusal,
    Session,
    Source,
    TransportCut,
    draining_refusal,
    error_answer,
)
from firstbyte.client_sdk.transports.longpoll import longpoll_source
from firstbyte.client_sdk.transports.sse import sse_source
from firstbyte.client_sdk.transports.websocket import WebSocketPool, websocket_source
from firstbyte.client_sdk.trust import Verify, build_ssl_context, check_trust
from firstbyte.protocol import codec, error_codes, paths
from firstbyte.protocol.content_coding import CONTENT_ENCODING_HEADER, gzip_body
from firstbyte.protocol.events import (
    CompletionChunk,
    EventFormat,
    MessageEvent,
    ResponseEvent,
)
from firstbyte.protocol.openai import Message, Usage
from firstbyte.protocol.prewarm import PromptWarmed
from firstbyte.tasks import cancel_and_wait

__all__ = ["AsyncClient", "ChatStream", "EventStream", "build_ssl_context"]  # the last from .trust

TransportName = Literal["sse", "websocket", "longpoll"]
HTTPVersion = Literal["1.1", "2", "3"]

_EOF = object()
_QUEUE_ITEMS = 256
"""Events read ahead of a slow consumer; beyond this the transport stops reading (bounded
memory whatever the server sends: this many events plus one network read's)."""
_LABEL_PROBE_S = 60.0
"""At most one probe per minute to learn router names for a better-region hint."""

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
E = TypeVar("E")


def keylog_path(keylog_file: str | None) -> str | None:
    """The key log file to write: ``keylog_file``, else ``$SSLKEYLOGFILE`` (``""``: none)."""
    if keylog_file is None:
        keylog_file = os.environ.get("SSLKEYLOGFILE")
    return keylog_file or None


def _check_numbers(*, at_least_zero: bool = False, **options: object) -> None:
    """``ConfigurationError`` naming the first option that is not a number above 0 (with
    ``at_least_zero``: 0 or more): a zero interval would busy-loop and a zero timeout fail
    every request, far from where it was set."""
    for name, value in options.items():
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if at_least_zero and not (number and value >= 0):  # type: ignore[operator]
            raise ConfigurationError(name, f"must be a number of 0 or more, not {value!r}")
        if not at_least_zero and not (number and value > 0):  # type: ignore[operator]
            raise ConfigurationError(name, f"must be a number above 0, not {value!r}")


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
    tried first, at once. A ``503`` ``draining`` is first sent again to the same region at
    once, on a new connection (one of the ``retries``, with no wait).
    ``compress_requests`` (default ``"auto"``) gzips a request body over 10 KiB once the
    server has said it takes gzip bodies (``Accept-Encoding`` on an answer: the router's to
    :meth:`prewarm` and :meth:`warm_prompt`) and the round trip measured to it is at least
    5 ms (:mod:`~firstbyte.client_sdk._core.compression`); True: every body over 10 KiB,
    whatever the server said; False: never.
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
        max_connections: int = 256,
        poll_wait_s: float = 10.0,
        reprobe_interval_s: float | None = 60.0,
        ticket_store: TicketStore | str | os.PathLike[str] | None = None,
        keylog_file: str | None = None,
        report_timings: bool = False,
        report_interval_s: float = 10.0,
        retries: int = 2,
        retry_budget_s: float = 5.0,
        compress_requests: CompressMode = "auto",
    ) -> None:
        checked, ca_file = check_trust(verify, ca_file)
        if compress_requests not in (True, False, "auto"):
            raise ConfigurationError(
                "compress_requests", f"must be 'auto', True or False, not {compress_requests!r}")
        self.compress_requests: CompressMode = compress_requests
        if retries < 0:
            raise ConfigurationError("retries", f"must be 0 or more, not {retries!r}")
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or (
            max_connections < 1
        ):
            raise ConfigurationError(
                "max_connections", f"must be a whole number, 1 or more, not {max_connections!r}")
        if retry_budget_s < 0:
            raise ConfigurationError("retry_budget_s", f"must be 0 or more, not {retry_budget_s!r}")
        tickets = ticket_store_for(ticket_store)
        if transport not in ("sse", "websocket", "longpoll"):
            raise ConfigurationError(
                "transport", f"must be sse, websocket or longpoll, not {transport!r}")
        _check_numbers(idle_timeout_s=idle_timeout_s, connect_timeout_s=connect_timeout_s,
                       keepalive_interval_s=keepalive_interval_s, poll_wait_s=poll_wait_s)
        _check_numbers(at_least_zero=True, max_resumes=max_resumes, stall_retries=stall_retries,
                       resume_backoff_s=resume_backoff_s, keepalive_expiry_s=keepalive_expiry_s)
        if reprobe_interval_s is not None:
            _check_numbers(reprobe_interval_s=reprobe_interval_s)
        if isinstance(base_url, str):
            named = {base_url: base_url}
        elif isinstance(base_url, Mapping):
            named = dict(base_url)
        elif isinstance(base_url, Sequence):
            named = {url: url for url in base_url}
            if len(named) != len(base_url):
                raise ConfigurationError("base_url", "the same URL is given for two regions")
        else:
            raise ConfigurationError(
                "base_url", "must be a URL, a list of URLs or a mapping of region name to URL,"
                f" not {base_url!r}")
        if not named:
            raise ConfigurationError("base_url", "give at least one URL")
        urls = list(named.values())
        self.origins = [Origin.parse(url) for url in urls]
        if len(set(self.origins)) != len(self.origins):  # also https://h/v1 and https://h/v1/
            raise ConfigurationError("base_url", "the same URL is given for two regions")
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
        self._prewarmed_next = False
        """A prewarm ran and no stream has started since: the next one's Timings may say
        ``prewarmed``."""
        self._busy: Counter[str] = Counter()
        """Streams reading from each region now: a re-probe does not close their connections."""
        self._streams: set[_Stream[Any]] = set()
        """Streams entered and not yet closed: :meth:`aclose` ends them first."""
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
        if http == "3":
            # aioquic (and the cryptography it pulls in) loads now, not inside the first
            # request's timings, where its ~70 ms would belong to no phase.
            import firstbyte.client_sdk.transports.h3  # noqa: F401
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
            connect_timeout_s=connect_timeout_s, max_connections=max_connections,
            tickets=tickets, keylog_file=keylog,
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
        self._rechecks: set[str] = set()
        """Regions a keep-warm ping found refusing that are to be asked again."""
        if len(self.origins) > 1:
            self.pool.on_refusal = self._keep_warm_refused
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
        """Close the client: streams still open end (their readers get
        :class:`~firstbyte.client_sdk.errors.StreamBrokenError` saying so, not a silent end),
        then every connection closes; nothing is sent with this client afterwards."""
        for stream in list(self._streams):
            await stream._close_with_client()
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

    async def prewarm(
        self, connections: int = 1, *, model: str | None = None,
        messages: Sequence[Message | dict[str, Any]] | None = None,
    ) -> PromptWarmed | None:
        """Open connections for the configured transport and HTTP version and keep them warm.

        With several regions: :meth:`probe_regions` first, then ``connections`` to the fastest
        region and one standby connection to the second, both kept warm (so a failover costs
        no handshake); the probe's connections to any other region are closed.

        With ``model`` and ``messages`` (the conversation so far), then :meth:`warm_prompt`:
        the prefix is computed ahead on the backend the next message will go to.
        """
        self._primary_connections = connections
        if len(self.origins) == 1:
            await self.pool.prewarm(self._target(), connections)
        else:
            async with self._regions_lock:
                await self.probe_regions()
                await self._settle_regions()
        self._prewarmed_next = True
        if messages is None:
            return None
        if model is None:
            raise ValueError("prewarm(messages=...) needs the model the messages are for")
        return await self.warm_prompt(model=model, messages=messages)

    async def warm_prompt(
        self, *, model: str, messages: Sequence[Message | dict[str, Any]]
    ) -> PromptWarmed | None:
        """Ask the router to place this conversation's prefix on the backend its next message
        will be routed to (``POST /v1/edge/warm``: one request of one token there, counted in
        the key's usage). Best effort: None when the router declines (the region busy, the
        user's warm-ups per minute spent, every region draining); other refusals raise as a
        request's would.

        Sent to the region the next message goes to. A ``503`` ``draining`` is sent there
        once more at once, on a new connection (another of its router processes may take
        it); refused again, the region is set aside as a stream's refusals set it (for the
        ``Retry-After``) and the warm-up goes to the next region, where the message now
        goes."""
        headers = {**self.headers, "content-type": "application/json"}
        data = msgspec.json.encode({"model": model, "messages": message_list(messages)})
        for index in self._plan():
            name, origin = self.regions.regions[index].name, self.origins[index]
            answer = await self._warm_prompt_at(origin, data, headers)
            if draining_refusal(answer):  # its connection is retired: this goes on a new one
                answer = await self._warm_prompt_at(origin, data, headers)
            if isinstance(answer, PromptWarmed):
                return answer
            if not draining_refusal(answer):
                if answer.code in (error_codes.PROMPT_WARM_BUSY,
                                   error_codes.PROMPT_WARM_LIMITED):
                    return None
                raise answer
            self.regions.failed(name, time.monotonic(), getattr(answer, "retry_after", None))
        return None

    async def _warm_prompt_at(
        self, origin: Origin, data: bytes, headers: dict[str, str]
    ) -> PromptWarmed | APIError:
        """One prompt warm-up sent to ``origin``: its answer, or the error it was (a ``503``
        ``draining`` retired the connection it came on)."""
        session = self.pool.session(origin, self.http)
        body, sent = self._packed(origin, data, headers)
        path = paths.at_base(paths.EDGE_WARM, origin.prefix)
        async with session.request("POST", path, headers=sent, body=body,
                                   recorder=None) as response:
            if response.status == 200:
                return msgspec.json.decode(await response.read(), type=PromptWarmed)
            return await error_answer(response)

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
                         samples, timeout_s=self.pool.connect_timeout_s)
            for r in regions
        ))
        now = time.monotonic()
        result: dict[str, float | None] = {}
        for region, probe in zip(regions, probes, strict=True):
            if probe.label is not None:
                self.regions.learn_label(region.name, probe.label)
            if probe.rtt_ms is None or not probe.healthy:
                # An unhealthy answer's Retry-After, as a refused request's (else the backoff).
                self.regions.failed(region.name, now, probe.retry_after_s)
            else:
                self.regions.succeeded(region.name)
            if probe.rtt_ms is not None:
                self.regions.observe_rtt(region.name, probe.rtt_ms)
            result[region.name] = probe.rtt_ms
        return result

    def _keep_warm_refused(self, origin: Origin, refused: Refusal) -> None:
        """A keep-warm ping's or a prewarm's ``/healthz`` was answered ``429`` or ``503``
        (``draining`` from a new connection too): set the region
        aside as a refused request does (for its ``Retry-After``, else the growing backoff),
        so the next request goes to another region without paying for a refusal first, and
        ask it again when that ends. A ping answered ``200`` changes nothing: it does not
        say that what else set the region aside (a key's ``429``, a stall, a failed probe)
        is over."""
        name = self.regions.regions[self.origins.index(origin)].name
        self.regions.failed(name, time.monotonic(), refused.retry_after_s)
        if name not in self._rechecks:
            self._rechecks.add(name)
            self._in_background(self._recheck(name, origin))

    async def _recheck(self, name: str, origin: Origin) -> None:
        """Ping ``name``'s connections once its set-aside ends (a refusal sets it aside again
        and comes back here), while the client is in use: without this, a region whose router
        said ``Retry-After: 1`` got requests again from then until the next keep-warm ping."""
        try:
            await asyncio.sleep(self.regions.aside_s(name, time.monotonic()))
        finally:
            self._rechecks.discard(name)
        if self.pool.in_use:
            await self.pool.ping(origin)

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

        self._in_background(act(region))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task of the client's (:meth:`aclose` cancels what is left); its
        failure is nobody's business but its own."""

        async def quietly() -> None:
            with contextlib.suppress(Exception):
                await work

        task = asyncio.get_running_loop().create_task(quietly())
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
        body: dict[str, Any] = {"model": model, "messages": message_list(messages), "stream": True,
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
        ``retries`` and ``retry_budget_s``, as a stream's first request is; a ``503``
        ``draining`` is first sent once more to its region at once, on a new connection."""
        self.pool.touch()
        data = msgspec.json.encode(body)
        headers = {**self.headers, "content-type": "application/json",
                   "accept": "application/json"}
        retry = RetryBudget(self.retries, self.retry_budget_s)
        while True:
            refused = await self._post_once(path, data, headers, retry)
            if isinstance(refused, bytes):
                return refused
            wait = None
            if isinstance(refused, APIError) and refused.status in RETRY_STATUSES:
                wait = retry.delay(getattr(refused, "retry_after", None))
            if wait is None:
                raise refused
            await asyncio.sleep(wait)

    async def _post_once(
        self, path: str, data: bytes, headers: dict[str, str], retry: RetryBudget
    ) -> bytes | FirstbyteError:
        """One pass over the regions, best first: the first answer's body, or the last
        refusal (every region refused or was unreachable). Raises any other error. A region's
        ``503`` ``draining`` is sent there once more at once, on a new connection (another of
        its router processes may take it), as one of ``retry``'s retries, as a stream's is."""
        refused: FirstbyteError | None = None
        for index in self._plan():
            name, origin = self.regions.regions[index].name, self.origins[index]
            answer = await self._post_to(origin, path, data, headers)
            if (
                isinstance(answer, ServiceUnavailableError)
                and draining_refusal(answer)
                and retry.delay(0.0) is not None
            ):
                answer = await self._post_to(origin, path, data, headers)
            if isinstance(answer, bytes):
                self.regions.succeeded(name)
                return answer
            # Set aside for its Retry-After, a 503's as a 429's (a draining or state-less
            # router says how long); the growing backoff when it gave none or was unreachable.
            retry_after = None if isinstance(answer, ConnectError) else answer.retry_after
            self.regions.failed(name, time.monotonic(), retry_after)
            refused = answer
        assert refused is not None
        return refused

    async def _post_to(
        self, origin: Origin, path: str, data: bytes, headers: dict[str, str]
    ) -> bytes | ConnectError | RateLimitError | ServiceUnavailableError:
        """``POST`` to one region: the answer's body, or why the region cannot take it now
        (unreachable, ``429``, ``502``-``504``; a ``503`` ``draining`` retired the connection
        it came on). Raises any other error."""
        session = self.pool.session(origin, self._probe_http)
        body, sent_headers = self._packed(origin, data, headers)
        try:
            async with session.request("POST", paths.at_base(path, origin.prefix),
                                       headers=sent_headers, body=body,
                                       recorder=None) as response:
                if response.status == 200:
                    return await response.read()
                error = await error_answer(response)
        except ConnectError as exc:
            return exc
        if not isinstance(error, RateLimitError | ServiceUnavailableError):
            raise error
        return error

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
        coding = None
        if body is not None and self._compresses(origin, len(body)):
            body, coding = gzip_body(body), "gzip"
        if body is not None:
            recorder.record.request_bytes = len(body)
        if self.transport == "longpoll":
            return longpoll_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                                   after=after, recorder=recorder, wait_s=self._poll_wait_s,
                                   max_failures=self.max_resumes, endpoint=endpoint,
                                   content_encoding=coding)
        if events is None:
            return sse_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                              after=after, recorder=recorder, content_encoding=coding)
        return sse_source(target, prefix, self.headers, body=body, stream_id=stream_id,
                          after=after, recorder=recorder, path=events.path,
                          ends=events.terminal, content_encoding=coding)

    @property
    def _poll_wait_s(self) -> float:
        """The ``wait`` a long-poll asks the router for: ``poll_wait_s``, at most half the idle
        timeout. The start's ``201`` (the stream id) comes once the wait is over, however slow
        the upstream's head or first token, so it must come before the watchdog fires: then a
        stall is resumed by the stream's id, not waited on without one. Half leaves the other
        half for the round trip and the router's own time; each later poll, answered empty at
        the wait's end, likewise never outlasts the watchdog."""
        return min(self.poll_wait_s, self.idle_timeout_s / 2)

    def _compresses(self, origin: Origin, size: int) -> bool:
        """Gzip a body of ``size`` bytes for ``origin`` (:func:`should_compress` over what the
        sessions heard from it; the round trip a region probe measured if no connect was)."""
        if self.compress_requests is False:
            return False
        accept_encoding, rtt_s = self.pool.heard(origin)
        if rtt_s is None and len(self.origins) > 1:
            probed = self.regions.rtt_ms(self.regions.regions[self.origins.index(origin)].name)
            rtt_s = None if probed is None else probed / 1000
        return should_compress(size, self.compress_requests, accept_encoding=accept_encoding,
                               rtt_s=rtt_s)

    def _packed(
        self, origin: Origin, body: bytes, headers: dict[str, str]
    ) -> tuple[bytes, dict[str, str]]:
        """``body`` and ``headers`` as sent to ``origin``: gzipped when :meth:`_compresses`."""
        if not self._compresses(origin, len(body)):
            return body, headers
        return gzip_body(body), {**headers, CONTENT_ENCODING_HEADER: "gzip"}


class _ReadAhead(asyncio.Queue[Item | object | BaseException]):
    """The reader task's queue, bounded in events: a batch takes one place per event.

    ``put`` waits while ``maxsize`` events are queued, then takes a whole batch, so the queue
    holds at most ``maxsize - 1`` events plus one batch.
    """

    def _init(self, maxsize: int) -> None:
        super()._init(maxsize)
        self._events = 0

    def _put(self, item: Item | object | BaseException) -> None:
        self._events += len(item) if type(item) is list else 1
        super()._put(item)

    def _get(self) -> Item | object | BaseException:
        item = super()._get()
        self._events -= len(item) if type(item) is list else 1
        return item

    def qsize(self) -> int:
        """Events queued (a batch counts its events; any other item counts one)."""
        return self._events


class _Assembler(Protocol[T_co]):
    """What a stream reads its events with (:class:`StreamAssembler` for chat,
    :class:`EventAssembler` for the typed formats)."""

    last_seq: int
    done: bool

    def receive(self, seq: int | None, payload: str | bytes | dict[str, Any]) -> T_co | None: ...


class _Stream(Generic[T]):
    """One streamed request in any format: the read-ahead, resume, failover and retries.
    Subclasses say how events are assembled and what an item hands the application."""

    _events: EventFormat[Any] | None = None
    """The format's events (None: chat)."""

    def __init__(
        self,
        client: AsyncClient,
        body: bytes,
        on_first_token: Callable[[T], object] | None,
    ) -> None:
        self._client = client
        self._body = body
        self._on_first_token = on_first_token
        self._recorder = TimingRecorder(time.perf_counter(), transport=client.transport)
        self._prewarmed = client._prewarmed_next  # the first stream after a prewarm
        client._prewarmed_next = False
        self._assembler: _Assembler[T] = self._new_assembler()
        self._queue = _ReadAhead(_QUEUE_ITEMS)
        self._batch: Batch = []
        """The events of the last item taken from the queue; ``_at`` is the next one's index."""
        self._at = 0
        self._pump_task: asyncio.Task[None] | None = None
        self._stream_id: str | None = None
        self._opened = False
        self._finished = False
        self._policy = ResumePolicy(max_resumes=client.max_resumes,
                                    backoff_s=client.resume_backoff_s,
                                    stall_retries=client.stall_retries,
                                    idle_timeout_s=client.idle_timeout_s)
        self._parts: list[str] = []
        self._plan = client._plan()
        self._attempt = 0
        self._retry = RetryBudget(client.retries, client.retry_budget_s)
        """Sends again after a refusal or a ``draining`` end before any token."""
        self._reconnected = False
        """This attempt is the one sent again at once on a new connection after a ``503``
        ``draining``: refused again, its region is set aside."""
        self._busy_region: str | None = None
        """The region counted in the client's ``_busy`` while a pump reads from it."""
        self._reported = False
        self._closed_by_client: StreamBrokenError | None = None
        """Set when the client was closed while this stream was open."""

    @property
    def _origin(self) -> Origin:
        return self._client.origins[self._plan[self._attempt]]

    @property
    def _region_name(self) -> str:
        return self._client.regions.regions[self._plan[self._attempt]].name

    # -- public ---------------------------------------------------------------------------------
    @property
    def timings(self) -> Timings:
        timings = self._recorder.timings()
        timings.prewarmed = self._prewarmed and timings.warm
        return timings

    @property
    def stream_id(self) -> str | None:
        return self._stream_id

    @property
    def text(self) -> str:
        """All text delivered so far."""
        return "".join(self._parts)

    async def __aenter__(self) -> Self:
        self._start(self._fresh_source())
        self._client._streams.add(self)
        try:
            # Sources yield Opened before any event; events before it would wait in _batch.
            while not self._opened and not self._finished and self._at >= len(self._batch):
                await self._step()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._pump_task is None:
            raise RuntimeError("use 'async with client.stream(...) as stream' before iterating")
        if self._closed_by_client is not None:
            raise StreamBrokenError(str(self._closed_by_client))
        assembler = self._assembler
        while not self._finished:
            try:
                delta = self._take()
            except SequenceGapError as exc:
                await self._recover(exc)  # drops the rest of the batch: the resume replays it
                continue
            except FirstbyteError as exc:
                self._finished = True
                if isinstance(exc, APIError) and exc.code == error_codes.DRAINING:
                    if (
                        self._recorder.record.first_token_ms is None
                        and self._retry.delay(0.0) is not None
                    ):
                        await self._resend()
                        assembler = self._assembler
                        continue
                    # Its router shut down mid-stream: nothing more comes on this stream.
                    raise self._lost(
                        f"stream {self._stream_id} is lost (its router shut down before the"
                        f" end) after event {assembler.last_seq}; send a new request for the"
                        " rest"
                    ) from exc
                if isinstance(exc, APIError) and exc.code == error_codes.STREAM_HISTORY_TRIMMED:
                    raise self._trimmed(exc) from exc  # fell behind a trim while following
                if isinstance(exc, APIError) and exc.code == error_codes.STREAM_LOST:
                    # The router process producing the stream died mid-stream, or its lease
                    # went from Redis: a router with shared state ends the stream for its
                    # readers elsewhere with this event, whose message says which.
                    raise self._lost(
                        f"stream {self._stream_id} is lost after event {assembler.last_seq};"
                        f" resumed {self._recorder.record.resumes} times ({exc.message})"
                    ) from exc
                raise
            if assembler.done:
                self._finished = True
                await self._stop_pump()
            if delta is not None:
                return self._deliver(delta)
            if not self._finished:
                await self._step()  # the batch is used up: wait for the next item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stop reading (also when the stream is abandoned half-way) and free the connection.

        With ``report_timings``, a stream that got its first token is queued for reporting
        (once)."""
        self._finished = True
        self._client._streams.discard(self)
        await self._stop_pump()
        reporter = self._client.timings_reporter
        if reporter is not None and not self._reported:
            self._reported = True
            reporter.note(self._origin, self.timings)

    async def _close_with_client(self) -> None:
        """The client is closing while this stream is open: stop reading and free its
        connection now (the pool closes next), and make the reader raise, at once if it waits
        for the next event: ending as if the answer were whole would pass a cut-off answer
        for a complete one."""
        if not self._finished:
            self._closed_by_client = StreamBrokenError(
                f"the client was closed while stream {self._stream_id} was read, after event"
                f" {self._assembler.last_seq}")
        await self.aclose()
        if self._closed_by_client is not None:
            queue = self._queue  # what a waiting reader wakes on: the error, nothing before
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(self._closed_by_client)

    # -- machinery ------------------------------------------------------------------------------
    def _new_assembler(self) -> _Assembler[T]:
        raise NotImplementedError

    def _deliver(self, item: T) -> T:
        """Record the item's timing and text, then hand it over."""
        raise NotImplementedError

    def _fresh_source(self) -> Source:
        """A source sending the request (again) to the current attempt's region."""
        return self._client._source(self._body, None, 0, self._recorder, self._origin,
                                    self._events)

    def _start(self, source: Source, *, reconnected: bool = False) -> None:
        self._reconnected = reconnected
        self._unbusy()
        self._busy_region = self._region_name
        self._client._busy[self._busy_region] += 1
        self._queue = _ReadAhead(_QUEUE_ITEMS)
        self._pump_task = asyncio.get_running_loop().create_task(self._pump(source, self._queue))

    @staticmethod
    async def _pump(source: Source, queue: _ReadAhead) -> None:
        try:
            async for item in source:
                if queue.full():  # stops reading: the server is slowed down
                    await queue.put(item)
                else:
                    queue.put_nowait(item)  # no coroutine per batch in the common case
            await queue.put(_EOF)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)
        finally:
            with contextlib.suppress(Exception):
                await source.aclose()  # type: ignore[attr-defined]

    def _unbusy(self) -> None:
        if self._busy_region is not None:
            self._client._busy[self._busy_region] -= 1
            self._busy_region = None

    async def _stop_pump(self) -> None:
        """Stop the reader task; the events it read and the iterator has not taken are dropped
        (a resume asks for everything after the last event taken, so it sends them again)."""
        self._unbusy()
        self._batch, self._at = [], 0
        task, self._pump_task = self._pump_task, None
        try:
            if task is not None and not task.done():
                with contextlib.suppress(Exception):
                    await cancel_and_wait(task)
        finally:
            self._pump_task = task  # keep "started" for __anext__'s check

    def _take(self) -> T | None:
        """The next item (a delta or a typed event) from the current batch, or None once the
        batch is used up or the stream is done (``_assembler.done``). Raises what the
        assembler raises."""
        batch, i = self._batch, self._at
        receive = self._assembler.receive
        while i < len(batch):
            event = batch[i]
            i += 1
            self._at = i  # before receive: an event that raises is not taken twice
            delta = receive(event.seq, event.payload)
            if delta is not None or self._assembler.done:
                return delta
        return None


    async def _step(self) -> None:
        """Take one queue item: a batch (becomes ``_batch``), the response opening, the end or
        an error (resumes, fails over or raises). Sets ``_finished`` at the end."""
        try:
            # Most items are already queued: take them without arming a watchdog timer each.
            item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                async with asyncio.timeout(self._client.idle_timeout_s):
                    item = await self._queue.get()
            except TimeoutError:
                if self._stream_id is None and self._attempt + 1 < len(self._plan):
                    # The region took the request and said nothing for the idle timeout (a
                    # wedged or stopped router, a black-holed path): it is as unreachable as
                    # one refusing connections, so the next region takes the request. Sent
                    # again here instead, it would stall as long again.
                    self._client.regions.failed(self._region_name, time.monotonic())
                    await self._stop_pump()
                    # Its connections may be dead without knowing it: dropped in the
                    # background (closing a WebSocket waits for a goodbye that may not come).
                    self._client._in_background(self._client._target(self._origin).reset())
                    self._attempt += 1
                    self._start(self._fresh_source())
                    return
                if self._stream_id is None and await self._region_answers():
                    # Nothing to resume by, and the region still answers: its router holds
                    # the request (queued, or its upstream slow to answer: a long prefill).
                    # Sent again, the model would run it twice; wait on it instead.
                    try:
                        self._policy.held(last_seq=self._assembler.last_seq)
                    except StreamStalledError:
                        # Given up, and closed: an SSE request gone before its head is
                        # cancelled upstream by the router.
                        self._finished = True
                        await self._stop_pump()
                        raise
                    return
                await self._recover(None, stalled=True)
                return
        if type(item) is list:
            self._batch, self._at = item, 0
            return
        if isinstance(item, Event):
            self._batch, self._at = [item], 0
            return
        if item is _EOF:
            if self._assembler.done:
                self._finished = True
                await self._stop_pump()
                return
            await self._recover(TransportCut("stream ended before its last event"))
            return
        if isinstance(item, BaseException):
            if (
                self._stream_id is None
                and draining_refusal(item)
                and not self._reconnected
                and self._retry.delay(0.0) is not None
            ):
                # The router process behind this connection is shutting down, not its region:
                # the transport retired the connection, and a new one through the region's
                # balancer reaches another of its processes. Sent there at once, as one of
                # the retries; refused again (one process, or all draining), the region is
                # set aside below.
                await self._stop_pump()
                self._start(self._fresh_source(), reconnected=True)
                return
            if self._stream_id is None and isinstance(
                item, ConnectError | RateLimitError | ServiceUnavailableError
            ):
                # A refusal's Retry-After (a 503's as a 429's) sets the region aside for
                # that long; an unreachable region gets the growing backoff.
                retry_after = None if isinstance(item, ConnectError) else item.retry_after
                self._client.regions.failed(self._region_name, time.monotonic(), retry_after)
            if (
                self._stream_id is None
                and isinstance(item, ConnectError | RateLimitError | ServiceUnavailableError)
                and self._attempt + 1 < len(self._plan)
            ):
                # Not started here: the next region may answer. The failed attempt's
                # phases stay in the timings; it is what this request cost.
                await self._stop_pump()
                self._attempt += 1
                self._start(self._fresh_source())
                return
            if self._stream_id is None and isinstance(item, APIError) and (
                item.status in RETRY_STATUSES
            ):
                wait = self._retry.delay(getattr(item, "retry_after", None))
                if wait is not None:
                    # Refused before the stream started (no token to repeat): once the
                    # server's Retry-After has passed, the preferred region again.
                    await self._stop_pump()
                    await asyncio.sleep(wait)
                    self._attempt = 0
                    self._start(self._fresh_source())
                    return
            if isinstance(item, TransportCut | SequenceGapError) or (
                isinstance(item, ConnectError) and self._stream_id is not None
            ):
                await self._recover(item)
                return
            self._finished = True
            if (
                self._stream_id is not None
                and isinstance(item, APIError)
                and item.code == error_codes.STREAM_HISTORY_TRIMMED
            ):
                raise self._trimmed(item) from item
            if (
                self._stream_id is not None
                and isinstance(item, APIError)
                and item.code == error_codes.STREAM_NOT_FOUND
            ):
                # A resume found no such stream (on every transport: a 404 or a WebSocket
                # error carry the same code): the router restarted or dropped it.
                if (
                    self._recorder.record.first_token_ms is None
                    and self._retry.delay(0.0) is not None
                ):
                    await self._resend()  # nothing was delivered: nothing can repeat
                    return
                raise self._lost(
                    f"stream {self._stream_id} is lost (the router no longer has it) after"
                    f" event {self._assembler.last_seq}; resumed"
                    # What Timings.resumes says: a long-poll's retried polls are its resumes,
                    # made inside the transport, which the resume policy does not see.
                    f" {self._recorder.record.resumes} times"
                ) from item
            raise item
        assert isinstance(item, Opened)
        if not self._opened:
            self._client.regions.succeeded(self._region_name)
            self._client._note_hint(self._recorder.record)
        self._opened = True
        if item.stream_id is not None:
            self._stream_id = item.stream_id

    async def _region_answers(self) -> bool:
        """Whether this attempt's region answers a probe now (any HTTP answer), within the
        connect timeout and the idle timeout. Over HTTP/2 and HTTP/3 the probe rides the
        stream's connection (the pooled one, unless prewarmed with several), so an answer
        also says the bytes sent before it, the request's, reached the router."""
        client = self._client
        probe = await probe_region(
            client.pool.session(self._origin, client._probe_http), 1,
            timeout_s=min(client.pool.connect_timeout_s, client.idle_timeout_s))
        return probe.rtt_ms is not None

    async def _resend(self) -> None:
        """The stream's router shut down (``draining``) before any content was delivered: send
        the request again as a new stream, within the retry budget (the region's other
        routers, or the next region, take it; the wasted attempt stays in the timings)."""
        await self._stop_pump()
        self._finished = False
        self._assembler = self._new_assembler()
        self._stream_id = None
        self._batch, self._at = [], 0
        self._start(self._fresh_source())

    def _fail_over_unstarted(self, reason: BaseException | None) -> bool:
        """Whether to send the request to the next region after every resume failed: its
        router cannot be reached (killed, its host gone) and took the stream with it before
        any content, so this is a request that could not start there, as an unreachable
        region's is (nothing was delivered, so nothing repeats). Sets the next attempt up."""
        if not (
            isinstance(reason, ConnectError)
            and self._recorder.record.first_token_ms is None
            and self._attempt + 1 < len(self._plan)
        ):
            return False
        self._client.regions.failed(self._region_name, time.monotonic())
        self._attempt += 1
        client = self._client
        self._policy = ResumePolicy(max_resumes=client.max_resumes,
                                    backoff_s=client.resume_backoff_s,
                                    stall_retries=client.stall_retries,
                                    idle_timeout_s=client.idle_timeout_s)
        return True

    def _trimmed(self, error: APIError) -> StreamHistoryTrimmedError:
        """The error for a resume from before the stream's trim point (on any transport)."""
        # The router's message says why (the key's share of the store, Redis's bound per
        # stream, Redis full): the SDK cannot tell which, so it adds no reason of its own.
        return StreamHistoryTrimmedError(
            f"stream {self._stream_id} cannot be resumed after event"
            f" {self._assembler.last_seq}: the router dropped the events after it; send a new"
            f" request for the rest ({error.message})",
            stream_id=self._stream_id or "",
            last_seq=self._assembler.last_seq,
            delivered_text=self.text,
        )

    def _lost(self, message: str) -> StreamLostError:
        """The error for this stream, lost for good, with what was delivered."""
        return StreamLostError(
            message,
            stream_id=self._stream_id or "",
            last_seq=self._assembler.last_seq,
            delivered_text=self.text,
        )

    async def _recover(self, reason: BaseException | None, *, stalled: bool = False) -> None:
        """Resume after a cut or a stall, or raise when out of attempts (:class:`ResumePolicy`)."""
        client = self._client
        await self._stop_pump()
        try:
            step = self._policy.broken(reason, opened=self._stream_id is not None,
                                       stalled=stalled, last_seq=self._assembler.last_seq)
        except StreamBrokenError as exc:
            if self._fail_over_unstarted(reason):
                await self._resend()
                return
            self._finished = True
            raise exc from reason
        if stalled:
            # A stalled connection may be dead without knowing it: reconnect from scratch.
            with contextlib.suppress(Exception):
                await client._target(self._origin).reset()
        if step.delay_s:
            await asyncio.sleep(step.delay_s)
        if step.resend:
            # Never opened: nothing to resume, send the request again.
            self._start(self._fresh_source())
            return
        self._recorder.feed("resume", time.perf_counter())
        self._start(client._source(None, self._stream_id, self._assembler.last_seq,
                                   self._recorder, self._origin, self._events))


class ChatStream(_Stream[StreamDelta]):
    """One streamed chat completion: iterate for deltas; ``timings``, ``usage``, ``text`` after."""

    _assembler: StreamAssembler

    def _new_assembler(self) -> StreamAssembler:
        return StreamAssembler()

    @property
    def usage(self) -> Usage | None:
        """Token usage from the final chunk (``None`` until the stream has ended)."""
        return self._assembler.usage

    def _deliver(self, delta: StreamDelta) -> StreamDelta:
        """Record the delta's timing (one clock read per content chunk: TTFT and ITL are
        defined per content chunk) and its text, then hand it over."""
        if delta.text or delta.tool_calls:  # StreamDelta.is_content, without the call
            recorder, callback = self._recorder, self._on_first_token
            first = callback is not None and recorder.record.first_token_ms is None
            recorder.feed("token", time.perf_counter())
            if first and callback is not None:
                callback(delta)
                recorder.feed("render", time.perf_counter())
        self._parts.append(delta.text)
        return delta


class EventStream(_Stream[E]):
    """One stream of a typed format (completions, Responses, Messages): iterate for its
    events, typed by :mod:`firstbyte.protocol.events` (every event the upstream sent, once, in
    order, across resumes); ``timings``, ``usage``, ``text`` after.

    ``text`` is the output text so far; ``usage`` the tokens the stream reported
    (:class:`~firstbyte.protocol.codec.Usage`, the same for every format); ``last_event`` the
    last event (the terminal one once the stream has ended)."""

    _assembler: EventAssembler[E]

    def __init__(
        self,
        client: AsyncClient,
        events: EventFormat[E],
        body: bytes,
        on_first_token: Callable[[E], object] | None,
    ) -> None:
        self._events = events
        super().__init__(client, body, on_first_token)

    def _new_assembler(self) -> EventAssembler[E]:
        assert self._events is not None
        return EventAssembler(self._events)

    @property
    def usage(self) -> codec.Usage | None:
        """Tokens used, as the stream said them (``None`` until it said them)."""
        return self._assembler.usage

    @property
    def last_event(self) -> E | None:
        return self._assembler.last

    def _deliver(self, event: E) -> E:
        events = self._assembler.events
        if events.is_content(event):
            recorder, callback = self._recorder, self._on_first_token
            first = callback is not None and recorder.record.first_token_ms is None
            recorder.feed("token", time.perf_counter())
            if first and callback is not None:
                callback(event)
                recorder.feed("render", time.perf_counter())
        text = events.text(event)
        if text:
            self._parts.append(text)
        return event


CompletionStream = EventStream[CompletionChunk]
"""``client.completions.stream(...)``: :class:`~firstbyte.protocol.events.CompletionChunk`s."""
ResponseStream = EventStream[ResponseEvent]
"""``client.responses.stream(...)``: :class:`~firstbyte.protocol.events.ResponseEvent`s."""
MessageStream = EventStream[MessageEvent]
"""``client.messages.stream(...)``: :class:`~firstbyte.protocol.events.MessageEvent`s."""
