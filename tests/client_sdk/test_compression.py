"""When the SDK gzips a request body (:func:`should_compress`), sans-IO."""

from __future__ import annotations

import pytest

from firstbyte.client_sdk import AsyncClient
from firstbyte.client_sdk._core.compression import AUTO_MIN_RTT_S, should_compress
from firstbyte.client_sdk.errors import ConfigurationError
from firstbyte.protocol.content_coding import COMPRESS_MIN_BYTES

BIG = 40_000
ROUTER = "gzip, deflate"
WAN_S = 0.151


@pytest.mark.parametrize(("size", "mode", "accept_encoding", "rtt_s", "compress"), [
    (BIG, "auto", ROUTER, WAN_S, True),
    (BIG, "auto", ROUTER, AUTO_MIN_RTT_S, True),
    (BIG, "auto", ROUTER, 0.0002, False),  # loopback: the CPU costs more than a round trip
    (BIG, "auto", ROUTER, None, False),  # no round trip measured yet
    (BIG, "auto", None, WAN_S, False),  # the server never said it takes gzip
    (BIG, "auto", "deflate", WAN_S, False),
    (BIG, "auto", "gzip;q=0", WAN_S, False),
    (COMPRESS_MIN_BYTES, "auto", ROUTER, WAN_S, False),  # fits the first flight as it is
    (COMPRESS_MIN_BYTES + 1, True, None, None, True),
    (COMPRESS_MIN_BYTES, True, None, None, False),
    (BIG, False, ROUTER, WAN_S, False),
])
def test_should_compress(
    size: int, mode: bool | str, accept_encoding: str | None, rtt_s: float | None,
    compress: bool,
) -> None:
    assert should_compress(size, mode, accept_encoding=accept_encoding,  # type: ignore[arg-type]
                           rtt_s=rtt_s) is compress


def test_compress_requests_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="compress_requests"):
        AsyncClient("http://127.0.0.1:9", compress_requests="always")  # type: ignore[arg-type]
