"""The per-request timing record: every network phase and every token, in milliseconds.

Definitions follow ``vllm bench serve``: TTFT is request start to the first content chunk,
ITL the gap between successive content chunks, TPOT ``(E2EL - TTFT) / (output_tokens - 1)``,
E2EL request start to the last content chunk.

Two kinds of fields:
- *durations* of connection phases (``dns_ms``, ``tcp_connect_ms``, ``tls_handshake_ms``,
  ``quic_handshake_ms``, ``pool_wait_ms``): ``None`` when the phase did not happen (a warm
  connection has no connect or handshake phase);
- *offsets* from the request start (``request_sent_ms``, ``first_byte_ms``, ``first_token_ms``,
  ``last_token_ms``, ``render_ms``).

The connection phases are serial and never overlap: DNS, then TCP and TLS (or QUIC), then the
pool wait, then the request is sent, so ``connect_ms + pool_wait_ms <= request_sent_ms``.
With HTTP/3 0-RTT the request leaves in the first flight, before the handshake has completed;
``quic_handshake_ms`` then covers only the time until the request was sent (building the
connection and its first flight), ``zero_rtt`` is True, and the rest of the handshake runs
concurrently with the request's round trip, inside ``first_byte_ms``.
"""

from __future__ import annotations

import msgspec

__all__ = ["Timings"]


class Timings(msgspec.Struct, kw_only=True):
    """What one streamed request cost, phase by phase (all times in milliseconds)."""

    transport: str = "sse"
    """``sse``, ``websocket`` or ``longpoll``."""
    http_version: str = ""
    """Negotiated protocol: ``HTTP/1.1``, ``HTTP/2`` or ``HTTP/3``."""
    warm: bool = False
    """True when the request reused an open connection (no connect or handshake phase)."""
    zero_rtt: bool = False
    """True when a new HTTP/3 connection sent the request as 0-RTT early data and the server
    accepted it; ``quic_handshake_ms`` then stops when the request was sent (module docstring)."""
    prewarmed: bool = False
    """True for the first stream after a ``prewarm()`` (the app's call, on the user's intent),
    on a connection it did not open itself (the browser client's ``warmOnIntent`` too)."""
    region: str | None = None
    """The region that served (``x-firstbyte-region``)."""
    better_region: str | None = None
    """``x-firstbyte-better-region``: where the router says this client would be served sooner."""
    better_region_url: str | None = None
    """``x-firstbyte-better-region-url`` (a hint only: the SDK goes to configured URLs only)."""
    stream_id: str | None = None
    started_at: float = 0.0
    """Wall-clock start, seconds since the epoch (for correlating logs; not used for durations)."""

    dns_ms: float | None = None
    tcp_connect_ms: float | None = None
    tls_handshake_ms: float | None = None
    quic_handshake_ms: float | None = None
    ws_upgrade_ms: float | None = None
    """WebSocket only: the HTTP upgrade request and its 101 answer, after TLS."""
    pool_wait_ms: float | None = None

    request_sent_ms: float | None = None
    first_byte_ms: float | None = None
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    render_ms: float | None = None
    inter_token_ms: list[float] = msgspec.field(default_factory=list)

    output_chunks: int = 0
    """Content chunks received (each carries one token from an OpenAI-compatible server)."""
    resumes: int = 0
    """How many times the stream was resumed after a broken connection."""
    request_bytes: int | None = None
    """The request body's bytes as sent (gzipped when the client compressed it:
    ``compress_requests``); None before a body was sent."""
    server_timing: dict[str, float] = msgspec.field(default_factory=dict)
    """The router's ``Server-Timing`` split (``queue``, ``route``, ``upstream-ttft``, ...)."""

    @property
    def ttft_ms(self) -> float | None:
        return self.first_token_ms

    @property
    def e2el_ms(self) -> float | None:
        return self.last_token_ms

    @property
    def tpot_ms(self) -> float | None:
        if self.first_token_ms is None or self.last_token_ms is None or self.output_chunks < 2:
            return None
        return (self.last_token_ms - self.first_token_ms) / (self.output_chunks - 1)

    @property
    def connect_ms(self) -> float:
        """Time spent opening a connection before the request went out: DNS + TCP + TLS, or
        DNS + QUIC (0 when warm). Never more than ``request_sent_ms``, 0-RTT included."""
        phases = (self.dns_ms, self.tcp_connect_ms, self.tls_handshake_ms, self.quic_handshake_ms)
        return sum(p for p in phases if p is not None)
