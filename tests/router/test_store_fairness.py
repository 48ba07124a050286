"""Store fairness over real sockets: key A's long outputs go far past its share of the stream
store while key B's finished streams stay resumable whole and B's new streams are admitted;
A pays with its own oldest history, and a resume of that history gets a clear
``stream_history_trimmed`` on every reading path, which the SDK raises as
:class:`StreamHistoryTrimmedError` with what it had delivered."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect as ws_connect

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.client_sdk import AsyncClient
from firstbyte.client_sdk.errors import StreamHistoryTrimmedError
from firstbyte.protocol import error_codes
from firstbyte.router.streams import Stream, owner_of
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth
from tests.router.formats_upstream import running_formats_upstream
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.upstream import running_upstream

STORE_BYTES = 256 << 10  # A's share: the default quarter, 64 KiB
A_TOKENS = 1_500  # ~200 bytes a chunk: ~300 KB a stream, more than the whole store
MESSAGES = [{"role": "user", "content": "a long story"}]


def chat(max_tokens: int) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "stream": True}


class HeldCutProxy(TcpCutProxy):
    """:class:`TcpCutProxy` (cuts the first connection after ``cut_after`` bytes) whose later
    connections wait until ``open`` is set: the SDK's resume is held until A's other streams
    have trimmed this one's history past where the SDK was."""

    def __init__(self, target_port: int, *, cut_after: int) -> None:
        super().__init__(target_port, cut_after=cut_after)
        self.open = asyncio.Event()
        self._first = True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._first:
            self._first = False
        else:
            await self.open.wait()
        await super()._handle(reader, writer)


async def _finished_stream(http: httpx.AsyncClient, key: str, base: str = "") -> tuple[str, str]:
    """A short completion of ``key``, read to its end: (stream id, its SSE text)."""
    answer = await http.post(f"{base}/v1/chat/completions", headers=auth(key), json=chat(30))
    assert answer.status_code == 200
    assert "data: [DONE]" in answer.text
    return answer.headers["x-firstbyte-stream"], answer.text


