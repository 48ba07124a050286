"""A Messages stream started on one router process and resumed on another, through Redis.

Two router processes share a real valkey-server (:mod:`tests.router.redis_fixture`); the
client cuts its connection to A mid-stream and reads the rest from B with ``Last-Event-ID``:
every event once, in order, with its ``event:`` line; B's long-poll gives the same events'
JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.sse import SSEDecoder
from tests.router.conftest import auth, client_tls
from tests.router.formats_upstream import CONTENT, _messages, running_formats_upstream
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.test_shared_state import running_pair

WORDS = 30


def _events(raw: bytes) -> list[tuple[int, str, dict[str, Any]]]:
    return [
        (int(e.id or 0), e.event, json.loads(e.data)) for e in SSEDecoder().receive_data(raw)
    ]


async def test_messages_stream_resumes_on_another_process(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path  # noqa: F811
) -> None:
    body = {"model": "test-model", "stream": True, "max_tokens": WORDS,
            "messages": [{"role": "user", "content": "hi"}]}
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix="fb-endpoints:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        first = b""
        async with client.stream("POST", a.url + "/v1/messages", json=body,
                                 headers=auth()) as response:
            assert response.status_code == 200
            stream_id = response.headers[STREAM_HEADER]
            async for piece in response.aiter_raw():
                first += piece
                if first.count(b"text_delta") >= 3:
                    break  # cut: the client leaves A mid-stream
        before = _events(first[: first.rindex(b"\n\n") + 2])
        resumed = await client.get(
            f"{b.url}/v1/streams/{stream_id}",
            headers={**auth(), "last-event-id": str(before[-1][0])},
        )
        assert resumed.status_code == 200
        after = _events(resumed.content)
        polled = await client.get(
            f"{b.url}/v1/streams/{stream_id}/poll", params={"after": 0, "wait": 0},
            headers=auth(),
        )
        assert polled.status_code == 200
    events = before + after
    assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1))
    upstream = b"".join(
        e.removeprefix(CONTENT) for e in _messages([f"w{i}" for i in range(WORDS)], body)
    )
    expected = [(name, data) for _, name, data in _events(upstream)]
    assert [(name, data) for _, name, data in events] == expected
    batch = polled.json()
    assert batch["done"] is True
    assert [e["data"] for e in batch["events"]] == [data for _, data in expected]
