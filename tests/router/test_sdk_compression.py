"""The SDK's request-body compression against the real router and the sim, over loopback with
a relay that keeps what the SDK sent: forced, a 40 KB history goes gzipped and the backend
counts the same prompt; ``"auto"`` gzips only for a server that advertised and over a round
trip worth saving (one measured on loopback is not; a WAN's is put in its place)."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from firstbyte.client_sdk import AsyncClient
from firstbyte.protocol.content_coding import COMPRESS_MIN_BYTES
from firstbyte.router.sim.server import running_sim
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.router.conftest import API_KEY, RouterFactory

MODEL = "m"
HISTORY = [{"role": "user" if i % 2 == 0 else "assistant",
            "content": " ".join(f"turn {i} says word{j % 89} about the tides" for j in range(50))}
           for i in range(30)]
"""A conversation of ~40 KB of JSON: more than TCP's initial window."""
BODY_BYTES = len(json.dumps({"model": MODEL, "messages": HISTORY}, separators=(",", ":")))
WAN_RTT_S = 0.151
"""The round trip the coordinator measured where users are (the WAN emulator's)."""


def _relay(url: str) -> TcpCutProxy:
    port = urlsplit(url).port
    assert port is not None
    return TcpCutProxy(port, cut_after=1 << 62, cuts=0, record=True)


async def _stream_long(client: AsyncClient) -> tuple[int, int]:
    """Stream the long history: the prompt tokens the backend counted, and the body's bytes
    as sent (``Timings.request_bytes``)."""
    async with client.stream(model=MODEL, messages=HISTORY, max_tokens=2) as stream:
        async for _ in stream:
            pass
    assert stream.usage is not None
    assert stream.timings.request_bytes is not None
    return stream.usage.prompt_tokens, stream.timings.request_bytes


def _sent_gzip(relay: TcpCutProxy) -> int:
    """How many request heads the relay saw say their body is gzipped."""
    return bytes(relay.upstream_bytes).lower().count(b"\r\ncontent-encoding: gzip\r\n")


async def test_forced_compression_sends_a_long_history_gzipped(
    start_router: RouterFactory,
) -> None:
    assert BODY_BYTES > 3 * COMPRESS_MIN_BYTES
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            start_router([sim], tls=False) as r:
        async with _relay(r.base_url) as plain_relay, \
                AsyncClient(f"http://127.0.0.1:{plain_relay.port}/v1", API_KEY,
                            compress_requests=False) as plain:
            expected, plain_sent = await _stream_long(plain)
        async with _relay(r.base_url) as relay, \
                AsyncClient(f"http://127.0.0.1:{relay.port}/v1", API_KEY,
                            compress_requests=True) as forced:
            tokens, forced_sent = await _stream_long(forced)
            warmed = await forced.warm_prompt(model=MODEL, messages=HISTORY)
            async with forced.stream(model=MODEL, messages=HISTORY[:1], max_tokens=2) as short:
                async for _ in short:
                    pass
        async with _relay(r.base_url) as poll_relay, \
                AsyncClient(f"http://127.0.0.1:{poll_relay.port}/v1", API_KEY,
                            transport="longpoll", compress_requests=True) as polled:
            poll_tokens, _ = await _stream_long(polled)
    assert tokens == expected == poll_tokens
    assert plain_sent > BODY_BYTES  # with stream options added
    assert forced_sent < BODY_BYTES // 3
    assert expected > 5000
    assert warmed is not None
    assert warmed.prompt_tokens == expected
    assert _sent_gzip(plain_relay) == 0
    assert len(plain_relay.upstream_bytes) > BODY_BYTES
    assert _sent_gzip(relay) == 2  # the stream and the warm-up; the short prompt went as it is
    assert len(relay.upstream_bytes) < BODY_BYTES  # both long bodies, and the short one, in less
    assert _sent_gzip(poll_relay) == 1


async def test_auto_compresses_for_an_advertising_router_over_a_long_round_trip(
    start_router: RouterFactory,
) -> None:
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            start_router([sim], tls=False) as r, _relay(r.base_url) as relay, \
            AsyncClient(f"http://127.0.0.1:{relay.port}/v1", API_KEY, http="1.1") as client:
        await client.prewarm()  # GET /healthz: the router's answer advertises gzip
        session = client.pool.session(client.origin, client.http)
        assert session.accept_encoding == "gzip, deflate"
        assert session.rtt_s is not None
        assert session.rtt_s > 0
        session.rtt_s = 0.0005  # as loopback measures it: compressing would cost more
        _, loopback_sent = await _stream_long(client)
        assert _sent_gzip(relay) == 0
        session.rtt_s = WAN_RTT_S  # what a connection from where users are measures
        _, wan_sent = await _stream_long(client)
        assert _sent_gzip(relay) == 1
    assert loopback_sent > BODY_BYTES
    assert wan_sent < BODY_BYTES // 3


async def test_auto_never_compresses_for_a_server_that_did_not_advertise() -> None:
    """Pointed at the sim (an inference server, no ``Accept-Encoding``), even over a long
    round trip: it would not know what to do with a gzipped body."""
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            _relay(sim) as relay, \
            AsyncClient(f"http://127.0.0.1:{relay.port}/v1", http="1.1") as client:
        await client.prewarm()
        session = client.pool.session(client.origin, client.http)
        assert session.accept_encoding is None
        session.rtt_s = WAN_RTT_S
        tokens, sent = await _stream_long(client)
    assert tokens > 5000
    assert sent > BODY_BYTES
    assert _sent_gzip(relay) == 0
    assert len(relay.upstream_bytes) > len(json.dumps(HISTORY))