# Long-poll spreads its polls over several connections, which a proxy holding all but the
# first cannot tell from a resume; the router's 410 to a poll is checked below on every run.
@pytest.mark.parametrize("transport", ["sse", "websocket"])
async def test_a_keys_long_outputs_trim_its_own_history_not_another_keys_streams(
    start_router: RouterFactory, transport: str,
) -> None:
    owner_a = owner_of(API_KEY)
    async with running_upstream(delay_s=0.002) as upstream, start_router(
        [upstream.url], tls=False, streams={"max_total_bytes": STORE_BYTES},
        limits={"heartbeat_interval_s": 0.5},
    ) as r, httpx.AsyncClient(base_url=r.base_url, timeout=60) as http:
        store = r.app.state.store
        b_streams = [await _finished_stream(http, OTHER_KEY) for _ in range(3)]

        # A's first stream, read by the SDK through a proxy that cuts it after a few events
        # and holds its resume while A's other streams trim this one's history past there.
        async with HeldCutProxy(r.port, cut_after=3_000) as proxy, AsyncClient(
            f"http://127.0.0.1:{proxy.port}/v1", API_KEY, http="1.1",
            transport=transport,  # type: ignore[arg-type]
            idle_timeout_s=60, max_resumes=3,
        ) as client:
            delivered: list[str] = []

            async def read_sdk() -> BaseException | None:
                try:
                    async for delta in sdk:
                        delivered.append(delta.text)
                except StreamHistoryTrimmedError as exc:
                    return exc
                return None

            async with client.stream(model="m", messages=MESSAGES, max_tokens=A_TOKENS) as sdk:
                reading = asyncio.create_task(read_sdk())
                for _ in range(600):  # until its stream is open (bounded in count and time)
                    if sdk.stream_id is not None:
                        break
                    await asyncio.sleep(0.05)
                sdk_stream = store.get(sdk.stream_id or "", owner_a)
                assert isinstance(sdk_stream, Stream)
                detached = [await http.post("/v1/streams", headers=auth(), json=chat(A_TOKENS))
                            for _ in range(4)]
                assert [d.status_code for d in detached] == [201] * 4
                a_streams = [sdk_stream] + [
                    store.get(d.json()["stream"], owner_a) for d in detached]
                # Until A has produced twice the whole store (bounded in count and time).
                for _ in range(1_200):
                    produced = sum(s.last_seq for s in a_streams if s is not None) * 200
                    if produced >= 2 * STORE_BYTES:
                        break
                    await asyncio.sleep(0.05)
                assert produced >= 2 * STORE_BYTES
                assert store.live_streams(owner_a) >= 2  # A's streams still run
                assert proxy.cuts_done == 1

                # B, meanwhile: its finished streams resume whole, its new stream is admitted.
                resumed = [await http.get(f"/v1/streams/{sid}", headers=auth(OTHER_KEY))
                           for sid, _ in b_streams]
                fresh = await http.post("/v1/chat/completions", headers=auth(OTHER_KEY),
                                        json=chat(30))
                resumed += [await http.get(f"/v1/streams/{sid}", headers=auth(OTHER_KEY))
                            for sid, _ in b_streams]  # B's new stream took none of them
                held = store.total_bytes
                metrics = (await http.get("/metrics", headers=auth())).text

                # A's own history is what went: a resume from its start is 410 on every path.
                sid = sdk_stream.id
                sse = await http.get(f"/v1/streams/{sid}", headers=auth())
                polled = await http.get(f"/v1/streams/{sid}/poll", headers=auth(),
                                        params={"after": "0", "wait": "0"})
                ws_url = r.base_url.replace("http://", "ws://") + "/v1/ws"
                async with ws_connect(ws_url, additional_headers=auth(), proxy=None) as ws:
                    await ws.send(json.dumps({"type": "resume", "stream": sid, "after": 0}))
                    async with asyncio.timeout(10):
                        ws_error = json.loads(await ws.recv())
                # The SDK's own resume, let through now, surfaces the same clear error.
                assert not reading.done()  # it waits for its resume
                proxy.open.set()
                trimmed_error = await asyncio.wait_for(reading, 30)

    assert fresh.status_code == 200, fresh.text
    assert "data: [DONE]" in fresh.text
    assert [a.status_code for a in resumed] == [200] * 6
    for answer, (_, original) in zip(resumed, b_streams * 2, strict=True):
        assert answer.text.startswith("id: 1\n")
        assert answer.text.count("\nid: ") + 1 == original.count("data: ")  # every event
        assert answer.text.endswith("data: [DONE]\n\n")
    assert held <= STORE_BYTES  # A's live streams were trimmed to keep the store's bound
    trimmed = re.search(
        r'^firstbyte_router_stream_trimmed_events_total\{reason="key_share"\} (\d+)', metrics,
        re.MULTILINE)
    assert trimmed is not None
    assert int(trimmed.group(1)) > 100

    for answer in (sse, polled):
        assert answer.status_code == 410, answer.text
        assert answer.json()["error"]["code"] == error_codes.STREAM_HISTORY_TRIMMED
    assert (ws_error["type"], ws_error["status"]) == ("error", 410)
    assert ws_error["error"]["code"] == error_codes.STREAM_HISTORY_TRIMMED

    assert isinstance(trimmed_error, StreamHistoryTrimmedError), repr(trimmed_error)
    assert trimmed_error.stream_id == sid
    assert trimmed_error.delivered_text == "".join(delivered)
    assert trimmed_error.last_seq >= 5
    assert "stream store" in str(trimmed_error)


