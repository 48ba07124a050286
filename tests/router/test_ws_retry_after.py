"""A WebSocket ``error`` message for a refusal carries ``retry_after``: the seconds SSE's
``Retry-After`` header says for the same situation (a key's rate limit, a draining router, an
upstream's 429), so a client waits the router's figure on either transport. Against the
router on loopback, with a real WebSocket client next to an HTTP one."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import InvalidStatus

from firstbyte.protocol import error_codes
from firstbyte.router.serve import RouterEndpoints
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.upstream import Upstream, running_upstream

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 4,
}


async def ws_answer(router: RouterEndpoints, tls_files: dict[str, str],
                    opened: Callable[[], object] = lambda: None) -> dict[str, Any]:
    """The router's first message to a ``request`` on a new socket (``opened()`` called once
    it is open, before the request)."""
    url = router.base_url.replace("https://", "wss://") + "/v1/ws"
    async with ws_connect(url, ssl=client_tls(tls_files), additional_headers=auth(),
                          proxy=None) as ws:
        opened()
        await ws.send(json.dumps({"type": "request", "body": BODY}))
        answer: dict[str, Any] = json.loads(await ws.recv())
    return answer


async def sse_refusal(client: httpx.AsyncClient, router: RouterEndpoints) -> httpx.Response:
    response = await client.post(router.base_url + "/v1/chat/completions", json=BODY,
                                 headers=auth())
    assert response.status_code in (429, 503), response.text
    return response


async def test_a_rate_limited_request_gets_the_headers_retry_after(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    """The key's bucket holds one request a 100 s: the second is refused with the seconds
    until the next token, which shrink as time passes, so the socket's figure lies between
    the header's just before and just after it (the same figure when within one second)."""
    limits = {"requests_per_s_per_key": 0.01, "request_burst_per_key": 1}
    async with (
        start_router([upstream.url], limits=limits) as router,
        httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client,
    ):
        served = await client.post(router.base_url + "/v1/chat/completions", json=BODY,
                                   headers=auth())
        assert served.status_code == 200
        before = await sse_refusal(client, router)
        answer = await ws_answer(router, tls_files)
        after = await sse_refusal(client, router)
    assert before.json()["error"]["code"] == error_codes.KEY_RATE_LIMITED
    assert (answer["type"], answer["status"], answer["error"]["code"]) == (
        "error", 429, error_codes.KEY_RATE_LIMITED)
    assert int(after.headers["retry-after"]) <= answer["retry_after"] <= int(
        before.headers["retry-after"])
    assert answer["retry_after"] > 90  # the bucket's wait, not a default


async def test_a_draining_router_gets_the_headers_retry_after(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    async with (
        start_router([upstream.url]) as router,
        httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client,
    ):
        # A socket opened before the drain: a new upgrade is refused (tests/router/
        # test_drain_close.py), a request on an open socket gets the error message.
        answer = await ws_answer(router, tls_files, router.app.state.start_draining)
        refused = await sse_refusal(client, router)
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, error_codes.DRAINING)
    assert (answer["status"], answer["error"]["code"]) == (503, error_codes.DRAINING)
    assert answer["retry_after"] == int(refused.headers["retry-after"])


async def test_an_upstreams_429_gets_the_headers_retry_after(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """The upstream's own refusal goes out with the router's ``Retry-After`` over SSE; the
    socket's error for it carries the same figure."""
    async with (
        running_upstream(fail_status=429) as refusing,
        start_router([refusing.url]) as router,
        httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client,
    ):
        refused = await sse_refusal(client, router)
        answer = await ws_answer(router, tls_files)
    assert refused.status_code == answer["status"] == 429
    assert answer["retry_after"] == int(refused.headers["retry-after"])


async def test_an_error_with_no_retry_after_over_http_has_none(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    """A resume of no such stream (404 over HTTP, no ``Retry-After``): no figure either."""
    async with start_router([upstream.url]) as router:
        url = router.base_url.replace("https://", "wss://") + "/v1/ws"
        async with ws_connect(url, ssl=client_tls(tls_files), additional_headers=auth(),
                              proxy=None) as ws:
            await ws.send(json.dumps({"type": "resume", "stream": "nope", "after": 0}))
            answer = json.loads(await ws.recv())
    assert (answer["type"], answer["status"]) == ("error", 404)
    assert answer.get("retry_after") is None


@pytest.mark.parametrize("server", ["auto", "hypercorn"])
async def test_an_upgrade_shed_for_memory_is_the_posts_503_with_retry_after(
    start_router: RouterFactory, upstream: Upstream, server: str
) -> None:
    """Memory short (1 MiB: always over): a POST gets ``503 overloaded`` with
    ``Retry-After: 1``; an upgrade gets the same answer, status, body and header, where it
    was closed (1013) before it was accepted, which a client read as a ``403``."""
    async with (
        start_router([upstream.url], tls=False, listen={"server": server},
                     limits={"max_rss_bytes": 1 << 20}) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        post = await client.post(router.base_url + "/v1/chat/completions", json=BODY,
                                 headers=auth())
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(router.base_url.replace("http://", "ws://") + "/v1/ws",
                                  additional_headers=auth(), proxy=None):
                pass
    refused = info.value.response
    assert (post.status_code, post.json()["error"]["code"]) == (503, error_codes.OVERLOADED)
    assert refused.status_code == 503
    assert json.loads(bytes(refused.body or b""))["error"]["code"] == error_codes.OVERLOADED
    assert refused.headers["retry-after"] == post.headers["retry-after"] == "1"
