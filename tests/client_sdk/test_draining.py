"""A router that shuts down (SIGTERM's drain) before a stream ends: the stream ends with a
``draining`` error event. Before any content the SDK sends the request again (the next router
takes it) and the caller sees only the full answer; after some content it raises
:class:`StreamLostError` with what was delivered, as for a router that died."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import APIError, StreamLostError
from firstbyte.router.config import parse_config
from firstbyte.router.drain import drain
from firstbyte.router.serve import RouterEndpoints, running_router
from firstbyte.router.sim.server import running_sim
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.test_client import MESSAGES

TRANSPORTS = [("sse", "1.1"), ("sse", "2"), ("websocket", "1.1"), ("longpoll", "1.1")]


@contextlib.asynccontextmanager
async def _region(
    tls_files: tuple[str, str, str], name: str, faults: list[str]
) -> AsyncIterator[RouterEndpoints]:
    """A sim and a router in front of it that drains within 0.3 s."""
    _, cert_file, key_file = tls_files
    async with running_sim("instant", faults=faults, seed=7) as sim_url:
        config = parse_config({
            "region": name,
            "upstreams": [{"url": sim_url}],
            "listen": {"host": "127.0.0.1", "port": 0, "certfile": cert_file,
                       "keyfile": key_file, "drain_timeout_s": 0.3},
            "auth": {"api_keys": [ROUTER_KEY]},
            "limits": {"heartbeat_interval_s": 0.2},
        }, "<sdk-test>")  # fmt: skip
        async with running_router(config) as endpoints:
            yield endpoints


def _url(router: RouterEndpoints) -> str:
    return f"https://localhost:{router.port}/v1"


def _client(
    base_url: str | dict[str, str], tls_files: tuple[str, str, str], transport: str, http: str
) -> AsyncClient:
    return AsyncClient(
        base_url, ROUTER_KEY, transport=transport, http=http,  # type: ignore[arg-type]
        ca_file=tls_files[0],
    )


@pytest.mark.parametrize(("transport", "http"), TRANSPORTS)
async def test_draining_before_content_sends_the_request_again(
    tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    async with (
        _region(tls_files, "first", ["stall:after=0"]) as first,  # never a token
        _region(tls_files, "second", []) as second,
        _client({"first": _url(first), "second": _url(second)}, tls_files, transport, http)
        as client,
    ):
        async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=12) as stream:
            first_id = stream.stream_id
            draining = asyncio.ensure_future(drain(first.app, None))
            text = "".join([delta.text async for delta in stream])
        await draining
        assert len(text.split()) == 12
        assert stream.text == text
        assert stream.stream_id != first_id  # a new stream, on the second region's router
        assert stream.timings.region == "second"
        assert stream.timings.first_token_ms is not None
        assert stream.timings.first_token_ms >= 300  # the wasted attempt is in the timings


@pytest.mark.parametrize(("transport", "http"), TRANSPORTS)
async def test_draining_after_content_raises_stream_lost_with_the_text(
    tls_files: tuple[str, str, str], transport: str, http: str
) -> None:
    async with (
        _region(tls_files, "only", ["stall:after=3"]) as only,
        _client(_url(only), tls_files, transport, http) as client,
    ):
        received = ""
        drained: list[asyncio.Future[None]] = []

        async def read() -> None:
            nonlocal received
            async with client.stream(
                model="sim-instant", messages=MESSAGES, max_tokens=12
            ) as stream:
                async for delta in stream:
                    received += delta.text
                    if len(received.split()) == 3 and not drained:
                        drained.append(asyncio.ensure_future(drain(only.app, None)))

        with pytest.raises(StreamLostError) as lost:
            await read()
        await drained[0]
    assert lost.value.delivered_text == received
    assert len(received.split()) == 3
    assert lost.value.stream_id
    assert "its router shut down before the end" in str(lost.value)


async def test_a_websocket_upgrade_refused_draining_goes_to_the_next_region(
    tls_files: tuple[str, str, str],
) -> None:
    """A draining router refuses the upgrade itself (``503 draining``, ``Retry-After``): the
    SDK reads it as a request's refusal and the stream is served by the next region; alone,
    the caller gets that 503."""
    async with (
        _region(tls_files, "first", []) as first,
        _region(tls_files, "second", []) as second,
        _client({"first": _url(first), "second": _url(second)}, tls_files, "websocket", "1.1")
        as client,
        _client(_url(first), tls_files, "websocket", "1.1") as alone,
    ):
        first.app.state.start_draining()
        async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=4) as stream:
            text = "".join([delta.text async for delta in stream])
        with pytest.raises(APIError) as refused:
            await _read(alone)
    assert len(text.split()) == 4
    assert stream.timings.region == "second"
    assert (refused.value.status, refused.value.code) == (503, "draining")
    assert getattr(refused.value, "retry_after", None) == 1
    assert first.app.state.metrics.requests[("ws", "draining", "")] >= 2  # both clients'


async def _read(client: AsyncClient) -> str:
    async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=4) as stream:
        return "".join([delta.text async for delta in stream])