async def test_with_redis_a_trim_is_mirrored_and_a_reader_elsewhere_gets_the_error(
    start_router: RouterFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Two router processes' worth (two routers in this process) sharing one Redis: A's
    streams on X go past its share there; X trims the same events from Redis, B's finished
    stream reads whole on Y, and a resume of A's trimmed history on Y gets
    ``stream_history_trimmed`` (an error event over SSE, 410 over long-poll), not a gap."""
    prefix = f"st{secrets.token_hex(4)}:"
    shared = {"state": {"redis_url": redis_server.url, "key_prefix": prefix}}
    owner_a = owner_of(API_KEY)
    redis = Redis.from_url(redis_server.url)
    try:
        async with running_upstream(delay_s=0.002) as upstream, start_router(
            [upstream.url], tls=False, streams={"max_total_bytes": STORE_BYTES}, **shared,
        ) as x, start_router([upstream.url], tls=False, **shared) as y, httpx.AsyncClient(
            timeout=60,
        ) as http:
            b_id, b_text = await _finished_stream(http, OTHER_KEY, x.base_url)
            first = await http.post(f"{x.base_url}/v1/streams", headers=auth(),
                                    json=chat(A_TOKENS))
            rest = [await http.post(f"{x.base_url}/v1/streams", headers=auth(),
                                    json=chat(A_TOKENS)) for _ in range(3)]
            assert [r.status_code for r in [first, *rest]] == [201] * 4
            sid = first.json()["stream"]
            local = x.app.state.store.get(sid, owner_a)
            assert isinstance(local, Stream)
            oldest_in_redis = 1
            for _ in range(1_200):  # until the trim reached Redis (bounded in count and time)
                if local.trimmed > 10:
                    head = await redis.xrange(f"{prefix}s:{sid}", count=1)
                    oldest_in_redis = int(head[0][0].split(b"-")[0]) if head else 1
                    if oldest_in_redis > 10:
                        break
                await asyncio.sleep(0.05)
            from_b = await http.get(f"{y.base_url}/v1/streams/{b_id}", headers=auth(OTHER_KEY))
            sse = await http.get(f"{y.base_url}/v1/streams/{sid}", headers=auth(),
                                 params={"after": "0"})
            polled = await http.get(f"{y.base_url}/v1/streams/{sid}/poll", headers=auth(),
                                    params={"after": "0", "wait": "0"})
    finally:
        await redis.aclose()
    assert oldest_in_redis > 10
    assert oldest_in_redis <= local.trimmed + 1  # Redis holds no more than X does
    assert from_b.status_code == 200
    assert from_b.text.startswith("id: 1\n")
    assert from_b.text.count("data: ") == b_text.count("data: ")
    assert sse.status_code == 200  # Y learns of the trim from its first read of Redis
    assert "id: " not in sse.text  # no event of the stream (and so no gap)
    error = json.loads(sse.text.split("data: ", 1)[1].split("\n", 1)[0])["error"]
    assert error["code"] == error_codes.STREAM_HISTORY_TRIMMED
    assert polled.status_code == 410, polled.text
    assert polled.json()["error"]["code"] == error_codes.STREAM_HISTORY_TRIMMED


async def test_with_redis_a_reader_elsewhere_behind_a_responses_trim_gets_its_error_event(
    start_router: RouterFactory,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """As above for a Responses stream: the reader on Y (its stream's format from the
    metadata in Redis) gets the trim as a Responses ``error`` event without ``id``, numbered
    after the last event it read from Redis (``response.completed``: the stream ended)."""
    prefix = f"st{secrets.token_hex(4)}:"
    shared = {"state": {"redis_url": redis_server.url, "key_prefix": prefix}}
    words = 3_000  # ~500 KB of events through a 64 KiB store: a 16 KiB share
    redis = Redis.from_url(redis_server.url)
    try:
        async with running_formats_upstream() as upstream, start_router(
            [upstream.url], tls=False, streams={"max_total_bytes": 64 << 10}, **shared,
        ) as x, start_router([upstream.url], tls=False, **shared) as y, httpx.AsyncClient(
            timeout=60,
        ) as http:
            started = await http.post(
                f"{x.base_url}/v1/streams", headers=auth(), params={"endpoint": "responses"},
                json={"model": "test-model", "input": "hi", "max_output_tokens": words},
            )
            assert started.status_code == 201, started.text
            sid = started.json()["stream"]
            local = x.app.state.store.get(sid, owner_of(API_KEY))
            assert isinstance(local, Stream)
            head: list[Any] = []
            tail: list[Any] = []
            for _ in range(1_200):  # until it ended, trimmed, in Redis (bounded)
                if local.done:
                    head = await redis.xrange(f"{prefix}s:{sid}", count=1)
                    tail = await redis.xrevrange(f"{prefix}s:{sid}", count=1)
                    if head and int(head[0][0].split(b"-")[0]) > 10 and tail[0][1][b"d"] == (
                            b"[DONE]"):
                        break
                await asyncio.sleep(0.05)
            sse = await http.get(f"{y.base_url}/v1/streams/{sid}", headers=auth(),
                                 params={"after": "0"})
    finally:
        await redis.aclose()
    assert head
    assert int(head[0][0].split(b"-")[0]) > 10  # trimmed in Redis
    assert tail
    assert tail[0][1][b"d"] == b"[DONE]"
    assert sse.status_code == 200
    assert sse.text.startswith("event: error\ndata: ")  # no id: not one of the stream's
    assert sse.text.endswith("\n\n")
    assert sse.text.count("\n\n") == 1  # one event, then the response ends
    error = json.loads(sse.text.removeprefix("event: error\ndata: "))
    assert error["type"] == "error"
    assert error["code"] == error_codes.STREAM_HISTORY_TRIMMED
    assert error["message"].startswith("Events 1 to ")
    assert error["param"] is None
    assert error["sequence_number"] == words + 8  # after response.completed's
