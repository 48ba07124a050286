"""Configuration sections for routing across regions (TOML -> msgspec Structs).

These Structs are sections of :class:`firstbyte.router.config.RouterConfig`::

    region = "tokyo"

    [geo]                       # where this region is, and how clients are located
    latitude = 35.68
    longitude = 139.69
    public_url = "https://tokyo.example.com"
    database = "/var/lib/GeoIP/GeoLite2-City.mmdb"
    trusted_proxies = ["10.0.0.0/8"]

    [routing]
    peer_key = "a long shared secret"   # router-to-router authentication
    first_token_deadline_ms = 2000

    [[peers]]
    name = "frankfurt"
    url = "https://frankfurt.example.com"
    latitude = 50.11
    longitude = 8.68

    [[warm_prefixes]]
    name = "support-bot"
    text = "You are a helpful support agent..."
    models = ["llama-3-8b"]      # empty: every model

    [warmup]
    interval_s = 60

Every field carries its unit in its name. Cross-field rules live in :func:`check_regions`,
which :class:`~firstbyte.router.config.RouterConfig` calls so that errors name the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

__all__ = [
    "GeoConfig",
    "PeerConfig",
    "RoutingConfig",
    "WarmPrefixConfig",
    "WarmupConfig",
    "check_regions",
]

Latitude = Annotated[float, msgspec.Meta(ge=-90.0, le=90.0)]
Longitude = Annotated[float, msgspec.Meta(ge=-180.0, le=180.0)]
HttpUrl = Annotated[str, msgspec.Meta(pattern=r"^https?://[^/\s]+(/\S*)?$")]
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
NonNegMs = Annotated[float, msgspec.Meta(ge=0)]
Ratio = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class GeoConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """This region's location and how a client's location is found.

    ``latitude``/``longitude`` may be omitted when ``region`` is a known cloud region code
    (``ap-northeast-1``, see ``router/data/regions.tsv``). Without ``database`` every client
    counts as local to this region.
    """

    latitude: Latitude | None = None
    longitude: Longitude | None = None
    public_url: HttpUrl | None = None
    """Where clients reach this region directly (sent to clients and peers as a hint)."""
    database: str | None = None
    """A GeoIP2/GeoLite2 City ``.mmdb`` file."""
    trusted_proxies: list[str] = msgspec.field(default_factory=list)
    """CIDRs whose ``forwarded_header`` is believed."""
    forwarded_header: Literal["x-forwarded-for", "forwarded"] = "x-forwarded-for"
    """The one header the trusted proxies set; the other is ignored (a client could send it)."""


class PeerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Another region's router."""

    name: Name
    url: HttpUrl
    latitude: Latitude | None = None
    longitude: Longitude | None = None
    public_url: HttpUrl | None = None
    """Where clients reach that region directly; defaults to ``url``."""


class RoutingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How requests are placed on regions and backends."""

    peer_key: Annotated[str, msgspec.Meta(min_length=16)] | None = None
    """Shared secret of the routers of one deployment; required when ``peers`` are set."""
    backend_policy: Literal["prefix", "round_robin", "least_loaded"] = "prefix"
    affinity_chars: Annotated[int, msgspec.Meta(ge=1)] = 256
    """How much of the prompt after the shared prefix keys backend affinity."""
    balance_abs_threshold: Annotated[int, msgspec.Meta(ge=0)] = 8
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1.0)] = 1.5
    """Affinity yields to least-loaded when max-min load exceeds abs AND max > rel * min."""
    bounded_load_factor: Annotated[float, msgspec.Meta(ge=1.0)] = 1.0
    """A new affinity key may not give a backend more than this times its fair share of keys."""
    affinity_ttl_s: PositiveSeconds = 600.0
    spill_budget_ratio: Ratio = 0.2
    """At most this share of active requests may be spilling to peers (Envoy's retry budget)."""
    spill_min_concurrency: Annotated[int, msgspec.Meta(ge=0)] = 3
    first_token_deadline_ms: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """A request without a first token by then is spilled (before any token was sent)."""
    forward_overhead_ms: NonNegMs = 5.0
    """Extra cost charged for serving from a peer (the additional hop's processing)."""
    forward_margin_ms: NonNegMs = 20.0
    """A peer must beat this region by this much before a request is forwarded to it."""
    prefill_ms_per_1k_tokens: NonNegMs = 16.0
    """Uncached prefill cost used to compare regions (a 7B model on an H100: ~4K tokens/65 ms)."""
    peer_poll_interval_s: PositiveSeconds = 1.0
    peer_status_ttl_s: PositiveSeconds = 5.0
    """Peer state older than this counts as unknown (not a candidate)."""
    models_refresh_s: PositiveSeconds = 30.0
    """How often each upstream without configured ``models`` is asked for its ``/v1/models``
    (also once before serving); a request goes only to a backend listing its model."""
    backend_metrics_interval_s: PositiveSeconds = 1.0
    backend_max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 1024
    """Default cap on requests in flight per backend when an upstream sets none. A cap, not
    the trigger: a backend that reports metrics is saturated by what it reports (its learned
    capacity, :mod:`firstbyte.router.backpressure`); one that does not (``kind = "openai"``)
    is saturated only at this cap."""
    backend_max_waiting: Annotated[int, msgspec.Meta(ge=0)] = 4
    """Queue allowed on a backend beyond its learned capacity: a backend whose waiting queue
    outlives a scrape interval and is longer than this is saturated (a few waiting for one
    scheduler step are normal and ignored)."""
    max_queue_wait_ms: NonNegMs = 0.0
    """A saturated region that cannot spill still queues a request on its least-loaded
    backend if the expected wait is at most this; beyond it: 429. 0: never queue."""
    first_byte_timeout_ttft_multiple: Annotated[float, msgspec.Meta(ge=1.0)] = 4.0
    """A streamed request whose local backend sent no byte of its answer within this many
    times the backend's recent high TTFT (95th percentile of its last 64) is taken away
    from it and the backend ejected (passive health), within the two bounds below."""
    first_byte_timeout_min_s: PositiveSeconds = 5.0
    """The first-byte deadline is never shorter than this (a fast backend's jitter)."""
    first_byte_timeout_max_s: PositiveSeconds = 60.0
    """Nor longer than this; also the deadline before any TTFT was observed in the region."""
    backend_eject_consecutive_5xx: Annotated[int, msgspec.Meta(ge=1)] = 5
    """This many 5xx answers in a row from a local backend (none served between) eject it."""
    backend_eject_s: PositiveSeconds = 10.0
    """An ejected backend (first-byte timeout, 5xx) stays out of rotation at least this long;
    then a metrics scrape that answers re-admits it (without scrapes: it is tried again)."""
    max_fair_wait_ms: NonNegMs = 5000.0
    """A saturated region that cannot spill holds a request below its fair share (of its key,
    then of its subject) in this process for a free slot, at most this long, instead of
    sending it past a backend's limit; past it: 429 ``region_saturated``. A slot that frees
    goes to the waiter of the flow furthest below its share before any new arrival. 0: no
    waiting (such a request is queued on a backend, past its limit)."""


class WarmPrefixConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A shared system prompt kept in every backend's prefix cache."""

    name: Name
    text: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    file: str | None = None
    models: list[str] = msgspec.field(default_factory=list)
    """Models it applies to; empty: every model the region serves."""


class WarmupConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    enabled: bool = True
    interval_s: PositiveSeconds = 60.0
    """Re-probe each (backend, prefix) this often; a probe of a warm prefix costs ~one block."""
    pressure_interval_s: PositiveSeconds = 5.0
    """Re-probe this often while ``vllm:gpu_cache_usage_perc`` is at or above the pressure mark."""
    cache_pressure_perc: Ratio = 0.9
    busy_running_threshold: Annotated[int, msgspec.Meta(ge=0)] = 4
    """Never warm a backend running more than this many requests (or with any waiting)."""
    retry_s: PositiveSeconds = 2.0
    startup_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    """At start, serve only once every prefix is warm everywhere, or after this long."""


def check_regions(
    region: str,
    geo: GeoConfig,
    peers: list[PeerConfig],
    routing: RoutingConfig,
    warm_prefixes: list[WarmPrefixConfig],
    base_dir: Path | None = None,
) -> None:
    """Cross-field rules; raises ``ValueError`` whose message starts with the key."""
    from firstbyte.router.geo import TrustedProxies, known_regions

    if (geo.latitude is None) != (geo.longitude is None):
        raise ValueError("geo.latitude and geo.longitude must be given together")
    if geo.latitude is None and peers and region not in known_regions():
        raise ValueError(
            f"geo.latitude/geo.longitude: required with peers (region {region!r} is not a"
            " known cloud region code)"
        )
    try:
        TrustedProxies(geo.trusted_proxies)
    except ValueError as exc:
        raise ValueError(f"geo.trusted_proxies: {exc}") from None
    if geo.database is not None and not _resolve(geo.database, base_dir).is_file():
        raise ValueError(f"geo.database: no such file: {geo.database}")
    seen: set[str] = set()
    for i, peer in enumerate(peers):
        if peer.name == region:
            raise ValueError(f"peers[{i}].name: {peer.name!r} is this router's own region")
        if peer.name in seen:
            raise ValueError(f"peers[{i}].name: duplicate peer {peer.name!r}")
        seen.add(peer.name)
        if (peer.latitude is None) != (peer.longitude is None):
            raise ValueError(f"peers[{i}]: latitude and longitude must be given together")
        if peer.latitude is None and peer.name not in known_regions():
            raise ValueError(
                f"peers[{i}].latitude: required ({peer.name!r} is not a known region code)"
            )
    if peers and routing.peer_key is None:
        raise ValueError("routing.peer_key: required when peers are configured")
    names: set[str] = set()
    for i, prefix in enumerate(warm_prefixes):
        if (prefix.text is None) == (prefix.file is None):
            raise ValueError(f"warm_prefixes[{i}]: give exactly one of text or file")
        if prefix.file is not None and not _resolve(prefix.file, base_dir).is_file():
            raise ValueError(f"warm_prefixes[{i}].file: no such file: {prefix.file}")
        if prefix.name in names:
            raise ValueError(f"warm_prefixes[{i}].name: duplicate {prefix.name!r}")
        names.add(prefix.name)


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p


def warm_prefix_text(prefix: WarmPrefixConfig, base_dir: Path | None = None) -> str:
    """The prompt text of a warm prefix (inline, or read from its file)."""
    if prefix.text is not None:
        return prefix.text
    assert prefix.file is not None
    return _resolve(prefix.file, base_dir).read_text(encoding="utf-8")
