"""CORS for the browser client: which page origins may call the router, and what they may read.

:meth:`CorsPolicy.decide` is pure: a request's method, path and headers in, what to do out
(answer a preflight, add headers to the response, or nothing). Listed origins (exact matches
from ``cors.allow_origins``) get ``Access-Control-Allow-Origin`` with their own origin, the
firstbyte response headers exposed and ``Timing-Allow-Origin`` (so the page's Resource Timing
shows DNS, connect, TLS and first byte, not zeros). An unlisted origin gets no CORS header at
all, so the browser withholds the answer from the page; the router logs it once per origin.
The browser client's own files are public code: any origin may load them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from firstbyte.protocol import paths
from firstbyte.protocol.content_coding import ACCEPT_ENCODING_HEADER
from firstbyte.protocol.headers import (
    BETTER_REGION_HEADER,
    BETTER_REGION_URL_HEADER,
    REGION_HEADER,
    STREAM_HEADER,
)

from .config import CorsConfig

__all__ = ["CorsPolicy", "Preflight", "ResponseHeaders"]

log = logging.getLogger("firstbyte.router.cors")

ALLOW_METHODS = "GET, POST, OPTIONS"
ALLOW_HEADERS = "authorization, content-encoding, content-type, last-event-id, traceparent"
"""What a preflight allows when it names no headers (a prewarm's plain ``OPTIONS``)."""
_MAX_ASKED_HEADERS_CHARS = 2048
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"  # an HTTP field name (RFC 9110)
_HEADER_NAMES = re.compile(rf"{_TOKEN}(?:[ \t]*,[ \t]*{_TOKEN})*")
EXPOSE_HEADERS = ", ".join((
    STREAM_HEADER, REGION_HEADER, BETTER_REGION_HEADER, BETTER_REGION_URL_HEADER,
    "server-timing", "retry-after", "traceparent", ACCEPT_ENCODING_HEADER,
))
_MAX_LOGGED_ORIGINS = 1000
Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Preflight:
    """Answer the ``OPTIONS`` preflight now with this status and these headers."""

    status: int
    headers: Headers


@dataclass(frozen=True, slots=True)
class ResponseHeaders:
    """Let the request through; add these headers to its response."""

    headers: Headers


class CorsPolicy:
    def __init__(self, config: CorsConfig) -> None:
        self.allowed = frozenset(config.allow_origins)
        self.max_age_s = config.max_age_s
        self._logged: set[str] = set()

    def decide(
        self, method: str, path: str, headers: dict[str, str]
    ) -> Preflight | ResponseHeaders | None:
        """What CORS asks of this request (``headers`` lower-cased, as :func:`header_dict`):
        always None for a request without ``Origin`` but to the client's files (the app
        does not ask then)."""
        origin = headers.get("origin")
        if path.startswith(paths.EDGE_CLIENT + "/"):
            return ResponseHeaders((("access-control-allow-origin", "*"),
                                    ("timing-allow-origin", "*")))
        if origin is None:
            return None  # not a cross-origin browser request
        preflight = method == "OPTIONS" and "access-control-request-method" in headers
        if origin in self.allowed:
            # A plain OPTIONS too: a browser's prewarm sends one to have its preflight cached
            # (the cache is per URL) and its answer must not cost an endpoint or a 405.
            if method == "OPTIONS":
                return Preflight(204, (
                    ("access-control-allow-origin", origin),
                    ("access-control-allow-methods", ALLOW_METHODS),
                    ("access-control-allow-headers", _allowed_headers(headers)),
                    ("access-control-max-age", str(self.max_age_s)),
                    ("vary", "Origin, Access-Control-Request-Headers"),
                ))
            return ResponseHeaders((
                ("access-control-allow-origin", origin),
                ("access-control-expose-headers", EXPOSE_HEADERS),
                ("timing-allow-origin", origin),
                ("vary", "Origin"),
            ))
        if _same_origin(origin, headers):
            return None  # a page the router serves itself: the browser needs no CORS
        self._note_refused(origin)
        return Preflight(403, (("vary", "Origin"),)) if preflight else None

    def refusal_headers(self, origin: str, host: str | None) -> Headers:
        """The CORS headers of a refusal the server writes before the app, to a request of
        ``origin`` for ``host`` (:mod:`.hosting.refusal_cors`): those :meth:`decide` gives
        the app's own answers to it; none for an origin not allowed."""
        headers = {"origin": origin} if host is None else {"origin": origin, "host": host}
        decided = self.decide("GET", "/", headers)
        return decided.headers if isinstance(decided, ResponseHeaders) else ()

    def allows(self, origin: str, headers: dict[str, str]) -> bool:
        """May a page of ``origin`` call the router: listed, or the router's own origin."""
        return origin in self.allowed or _same_origin(origin, headers)

    def _note_refused(self, origin: str) -> None:
        if origin in self._logged or len(self._logged) >= _MAX_LOGGED_ORIGINS:
            return
        self._logged.add(origin)
        log.warning("CORS: origin %r is not in cors.allow_origins; answered without CORS"
                    " headers (the browser withholds the response)", origin[:200])


def _allowed_headers(headers: dict[str, str]) -> str:
    """The request headers a listed origin's page may send: :data:`ALLOW_HEADERS` and those
    its preflight asks for (a well-formed list of names). The official SDKs send headers
    of their own (``x-stainless-*``, ``anthropic-version``, ``x-api-key``); the router reads
    the ones it knows and ignores the rest, and no credentials mode means no cookie rides
    along, so a listed page sending any of them reaches nothing it could not already."""
    asked = headers.get("access-control-request-headers", "").strip()
    if not asked or len(asked) > _MAX_ASKED_HEADERS_CHARS or not _HEADER_NAMES.fullmatch(asked):
        return ALLOW_HEADERS
    names = (name.strip().lower() for name in asked.split(","))
    return ", ".join(dict.fromkeys((*ALLOW_HEADERS.split(", "), *names)))


def _same_origin(origin: str, headers: dict[str, str]) -> bool:
    host = headers.get("host") or headers.get(":authority")
    return host is not None and urlsplit(origin).netloc == host
