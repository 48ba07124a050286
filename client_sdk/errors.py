"""Typed exceptions raised by the SDK.

Every error the SDK raises derives from :class:`FirstbyteError`. HTTP error answers become
:class:`APIError` (or a subclass chosen by status) carrying OpenAI's error body fields;
network failures become :class:`ConnectError` (could not reach the server) or
:class:`StreamBrokenError` (the stream was cut and could not be resumed); a client built with
an option it cannot use raises :class:`ConfigurationError` at construction. docs/sdk-errors.md
lists every situation with its exception and message.
"""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

import msgspec

__all__ = [
    "APIError",
    "AuthenticationError",
    "BadRequestError",
    "ConfigurationError",
    "ConnectError",
    "FirstbyteError",
    "NotFoundError",
    "RateLimitError",
    "ServiceUnavailableError",
    "StreamBrokenError",
    "StreamHistoryTrimmedError",
    "StreamLostError",
    "StreamStalledError",
    "TLSError",
    "api_error_from_response",
    "retry_after_s",
]


class FirstbyteError(Exception):
    """Base class of every exception raised by the SDK."""


class ConfigurationError(FirstbyteError, ValueError):
    """A client option cannot be used as given (e.g. ``ca_file`` names no certificate file).

    ``option`` is the argument's name; raised when the client is built, before any network use.
    """

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


class ConnectError(FirstbyteError):
    """The server could not be reached (DNS failure, refused or timed-out connection)."""


class TLSError(ConnectError):
    """The TLS (or QUIC) handshake failed, e.g. the certificate did not verify."""


class StreamBrokenError(FirstbyteError):
    """The stream was cut and every resume attempt failed."""


class StreamLostError(StreamBrokenError):
    """The router no longer has the stream (it restarted, or the stream was evicted): what
    was delivered is all this stream will ever give.

    Raised on every transport when a resume is answered ``stream_not_found``, when the
    stream ends with a ``stream_lost`` error event (the router process producing it died
    mid-stream; routers sharing state through Redis tell its readers so within seconds), and
    when it ends with a ``draining`` error event after some content (its router shut down;
    before any content the request is sent again instead).
    ``delivered_text`` is the text the iterator handed out, ``last_seq`` the last event
    delivered, ``stream_id`` the lost stream; send a new request to go on.
    """

    def __init__(
        self, message: str, *, stream_id: str, last_seq: int, delivered_text: str
    ) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.last_seq = last_seq
        self.delivered_text = delivered_text


class StreamHistoryTrimmedError(StreamLostError):
    """A resume asked for events the router has dropped (code ``stream_history_trimmed``: a
    410 on resume, or an error event or WebSocket error for a reader that fell behind): the
    stream's API key went over its share of the router's stream store, so the oldest events
    of the key's streams were trimmed; or, with shared state, Redis keeps only the last
    ``state.max_events_per_stream`` events of a stream, or could not take them (full, away).
    The message ends with the router's, which says which. The events after ``last_seq`` that
    this client missed are gone for good; send a new request for the rest."""


class StreamStalledError(StreamBrokenError):
    """No event (heartbeats do not count) arrived within the idle watchdog's limit."""

    def __init__(self, message: str, *, idle_s: float) -> None:
        super().__init__(message)
        self.idle_s = idle_s


