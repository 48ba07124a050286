"""A draining router sends new work to a peer region with room (the forwarding a saturated
region uses), and answers 503 ``draining`` when none has room; on loopback with two regions
(``benchmarks.cluster``)."""

from __future__ import annotations

import httpx

from firstbyte.benchmarks.cluster import RegionSpec, running_regions, wait_for_peers
from firstbyte.protocol import error_codes


def _body(i: int) -> dict[str, object]:
    return {"model": "sim", "stream": False, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"request {i}"}]}


async def test_new_work_goes_to_a_peer_with_room_else_503_draining() -> None:
    specs = [RegionSpec("tokyo", 35.68, 139.69, backends=1),
             RegionSpec("frankfurt", 50.11, 8.68, backends=1)]
    async with running_regions(specs) as regions:
        await wait_for_peers(regions)
        tokyo, frankfurt = regions["tokyo"], regions["frankfurt"]
        async with httpx.AsyncClient(timeout=30) as client:
            before = await client.post(f"{tokyo.url}/v1/chat/completions", json=_body(0))
            assert before.headers["x-firstbyte-region"] == "tokyo"
            assert "connection" not in before.headers  # kept alive
            tokyo.state.start_draining()
            health = await client.get(f"{tokyo.url}/healthz")
            assert (health.status_code, health.text) == (503, "draining\n")
            status = (await client.get(f"{tokyo.url}/v1/edge/status")).json()
            assert status["healthy"] is False  # peers stop sending here
            moved = [await client.post(f"{tokyo.url}/v1/chat/completions", json=_body(i))
                     for i in range(1, 4)]
            assert [(r.status_code, r.headers["x-firstbyte-region"]) for r in moved] == [
                (200, "frankfurt")
            ] * 3
            # Answered, yet each the last of its HTTP/1.1 connection: behind a balancer the
            # client's next request opens a new one, which goes to a process not draining.
            assert [r.headers.get("connection") for r in moved] == ["close"] * 3
            frankfurt.state.start_draining()  # no region left with room
            refused = await client.post(f"{tokyo.url}/v1/chat/completions", json=_body(9))
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == error_codes.DRAINING
            assert refused.headers["retry-after"] == "1"
