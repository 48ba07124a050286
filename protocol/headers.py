"""The HTTP header names of firstbyte's protocol (docs/protocol.md, "Response headers").

All lower case, as HTTP/2 and HTTP/3 send them (HTTP/1.1 names are case-insensitive).
"""

from __future__ import annotations

__all__ = [
    "BETTER_REGION_HEADER",
    "BETTER_REGION_URL_HEADER",
    "FORWARDED_HEADER",
    "PEER_KEY_HEADER",
    "REGION_HEADER",
    "STREAM_HEADER",
]

STREAM_HEADER = "x-firstbyte-stream"
"""Response: the id of the stream the answer belongs to (resume with it)."""

REGION_HEADER = "x-firstbyte-region"
"""Response (and WebSocket upgrade): the region whose router served the request."""

BETTER_REGION_HEADER = "x-firstbyte-better-region"
"""Response: a peer region expected to answer this client first; a hint only."""

BETTER_REGION_URL_HEADER = "x-firstbyte-better-region-url"
"""Response: the base URL of :data:`BETTER_REGION_HEADER`, when its router publishes one."""

PEER_KEY_HEADER = "x-firstbyte-peer-key"
"""Router-to-router request: the shared peer secret (authenticates a peer region)."""

FORWARDED_HEADER = "x-firstbyte-forwarded"
"""Router-to-router request: the region that forwarded it, so it is never forwarded again."""
