"""CORS headers for the answers the hosting layer writes itself, before any app runs (sans-IO).

A browser hands a cross-origin page an answer only if it carries
``Access-Control-Allow-Origin`` for the page's origin; without it the page sees a network
error and cannot read the status, the error ``code`` or ``Retry-After``. The app adds those
headers to its own answers, but a refused connection's 503, or a 414 or 431 for an HTTP/2
or HTTP/3 head over its bounds, is written by the server before the app sees the request.
Those refusals are written once the request's head is read, so its ``Origin`` is known: the
server asks the app's policy (:data:`RefusalCors`, from :class:`.ServerOptions`), which
answers only for an origin it allows, with the headers its own answers carry.

What is refused before its head was read whole cannot know its origin and carries none: a
connection closed at its accept (the last half of the descriptor reserve), a QUIC connection
refused at its first packet, an HTTP/1.1 head over a bound (refused as it crosses the bound,
its ``Origin`` line perhaps still unsent) or not complete in time (408).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["RefusalCors", "cors_fields", "h1_cors_lines"]

RefusalCors = Callable[[str, str | None], tuple[tuple[str, str], ...]]
"""``(origin, host) -> headers``: the CORS headers of a refusal to a request from ``origin``
(the value of its ``Origin`` field) sent to ``host`` (its ``Host`` or ``:authority``, None
if it has none); none for an origin the policy does not allow, or with CORS off."""

_HOST_NAMES = (b"host", b":authority")


def _headers(
    cors: RefusalCors | None, origin: bytes | None, host: bytes | None
) -> tuple[tuple[str, str], ...]:
    if cors is None or origin is None:
        return ()
    return cors(origin.decode("latin-1"), None if host is None else host.decode("latin-1"))


def cors_fields(
    cors: RefusalCors | None, fields: Iterable[tuple[bytes, bytes]]
) -> list[tuple[bytes, bytes]]:
    """The CORS fields to add to a refusal of a decoded head (HTTP/2, HTTP/3: lower-case
    names); none if it has no ``Origin`` or more than one."""
    if cors is None:
        return []
    origins = [value for name, value in fields if name == b"origin"]
    if len(origins) != 1:
        return []
    host = next((value for name, value in fields if name in _HOST_NAMES), None)
    return [(k.encode("latin-1"), v.encode("latin-1"))
            for k, v in _headers(cors, origins[0], host)]


def h1_cors_lines(cors: RefusalCors | None, head: bytes) -> bytes:
    """The CORS header lines (each ending CRLF) to add to a refusal of the HTTP/1.1 request
    whose head begins ``head`` (read up to its blank line, or a bound); none if the head
    read holds no ``Origin`` line, or more than one."""
    if cors is None:
        return b""
    end = head.find(b"\r\n\r\n")
    origin = host = None
    origins = 0
    for line in head[: end if end >= 0 else len(head)].split(b"\n")[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            continue
        name = name.strip().lower()
        if name == b"origin":
            origin, origins = value.strip(b" \t\r"), origins + 1
        elif name == b"host":
            host = value.strip(b" \t\r")
    if origins != 1:
        return b""
    return b"".join(
        b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
        for k, v in _headers(cors, origin, host)
    )
