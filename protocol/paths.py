"""The router's URL paths (docs/protocol.md).

The constants are the paths the router serves. A client whose base URL carries another API
base path than ``/v1`` (a proxy mounting the router at ``/api/v1``) puts them under its own
with :func:`at_base`.
"""

from __future__ import annotations

__all__ = [
    "API_BASE",
    "CHAT_COMPLETIONS",
    "EDGE_CLIENT",
    "EDGE_STATUS",
    "EDGE_TIMINGS",
    "EDGE_TOKENS",
    "EDGE_WARM",
    "HEALTHZ",
    "METRICS",
    "MODELS",
    "STREAMS",
    "WEBSOCKET",
    "at_base",
    "edge_client",
    "stream",
    "stream_poll",
]

API_BASE = "/v1"
"""The OpenAI-style API base: a client's base URL ends with it (``https://host/v1``)."""

CHAT_COMPLETIONS = "/v1/chat/completions"
"""``POST``: a chat completion, streamed as SSE when ``"stream": true``."""

MODELS = "/v1/models"
"""``GET``: the models the upstreams serve."""

STREAMS = "/v1/streams"
"""``POST ?wait=S``: start a stream for long-poll (answers its id and first batch)."""

WEBSOCKET = "/v1/ws"
"""WebSocket: start and resume streams over one socket (:mod:`firstbyte.protocol.ws`)."""

EDGE_STATUS = "/v1/edge/status"
"""``GET``: the region's status document (:mod:`firstbyte.protocol.edge`)."""

EDGE_TIMINGS = "/v1/edge/timings"
"""``POST``: a client's report of what its finished streams cost it
(:mod:`firstbyte.protocol.timings`); 202 ``{"accepted": N}``."""
EDGE_TOKENS = "/v1/edge/tokens"
"""``POST`` with an API key (from the application's backend, never a browser): a short-lived
client token for a browser (:mod:`firstbyte.protocol.tokens`)."""

EDGE_WARM = "/v1/edge/warm"
"""``GET``, no key: 204 and nothing else. What a browser's prewarm fetches to open its
connection (and learn ``Alt-Svc``) before the user sends; cheap enough to repeat."""

EDGE_CLIENT = "/v1/edge/client"
"""``GET {EDGE_CLIENT}/NAME.js``, no key: the browser client's JavaScript modules."""

HEALTHZ = "/healthz"
"""``GET``, no key: ``ok``, or 503 ``warming`` / ``unhealthy``. At the server root."""

METRICS = "/metrics"
"""``GET``: Prometheus text. At the server root."""


def stream(stream_id: str) -> str:
    """``GET``: read (or resume, with ``Last-Event-ID``) a stream as SSE."""
    return f"{STREAMS}/{stream_id}"


def stream_poll(stream_id: str) -> str:
    """``GET ?after=N&wait=S``: the stream's next long-poll batch."""
    return f"{STREAMS}/{stream_id}/poll"


def edge_client(name: str) -> str:
    """``GET``: one module of the browser client (``firstbyte.js``, ``sse.js``, ...)."""
    return f"{EDGE_CLIENT}/{name}"


def at_base(path: str, base: str) -> str:
    """``path`` (one under :data:`API_BASE`) with ``base`` in place of ``/v1``.

    ``at_base(CHAT_COMPLETIONS, "/api/v1") == "/api/v1/chat/completions"``.
    """
    if not path.startswith(API_BASE + "/"):
        raise ValueError(f"{path!r} is not under {API_BASE}")
    return base + path[len(API_BASE) :]
