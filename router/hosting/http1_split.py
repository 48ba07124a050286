"""One listening port, each HTTP version on the server that costs the least CPU for it: HTTP/2
and HTTP/3 on hypercorn, HTTP/1.1 (and WebSockets upgraded from it) on uvicorn's httptools
protocol. This is ``listen.server = "auto"``.

hypercorn accepts every connection and, over TLS, completes the handshake (with its timeout)
and the ALPN choice. :func:`split_http1` makes its per-connection server look at that choice:

- ``h2`` stays with hypercorn;
- anything else over TLS (``http/1.1``, or no ALPN) is handed to a uvicorn protocol object
  at once: the socket's protocol is swapped, and whatever hypercorn's stream reader had
  already buffered is passed on first, so no byte is lost or reordered;
- without TLS, the first bytes decide: the HTTP/2 connection preface (h2c prior knowledge)
  stays with hypercorn, any other request goes to uvicorn with those bytes. A connection
  that sends nothing is closed after the keep-alive timeout.

Every connection counts for its client from its accept (:mod:`.accept`), before the TLS
handshake; one refused there is answered (503 after its request's head) by
:func:`.accept.answer_refused` and never reaches either server.

A handed-over connection stays a task of hypercorn's server, so a drain waits for it: when
hypercorn stops accepting, uvicorn's own ``shutdown()`` closes it if idle, or after the
response in flight; at the end of the graceful timeout it is aborted. The uvicorn side runs
with :mod:`.uvicorn_limits`, so both halves enforce the same client limits; uvicorn's
``Upgrade: h2c`` is not honoured (a server may ignore it, RFC 9110 section 7.8).

Why: per request and per streamed chunk hypercorn's HTTP/1.1 (h11) costs several times
uvicorn's (``docs/router.md``, "What it costs"), and most clients of an OpenAI-compatible API
(the ``openai`` SDK, curl without ``--http2``, browsers' ``EventSource`` over HTTP/1.1) speak
HTTP/1.1; uvicorn has no HTTP/2 or HTTP/3.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any

from .accept import H2_PREFACE, Admission, answer_refused
from .limits import ConnectionCounter

__all__ = ["H2_PREFACE", "Http1Handoff", "split_http1"]

@dataclass
class Http1Handoff:
    """Where hypercorn hands HTTP/1.1 connections: a loaded uvicorn ``Config`` (its ``http``
    and ``ws`` protocols those of :func:`.uvicorn_limits.guarded_protocols`) and the
    connection counter both servers share."""

    config: Any
    """``uvicorn.Config``, loaded, without TLS (hypercorn did the handshake)."""
    counter: ConnectionCounter
    state: Any = field(init=False)
    """uvicorn's ``ServerState``: its connections (for ``shutdown()``), tasks and the
    ``Date`` header every response carries."""
    _clock: asyncio.TimerHandle | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        from uvicorn.server import ServerState

        self.state = ServerState()

    def start(self) -> None:
        """Keep the ``Date`` header current, ahead of the config's own headers (``Alt-Svc``):
        uvicorn's server loop does this once a second; here there is no uvicorn server."""
        date = formatdate(usegmt=True).encode()
        self.state.default_headers = [(b"date", date), *self.config.encoded_headers]
        self._clock = asyncio.get_running_loop().call_later(1.0, self.start)

    def stop(self) -> None:
        if self._clock is not None:
            self._clock.cancel()
            self._clock = None

    async def serve(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        terminated: Any,
        app_state: dict[str, Any],
        first: bytes = b"",
        admission: Admission | None = None,
    ) -> None:
        """Serve the connection behind ``reader``/``writer`` with uvicorn until it closes:
        ``first`` (bytes already read from it) and what ``reader`` holds are its first
        input. ``terminated`` is hypercorn's drain event: uvicorn's ``shutdown()`` then.
        ``admission``: the connection's count, taken at its accept, which uvicorn's protocol
        then holds (without one, the protocol counts the connection itself)."""
        transport: Any = writer.transport
        if transport.is_closing():  # lost before the hand-over: hypercorn's reader saw it
            return
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        protocol = self.config.http_protocol_class(
            config=self.config, server_state=self.state, app_state=app_state, _loop=loop
        )
        protocol.ended = ended
        protocol.admission = admission
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        # From here the socket feeds uvicorn. What hypercorn's reader already held comes
        # first: with EOF fed, read() returns it without waiting, so nothing runs between.
        reader.feed_eof()
        with contextlib.suppress(ConnectionError, OSError):  # an error it held: none left
            first += await reader.read()
        if first and not transport.is_closing():
            protocol.data_received(first)
        drain = asyncio.ensure_future(terminated.wait())
        try:
            await asyncio.wait({ended, drain}, return_when=asyncio.FIRST_COMPLETED)
            if not ended.done():
                transport.get_protocol().shutdown()  # HTTP, or the WebSocket it became
                await ended
        finally:
            drain.cancel()
            if not ended.done():  # cancelled: the graceful timeout is over
                transport.abort()

    async def first_bytes(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bytes | None:
        """The first bytes of a plain connection, enough to tell the HTTP/2 preface from an
        HTTP/1.1 request; None if the client sends nothing within the keep-alive timeout, or
        closes first."""
        try:
            data = b""
            async with asyncio.timeout(self.config.timeout_keep_alive):
                while len(data) < len(H2_PREFACE) and H2_PREFACE.startswith(data):
                    chunk = await reader.read(65536)
                    if not chunk:
                        return None
                    data += chunk
            return data
        except (TimeoutError, ConnectionError, OSError):
            return None


def split_http1() -> None:
    """Make hypercorn's per-connection server hand HTTP/1.1 connections to the
    :class:`Http1Handoff` its config names (``config.firstbyte_http1``); a config without one
    is served by hypercorn alone. Applied after the hardening's connection guard
    (:mod:`.patches`), which then serves HTTP/2."""
    from hypercorn.asyncio import run

    hypercorn_run: Any = run

    class SplittingTCPServer(hypercorn_run.TCPServer):  # type: ignore[misc]
        reader: Any

        async def run(self) -> None:
            handoff: Http1Handoff | None = getattr(self.config, "firstbyte_http1", None)
            admission: Admission | None = getattr(self.reader, "admission", None)
            if handoff is None:
                await super().run()
                return
            if admission is not None and admission.refusal is not None:
                await answer_refused(
                    self.reader, self.writer, deadline_s=admission.deadline_s,
                    cors=getattr(self.config, "firstbyte_refusal_cors", None),
                )
                return
            ssl_object = self.writer.get_extra_info("ssl_object")
            if ssl_object is not None:
                if ssl_object.selected_alpn_protocol() == "h2":
                    await super().run()
                else:
                    await handoff.serve(
                        self.reader, self.writer, self.context.terminated, self.state,
                        admission=admission,
                    )
                return
            first = await handoff.first_bytes(self.reader, self.writer)
            if first is None:
                self.writer.close()
                return
            if first.startswith(H2_PREFACE):
                self.reader = _Replayed(first, self.reader)
                await super().run()
            else:
                await handoff.serve(
                    self.reader, self.writer, self.context.terminated, self.state, first,
                    admission,
                )

    hypercorn_run.TCPServer = SplittingTCPServer


class _Replayed:
    """A stream reader that returns ``first`` before what ``reader`` holds (the reads
    hypercorn's server makes: ``read(n)`` and ``at_eof()``)."""

    def __init__(self, first: bytes, reader: asyncio.StreamReader) -> None:
        self._first = first
        self._reader = reader

    def at_eof(self) -> bool:
        return not self._first and self._reader.at_eof()

    async def read(self, n: int = -1) -> bytes:
        if self._first:
            data, self._first = self._first, b""
            return data
        return await self._reader.read(n)

