"""What every transport hands the client: a source of stream items, and the HTTP session shape.

A *source* is an async iterator of :class:`Opened` (once, when the server accepted the request
and the stream id is known) followed by the router's numbered events: each an :class:`Event`, or
a :data:`Batch` of them (events that arrived together, e.g. in one network read: one queue item
for the lot is what lets the client keep up with hundreds of thousands of events a second). It
raises :class:`TransportCut` when the connection broke mid-stream (the client resumes), an
:class:`~firstbyte.client_sdk.errors.APIError` for an error answer, and
:class:`~firstbyte.client_sdk.errors.ConnectError` when the server could not be reached.

A *session* is one origin's HTTP connections for one HTTP version (httpx for 1.1 and 2,
aioquic for 3); SSE and long-poll run over any session.

A ``503`` ``draining`` answer (:func:`draining_refusal`; ``/healthz``'s plain ``draining``) is
about the router process behind one connection, not about its region: behind a balancer a new
connection reaches another of the region's processes. So the transport that reads one retires
the connection it came on (:meth:`HTTPResponse.retire_connection`; a WebSocket's is closed)
before it raises, and the next request to that origin opens a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from firstbyte.client_sdk._core.retry import RETRY_STATUSES
from firstbyte.client_sdk._core.timing import TimingRecorder, parse_server_timing
from firstbyte.client_sdk.errors import (
    APIError,
    StreamBrokenError,
    api_error_from_response,
    retry_after_s,
)
from firstbyte.client_sdk.resolver import Origin
from firstbyte.protocol import error_codes
from firstbyte.protocol.content_coding import ACCEPT_ENCODING_HEADER
from firstbyte.protocol.headers import (
    BETTER_REGION_HEADER,
    BETTER_REGION_URL_HEADER,
    REGION_HEADER,
    STREAM_HEADER,
)

__all__ = ["MAX_BODY_BYTES", "Batch", "Event", "HTTPResponse", "Item", "Opened", "Refusal",
           "Session", "Source", "TransportCut", "draining_refusal", "error_answer",
           "note_response_headers", "noted_accept_encoding", "refusal"]

MAX_BODY_BYTES = 64 << 20
"""The most :meth:`HTTPResponse.read` holds: a long-poll batch of a long completion fits,
a server that never stops sending does not take the client's memory."""


class TransportCut(StreamBrokenError):
    """The connection broke after the request was sent; the stream may be resumable."""


@dataclass(frozen=True, slots=True)
class Opened:
    stream_id: str | None


@dataclass(frozen=True, slots=True)
class Refusal:
    """A keep-warm's or a prewarm's ``GET /healthz`` was answered ``429`` or ``503`` (the router is
    draining, its shared state is away, it has no healthy backend, ...): its requests would
    be refused too. ``retry_after_s``: the answer's ``Retry-After`` (None: none).
    ``draining``: a ``503`` ``draining`` (the router process behind that connection is shutting
    down; a new connection through the region's balancer may reach another)."""

    status: int
    retry_after_s: float | None = None
    draining: bool = False


def refusal(response: HTTPResponse, body: bytes) -> Refusal | None:
    """The :class:`Refusal` a ``/healthz`` answer (``body`` read) is, if it is one."""
    if response.status not in RETRY_STATUSES:
        return None
    return Refusal(response.status, retry_after_s(response.headers.get("retry-after")),
                   draining=response.status == 503
                   and body.strip() == error_codes.DRAINING.encode())


def draining_refusal(error: object) -> bool:
    """Whether ``error`` is a request's ``503`` ``draining``: the router process that answered
    takes no new work, though its region's other processes may (a WebSocket ``error`` message
    carries the status too)."""
    return (isinstance(error, APIError) and error.status == 503
            and error.code == error_codes.DRAINING)


async def error_answer(response: HTTPResponse) -> APIError:
    """The error an answer other than a success is, its body read. A ``503`` ``draining``
    retires the connection it came on (see the module docstring)."""
    error = api_error_from_response(response.status, await response.read(),
                                    retry_after=response.headers.get("retry-after"))
    if draining_refusal(error):
        response.retire_connection()
    return error


class Event(msgspec.Struct, frozen=True, gc=False):
    """One stream event: its sequence number (None if the server does not number events) and
    payload (a chunk's JSON, an error's JSON or ``[DONE]``). A Struct: one is built per event."""

    seq: int | None
    payload: str | bytes | dict[str, Any]


