"""A removed key's client tokens, and every token of a rotated ``auth.token_secret``, are
refused (401) from the reload on, on every path that takes a token: completions, stream reads
(SSE, query token, long-poll), WebSocket (a new socket, and a resume on one opened before the
reload), and ``/v1/edge/timings``. A real router on loopback, reloaded through
:class:`~firstbyte.router.reload.Reloader`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from firstbyte.client_sdk.client_tokens import amint_client_token
from firstbyte.protocol import error_codes
from firstbyte.router.reload import Reloader
from firstbyte.router.serve import RouterEndpoints
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth, router_config
from tests.router.upstream import Upstream

SECRET = "s" * 40
CHAT: dict[str, Any] = {
    "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
    "stream": True,
}


async def _reload(r: RouterEndpoints, upstream: Upstream, **auth_section: Any) -> None:
    new = router_config([upstream.url], None, auth=auth_section)
    assert await Reloader(r.app, lambda: new).reload()


async def _paths(http: httpx.AsyncClient, token: str, stream_id: str) -> dict[str, httpx.Response]:
    """One request on each HTTP path that takes a client token."""
    return {
        "chat": await http.post("/v1/chat/completions", headers=auth(token), json=CHAT),
        "sse": await http.get(f"/v1/streams/{stream_id}", headers=auth(token)),
        "sse_query": await http.get(f"/v1/streams/{stream_id}", params={"token": token}),
        "poll": await http.get(f"/v1/streams/{stream_id}/poll", headers=auth(token),
                               params={"wait": "0"}),
        "timings": await http.post("/v1/edge/timings", headers=auth(token), json={}),
    }


async def _ws_refused(ws_url: str, token: str) -> int:
    with pytest.raises(InvalidStatus) as refused:
        async with asyncio.timeout(10), ws_connect(ws_url, subprotocols=[  # type: ignore[list-item]
                "firstbyte.v1", f"firstbyte.token.{token}"], proxy=None):
            pass
    return refused.value.response.status_code


async def test_a_removed_keys_tokens_are_refused_on_every_path_from_the_reload(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False, auth={"token_secret": SECRET}) as r:
        base = f"{r.base_url}/v1"
        ws_url = r.base_url.replace("http://", "ws://") + "/v1/ws"
        kept = (await amint_client_token(base, API_KEY)).token
        removed = (await amint_client_token(base, OTHER_KEY)).token
        async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
            started = await http.post("/v1/chat/completions", headers=auth(removed), json=CHAT)
            assert started.status_code == 200
            stream_id = started.headers["x-firstbyte-stream"]
            before = await _paths(http, removed, stream_id)
            assert {k: v.status_code for k, v in before.items()} == {
                "chat": 200, "sse": 200, "sse_query": 200, "poll": 200, "timings": 400}
            async with ws_connect(ws_url, subprotocols=[  # type: ignore[list-item]
                    "firstbyte.v1", f"firstbyte.token.{removed}"], proxy=None) as ws:
                await _reload(r, upstream, api_keys=[API_KEY], token_secret=SECRET)
                # A socket opened before the reload: its resume is refused and it is closed.
                await ws.send(json.dumps({"type": "resume", "stream": stream_id, "after": 0}))
                async with asyncio.timeout(10):
                    refused = json.loads(await ws.recv())
                    await ws.wait_closed()
            after = await _paths(http, removed, stream_id)
            still = await http.post("/v1/chat/completions", headers=auth(kept), json=CHAT)
        ws_status = await _ws_refused(ws_url, removed)
    assert {k: v.status_code for k, v in after.items()} == dict.fromkeys(after, 401)
    assert {v.json()["error"]["code"] for v in after.values()} == {
        error_codes.CLIENT_TOKEN_REVOKED}
    assert removed not in json.dumps([v.json() for v in after.values()])
    assert ws_status == 401
    assert (refused["type"], refused["status"]) == ("error", 401)
    assert refused["error"]["code"] == error_codes.CLIENT_TOKEN_REVOKED
    assert ws.close_code == 1008
    assert still.status_code == 200  # a key that stays keeps its tokens


async def test_a_rotated_secret_refuses_the_tokens_it_signed(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False, auth={"token_secret": SECRET}) as r:
        base = f"{r.base_url}/v1"
        old = (await amint_client_token(base, API_KEY)).token
        async with httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
            started = await http.post("/v1/chat/completions", headers=auth(old), json=CHAT)
            stream_id = started.headers["x-firstbyte-stream"]
            # A reload that leaves the secret alone revokes nothing.
            await _reload(r, upstream, api_keys=[API_KEY, OTHER_KEY], token_secret=SECRET,
                          client_token_default_ttl_s=60.0)
            same = await http.post("/v1/chat/completions", headers=auth(old), json=CHAT)
            await _reload(r, upstream, api_keys=[API_KEY, OTHER_KEY], token_secret="r" * 40)
            after = await _paths(http, old, stream_id)
            fresh = (await amint_client_token(base, API_KEY)).token
            renewed = await http.post("/v1/chat/completions", headers=auth(fresh), json=CHAT)
        ws_status = await _ws_refused(r.base_url.replace("http://", "ws://") + "/v1/ws", old)
    assert (started.status_code, same.status_code) == (200, 200)
    assert {k: v.status_code for k, v in after.items()} == dict.fromkeys(after, 401)
    assert {v.json()["error"]["code"] for v in after.values()} == {
        error_codes.INVALID_CLIENT_TOKEN}
    assert ws_status == 401
    assert renewed.status_code == 200
