"""Responses, Messages and completions forwarded to the client's region, in their formats.

Three regions on loopback (a router and a sim each), a real GeoIP database: a client in
Tokyo reaching Frankfurt is served by Tokyo through the peer link (HTTP/2 between routers),
its stream in its own wire format end to end.
"""

from __future__ import annotations

from pathlib import Path

import httpx

from firstbyte.benchmarks.cluster import MODEL
from firstbyte.protocol.sse import SSEDecoder
from tests.router.geo_fixtures import TOKYO_CLIENT
from tests.router.test_multiregion import AUTH, cluster


async def test_every_format_is_forwarded_to_the_clients_region(tmp_path: Path) -> None:
    headers = {**AUTH, "x-forwarded-for": TOKYO_CLIENT}
    user = [{"role": "user", "content": "hello from Tokyo"}]
    calls = {
        "/v1/responses": ({"input": "hello from Tokyo", "max_output_tokens": 6},
                          ("response.completed", "response.incomplete")),
        "/v1/messages": ({"messages": user, "max_tokens": 6}, ("message_stop",)),
    }
    async with cluster(tmp_path) as regions, httpx.AsyncClient(timeout=30) as client:
        frankfurt = regions["frankfurt"]
        for path, (body, ends) in calls.items():
            r = await client.post(f"{frankfurt.url}{path}", headers=headers,
                                  json={"model": MODEL, "stream": True, **body})
            assert r.status_code == 200, r.text
            assert r.headers["x-firstbyte-region"] == "tokyo"
            events = SSEDecoder().receive_data(r.content)
            assert events[-1].event in ends
            assert [int(e.id or 0) for e in events] == list(range(1, len(events) + 1))
            assert b"[DONE]" not in r.content
        r = await client.post(f"{frankfurt.url}/v1/completions", headers=headers,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.headers["x-firstbyte-region"] == "tokyo"
        assert r.json()["object"] == "text_completion"
        metrics = (await client.get(f"{frankfurt.url}/metrics", headers=AUTH)).text
        assert 'firstbyte_route_forwards_total{to="tokyo"} 3' in metrics