Batch = list[Event]
"""Events in order, never empty; the source does not touch the list once it has yielded it."""

Item = Opened | Event | Batch
Source = AsyncIterator[Item]


@dataclass
class HTTPResponse:
    """A response whose body is read incrementally from ``chunks``."""

    status: int
    headers: dict[str, str]
    http_version: str
    chunks: AsyncIterator[bytes]
    extra: dict[str, Any] = field(default_factory=dict)
    on_retire: Callable[[], None] | None = None
    """Set by the session: takes the connection this answer came on out of use."""

    def retire_connection(self) -> None:
        """Give the connection this answer came on no new request (its router process is
        draining): the session's next request opens a new connection, and this one closes
        once its requests in flight (a stream of another request, this answer) end."""
        if self.on_retire is not None:
            self.on_retire()

    async def finish(self, budget_s: float = 0.1, max_bytes: int = 64 << 10) -> None:
        """Read what is left of the body (the stream's end has been seen), within
        ``budget_s`` and ``max_bytes``: a connection whose response was read to its end goes
        back to the pool, one closed before its last bytes (HTTP/1.1's final chunk, HTTP/2's
        END_STREAM) pays a new handshake on the next request. Failing only costs the reuse."""

        async def rest() -> None:
            left = max_bytes
            async for chunk in self.chunks:
                left -= len(chunk)
                if left < 0:
                    return

        with contextlib.suppress(TimeoutError, TransportCut, OSError):
            async with asyncio.timeout(budget_s):
                await rest()

    async def read(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body; :class:`~firstbyte.client_sdk.errors.StreamBrokenError` (not resumed)
        once it passes ``limit`` bytes, without reading further."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks:
            size += len(chunk)
            if size > limit:
                raise StreamBrokenError(f"response body larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)


class Session(Protocol):
    """HTTP requests to one origin over one HTTP version, with kept-warm connections."""

    origin: Origin
    http_version: str
    accept_encoding: str | None
    """The last ``Accept-Encoding`` an answer on this session carried: the request codings
    the server takes (None: no answer said)."""
    rtt_s: float | None
    """The smallest round trip measured on this session's connections (a TCP connect; QUIC's
    own RTT estimate), in seconds; None: none opened or measured yet."""

    def request(
        self,
        method: str,
        path: str,
        *,
        headers: dict[str, str],
        body: bytes | None,
        recorder: TimingRecorder | None,
    ) -> AbstractAsyncContextManager[HTTPResponse]:
        """Send a request; the response is open inside the context.

        Connection failures before the response raise ConnectError (or TLSError); failures
        while reading the body raise :class:`TransportCut`.
        """
        ...

    async def prewarm(self, connections: int) -> Refusal | None:
        """Open ``connections`` connections now (idempotent: counts ones already open); the
        :class:`Refusal` an answer on them was, if one (as :meth:`keepalive`)."""
        ...

    async def keepalive(self) -> Refusal | None:
        """Exercise every idle connection once so neither end's idle timer closes it; the
        :class:`Refusal` one of the pings' answers was (None: none was)."""
        ...

    async def reset(self) -> None:
        """Drop the open connections (after a stall they may be dead without knowing it)."""
        ...

    async def aclose(self) -> None: ...


def noted_accept_encoding(session: Session, response: HTTPResponse) -> None:
    """Keep the ``Accept-Encoding`` of an answer on ``session`` (the last one wins: a server
    that stops taking a coding says so on its next answer)."""
    value = response.headers.get(ACCEPT_ENCODING_HEADER)
    if value is not None:
        session.accept_encoding = value


def note_response_headers(recorder: TimingRecorder | None, response: HTTPResponse) -> None:
    """Copy what the router tells us in headers (region, stream id, Server-Timing) to Timings."""
    if recorder is None:
        return
    rec = recorder.record
    rec.http_version = response.http_version
    region = response.headers.get(REGION_HEADER)
    if region is not None:
        rec.region = region
    better = response.headers.get(BETTER_REGION_HEADER)
    if better is not None:
        rec.better_region = better
        rec.better_region_url = response.headers.get(BETTER_REGION_URL_HEADER)
    sid = response.headers.get(STREAM_HEADER)
    if sid is not None:
        rec.stream_id = sid
    timing = response.headers.get("server-timing")
    if timing and not rec.server_timing:
        rec.server_timing = parse_server_timing(timing)
