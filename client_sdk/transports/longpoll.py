"""Long-poll transport: ``POST /v1/streams?wait=S``, then ``GET /v1/streams/{id}/poll?after=N``
(``&wait=S``) until done.

The POST carries ``wait``, so the router answers it with the stream's first batch of events (not
just the stream id): the first token costs one round trip, like SSE. A router that answers the
bare ``{"stream": ID}`` (``wait`` unsupported or 0) still works; the first poll fetches them.

For networks where a held-open response is buffered or cut by a proxy. The cursor logic
(position, duplicates, backoff, give-up) is the sans-IO
:class:`~firstbyte.client_sdk._core.longpoll.PollCursor`; this module only sends the polls it asks
for and sleeps until it says so. A failed poll is retried from the same cursor, so nothing
is lost or repeated.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from firstbyte.client_sdk._core.longpoll import PollCursor, decode_batch
from firstbyte.client_sdk._core.timing import TimingRecorder
from firstbyte.client_sdk.errors import ConnectError, StreamBrokenError, api_error_from_response
from firstbyte.client_sdk.transports.base import (
    Event,
    Opened,
    Session,
    Source,
    TransportCut,
    error_answer,
)
from firstbyte.protocol import paths
from firstbyte.protocol.content_coding import CONTENT_ENCODING_HEADER
from firstbyte.protocol.poll import PollBatch, StreamStarted
from firstbyte.protocol.sse import DONE

__all__ = ["longpoll_source", "start_stream"]

_started = msgspec.json.Decoder(StreamStarted)


async def start_stream(
    session: Session, prefix: str, headers: dict[str, str], body: bytes,
    recorder: TimingRecorder | None, *, wait_s: float = 0.0, endpoint: str | None = None,
) -> tuple[str, PollBatch | None]:
    """``POST /v1/streams?wait=S``: the router admits the request and answers with the stream
    id and, when ``wait_s`` > 0 and the router supports it, the stream's first batch (else
    ``None``: the first poll fetches it). ``endpoint`` names the request's format
    (``completions``, ``responses``, ``messages``; None: chat)."""
    params = [f"wait={wait_s:g}"] if wait_s > 0 else []
    if endpoint is not None:
        params.append(f"endpoint={endpoint}")
    query = "?" + "&".join(params) if params else ""
    async with session.request(
        "POST", paths.at_base(paths.STREAMS, prefix) + query,
        headers={**headers, "content-type": "application/json"}, body=body, recorder=recorder,
    ) as response:
        if response.status not in (200, 201):
            raise await error_answer(response)  # a 503 draining retires the connection
        raw = await response.read()
    try:
        started = _started.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StreamBrokenError(f"invalid POST /v1/streams answer: {exc}") from None
    return started.stream, started.batch()


def _retry(cursor: PollCursor, recorder: TimingRecorder | None, reason: str) -> None:
    """A failed poll: the next one is this transport's resume (from the same event on), so it
    counts in ``Timings.resumes`` and within ``max_resumes``, as an SSE or WebSocket resume."""
    cursor.receive_failure(time.monotonic(), reason)
    if recorder is not None:
        recorder.feed("resume", time.perf_counter())


async def longpoll_source(
    session: Session,
    prefix: str,
    headers: dict[str, str],
    *,
    body: bytes | None,
    stream_id: str | None,
    after: int,
    recorder: TimingRecorder | None,
    wait_s: float = 10.0,
    max_failures: int = 5,
    endpoint: str | None = None,
    content_encoding: str | None = None,
) -> Source:
    """Start a stream (``stream_id`` None) or continue one after ``after``, by polling.

    A new stream's first batch comes in the POST's answer; polls continue from its ``next``.
    ``content_encoding`` is the coding ``body`` is in (None: as it is).
    """
    first: PollBatch | None = None
    if stream_id is None:
        if body is None:
            raise ValueError("a new long-poll stream needs a request body")
        start_headers = headers if content_encoding is None else {
            **headers, CONTENT_ENCODING_HEADER: content_encoding}
        stream_id, first = await start_stream(session, prefix, start_headers, body, recorder,
                                              wait_s=wait_s, endpoint=endpoint)
    if recorder is not None:
        recorder.record.stream_id = stream_id
    yield Opened(stream_id)
    cursor = PollCursor(stream_id, after=after, wait_s=wait_s, max_failures=max_failures)
    if first is not None and (events := cursor.receive_batch(first, time.monotonic())):
        yield [Event(event.seq, bytes(event.data)) for event in events]
    while (poll := cursor.next_poll(time.monotonic())) is not None:
        delay = poll.not_before - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        query = "&".join(f"{k}={v}" for k, v in poll.params.items())
        try:
            async with session.request("GET", f"{prefix}{poll.path}?{query}", headers=headers,
                                       body=None, recorder=None) as response:
                raw = await response.read()
                status = response.status
                retry_after = response.headers.get("retry-after")
        except (TransportCut, ConnectError) as exc:
            _retry(cursor, recorder, f"poll failed: {exc}")
            continue
        if status in (429, 502, 503, 504):
            _retry(cursor, recorder, f"poll answered {status}")
            continue
        if status != 200:
            raise api_error_from_response(status, raw, retry_after=retry_after)
        if events := cursor.receive_batch(decode_batch(raw), time.monotonic()):
            yield [Event(event.seq, bytes(event.data)) for event in events]  # one queue item
    yield Event(None, DONE)
