"""When the SDK gzips a request body: a sans-IO decision over what the client has measured.

A body over :data:`~firstbyte.protocol.content_coding.COMPRESS_MIN_BYTES` (10 KiB) is more
than fits comfortably in TCP's first flight (10 segments, ~14.5 KB, and the window restarts
after an idle period), so sent as it is it costs one more round trip; gzipped (~3x on a
conversation's JSON) it does not. Gzipping 40 KB costs ~0.5 ms of CPU (inflating it, under
0.1 ms), against a round trip it may save: worth it when the round trip is at least
:data:`AUTO_MIN_RTT_S`, not on loopback or in the same rack. And only for a server that said
it takes gzip bodies (``Accept-Encoding`` on an answer, RFC 7694 section 3: the router's
``/v1/edge/warm`` answers); any other server would refuse or misread one.
"""

from __future__ import annotations

from typing import Literal

from firstbyte.protocol.content_coding import COMPRESS_MIN_BYTES, advertises_gzip

__all__ = ["AUTO_MIN_RTT_S", "CompressMode", "should_compress"]

CompressMode = bool | Literal["auto"]
"""``compress_requests``: ``"auto"`` (the default), ``True`` (always, over 10 KiB), ``False``."""

AUTO_MIN_RTT_S = 0.005
"""Under this round trip, ``"auto"`` sends bodies as they are: the round trip compressing
could save costs less than compressing does."""


def should_compress(
    size: int,
    mode: CompressMode,
    *,
    accept_encoding: str | None,
    rtt_s: float | None,
    min_rtt_s: float = AUTO_MIN_RTT_S,
) -> bool:
    """Gzip a body of ``size`` bytes? Never at or under 10 KiB or with ``mode`` False; always
    over it with True; with ``"auto"``, only when the server's ``accept_encoding`` lists gzip
    and the measured round trip ``rtt_s`` (None: not measured) is at least ``min_rtt_s``."""
    if mode is False or size <= COMPRESS_MIN_BYTES:
        return False
    if mode is True:
        return True
    return advertises_gzip(accept_encoding) and rtt_s is not None and rtt_s >= min_rtt_s
