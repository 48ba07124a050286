"""The router's configuration: TOML (or command-line flags) -> typed msgspec Structs.

Every field carries its unit in its name (``idle_timeout_s``, ``max_body_bytes``). Loading
rejects unknown keys and bad values with a :class:`ConfigError` whose message names the file
and the key, e.g. ``router.toml: listen.port: Expected `int` >= 0, got -1``.

A relative file path in a config file (every key in :data:`PATH_KEYS`) is relative to the
directory of that file, not to the working directory: :func:`load_config` makes it absolute.

Upstreams come only from here, never from a request.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec

from .regions_config import (
    GeoConfig,
    PeerConfig,
    RoutingConfig,
    WarmPrefixConfig,
    WarmupConfig,
    check_regions,
)

__all__ = [
    "PATH_KEYS",
    "AuthConfig",
    "ClientTimingsConfig",
    "ConfigError",
    "CorsConfig",
    "KeyConfig",
    "LimitsConfig",
    "ListenConfig",
    "RouterConfig",
    "StateConfig",
    "StreamsConfig",
    "TelemetryConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
    "resolve_paths",
]

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_MAX_SECONDS = 10_000_000.0
"""A duration's bound (~115 days): finite, so no timeout can be turned off with ``inf``."""
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0, le=_MAX_SECONDS)]
NonNegSeconds = Annotated[float, msgspec.Meta(ge=0, le=_MAX_SECONDS)]
PositiveBytes = Annotated[int, msgspec.Meta(ge=1)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
_MIN_UPSTREAM_CONNECTIONS = 512
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
HttpUrl = Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s]+(/\S*)?$")]
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]


class ConfigError(ValueError):
    """An invalid configuration; the message names the file (if any) and the key."""


class ListenConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where and how the router listens.

    With ``certfile``/``keyfile`` it serves HTTPS (HTTP/1.1 and HTTP/2 by ALPN) on TCP and,
    when ``http3`` is true, HTTP/3 on the same UDP port, advertised with ``Alt-Svc``. Without
    a certificate it refuses to start unless ``insecure_plain_http`` is true (local use).
    """

    host: str = "127.0.0.1"
    port: Port = 8443
    certfile: str | None = None
    keyfile: str | None = None
    http3: bool = True
    http3_advertised_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    """The UDP port ``alt-svc`` names for HTTP/3 (``h3=":PORT"``); default: ``port``, the one
    bound. For clients that reach the router on another port number (a container published
    with ``-p 443:8443``, a balancer on 443): they try HTTP/3 on the advertised port of the
    address they connected to, so the router's own would be a port nobody answers there."""
    insecure_plain_http: bool = False
    server: Annotated[str, msgspec.Meta(pattern=r"^(auto|hypercorn|uvicorn)$")] = "auto"
    """``auto``: HTTP/2 and HTTP/3 on hypercorn, HTTP/1.1 on uvicorn's httptools protocol, one
    port (``router/hosting/http1_split.py``); ``hypercorn``: all three on hypercorn;
    ``uvicorn``: HTTP/1.1 only (plain or TLS)."""
    keep_alive_timeout_s: PositiveSeconds = 75.0
    backlog: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 4096  # hosting.DEFAULT_BACKLOG
    """The TCP accept queue (``listen()`` backlog; the kernel caps it at
    ``net.core.somaxconn``). hypercorn's own default, 100, overflowed with 500 clients
    connecting at once (each dropped SYN costs the client 1 s)."""
    workers: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    """Router processes on this host sharing the port (``SO_REUSEPORT`` on TCP and UDP); more
    than one needs ``state.redis_url`` so that they share streams, tickets and limits."""
    drain_timeout_s: PositiveSeconds = 30.0
    """On SIGTERM, how long streams in flight may run to their end (``docs/router.md``,
    "Drain"); then they end with a ``draining`` error event and the process exits 0. Keep it
    below the supervisor's stop timeout (systemd ``TimeoutStopSec``, Kubernetes
    ``terminationGracePeriodSeconds`` minus the preStop sleep)."""
    drain_grace_s: NonNegSeconds = 0.0
    """On SIGTERM, keep listening (answering 503 ``draining``) at least this long even when
    nothing is in flight: for a load balancer that learns of the drain only from its health
    checks. 0 (the default) suits Kubernetes, whose preStop sleep does that wait."""
    pid_file: str | None = None
    """Written with the router's pid at start (the supervisor's, with workers) and removed at
    exit; ``firstbyte router reload --config FILE`` signals the pid it names."""
    proxy_protocol: bool = False
    """Behind an L4 balancer (HAProxy ``send-proxy``/``send-proxy-v2``, AWS NLB, ...): read a
    PROXY protocol header (v1 or v2) at the start of each TCP connection from
    ``proxy_protocol_from``, before TLS, and take the client's address from it for GeoIP,
    per-address limits and forwarding-header trust (``router/hosting/proxy_protocol.py``).
    A header from any other address closes the connection (never trusted)."""
    proxy_protocol_from: list[str] = msgspec.field(default_factory=list)
    """The balancers' addresses or CIDRs (``["10.0.0.0/8"]``); required with
    ``proxy_protocol``. A connection from one of them must start with a header (else it is
    closed); one from anywhere else is served as without ``proxy_protocol``."""


class UpstreamConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One inference server (OpenAI-compatible base URL, e.g. ``http://10.0.0.5:8000``)."""

    url: HttpUrl
    name: str = ""
    api_key: str | None = None
    """Sent upstream as ``Authorization: Bearer``; never the client's key."""
    kind: Literal["vllm", "sglang", "openai"] = "vllm"
    """Which metric names ``/metrics`` has (``openai``: no metrics; load from own counts)."""
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Requests in flight (or queued upstream) before it counts as saturated; default
    ``routing.backend_max_in_flight``."""
    models: list[str] = msgspec.field(default_factory=list)
    """Models it serves: a request for another model never goes to it; empty: the ones its
    ``/v1/models`` lists (asked before serving and every ``routing.models_refresh_s``)."""

    @property
    def backend_name(self) -> str:
        """Its name in metrics, logs and the shared state: ``name``, else its URL without the
        scheme (``10.0.0.5:8000``): the same in every process, across reloads and restarts,
        wherever it sits in the list (a name by place renamed the others when one went)."""
        return self.name or self.base_url.split("://", 1)[-1]

    @property
    def base_url(self) -> str:
        """The URL the router appends ``/v1/...`` and ``/metrics`` to: ``url`` without a
        trailing ``/`` or ``/v1`` (vLLM and OpenAI document their URLs with ``/v1``; kept, it
        made every request ``/v1/v1/chat/completions``)."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


class KeyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One API key of the per-key table (``[[auth.keys]]``): its weight in the fair share of
    a contended region and its own hard caps (unset: the ``[limits]`` per-key value, itself
    unset by default: no cap). ``docs/limits.md``, "Per API key"."""

    key: Annotated[str, msgspec.Meta(min_length=8)]
    weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0
    """Its share of a full region relative to the other keys asking (1:1:2 gets 25/25/50%)."""
    max_streams: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Completions in flight; beyond: 429 key_concurrency_exceeded."""
    requests_per_s: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """Sustained request rate (0: none); beyond: 429 key_rate_limited."""
    request_burst: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Requests at once before the rate applies."""
    max_streams_per_subject: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Completions in flight per subject (end user) of this key; beyond: 429
    subject_concurrency_exceeded."""
    usage_label: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None
    """This key's own ``key`` label on the usage metrics (``firstbyte_key_*_total``); unset:
    it is counted with every other such key under ``other``."""


class AuthConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """API keys accepted in ``Authorization: Bearer``.

    A router without keys is refused unless ``allow_anonymous`` says so: an internet-facing
    router must never accept every request by accident.
    """

    api_keys: list[Annotated[str, msgspec.Meta(min_length=8)]] = msgspec.field(default_factory=list)
    keys: list[KeyConfig] = msgspec.field(default_factory=list)
    """The per-key table: keys with a weight and caps of their own, accepted like
    ``api_keys`` (a key there has weight 1 and the ``[limits]`` caps)."""
    allow_anonymous: bool = False
    """With no ``api_keys``: accept any request (local use only)."""

    def all_keys(self) -> list[str]:
        """Every accepted API key: ``api_keys``, then the table's."""
        return [*self.api_keys, *(k.key for k in self.keys)]
    metrics_keys: list[Annotated[str, msgspec.Meta(min_length=8)]] = msgspec.field(
        default_factory=list
    )
    """Bearer keys that may read ``/metrics`` and the whole ``/v1/edge/status`` and nothing else
    (a Prometheus scraper's token); API keys and the peer key may read them too."""
    token_secret: Annotated[str, msgspec.Meta(min_length=32)] | None = None
    """Signs client tokens (``POST /v1/edge/tokens``, docs/browser.md). Every process and host
    that must accept a token needs the same secret; unset, each process draws its own at start
    and accepts only the tokens it minted."""
    client_token_max_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 900.0
    """The longest lifetime a client token may ask for (a longer ``ttl_s`` is cut to it)."""
    client_token_default_ttl_s: PositiveSeconds = 300.0
    """A client token's lifetime when the request names none."""


Origin = Annotated[str, msgspec.Meta(pattern=r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?$")]


class CorsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Which web pages may call the router from a browser (docs/browser.md, "CORS").

    Origins match exactly (``https://app.example``, port included when not the default); no
    wildcard: a browser sends client tokens, and an open list would let any page spend them.
    """

    allow_origins: list[Origin] = msgspec.field(default_factory=list)
    max_age_s: Annotated[int, msgspec.Meta(ge=0, le=86400)] = 600
    """How long a browser may cache a preflight answer."""


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What one request, one key and one upstream may use (``docs/limits.md`` lists each
    limit, its default, what it protects and what the client sees)."""

    max_body_bytes: PositiveBytes = 1 << 20
    upstream_connect_timeout_s: PositiveSeconds = 5.0
    upstream_read_timeout_s: PositiveSeconds = 300.0
    """Longest silence between two upstream chunks before the stream fails."""
    upstream_keepalive_expiry_s: PositiveSeconds = 120.0
    """Idle upstream connections stay open this long (httpx's default of 5 s is too short)."""
    upstream_max_connections: PositiveInt | None = None
    """Connections the router holds to upstreams and peers at once (each pool). Default: the
    slots the region's backends offer (``max_in_flight`` summed over ``upstreams``, at least
    512), read at start, so a region with room never makes a stream wait for a socket."""
    heartbeat_interval_s: PositiveSeconds = 15.0
    """An SSE reader idle this long gets a ``: ping`` comment."""
    # Per API key (router/tenancy.py): hard caps, opt-in for every key ([[auth.keys]] sets
    # them per key). Unset, a key takes what the region has room for, and a full region is
    # shared max-min fairly by weight (router/fair_share.py). They apply with API keys only.
    max_streams_per_key: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Completions in flight (streamed or not) per key; None: no cap. Beyond: 429
    key_concurrency_exceeded."""
    max_streams_per_subject: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Completions in flight per subject (an app's end user) of a key; None: no cap (a full
    region or key still shares fairly between subjects). Beyond: 429
    subject_concurrency_exceeded."""
    requests_per_s_per_key: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Sustained request rate per key (a token bucket); 0: no rate limit. Beyond: 429
    key_rate_limited with Retry-After = seconds until the next token."""
    request_burst_per_key: Annotated[int, msgspec.Meta(ge=1)] = 100
    """Requests a key may send at once before its rate applies (the bucket's size)."""
    # Prompt warm-ups (POST /v1/edge/warm, router/prewarm.py): a short request placing a
    # conversation's prefix on the backend its next message will be routed to.
    prompt_warms_per_min_per_subject: NonNegInt = 6
    """Prompt warm-ups per minute per key and subject (each router process); 0: the
    endpoint is off (404). Beyond: 429 prompt_warm_limited with Retry-After."""
    prompt_warm_max_load: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5
    """A warm-up goes only while the region's backends hold at most this fraction of their
    slots (and none is saturated): beyond, 503 prompt_warm_busy with Retry-After, so a
    warm-up never takes a slot a real request needs."""
    max_store_bytes_per_key: PositiveBytes | None = None
    """A key's share of the stream store (default: a quarter of streams.max_total_bytes),
    charged as its streams grow: what it keeps when the store is full, not a cap while there
    is room. The store full, keys over their share lose their own oldest history first (events
    trimmed from the front of their oldest streams, live ones included; a resume from before
    the trim point gets 410 stream_history_trimmed), never another key's streams."""
    # What one client connection may hold (docs/router.md, "Limits"); defaults like nginx's.
    client_header_timeout_s: PositiveSeconds = 60.0
    """From a request's first byte to its complete head (HTTP/1.1; TLS handshakes too):
    longer, 408 and the connection closes (a slowloris). HTTP/2: from a stream's first
    HEADERS bytes to the end of its header block; longer, GOAWAY and the connection closes."""
    # A request head, bounded before authentication (router/hosting/heads.py); nginx's
    # large_client_header_buffers 4 8k: a line fits one 8 KiB buffer, the head four.
    max_request_line_bytes: PositiveBytes = 8192
    """The request line (HTTP/2, HTTP/3: the ``:path``); longer: 414 and close."""
    max_header_line_bytes: PositiveBytes = 8192
    """One header field (name, ``": "``, value); longer: 431 and close."""
    max_header_bytes: PositiveBytes = 32768
    """All header fields of a request together; more: 431 and close."""
    max_headers: PositiveInt = 100
    """Header fields in one request; more: 431 and close."""
    client_body_timeout_s: PositiveSeconds = 60.0
    """Longest wait for the next piece of a request body: longer, 408 and close."""
    client_send_timeout_s: PositiveSeconds = 60.0
    """A client whose connection has taken nothing of what the router has for it for this
    long (its writes paused throughout: it stopped reading) is disconnected, as nginx's
    ``send_timeout``; every server and HTTP version over TCP. HTTP/2: a stream that has
    taken nothing for this long, waiting on its flow-control window, is reset alone
    (``CANCEL``). Not HTTP/3 (``docs/limits.md``)."""
    websocket_idle_timeout_s: PositiveSeconds = 300.0
    """A WebSocket with no client message and no stream followed for this long is closed
    (1001)."""
    max_connections_per_client: PositiveInt = 256
    """Under pressure only (descriptors or memory near their budget), a client address
    holding this many connections gets no more (503 overloaded after its request's head):
    the heaviest addresses first. With room, one address may open any number."""
    hard_max_connections_per_client: PositiveInt | None = None
    """Opt-in: open connections from one client address, pressure or not (None: no cap)."""
    reserved_fds: NonNegInt = 64
    """File descriptors kept free for streams in flight and upstream connections: when a new
    client connection would leave fewer, it is refused (503 after its request's head)."""
    max_rss_bytes: PositiveBytes | None = None
    """Resident memory above which new work is refused with 503 while streams in flight go
    on (None: no bound; set it below the container's memory limit)."""
    h2_max_early_resets: PositiveInt = 200
    """HTTP/2: streams one connection may reset before their response was done, at once
    (twice the 100 streams a client may have open); past that budget the connection gets
    GOAWAY (the 2023 rapid-reset attack)."""
    h2_early_resets_per_s: Annotated[float, msgspec.Meta(gt=0)] = 20.0
    """... and how fast the budget refills: a client may go on resetting this many streams a
    second. Only time refills it, not the requests that complete."""
    quic_retry_above_handshakes_per_s: Annotated[float, msgspec.Meta(ge=0)] = 200.0
    """HTTP/3: while new QUIC handshakes arrive faster than this, each must first prove its
    address with a Retry (RFC 9000 section 8.1, one more round trip), so a flood from spoofed
    addresses costs no connection state; below it clients keep their 1-RTT handshake.
    0: always Retry."""


class StreamsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The resumable stream store."""

    max_total_bytes: PositiveBytes = 256 << 20
    max_age_s: PositiveSeconds = 600.0
    resume_grace_s: NonNegSeconds = 30.0
    """With no reader attached for this long, a running upstream request is cancelled."""
    max_poll_wait_s: PositiveSeconds = 30.0


RedisUrl = Annotated[str, msgspec.Meta(pattern=r"^(redis|rediss|unix)://\S+$")]


class StateConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where the region's shared state lives (docs/router.md, "Many processes").

    Without ``redis_url`` one process keeps its streams, QUIC tickets, affinity and limits in
    memory (the default). With it, every router process of the region (``listen.workers`` on
    one host, or several hosts behind a load balancer) shares them through Redis or Valkey.
    """

    redis_url: RedisUrl | None = None
    """``redis://[user[:password]@]host:port/db``, ``rediss://`` (TLS) or ``unix:///path``.
    Never printed with its password (``router/shared/target.py``)."""
    redis_password_file: str | None = None
    """A file holding the password (AUTH, for the URL's user if it names one), read at
    start: a mounted Secret instead of a password in the config. One trailing newline is
    dropped. Not together with a password in ``redis_url`` or ``redis_password_env``."""
    redis_password_env: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | (
        None
    ) = None
    """The name of an environment variable holding the password, read at start (instead
    of ``redis_password_file``)."""
    redis_ca_file: str | None = None
    """PEM CA bundle that verifies a ``rediss://`` server (default: the system's bundle)."""
    key_prefix: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")] = "firstbyte:"
    """Prefix of every key the router writes (several regions may share one server)."""
    lease_s: Annotated[float, msgspec.Meta(ge=0.5, le=60)] = 3.0
    """A process renews its lease this often x3; readers elsewhere declare its unfinished
    streams lost (a ``stream_lost`` error event) once the lease has lapsed."""
    max_events_per_stream: Annotated[int, msgspec.Meta(ge=16)] = 100_000
    """Redis keeps about this many events per stream (``XADD MAXLEN ~``, checked on every
    64th event, or eighth of this if fewer)."""
    write_interval_ms: Annotated[float, msgspec.Meta(ge=0, le=100)] = 10.0
    """A process writes its streams' new events to Redis at most this often (all of them in
    one round trip): a reader on another process sees an event up to this much later (plus
    a round trip); readers on the producing process read it from memory at once. 0 writes
    as soon as the previous write returns."""
    max_connections: Annotated[int, msgspec.Meta(ge=4, le=10_000)] = 64
    """Redis connections per process, in a blocking pool: a burst past it waits for a free
    connection (up to ``timeout_s``) instead of failing."""
    timeout_s: Annotated[float, msgspec.Meta(ge=0.5, le=60)] = 2.0
    """Longest wait for a Redis connect, a free pooled connection or a reply; past it the
    request gets ``503 state_unavailable`` (nothing stays claimed for it). Also the start-up
    check's bound (connect, AUTH, PING). At least 0.5: the stream follower's ``XREAD BLOCK``
    waits 250 ms for its reply."""

    def __post_init__(self) -> None:
        passwords = [key for key, given in (
            ("a password in redis_url", _url_has_password(self.redis_url)),
            ("redis_password_file", self.redis_password_file is not None),
            ("redis_password_env", self.redis_password_env is not None),
        ) if given]  # fmt: skip
        if len(passwords) > 1:
            raise ValueError(f"give the Redis password once, not {' and '.join(passwords)}")
        if passwords and self.redis_url is None:
            raise ValueError(f"{passwords[0]} needs redis_url")
        if self.redis_ca_file is not None and not (self.redis_url or "").startswith("rediss://"):
            raise ValueError("redis_ca_file needs a rediss:// (TLS) redis_url")


def _url_has_password(url: str | None) -> bool:
    if url is None:
        return False
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(url)
        return parts.password is not None or any(
            key in ("password", "ssl_password") for key, _ in parse_qsl(parts.query))
    except ValueError:
        return False


class TelemetryConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Traces exported over OTLP/HTTP (protobuf), one trace per request; needs the ``otel``
    extra. Without ``otlp_endpoint`` nothing is exported and OpenTelemetry is never imported."""

    otlp_endpoint: HttpUrl | None = None
    """The collector's OTLP/HTTP traces URL, e.g. ``http://127.0.0.1:4318/v1/traces`` (a URL
    without a path gets ``/v1/traces``)."""
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    """Sent with every export (e.g. a collector's ``authorization``)."""
    service_name: Name = "firstbyte-router"
    export_interval_s: PositiveSeconds = 1.0
    """Finished spans are sent in a batch at least this often."""


class ClientTimingsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Client-felt latency reported by opted-in clients on ``POST /v1/edge/timings``
    (docs/router.md, "Client-perceived latency"). Accepted by default: a client sends
    reports only when its application opted in, and a report holds timings only."""

    enabled: bool = True
    """False: the path answers 404 and the client histograms stay empty."""
    max_countries: NonNegInt = 50
    """Countries with their own ``country`` label; clients of later ones count as ``other``."""
    max_countries_per_key: NonNegInt = 10
    """Of those, how many one API key may bring in (its clients' later new countries count
    as ``other``), so one tenant cannot fill the table; 0: no bound per key. Only with
    ``auth.api_keys``; a deployment with one key may raise it to ``max_countries``."""
    max_records_per_report: PositiveInt = 100
    """Records one report may hold; more: 400."""
    max_report_bytes: PositiveBytes = 64 << 10
    """Body size of one report; larger: 413."""
    reports_per_s_per_key: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    """Sustained reports per second per API key (a token bucket); 0: no limit. Beyond: 429
    key_rate_limited. Like the other per-key limits, only with ``auth.api_keys``."""
    report_burst_per_key: PositiveInt = 10
    """Reports a key may send at once before its rate applies."""


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    region: Name = "local"
    upstreams: Annotated[list[UpstreamConfig], msgspec.Meta(min_length=1)]
    listen: ListenConfig = msgspec.field(default_factory=ListenConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
    streams: StreamsConfig = msgspec.field(default_factory=StreamsConfig)
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    cors: CorsConfig = msgspec.field(default_factory=CorsConfig)
    # Routing across regions (router/regions_config.py).
    geo: GeoConfig = msgspec.field(default_factory=GeoConfig)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig)
    peers: list[PeerConfig] = msgspec.field(default_factory=list)
    warm_prefixes: list[WarmPrefixConfig] = msgspec.field(default_factory=list)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)
    client_timings: ClientTimingsConfig = msgspec.field(default_factory=ClientTimingsConfig)
    upstream_ca_file: str | None = None
    """PEM CA bundle trusted for TLS to upstreams and peers (default: the public bundle)."""

    def upstream_connections(self) -> int:
        """The upstream pools' size in effect (``limits.upstream_max_connections``)."""
        if self.limits.upstream_max_connections is not None:
            return self.limits.upstream_max_connections
        slots = sum(u.max_in_flight or self.routing.backend_max_in_flight for u in self.upstreams)
        return max(_MIN_UPSTREAM_CONNECTIONS, slots)

    def store_bytes_per_key(self) -> int:
        """The per-key share of the stream store in effect (its default: a quarter)."""
        share = self.limits.max_store_bytes_per_key
        return self.streams.max_total_bytes // 4 if share is None else share

    def __post_init__(self) -> None:
        if self.upstream_ca_file is not None and not Path(self.upstream_ca_file).is_file():
            raise ValueError(f"upstream_ca_file: no such file: {self.upstream_ca_file}")
        check_regions(self.region, self.geo, self.peers, self.routing, self.warm_prefixes)
        listen = self.listen
        if (listen.certfile is None) != (listen.keyfile is None):
            raise ValueError("listen.certfile and listen.keyfile must be given together")
        if listen.certfile is None and not listen.insecure_plain_http:
            raise ValueError(
                "listen.certfile/listen.keyfile are required"
                " (or set listen.insecure_plain_http = true for local use)"
            )
        _check_proxy_protocol(listen)
        _check_upstreams(self.upstreams)
        _check_url_ports(self)
        if listen.http3_advertised_port is not None and (
            listen.certfile is None or not listen.http3
        ):
            # Set for nothing: the operator expects an alt-svc that is never sent.
            raise ValueError(
                "listen.http3_advertised_port: no HTTP/3 to advertise: it needs"
                " listen.certfile/listen.keyfile and listen.http3"
            )
        if listen.server == "uvicorn" and listen.http3 and listen.certfile is not None:
            # uvicorn has no HTTP/3: the flag would silently do nothing.
            raise ValueError("listen.http3 needs listen.server = 'auto' or 'hypercorn'")
        if not listen.insecure_plain_http:
            for i, peer in enumerate(self.peers):
                if not peer.url.startswith("https://"):
                    # A forwarded request carries the client's API key to the peer.
                    raise ValueError(
                        f"peers[{i}].url: must be https (forwarded requests carry clients'"
                        " API keys); plain http only with listen.insecure_plain_http"
                    )
        if listen.workers > 1 and self.state.redis_url is None:
            # N processes with N private stores: a resume, a 0-RTT ticket or a per-key limit
            # would work or not depending on which process the kernel picked.
            raise ValueError(
                f"listen.workers = {listen.workers} needs state.redis_url: processes share"
                " streams, QUIC tickets and limits only through Redis (or set listen.workers = 1)"
            )
        seen: set[str] = set()
        for i, key in enumerate(self.auth.all_keys()):
            if key in seen:
                where = f"auth.keys[{i - len(self.auth.api_keys)}]" if i >= len(
                    self.auth.api_keys) else f"auth.api_keys[{i}]"
                raise ValueError(f"{where}: this key is listed twice")
            seen.add(key)
        if not self.auth.all_keys() and not self.auth.allow_anonymous:
            raise ValueError(
                "auth.api_keys: no API key configured; give one, or set"
                " auth.allow_anonymous = true to accept any request"
            )


def _check_upstreams(upstreams: list[UpstreamConfig]) -> None:
    """Each upstream once: one URL listed twice would count its slots twice, two of one name
    would share one backend's counts (one of them never chosen). An unnamed upstream is named
    by its URL (:attr:`UpstreamConfig.backend_name`). No query or fragment in a URL
    (``/v1/...`` is appended to it)."""
    names: dict[str, int] = {}
    urls: dict[str, int] = {}
    for i, upstream in enumerate(upstreams):
        if "?" in upstream.url or "#" in upstream.url:
            raise ValueError(f"upstreams[{i}].url: no query or fragment: {upstream.url!r}"
                             " (the router appends /v1/... to it)")
        if upstream.base_url in urls:
            raise ValueError(f"upstreams[{i}].url: the same backend as upstreams"
                             f"[{urls[upstream.base_url]}] ({upstream.base_url}): its slots"
                             " would count twice")
        urls[upstream.base_url] = i
        name = upstream.backend_name
        if name in names:
            raise ValueError(f"upstreams[{i}].name: {name!r} is also upstreams[{names[name]}]'s"
                             " name (an unnamed upstream is named by its URL)")
        names[name] = i


def _check_url_ports(config: RouterConfig) -> None:
    """Each URL's port a number from 1 to 65535. The URLs' pattern lets any digits through,
    and the resolver takes the port modulo 65536: ``http://10.0.0.5:73537`` would send
    requests to port 8001, whatever listens there."""
    urls: list[tuple[str, str | None]] = [
        (f"upstreams[{i}].url", u.url) for i, u in enumerate(config.upstreams)
    ]
    for i, peer in enumerate(config.peers):
        urls += [(f"peers[{i}].url", peer.url), (f"peers[{i}].public_url", peer.public_url)]
    urls += [("geo.public_url", config.geo.public_url),
             ("telemetry.otlp_endpoint", config.telemetry.otlp_endpoint)]
    for key, url in urls:
        if url is None:
            continue
        try:
            port = urlsplit(url).port
        except ValueError:
            port = 0
        if port == 0:
            raise ValueError(f"{key}: the port of {url!r} is not a number from 1 to 65535")


def _check_proxy_protocol(listen: ListenConfig) -> None:
    import ipaddress

    for i, cidr in enumerate(listen.proxy_protocol_from):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            raise ValueError(
                f"listen.proxy_protocol_from[{i}]: not an address or CIDR: {cidr!r}"
            ) from None
    if listen.proxy_protocol and not listen.proxy_protocol_from:
        # Trusting a header from anyone would let every client name its own address.
        raise ValueError(
            "listen.proxy_protocol needs listen.proxy_protocol_from: the balancers' addresses"
            " (a header from any other address is never trusted)"
        )


_PATH = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]*)`")


def _describe(exc: msgspec.ValidationError) -> str:
    """Rewrite msgspec's ``msg - at `$.a[0].b``` as ``a[0].b: msg``."""
    text = str(exc)
    match = _PATH.search(text)
    path = match.group("path").lstrip(".") if match else ""
    message = text[: match.start()] if match else text
    unknown = _UNKNOWN.match(message)
    if unknown:
        key = f"{path}.{unknown.group('field')}" if path else unknown.group("field")
        return f"{key}: unknown key"
    return f"{path}: {message}" if path else message


def parse_config(data: dict[str, Any], source: str = "<config>") -> RouterConfig:
    """Validate a configuration mapping (as TOML decodes it)."""
    try:
        return msgspec.convert(data, RouterConfig, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {_describe(exc)}") from None


PATH_KEYS = (
    "listen.certfile",
    "listen.keyfile",
    "listen.pid_file",
    "upstream_ca_file",
    "geo.database",
    "warm_prefixes[].file",
    "state.redis_password_file",
    "state.redis_ca_file",
)
"""Every config key holding a file path (``[]``: each entry of that list)."""


def resolve_paths(data: dict[str, Any], base_dir: Path) -> None:
    """Make every relative path of :data:`PATH_KEYS` in ``data`` (a decoded TOML document)
    absolute against ``base_dir``, in place; values of the wrong type are left for validation."""
    for key in PATH_KEYS:
        section, _, name = key.rpartition(".")
        if not section:
            tables = [data]
        elif section.endswith("[]"):
            items = data.get(section[:-2])
            tables = [t for t in items if isinstance(t, dict)] if isinstance(items, list) else []
        else:
            table = data.get(section)
            tables = [table] if isinstance(table, dict) else []
        for table in tables:
            value = table.get(name)
            if isinstance(value, str) and value and not Path(value).is_absolute():
                table[name] = str(base_dir / value)


def load_config(path: str | Path) -> RouterConfig:
    """Read and validate a TOML file; every failure is a :class:`ConfigError` naming it.

    Relative file paths in it are resolved against the file's own directory."""
    source = str(path)
    try:
        text = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    resolve_paths(data, Path(path).absolute().parent)
    return parse_config(data, source)
