"""SSE transport: ``POST /v1/chat/completions`` (stream; or another format's path) and resume
by ``GET /v1/streams/{id}``.

Runs over any :class:`~firstbyte.client_sdk.transports.base.Session` (httpx for HTTP/1.1 and 2,
aioquic for HTTP/3); the bytes go through the protocol's sans-IO
:class:`~firstbyte.protocol.sse.SSEDecoder`.
Each network read's events go to the client as one :data:`~.base.Batch`; heartbeat comments
never become events and a read of heartbeats alone yields nothing, so the client's idle
watchdog ignores them.
"""

from __future__ import annotations

from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import StreamBrokenError
from firstbyte.client_sdk.transports.base import Event, Opened, Session, Source, error_answer
from firstbyte.protocol import paths
from firstbyte.protocol.content_coding import CONTENT_ENCODING_HEADER
from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.sse import DONE, SSEDecoder, SSEProtocolError

__all__ = ["sse_source"]


async def sse_source(
    session: Session,
    prefix: str,
    headers: dict[str, str],
    *,
    body: bytes | None,
    stream_id: str | None,
    after: int,
    recorder: TimingRecorder | None,
    path: str = paths.CHAT_COMPLETIONS,
    ends: frozenset[str] = frozenset(),
    content_encoding: str | None = None,
) -> Source:
    """Start a stream (``stream_id`` None, ``body`` the request for ``path``, in
    ``content_encoding`` if not None) or resume one after ``after``. ``ends`` names the events
    that end a stream of a format whose events carry names (Responses, Messages: no
    ``[DONE]`` follows them)."""
    if stream_id is None:
        method, path = "POST", paths.at_base(path, prefix)
        req_headers = {**headers, "content-type": "application/json",
                       "accept": "text/event-stream"}
        if content_encoding is not None:
            req_headers[CONTENT_ENCODING_HEADER] = content_encoding
    else:
        method, path = "GET", paths.at_base(paths.stream(stream_id), prefix)
        req_headers = {**headers, "accept": "text/event-stream", "last-event-id": str(after)}
        body = None
    async with session.request(method, path, headers=req_headers, body=body,
                               recorder=recorder) as response:
        if response.status != 200:
            raise await error_answer(response)  # a 503 draining retires the connection
        ctype = response.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            raise StreamBrokenError(f"expected an event stream, got content-type {ctype!r}")
        yield Opened(response.headers.get(STREAM_HEADER) or stream_id)
        decoder = SSEDecoder()
        previous: str | None = None
        async for chunk in response.chunks:
            try:
                events = decoder.receive_data(chunk)
            except SSEProtocolError as exc:
                raise StreamBrokenError(str(exc)) from None
            if events:
                if events[-1].data == DONE or (ends and events[-1].event in ends):
                    # The consumer stops at [DONE]: read the body's end first, so the
                    # connection is pooled rather than closed under the next request.
                    await response.finish()
                batch = []
                for e in events:
                    # An event keeps the last id seen when it has no ``id:`` line of its own
                    # (the SSE spec), and the router numbers each of its events once: the
                    # same id again is an event outside the stream's sequence (an error the
                    # router adds, such as stream_history_trimmed), not a replay to drop.
                    batch.append(Event(None if e.id == previous else _seq(e.id), e.data))
                    previous = e.id
                yield batch


def _seq(event_id: str | None) -> int | None:
    """The router's sequence number from an event's ``id`` (None: not a plain number)."""
    return int(event_id) if event_id is not None and event_id.isascii() and event_id.isdigit() \
        else None
