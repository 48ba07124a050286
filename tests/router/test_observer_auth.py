"""Who may read the region's load: /metrics and the whole /v1/edge/status need a key."""

from __future__ import annotations

import httpx

from firstbyte.protocol.headers import PEER_KEY_HEADER
from tests.router.conftest import RouterFactory, auth
from tests.router.upstream import Upstream

METRICS_KEY = "prometheus-scrape-token"
PEER_KEY = "a long shared peer secret"


async def test_metrics_key_reads_metrics_and_status_but_cannot_infer(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router(
        [upstream.url], tls=False, auth={"metrics_keys": [METRICS_KEY]},
        routing={"peer_key": PEER_KEY},
    ) as router, httpx.AsyncClient(timeout=10) as client:
        url = router.base_url
        for headers in (auth(METRICS_KEY), auth(), {PEER_KEY_HEADER: PEER_KEY}):
            metrics = await client.get(url + "/metrics", headers=headers)
            assert metrics.status_code == 200, headers
            assert "firstbyte_router_streams" in metrics.text
            status = (await client.get(url + "/v1/edge/status", headers=headers)).json()
            assert status["in_flight"] == 0, headers
            assert "backends" in status, headers
        for headers in ({}, auth("sk-not-a-key-1"), {PEER_KEY_HEADER: "a wrong peer secret!"}):
            denied = await client.get(url + "/metrics", headers=headers)
            assert denied.status_code == 401, headers
            assert denied.json()["error"]["type"] == "authentication_error"
            public = (await client.get(url + "/v1/edge/status", headers=headers)).json()
            assert set(public) == {"region", "healthy", "public_url", "latitude", "longitude",
                                   "peers"}
        chat = await client.post(
            url + "/v1/chat/completions", headers=auth(METRICS_KEY),
            json={"model": "test-model", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 401
        assert upstream.chat_requests == []
