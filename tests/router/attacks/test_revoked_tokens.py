"""A removed key's client tokens, tried against a real router process over TLS after SIGHUP:
every path that takes a token answers 401 ``client_token_revoked`` from the reload on, over
HTTP/1.1 and HTTP/2 and on a WebSocket, while the canary streams on; the log has no
traceback."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from firstbyte.protocol import error_codes
from tests.router.conftest import API_KEY, OTHER_KEY, auth
from tests.router.upstream import Upstream

from .conftest import RouterStarter, canary_running, chat_body, router_sections, write_config

SECRET = "x" * 40


async def _paths(client: httpx.AsyncClient, base: str, token: str,
                 stream_id: str) -> list[httpx.Response]:
    return [
        await client.post(f"{base}/v1/chat/completions", headers=auth(token), json=chat_body()),
        await client.post(f"{base}/v1/streams", headers=auth(token), json=chat_body()),
        await client.get(f"{base}/v1/streams/{stream_id}", headers=auth(token)),
        await client.get(f"{base}/v1/streams/{stream_id}", params={"token": token}),
        await client.get(f"{base}/v1/streams/{stream_id}/poll", headers=auth(token),
                         params={"wait": "0"}),
        await client.post(f"{base}/v1/edge/timings", headers=auth(token), json={}),
    ]


async def test_a_removed_keys_tokens_are_refused_after_sighup(
    start_router_process: RouterStarter,
    tls_files: dict[str, str],
    tmp_path: Path,
    upstream: Upstream,
) -> None:
    keys = {"api_keys": [API_KEY, OTHER_KEY], "token_secret": SECRET}
    async with start_router_process(auth=keys) as router:
        base = router.base_url
        async with httpx.AsyncClient(verify=router.client_tls(), timeout=30) as client:
            minted = await client.post(f"{base}/v1/edge/tokens", headers=auth(OTHER_KEY),
                                       json={})
            token = minted.json()["token"]
            started = await client.post(f"{base}/v1/streams", headers=auth(token),
                                        json=chat_body())
            assert started.status_code == 201
            stream_id = started.json()["stream"]
            before = await _paths(client, base, token, stream_id)
            async with canary_running(router):
                # The operator removes key B and reloads.
                config = tmp_path / f"router-{router.port}.toml"
                write_config(config, router_sections(
                    router.port, tls_files, listen={"server": "auto"},
                    auth={"api_keys": [API_KEY], "token_secret": SECRET}), upstream.url)
                router.proc.send_signal(signal.SIGHUP)
                for _ in range(200):  # until the reload is logged (bounded in count and time)
                    if "config reloaded" in router.log():
                        break
                    await asyncio.sleep(0.05)
                assert "config reloaded" in router.log()
                after = await _paths(client, base, token, stream_id)
                async with httpx.AsyncClient(verify=router.client_tls(), http2=True,
                                             timeout=30) as h2:
                    after_h2 = await _paths(h2, base, token, stream_id)
                    assert {r.http_version for r in after_h2} == {"HTTP/2"}
                ws_url = base.replace("https://", "wss://") + "/v1/ws"
                with pytest.raises(InvalidStatus) as refused:
                    async with asyncio.timeout(10), ws_connect(
                        ws_url, ssl=router.client_tls(), proxy=None,
                        subprotocols=["firstbyte.v1",  # type: ignore[list-item]
                                      f"firstbyte.token.{token}"]):
                        pass
                kept = await client.post(f"{base}/v1/chat/completions", headers=auth(),
                                         json=chat_body())
    assert [r.status_code for r in before] == [200, 201, 200, 200, 200, 400]
    for answer in after + after_h2:
        assert answer.status_code == 401, (answer.request.url, answer.text)
        assert answer.json()["error"]["code"] == error_codes.CLIENT_TOKEN_REVOKED
    assert refused.value.response.status_code == 401
    assert kept.status_code == 200  # the key that stays, and the canary, go on
    assert token not in router.log()
    router.assert_clean_log()
