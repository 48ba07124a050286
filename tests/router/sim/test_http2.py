"""HTTP/2: over TLS with ALPN (trustme certificates), and h2c with prior knowledge."""

from __future__ import annotations

import httpx
import pytest

from firstbyte.protocol.sse import DONE, SSEDecoder
from firstbyte.router.sim.server import running_sim
from tests.router.conftest import client_tls
from tests.router.sim.helpers import MODEL, chat_body


async def stream_events(client: httpx.AsyncClient, url: str) -> tuple[str, list[str]]:
    body = chat_body("over h2", max_tokens=5)
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        decoder = SSEDecoder()
        data = [e.data async for piece in response.aiter_raw() for e in decoder.receive_data(piece)]
        return response.http_version, data


async def test_http2_over_tls_negotiates_and_streams(tls_files: dict[str, str]) -> None:
    certfile, keyfile = tls_files["certfile"], tls_files["keyfile"]
    context = client_tls(tls_files)
    async with (
        running_sim("instant", served_model_names=[MODEL], certfile=certfile, keyfile=keyfile) as url,
        httpx.AsyncClient(http2=True, verify=context) as client,
    ):
        assert url.startswith("https://")
        version, data = await stream_events(client, url)
        assert version == "HTTP/2"
        assert data[-1] == DONE
        assert len(data) == 1 + 5 + 1 + 1  # role, 5 tokens, finish, [DONE]
        # Several streams share the one connection.
        models = await client.get(f"{url}/v1/models")
        assert models.http_version == "HTTP/2"
        # HTTP/1.1 clients still work on the same listener.
        async with httpx.AsyncClient(verify=context) as h1:
            version, data = await stream_events(h1, url)
            assert version == "HTTP/1.1"
            assert data[-1] == DONE


async def test_h2c_prior_knowledge_on_hypercorn() -> None:
    async with (
        running_sim("instant", served_model_names=[MODEL], server="hypercorn") as url,
        httpx.AsyncClient(http1=False, http2=True) as client,
    ):
        version, data = await stream_events(client, url)
        assert version == "HTTP/2"
        assert data[-1] == DONE


async def test_drop_over_http2_resets_only_that_stream(tls_files: dict[str, str]) -> None:
    certfile, keyfile = tls_files["certfile"], tls_files["keyfile"]
    context = client_tls(tls_files)
    async with (
        running_sim("instant", served_model_names=[MODEL], certfile=certfile, keyfile=keyfile, faults=["drop:after=2"]) as url,
        httpx.AsyncClient(http2=True, verify=context) as client,
    ):
        with pytest.raises(httpx.RemoteProtocolError):
            await stream_events(client, url)
        # The connection itself lives on: the next stream on it completes.
        body = chat_body("short", max_tokens=1)
        r = await client.post(f"{url}/v1/chat/completions", json={**body, "stream": False})
        assert r.http_version == "HTTP/2"
        assert r.status_code == 200
