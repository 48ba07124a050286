"""Bounds on a request head, checked before anything else reads it (sans-IO).

A request head is the one part of a request a server must take whole before it can answer
anything, authentication included; unbounded, one client without a key makes it buffer
megabytes per connection (httptools appends a header value piece by piece: quadratic CPU
too). The bounds are nginx's, with its answers:

- the request line (HTTP/2 and HTTP/3: the ``:path``) over ``max_request_line_bytes``:
  ``414``;
- one header line (name and value) over ``max_header_line_bytes``, all header lines
  together over ``max_header_bytes``, or more than ``max_headers`` of them: ``431``.

:class:`HeadScanner` watches HTTP/1.1 bytes as they arrive, before the parser buffers them,
so it refuses a head once it is over a bound, whatever it would have grown to;
:func:`check_fields` checks a head an HTTP/2 or HTTP/3 parser decoded (its size bounded
there by the protocol's own settings). :func:`refusal_body` is the error body either way.
Nothing here touches a socket or a clock: :mod:`.head_guards` (the servers' side) does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .limits import HeadLimits

__all__ = [
    "HeadLimits",
    "HeadRefusal",
    "HeadScanner",
    "UnalignedHead",
    "check_fields",
    "max_head_bytes",
    "refusal_body",
    "refusal_h1",
    "too_many_fields",
]


@dataclass(frozen=True, slots=True)
class HeadRefusal:
    """Why a head is refused, and the answer: ``status`` (414 or 431), ``code`` (the error
    body's), ``reason`` (a sentence for the log and the client)."""

    status: int
    code: str
    reason: str


_REASONS = {414: "URI Too Long", 431: "Request Header Fields Too Large"}


def _too_long_line(limits: HeadLimits) -> HeadRefusal:
    return HeadRefusal(
        414,
        "request_line_too_long",
        f"The request line is longer than {limits.max_request_line_bytes} bytes.",
    )


def _too_long_header(limits: HeadLimits) -> HeadRefusal:
    return HeadRefusal(
        431,
        "header_too_large",
        f"A header field is longer than {limits.max_header_line_bytes} bytes.",
    )


def _too_many_bytes(limits: HeadLimits) -> HeadRefusal:
    return HeadRefusal(
        431,
        "headers_too_large",
        f"The header fields are larger than {limits.max_header_bytes} bytes in all.",
    )


def too_many_fields(limits: HeadLimits) -> HeadRefusal:
    """The refusal of a head with more than ``limits.max_headers`` fields."""
    return HeadRefusal(
        431, "too_many_headers", f"More than {limits.max_headers} header fields."
    )


class HeadScanner:
    """One HTTP/1.1 request head's bytes as they arrive: :meth:`feed` each piece (before the
    parser sees it) until :attr:`complete` or a refusal.

    Lines end at LF (a CR before it counts as the line's); blank lines before the request
    line count toward it, as they must end some time too. What follows the blank line that
    ends the head (a body, a next request) is not looked at.
    """

    __slots__ = (
        "_cr", "_header_bytes", "_headers", "_leading", "_line", "_request_line", "complete",
        "limits",
    )

    def __init__(self, limits: HeadLimits) -> None:
        self.limits = limits
        self.complete = False
        self._request_line = True
        self._line = 0  # bytes of the line in progress, its line end included when known
        self._leading = 0  # bytes of blank lines before the request line
        self._cr = False  # the last byte fed was a CR
        self._headers = 0
        self._header_bytes = 0

    def feed(self, data: bytes) -> HeadRefusal | None:
        """Account for ``data``; the refusal once the head is over a bound (then stop
        reading: what follows is not worth parsing), else None."""
        if self.complete or not data:
            return None
        limits = self.limits
        if self._line == 0 and self._request_line and not self._leading and data[0] > 0x0D:
            # Fast path, a whole small head in one piece (the usual case): no line and no
            # total can be over its bound; only the count is left to check. (uvicorn_limits'
            # protocol runs the same test on a head's first read before making a scanner.)
            end = data.find(b"\r\n\r\n")
            if 0 <= end < min(limits.max_request_line_bytes, limits.max_header_line_bytes,
                              limits.max_header_bytes):
                if data.count(b"\n", 0, end) > limits.max_headers:
                    return too_many_fields(limits)
                self.complete = True
                return None
        start, size = 0, len(data)
        while start < size:
            newline = data.find(b"\n", start)
            end = size if newline < 0 else newline + 1
            self._line += end - start
            if newline < 0:
                self._cr = data[-1] == 0x0D
                return self._check_partial()
            # A line ended: its length without the line end.
            ending = 2 if (newline > start and data[newline - 1] == 0x0D) or (
                newline == start and self._cr
            ) else 1
            length = self._line - ending
            self._line = 0
            self._cr = False
            start = end
            refusal = self._line_ended(length, ending)
            if refusal is not None or self.complete:
                return refusal
        return None

    def _check_partial(self) -> HeadRefusal | None:
        """The line in progress, bounded before its end arrives (a CR it ends with may be
        the start of its line end)."""
        limits = self.limits
        content = self._line - 1 if self._cr else self._line
        if self._request_line:
            too_long = self._leading + content > limits.max_request_line_bytes
            return _too_long_line(limits) if too_long else None
        if content > limits.max_header_line_bytes:
            return _too_long_header(limits)
        if self._header_bytes + content > limits.max_header_bytes:
            return _too_many_bytes(limits)
        return None

    def _line_ended(self, length: int, ending: int) -> HeadRefusal | None:
        limits = self.limits
        if self._request_line:
            if length == 0:  # a blank line before the request: it counts toward the line
                self._leading += ending
                too_long = self._leading > limits.max_request_line_bytes
                return _too_long_line(limits) if too_long else None
            if self._leading + length > limits.max_request_line_bytes:
                return _too_long_line(limits)
            self._request_line = False
            return None
        if length == 0:
            self.complete = True
            return None
        if length > limits.max_header_line_bytes:
            return _too_long_header(limits)
        self._headers += 1
        self._header_bytes += length
        if self._header_bytes > limits.max_header_bytes:
            return _too_many_bytes(limits)
        if self._headers > limits.max_headers:
            return too_many_fields(limits)
        return None


def max_head_bytes(limits: HeadLimits) -> int:
    """The largest HTTP/1.1 head :class:`HeadScanner` lets through: the request line, every
    header, and their line ends (CRLF each, and the blank line)."""
    return limits.max_request_line_bytes + limits.max_header_bytes + 2 * (limits.max_headers + 2)


class UnalignedHead:
    """A head whose first bytes went past unseen (a pipelined head that began in the read
    that ended the request before it), so its lines cannot be told apart: only its size is
    bounded, by :func:`max_head_bytes`. The caller adds the size of each later read that did
    not complete the head."""

    __slots__ = ("limits", "size")

    def __init__(self, limits: HeadLimits) -> None:
        self.limits = limits
        self.size = 0

    def add(self, size: int) -> HeadRefusal | None:
        self.size += size
        return _too_many_bytes(self.limits) if self.size > max_head_bytes(self.limits) else None


def check_fields(
    path: bytes, headers: list[tuple[bytes, bytes]], limits: HeadLimits
) -> HeadRefusal | None:
    """A decoded head (HTTP/2, HTTP/3) against the bounds: ``path`` as the request line, each
    field as a line ``name: value``."""
    if len(path) > limits.max_request_line_bytes:
        return _too_long_line(limits)
    if len(headers) > limits.max_headers:
        return too_many_fields(limits)
    total = 0
    for name, value in headers:
        length = len(name) + len(value) + 2
        if length > limits.max_header_line_bytes:
            return _too_long_header(limits)
        total += length
    if total > limits.max_header_bytes:
        return _too_many_bytes(limits)
    return None


def refusal_body(refusal: HeadRefusal) -> bytes:
    """The OpenAI-style error body for ``refusal``."""
    return (
        b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"%s"}}'
        % (refusal.reason.encode(), refusal.code.encode())
    )


def refusal_h1(refusal: HeadRefusal) -> bytes:
    """The whole HTTP/1.1 response for ``refusal``, closing the connection."""
    body = refusal_body(refusal)
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" \
        b"connection: close\r\n\r\n%s" % (
            refusal.status, _REASONS[refusal.status].encode(), len(body), body
        )
