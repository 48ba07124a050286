"""The request-head bounds of :mod:`.heads`, enforced by each server before it buffers a head.

- uvicorn's httptools protocol (``auto`` and ``uvicorn``, HTTP/1.1): the subclass of
  :mod:`.uvicorn_limits` passes every piece of a head to a :class:`~.heads.HeadScanner`
  before the parser sees it. httptools keeps a header line it has not seen the end of,
  appending each new piece (quadratic in the line's length), and has no bound: a 64 MiB
  line was 64 MiB of memory and seconds of CPU.
- hypercorn's h11 (``hypercorn``, HTTP/1.1): the same scanner in front of h11, whose own
  bound (``h11_max_incomplete_size``) answers a plain 400 for any kind of excess.
- HTTP/2 and HTTP/3 (hypercorn): the decoded head is checked before the stream's app starts
  (:func:`~.heads.check_fields`). What a decoder may hold is bounded before that by the
  protocol: HTTP/2 by ``SETTINGS_MAX_HEADER_LIST_SIZE`` (:func:`h2_header_list_size`,
  advertised and enforced by the HPACK decoder; a client that ignores it gets GOAWAY
  ``ENHANCE_YOUR_CALM``) and h2's own limit of 64 CONTINUATION frames; HTTP/3 only by QUIC's
  flow control on the request stream (aioquic buffers a HEADERS frame whole, and pylsqpack
  has no header-list bound): at most aioquic's windows, 1 MiB a stream and 1 MiB a
  connection.

A refused head gets 414 or 431 with an OpenAI-style error body and ``connection: close``;
on HTTP/1.1 what the client still sends is read and dropped for :data:`.hardening.LINGER_S`
(so the kernel does not reset the connection under the answer), then the connection closes;
on HTTP/2 and HTTP/3 only the stream ends. Each refusal is one throttled log line.
HTTP/2 and HTTP/3 refusals, written with the head decoded, carry the CORS headers of its
origin (:mod:`.refusal_cors`); an HTTP/1.1 one, refused before its head's end, carries none.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .hardening import LINGER_S, report
from .heads import (
    HeadLimits,
    HeadRefusal,
    HeadScanner,
    check_fields,
    max_head_bytes,
    refusal_body,
    refusal_h1,
)
from .refusal_cors import cors_fields

__all__ = [
    "bound_decoded_heads",
    "bound_h11_heads",
    "h2_header_list_size",
    "h11_incomplete_size",
]

_HPACK_FIELD_OVERHEAD = 32
"""What HPACK (and QPACK) add to each field's name and value when sizing a header list."""
_PSEUDO_HEADERS = 5
"""``:method``, ``:scheme``, ``:authority``, ``:path``, ``:protocol``."""


def h2_header_list_size(limits: HeadLimits) -> int:
    """``SETTINGS_MAX_HEADER_LIST_SIZE`` for ``limits``: a head within them fits, with room
    for the pseudo-headers; a bigger one is still decoded (up to this) and answered 431."""
    fields = limits.max_headers + _PSEUDO_HEADERS
    return limits.max_header_bytes + limits.max_request_line_bytes + 256 + (
        _HPACK_FIELD_OVERHEAD * fields
    )


def h11_incomplete_size(limits: HeadLimits) -> int:
    """h11's ``max_incomplete_event_size`` for ``limits``: above any head the scanner lets
    through, so the scanner answers first."""
    return max_head_bytes(limits) + 4096


def _log(refusal: HeadRefusal, client: object) -> None:
    report(logging.INFO, f"request head refused: {refusal.status}", client, refusal.reason)


def _heads(config: Any) -> HeadLimits | None:
    limits = getattr(config, "firstbyte_limits", None)
    heads: HeadLimits | None = getattr(limits, "heads", None)
    return heads


def bound_h11_heads() -> None:
    """Scan each HTTP/1.1 head in front of hypercorn's h11 (a patch of ``H11Protocol``'s
    ``handle`` and ``_create_stream``, applied by :mod:`.patches`)."""
    import h11
    from hypercorn.events import Closed, RawData
    from hypercorn.protocol.h11 import H11Protocol

    handle = H11Protocol.handle
    create_stream = H11Protocol._create_stream

    async def bounded(self: Any, event: Any) -> None:
        heads = _heads(self.config)
        if (
            heads is not None
            and isinstance(event, RawData)
            and isinstance(self.connection, h11.Connection)  # not a WebSocket's
        ):
            if getattr(self, "_firstbyte_head_refused", False):
                return  # answered: dropped until the connection closes
            if self.stream is None:
                scan: HeadScanner | None = getattr(self, "_firstbyte_head_scan", None)
                refusal = None
                if scan is None:
                    scan = self._firstbyte_head_scan = HeadScanner(heads)
                    # What h11 holds past the last request is the start of this head: a
                    # pipelined one that came in the read that ended the request before.
                    refusal = scan.feed(self.connection.trailing_data[0])
                refusal = refusal or scan.feed(event.data)
                if refusal is not None:
                    await _refuse(self, refusal)
                    return
        await handle(self, event)

    async def scanned(self: Any, request: Any) -> None:
        self._firstbyte_head_scan = None  # the next head gets a new scanner
        await create_stream(self, request)

    async def _refuse(self: Any, refusal: HeadRefusal) -> None:
        from .hardening import _stop_head_timer

        self._firstbyte_head_refused = True
        _stop_head_timer(self)
        _log(refusal, self.client[0] if self.client else "?")
        await self.send(RawData(data=refusal_h1(refusal)))

        async def close_later() -> None:
            await asyncio.sleep(LINGER_S)
            await self.send(Closed())

        self.task_group.spawn(close_later)

    H11Protocol.handle = bounded  # type: ignore[method-assign]
    H11Protocol._create_stream = scanned  # type: ignore[method-assign]


def bound_decoded_heads() -> None:
    """Answer an HTTP/2 or HTTP/3 request whose decoded head is over the bounds 414 or 431
    before its app starts (a patch of hypercorn's ``HTTPStream.handle``)."""
    from hypercorn.protocol.events import Body, EndBody, Request, Response, StreamClosed
    from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

    handle = HTTPStream.handle

    async def bounded(self: Any, event: Any) -> None:
        if getattr(self, "_firstbyte_head_refused", False):
            if isinstance(event, StreamClosed):
                await handle(self, event)
            return  # a body sent after the refusal: dropped (the stream has no app)
        heads = _heads(self.config)
        if heads is not None and isinstance(event, Request) and event.http_version in ("2", "3"):
            refusal = check_fields(event.raw_path, event.headers, heads)
            if refusal is not None:
                self._firstbyte_head_refused = True
                self.state = ASGIHTTPState.CLOSED
                self.app_put = None  # no app: set only once one starts
                _log(refusal, self.client[0] if self.client else "?")
                cors = cors_fields(getattr(self.config, "firstbyte_refusal_cors", None),
                                   event.headers)
                # Answered from a task, as an app would: sending waits for the client's flow
                # control window, and the connection's reader must not wait with it.
                self.task_group.spawn(_answer, self, refusal, cors)
                return
        await handle(self, event)

    async def _answer(self: Any, refusal: HeadRefusal, cors: list[tuple[bytes, bytes]]) -> None:
        body = refusal_body(refusal)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                   *cors]
        await self.send(Response(stream_id=self.stream_id, status_code=refusal.status,
                                 headers=headers))
        await self.send(Body(stream_id=self.stream_id, data=body))
        await self.send(EndBody(stream_id=self.stream_id))
        await self.send(StreamClosed(stream_id=self.stream_id))

    HTTPStream.handle = bounded  # type: ignore[method-assign]
