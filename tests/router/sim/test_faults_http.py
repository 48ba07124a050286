"""Every ``--fault`` mode over real HTTP, and the server keeps serving other requests."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from firstbyte.protocol.sse import DONE, SSEDecoder, SSEEvent
from firstbyte.router.sim.server import running_sim
from tests.router.sim.helpers import MODEL, chat_body, stream_chat


async def still_serving(client: httpx.AsyncClient, url: str) -> None:
    """Health, models and a short completion all work (a fresh connection each)."""
    assert (await client.get(f"{url}/health")).status_code == 200
    assert (await client.get(f"{url}/v1/models")).status_code == 200
    ok = await stream_chat(client, url, chat_body("still there?", max_tokens=1))
    assert ok.status == 200
    assert ok.done


async def read_content_chunks(response: httpx.Response, within_s: float) -> list[str]:
    """Content deltas read from ``response`` until the stream stalls for ``within_s``."""
    decoder = SSEDecoder()
    contents: list[str] = []

    async def consume() -> None:
        async for piece in response.aiter_raw():
            for event in decoder.receive_data(piece):
                assert event.data != DONE
                if '"content":"' in event.data and '"role"' not in event.data:
                    contents.append(event.data)

    with pytest.raises(TimeoutError):  # the stall: nothing more arrives, nothing closes
        await asyncio.wait_for(consume(), within_s)
    return contents


async def read_until_broken(
    client: httpx.AsyncClient, url: str, body: dict[str, object]
) -> list[SSEEvent]:
    """Events of a stream that must end with the connection torn down mid-response."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []

    async def consume() -> None:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for piece in response.aiter_raw():
                events.extend(decoder.receive_data(piece))

    with pytest.raises(httpx.RemoteProtocolError):
        await consume()
    return events


async def test_stall_keeps_the_connection_open_and_silent() -> None:
    async with running_sim("instant", served_model_names=[MODEL], faults=["stall:after=3"]) as url, httpx.AsyncClient() as c:
        body = chat_body("stall me", max_tokens=20)
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            contents = await read_content_chunks(response, within_s=0.8)
            assert len(contents) == 3
            # While that stream hangs, others are served (max_tokens 1 < 3: no stall).
            await still_serving(c, url)
        # Non-streaming: no answer at all while stalled.
        with pytest.raises(httpx.ReadTimeout):
            await c.post(
                f"{url}/v1/chat/completions",
                json={**chat_body("x", max_tokens=20), "stream": False},
                timeout=0.5,
            )
        await still_serving(c, url)


async def test_timed_stall_sends_on_after_the_gap() -> None:
    """``stall:after=N,ms=M``: N tokens, M ms of silence, then the rest and ``[DONE]``."""
    async with running_sim("instant", served_model_names=[MODEL], faults=["stall:after=2,ms=600"]) as url, \
            httpx.AsyncClient() as c:
        gaps: list[float] = []
        decoder = SSEDecoder()
        contents = 0
        done = False
        last = time.perf_counter()
        body = chat_body("pause me", max_tokens=6)
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for piece in response.aiter_raw():
                for event in decoder.receive_data(piece):
                    done = done or event.data == DONE
                    if '"content":"' in event.data and '"role"' not in event.data:
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
                        contents += 1
        assert (contents, done) == (6, True)
        # The silence falls after the 2nd token (timers may fire a clock tick early).
        assert gaps[2] >= 0.55, gaps
        assert max(gaps[1:]) == gaps[2], gaps
        reply = await c.post(
            f"{url}/v1/chat/completions", json={**chat_body("x", max_tokens=4), "stream": False}
        )
        assert reply.status_code == 200


async def test_drop_closes_the_connection_mid_stream() -> None:
    async with running_sim("instant", served_model_names=[MODEL], faults=["drop:after=2"]) as url, httpx.AsyncClient() as c:
        body = chat_body("drop me", max_tokens=20)
        events = await read_until_broken(c, url, body)
        assert len(events) == 1 + 2  # role chunk and two tokens, then the abrupt end
        assert all(e.data != DONE for e in events)
        with pytest.raises(httpx.RemoteProtocolError):
            await c.post(
                f"{url}/v1/chat/completions",
                json={**chat_body("x", max_tokens=20), "stream": False},
            )
        await still_serving(c, url)


async def test_delay_holds_back_the_first_byte() -> None:
    async with running_sim("instant", served_model_names=[MODEL], faults=["delay:ms=400"]) as url, httpx.AsyncClient() as c:
        start = time.perf_counter()
        health = await c.get(f"{url}/health")
        health_s = time.perf_counter() - start
        start = time.perf_counter()
        async with c.stream(
            "POST", f"{url}/v1/chat/completions", json=chat_body("slow", max_tokens=2)
        ) as response:
            first_byte_s = time.perf_counter() - start
            await response.aread()
        assert health.status_code == 200
        assert response.status_code == 200
        assert first_byte_s >= 0.4
        assert health_s < first_byte_s
        # Two delayed requests overlap rather than queue behind each other.
        start = time.perf_counter()
        results = await asyncio.gather(
            *(stream_chat(c, url, chat_body(f"r{i}", max_tokens=1)) for i in range(2))
        )
        assert all(r.done for r in results)
        assert time.perf_counter() - start < 0.4 * 2


async def test_error503_rate_is_deterministic_with_the_seed() -> None:
    async def statuses(seed: int) -> list[int]:
        async with (
            running_sim("instant", served_model_names=[MODEL], faults=["error503:rate=0.5"], seed=seed) as url,
            httpx.AsyncClient() as c,
        ):
            codes = []
            for i in range(24):
                r = await c.post(
                    f"{url}/v1/chat/completions",
                    json={**chat_body(f"n{i}", max_tokens=1), "stream": False},
                )
                codes.append(r.status_code)
                if r.status_code == 503:
                    assert r.json()["error"]["type"] == "server_error"
                    assert r.headers["retry-after"] == "1"
            assert (await c.get(f"{url}/health")).status_code == 200
            return codes

    first, again, other = await statuses(3), await statuses(3), await statuses(4)
    assert set(first) == {200, 503}
    assert 4 <= first.count(503) <= 20
    assert first == again
    assert first != other


async def test_error503_at_rate_one_still_serves_other_routes() -> None:
    async with (
        running_sim("instant", served_model_names=[MODEL], faults=["error503:rate=1"]) as url,
        httpx.AsyncClient() as c,
    ):
        r = await stream_chat(c, url, chat_body("x"))
        assert r.status == 503
        assert (await c.get(f"{url}/health")).status_code == 200
        assert (await c.get(f"{url}/metrics")).status_code == 200


async def test_faults_at_a_rate_hit_only_some_requests() -> None:
    async with (
        running_sim("instant", served_model_names=[MODEL], faults=["drop:after=1,rate=0.5"], seed=1) as url,
        httpx.AsyncClient() as c,
    ):
        outcomes = []
        for i in range(12):
            try:
                r = await stream_chat(c, url, chat_body(f"n{i}", max_tokens=4))
                outcomes.append(r.done)
            except httpx.RemoteProtocolError:
                outcomes.append(False)
        assert any(outcomes), "every request was dropped"
        assert not all(outcomes), "no request was dropped"