class APIError(FirstbyteError):
    """The server answered with an error: HTTP status plus OpenAI's error body fields.

    ``status`` is ``None`` for an error event inside an already-started stream.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(f"{status} {message}" if status is not None else message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param


class BadRequestError(APIError):
    """400: the request was invalid."""


class AuthenticationError(APIError):
    """401 (or a WebSocket close with 1008 for auth): the API key was missing or wrong."""


class NotFoundError(APIError):
    """404: unknown route, model, or a stream id this key does not own."""


class RateLimitError(APIError):
    """429: the server is saturated; ``retry_after`` seconds from its ``Retry-After`` header
    (over WebSocket, the ``error`` message's ``retry_after``)."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ServiceUnavailableError(APIError):
    """503 (or 502/504): no backend could serve the request right now; ``retry_after``
    seconds from its ``Retry-After`` header or WebSocket ``retry_after`` (a draining router
    sends one)."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


class _ErrorEnvelope(msgspec.Struct):
    error: _ErrorDetail


def _parse_body(body: bytes | str | dict[str, Any] | None) -> _ErrorDetail | None:
    if body is None:
        return None
    try:
        if isinstance(body, dict):
            return msgspec.convert(body, _ErrorEnvelope).error
        return msgspec.json.decode(body, type=_ErrorEnvelope).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_TIME = r"([01]\d|2[0-3]):([0-5]\d):([0-5]\d)"
_MONTH = "(" + "|".join(_MONTHS) + ")"
# RFC 9110 section 5.6.7: IMF-fixdate, and the two obsolete forms a recipient must accept.
_IMF_FIXDATE = re.compile(rf"(?:{'|'.join(_DAYS)}), (\d\d) {_MONTH} (\d{{4}}) {_TIME} GMT")
_RFC850_DATE = re.compile(
    rf"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), (\d\d)-{_MONTH}-(\d\d)"
    rf" {_TIME} GMT")
_ASCTIME_DATE = re.compile(rf"(?:{'|'.join(_DAYS)}) {_MONTH} ([ \d]\d) {_TIME} (\d{{4}})")
_DELAY_SECONDS = re.compile(r"\d+(?:\.\d+)?")


def _http_date(value: str, now: float) -> float | None:
    """An HTTP-date (RFC 9110 section 5.6.7) as POSIX seconds, or None if ``value`` is not one.

    ``now`` (POSIX seconds) places an obsolete two-digit year: more than 50 years ahead of it
    is the century before, as the RFC says. The browser client's ``retryAfterS`` (stream.js) reads
    the same forms; tests/client_sdk/stream_rules.py holds both to one table.
    """
    value = value.strip()
    if m := _IMF_FIXDATE.fullmatch(value):
        day, month, year, hh, mm, ss = m.groups()
    elif m := _RFC850_DATE.fullmatch(value):
        day, month, yy, hh, mm, ss = m.groups()
        this_year = time.gmtime(now).tm_year
        year = str(this_year - this_year % 100 + int(yy))
        if int(year) > this_year + 50:
            year = str(int(year) - 100)
    elif m := _ASCTIME_DATE.fullmatch(value):
        month, day, hh, mm, ss, year = m.groups()
    else:
        return None
    try:
        when = datetime.datetime(int(year), _MONTHS.index(month) + 1, int(day), int(hh),
                                 int(mm), int(ss), tzinfo=datetime.UTC)
    except ValueError:
        return None  # no such day (30 Feb)
    return when.timestamp()


def retry_after_s(value: str | float | None, now: float | None = None) -> float | None:
    """A ``Retry-After``'s wait in seconds, never negative; None when absent or garbage (the
    caller's own backoff then). The header is delay-seconds or an HTTP-date (RFC 9110 section
    10.2.3): the router sends seconds, a balancer or an upstream's 503 may send a date, which
    is read as seconds from ``now`` (POSIX seconds; default: this machine's clock). A number
    is already seconds (a WebSocket ``error`` message's ``retry_after``)."""
    if value is None:
        return None
    if isinstance(value, int | float):
        return max(float(value), 0.0)
    value = value.strip()
    if _DELAY_SECONDS.fullmatch(value):
        return float(value)
    now = time.time() if now is None else now
    when = _http_date(value, now)
    return None if when is None else max(when - now, 0.0)


def api_error_from_response(
    status: int | None,
    body: bytes | str | dict[str, Any] | None,
    *,
    retry_after: str | float | None = None,
) -> APIError:
    """Build the typed error for an HTTP status and (OpenAI-style) error body.

    ``body`` may also be an already-decoded ``{"error": {...}}`` dict, as found in a stream's
    error event. Bodies that are not OpenAI errors still yield an error with the raw text.
    ``retry_after`` is the ``Retry-After`` header, or a WebSocket error's seconds.
    """
    detail = _parse_body(body)
    if detail is not None:
        message = detail.message or "(no message)"
        code = None if detail.code is None else str(detail.code)
        kw: dict[str, Any] = {"status": status, "type": detail.type, "code": code,
                              "param": detail.param}
    else:
        raw = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body or "")
        message = raw.strip()[:500] or "(empty body)"
        kw = {"status": status}
    if status == 401:
        return AuthenticationError(message, **kw)
    if status == 400:
        return BadRequestError(message, **kw)
    if status == 404:
        return NotFoundError(message, **kw)
    if status == 429:
        return RateLimitError(message, retry_after=retry_after_s(retry_after), **kw)
    if status in (502, 503, 504):
        return ServiceUnavailableError(message, retry_after=retry_after_s(retry_after), **kw)
    return APIError(message, **kw)
