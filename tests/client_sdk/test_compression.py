"""When the SDK gzips a request body (:func:`should_compress`, sans-IO), and what its HTTP/3
session measures for it."""

from __future__ import annotations

import pytest

from firstbyte.client_sdk import AsyncClient
from firstbyte.client_sdk._core.compression import AUTO_MIN_RTT_S, should_compress
from firstbyte.client_sdk.errors import ConfigurationError
from firstbyte.protocol.content_coding import COMPRESS_MIN_BYTES
from tests.client_sdk.conftest import ROUTER_KEY, Stack

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


async def test_http3_measures_its_round_trip_and_hears_the_router(stack: Stack) -> None:
    """Over HTTP/3 the round trip is QUIC's own estimate, known from the handshake (the
    prewarm sends no request); the router's warm-up answer says it takes gzip."""
    async with AsyncClient(stack.base_url, ROUTER_KEY, http="3", ca_file=stack.ca_file) as client:
        await client.prewarm()
        session = client.pool.session(client.origin, "3")
        assert session.rtt_s is not None
        assert 0 < session.rtt_s < 1
        assert session.accept_encoding is None
        await client.warm_prompt(model="sim-instant",
                                 messages=[{"role": "user", "content": "hi"}])
        assert session.accept_encoding == "gzip, deflate"
