"""The relay's per-chunk path, compiled where it could be built (``router/_chunkpath.c``).

For every token a caught-up stream relays, the compiled path does in C what the Python path
does in ~400 bytecodes: it cuts an upstream read of whole HTTP/1.1 chunks of whole ``data:``
events (:class:`ReadPath`, in place of httptools' parse, the producer's
``on_body``/``on_read_end`` and :meth:`~firstbyte.router.pipeline.relay.Relay.feed`), hands
the events to the store (:meth:`~firstbyte.router.streams.Stream.add`'s work, in C where it
neither trims nor reclaims) and the inter-token metric
(:class:`~firstbyte.router.hosting.prometheus.GapTimer`), and writes a direct SSE reader's
frame on uvicorn's transport (:class:`SSEWriter`); a reader's batch from the store (the
events a stream had before its reader came, its ``[DONE]``) is framed in one call too
(:data:`SSE_FRAMES`, in :meth:`~firstbyte.router.readers.SSEFramer.frame`), and the events
the producer appends itself (a stream's first events, its first content) are stored as the
reads it takes (:data:`STREAM_ADDER`, in :meth:`~firstbyte.router.streams.Stream.add` and
:meth:`~firstbyte.router.streams.Stream.append`). The objects it reads per chunk keep their
fields in ``__slots__`` (the stream, its store and owner, the relay and its framer, the
connection, the reader's tap and framer, the timer and histogram); the C reads and writes
those at the slots' offsets, as CPython's specialized ``LOAD_ATTR_SLOT`` does, and any other
object through ``getattr``. A read of whole chunks of one-line ``data:`` events that is not
such a read (the first content, the usage chunk, ``[DONE]``, the body's end) is cut in C and
its events handed to the producer's ``on_events``: the relay's Python path from its framer
on, without httptools' callbacks, the read's join and the framer. Any other read (a partial
chunk, another shape of event, a named event), and a reader that fell behind, go the Python
way, which stays the one definition of what a read means; the compiled path gives the same
store, bytes and counters (``tests/router/test_chunkpath.py``).

An upstream connection's ``data_received`` is compiled too (:data:`CONN_READER`): a read
goes to the connection's taker (a :class:`ReadPath`) without a Python call in between, and
to the connection's Python ``_data_received`` where there is none or it leaves the read.

With shared state it also queues each event for the Redis writer (:data:`MIRROR`, in place
of :meth:`~firstbyte.router.shared.streams._Writer.push`) and packs the writer's operation
for each plain event (:data:`PACK_XADDS`, in place of
:meth:`~firstbyte.router.shared.streams._Writer._pack`'s loop for that event; the loop packs
everything else).

Three functions of it run once a request, not a chunk, where a Python loop over the headers
cost ~7-16k instructions each: :data:`RENDER_HEAD` (a response head as uvicorn's HTTP/1.1
writes it: :mod:`.hosting.uvicorn_send`), :data:`ENCODE_HEADERS` and :data:`DECODE_HEADERS`
(a response's headers in bytes, a request's by their names: :mod:`.asgi`). Each takes only
the common case (names already known, exact types) and says None for any other, which the
Python function it stands in for then does. A fourth, :data:`RECEIVE_NOW`, is
:func:`.asgi.receive_now` whole (a request's ``receive()`` begun, its body taken without a
StopIteration made and caught). :data:`ELAPSED_MS` is an access line's times in
milliseconds rounded to hundredths (:func:`.observability.access.hundredths`'s shortcut,
twice a request, without its Python frame), None where the Python must do it, and
:data:`HUNDREDTHS_TEXT` a ``Server-Timing`` duration's text (``format(ms, ".2f")``, three a
streamed request, in :meth:`.pipeline.context.RequestContext.server_timing`) without a
decimal conversion.

``pip install`` builds it (setuptools, the machine's C compiler); where it was not built,
``READ_PATH``, ``CONN_READER``, ``SSE_WRITER``, ``SSE_FRAMES``, ``STREAM_ADDER``, ``MIRROR``,
``PACK_XADDS`` and the six above are None and the Python path runs alone, as it does with
``FIRSTBYTE_CHUNKPATH=python`` in the environment (to compare the two).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "BUILT",
    "CONN_READER",
    "DECODE_HEADERS",
    "ELAPSED_MS",
    "ENCODE_HEADERS",
    "HUNDREDTHS_TEXT",
    "MIRROR",
    "PACK_XADDS",
    "READ_PATH",
    "RECEIVE_NOW",
    "RENDER_HEAD",
    "SSE_FRAMES",
    "SSE_WRITER",
    "STREAM_ADDER",
]

READ_PATH: Any = None
CONN_READER: Any = None
SSE_WRITER: Any = None
SSE_FRAMES: Any = None
STREAM_ADDER: Any = None
PACK_XADDS: Any = None
MIRROR: Any = None
RENDER_HEAD: Any = None
ENCODE_HEADERS: Any = None
DECODE_HEADERS: Any = None
RECEIVE_NOW: Any = None
ELAPSED_MS: Any = None
HUNDREDTHS_TEXT: Any = None
BUILT = False
"""The compiled module imported (whether or not the environment turned it off)."""

try:
    from . import _chunkpath  # type: ignore[attr-defined]
except ImportError:  # not built: the Python path
    pass
else:
    BUILT = True
    if os.environ.get("FIRSTBYTE_CHUNKPATH", "") != "python":
        READ_PATH = _chunkpath.ReadPath
        CONN_READER = _chunkpath.ConnReader
        SSE_WRITER = _chunkpath.SSEWriter
        SSE_FRAMES = _chunkpath.sse_frames
        STREAM_ADDER = _chunkpath.StreamAdder
        PACK_XADDS = _chunkpath.pack_xadds
        MIRROR = _chunkpath.Mirror
        RENDER_HEAD = _chunkpath.render_head
        ENCODE_HEADERS = _chunkpath.encode_headers
        DECODE_HEADERS = _chunkpath.decode_headers
        RECEIVE_NOW = _chunkpath.receive_now
        ELAPSED_MS = _chunkpath.elapsed_ms
        HUNDREDTHS_TEXT = _chunkpath.hundredths_text
