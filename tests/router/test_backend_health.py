"""Backend health as a client sees it: an upstream URL written with ``/v1`` works, the status
says why a request was refused, and a backend that stops answering (or answers 5xx) is
ejected at once and re-admitted when it heals (passive health, as Envoy's outlier detection)."""

from __future__ import annotations

import httpx
import pytest

from firstbyte.router.sim.server import running_sim
from tests.router.conftest import RouterFactory, auth

pytestmark = pytest.mark.asyncio

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_an_upstream_url_ending_in_v1_is_served(start_router: RouterFactory) -> None:
    async with (
        running_sim("instant") as sim_url,
        start_router([sim_url + "/v1/"], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        streamed = await client.post(url, json={**BODY, "stream": True}, headers=auth())
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in streamed.text
        whole = await client.post(url, json=BODY, headers=auth())
        assert whole.status_code == 200, whole.text
        models = await client.get(router.base_url + "/v1/models", headers=auth())
        assert models.status_code == 200, models.text
