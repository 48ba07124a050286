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
WAN_RTT_S = 0.151
"""The round trip the coordinator measured where users are (the WAN emulator's)."""


def _relay(url: str) -> TcpCutProxy:
    port = urlsplit(url).port
    assert port is not None
    return TcpCutProxy(port, cut_after=1 << 62, cuts=0, record=True)


async def _prompt_tokens(client: AsyncClient) -> int:
    async with client.stream(model=MODEL, messages=HISTORY, max_tokens=2) as stream:
        async for _ in stream:
            pass
    assert stream.usage is not None
    return stream.usage.prompt_tokens


def _sent_gzip(relay: TcpCutProxy) -> int:
    """How many request heads the relay saw say their body is gzipped."""
    return bytes(relay.upstream_bytes).lower().count(b"\r\ncontent-encoding: gzip\r\n")


async def test_forced_compression_sends_a_long_history_gzipped(
    start_router: RouterFactory,
) -> None:
    body_bytes = len(json.dumps({"model": MODEL, "messages": HISTORY}))
    assert body_bytes > 3 * COMPRESS_MIN_BYTES
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            start_router([sim], tls=False) as r:
        async with _relay(r.base_url) as plain_relay, \
                AsyncClient(f"http://127.0.0.1:{plain_relay.port}/v1", API_KEY,
                            compress_requests=False) as plain:
            expected = await _prompt_tokens(plain)
        async with _relay(r.base_url) as relay, \
                AsyncClient(f"http://127.0.0.1:{relay.port}/v1", API_KEY,
                            compress_requests=True) as forced:
            tokens = await _prompt_tokens(forced)
            warmed = await forced.warm_prompt(model=MODEL, messages=HISTORY)
            async with forced.stream(model=MODEL, messages=HISTORY[:1], max_tokens=2) as short:
                async for _ in short:
                    pass
        async with _relay(r.base_url) as poll_relay, \
                AsyncClient(f"http://127.0.0.1:{poll_relay.port}/v1", API_KEY,
                            transport="longpoll", compress_requests=True) as polled:
            poll_tokens = await _prompt_tokens(polled)
    assert tokens == expected == poll_tokens
    assert expected > 5000
    assert warmed is not None
    assert warmed.prompt_tokens == expected
    assert _sent_gzip(plain_relay) == 0
    assert len(plain_relay.upstream_bytes) > body_bytes
    assert _sent_gzip(relay) == 2  # the stream and the warm-up; the short prompt went as it is
    assert len(relay.upstream_bytes) < body_bytes  # both long bodies, and the short one, in less
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
        await _prompt_tokens(client)
        assert _sent_gzip(relay) == 0
        session.rtt_s = WAN_RTT_S  # what a connection from where users are measures
        await _prompt_tokens(client)
        assert _sent_gzip(relay) == 1


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
        assert await _prompt_tokens(client) > 5000
    assert _sent_gzip(relay) == 0
    assert len(relay.upstream_bytes) > len(json.dumps(HISTORY))
