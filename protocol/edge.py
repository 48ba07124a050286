"""The ``GET /v1/edge/status`` document (docs/protocol.md, "Other endpoints").

Every router publishes its region's status there. A peer router (or a dashboard) holding a key
that may see it gets :class:`EdgeStatusReport`: the :class:`EdgeStatus` a peer decides on, plus
the router's own counters. Anyone else gets :class:`PublicEdgeStatus`, what a client needs to
find the deployment's regions. Decoders ignore fields they do not know, so a reader of the
smaller document can read the larger one.
"""

from __future__ import annotations

import hashlib

import msgspec

__all__ = [
    "BackendStatus",
    "EdgeStatus",
    "EdgeStatusReport",
    "ModelStatus",
    "PeerLink",
    "PublicEdgeStatus",
    "prefix_hash",
]


def prefix_hash(text: str) -> str:
    """The published identity of a warm prefix (its text is not published)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class BackendStatus(msgspec.Struct, kw_only=True):
    name: str
    healthy: bool
    in_flight: int
    load: int
    max_in_flight: int
    saturated: bool
    ttft_ms: float | None = None
    warm_prefixes: list[str] = msgspec.field(default_factory=list)
    """Names of the prefixes this backend holds warm."""


class ModelStatus(msgspec.Struct, kw_only=True):
    """One model a region serves, and its room: the region's figures over the backends that
    serve it (a peer routes a request for ``name`` by these, not by the region's)."""

    name: str
    healthy: bool
    """At least one backend serving it answers."""
    saturated: bool
    in_flight: int
    capacity: int
    queue_wait_ms: float


class PeerLink(msgspec.Struct, kw_only=True):
    """A peer region as clients may reach it (for the SDK's region list)."""

    name: str
    url: str
    up: bool = True


class EdgeStatus(msgspec.Struct, kw_only=True):
    """What a peer needs to decide whether to send this region a request."""

    region: str
    healthy: bool
    saturated: bool
    in_flight: int
    capacity: int
    queue_wait_ms: float
    latitude: float | None = None
    longitude: float | None = None
    public_url: str | None = None
    ttft_ms: float | None = None
    warm_prefixes: list[str] = msgspec.field(default_factory=list)
    """Hashes (:func:`prefix_hash`) of the prefixes warm on at least one backend."""
    backends: list[BackendStatus] = msgspec.field(default_factory=list)
    peers: list[PeerLink] = msgspec.field(default_factory=list)
    models: list[ModelStatus] | None = None
    """The models the region's backends serve (configured or listed by them), each with its
    room; None from a router older than per-model routing (taken to serve any model)."""


class EdgeStatusReport(EdgeStatus, kw_only=True):
    """The whole document, for a key that may see it: :class:`EdgeStatus` and then ``streams``
    (held in the store), ``warm`` (``{backend: {prefix name: state}}``) and ``time`` (Unix)."""

    streams: int
    warm: dict[str, dict[str, str]]
    time: float


class PublicEdgeStatus(msgspec.Struct, kw_only=True):
    """The document without a key: the region, whether it serves, where it is and its peers."""

    region: str
    healthy: bool = True
    public_url: str | None = None
    latitude: float | None = None
    longitude: float | None = None
    peers: list[PeerLink] = msgspec.field(default_factory=list)
