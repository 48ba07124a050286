"""Forwarding to a peer region over TLS: the peer is trusted through ``upstream_ca_file`` and
every forwarded request shares one HTTP/2 connection with the status polls."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpcore
import httpx
import pytest

from firstbyte.router.sim.server import sim_server
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.geo_fixtures import TOKYO_CLIENT, write_city_mmdb
from tests.router.logs import access_records

PEER_KEY = "a long shared peer secret"


async def test_concurrent_forwards_ride_one_http2_connection_to_the_peer(
    start_router: RouterFactory, tls_files: dict[str, str], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    mmdb = write_city_mmdb(tmp_path / "cities.mmdb")
    async with sim_server(served_model_names=["m"]) as tokyo_sim, sim_server(
        served_model_names=["m"]
    ) as frankfurt_sim, start_router(
        [tokyo_sim.url], region="tokyo", routing={"peer_key": PEER_KEY},
        geo={"latitude": 35.68, "longitude": 139.69},
    ) as tokyo, start_router(
        [frankfurt_sim.url], region="frankfurt", upstream_ca_file=tls_files["cafile"],
        routing={"peer_key": PEER_KEY, "peer_poll_interval_s": 0.2},
        geo={"latitude": 50.11, "longitude": 8.68, "database": str(mmdb),
             "trusted_proxies": ["127.0.0.1/32"]},
        peers=[{"name": "tokyo", "url": tokyo.base_url,
                "latitude": 35.68, "longitude": 139.69}],
    ) as frankfurt, httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        routing = frankfurt.app.state.routing
        for _ in range(200):
            if routing.peer_table.fresh(routing.clock()):
                break
            await asyncio.sleep(0.05)
        assert routing.peer_table.fresh(routing.clock()), "no status from the TLS peer"
        body = {"model": "m", "stream": True, "max_tokens": 6,
                "messages": [{"role": "user", "content": "hello from Tokyo"}]}
        headers = {**auth(), "x-forwarded-for": TOKYO_CLIENT}
        answers = await asyncio.gather(*(
            client.post(frankfurt.base_url + "/v1/chat/completions", json=body,
                        headers=headers)
            for _ in range(4)))
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-firstbyte-region"] == "tokyo"
            assert answer.text.rstrip().endswith("data: [DONE]")
        # The peer pool (the one the status polls use) holds one connection to Tokyo.
        pool = routing.poller.client._transport._pool  # httpx has no public pool
        port = int(tokyo.base_url.rsplit(":", 1)[1])
        origin = httpcore.Origin(b"https", b"127.0.0.1", port)
        to_peer = [c for c in pool.connections if c.can_handle_request(origin)]
        assert len(to_peer) == 1, pool.connections
    records = access_records(caplog)
    at_peer = [r for r in records
               if r["entry_region"] == "tokyo" and r["path"].endswith("/completions")]
    assert len(at_peer) == 4
    assert {r["http_version"] for r in at_peer} == {"2"}
