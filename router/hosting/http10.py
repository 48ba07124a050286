"""An answer of unknown length to an HTTP/1.0 request, on uvicorn's httptools protocol:
delimited by the connection's close, not chunked.

uvicorn (0.53-0.55) frames every response without ``Content-Length`` with
``Transfer-Encoding: chunked``, whatever the request's version. HTTP/1.0 has no chunked
coding (RFC 9112 section 6.1: a server MUST NOT send it to a 1.0 client), so a 1.0 client
reads the chunk-size lines as part of the body: in an SSE stream, lines that are no event.
hypercorn's h11 does it right (h11 writes such a body as is and closes); uvicorn is the
router's HTTP/1.1 server by default (``listen.server = "auto"`` and ``"uvicorn"``).

:func:`close_delimited` gives one HTTP/1.0 request's cycle a ``send`` that, for a response
head with neither ``Content-Length`` nor ``Transfer-Encoding`` (and a body: not a HEAD, a
204 or a 304), tells uvicorn the body is not chunked and lets each part through as if its
length had been announced: the body goes out as it is, the head with ``connection: close``,
and uvicorn closes the connection after the last part, as for any 1.0 request (it keeps no
1.0 connection alive). A response with a length is unchanged; so is every HTTP/1.1 request
(the override is set only on 1.0 cycles, so 1.1 pays nothing). The request's own
``send`` does the writing, flow control and end-of-response bookkeeping as always.

It reads and sets the cycle's ``response_started``, ``chunked_encoding``,
``expected_content_length`` and ``keep_alive``, and relies on ``run_asgi`` reading
``self.send`` when its task runs (after the override is set); :mod:`.patches` checks that
shape (``uvicorn-http10-close-delimited``). The ``firstbyte.body_writer`` extension is not
offered to these cycles (:mod:`.uvicorn_limits`): its chunk framing is HTTP/1.1's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

__all__ = ["close_delimited", "is_http10"]

_FRAMING = (b"content-length", b"transfer-encoding")
_NO_BODY = (204, 304)


def is_http10(scope: Mapping[str, Any]) -> bool:
    """Is this uvicorn scope an HTTP/1.0 request's (the version with no chunked coding)?"""
    return scope.get("http_version") == "1.0"


def _unframed(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    return not any(name.lower() in _FRAMING for name, _ in headers)


def close_delimited(cycle: Any) -> None:
    """Make uvicorn's request ``cycle`` send a response without a length as HTTP/1.0's
    (close-delimited) body; must be called before its ``run_asgi`` task runs."""
    send: Callable[[Any], Awaitable[None]] = cycle.send
    delimited = False

    async def send_until_close(message: Any) -> None:
        nonlocal delimited
        if delimited:
            if message["type"] == "http.response.body":
                # uvicorn counts the body down from its announced length: announce each part.
                cycle.expected_content_length += len(message.get("body", b""))
        elif (
            message["type"] == "http.response.start"
            and not cycle.response_started
            and cycle.scope["method"] != "HEAD"
            and message["status"] not in _NO_BODY
            and _unframed(message.get("headers", ()))
            and _unframed(cycle.default_headers)
        ):
            delimited = True
            cycle.chunked_encoding = False  # uvicorn adds chunked only while this is None
            cycle.expected_content_length = 0
            cycle.keep_alive = False  # the close is the body's end
        await send(message)

    cycle.send = send_until_close
