"""Responses and Messages streams started on one router process, resumed on another via Redis.

Two router processes share a real valkey-server (:mod:`tests.router.redis_fixture`); the
client cuts its connection to A mid-stream and reads the rest from B with ``Last-Event-ID``:
every event once, in order, with its ``event:`` line; B's long-poll gives the same events'
JSON.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseErrorEvent, ResponseStreamEvent
from websockets.asyncio.client import connect as ws_connect

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.protocol import error_codes
from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.sse import SSEDecoder
from tests.router.conftest import API_KEY, auth, client_tls
from tests.router.formats_upstream import CONTENT, _messages, running_formats_upstream
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)
from tests.router.test_shared_state import RouterProcess, running_pair

WORDS = 30


def _events(raw: bytes) -> list[tuple[int, str, dict[str, Any]]]:
    return [
        (int(e.id or 0), e.event, json.loads(e.data)) for e in SSEDecoder().receive_data(raw)
    ]


async def _admitted_at_once(client: httpx.AsyncClient, base: str) -> int:
    """Requests the router process at ``base`` admitted without waiting for Redis."""
    text = (await client.get(base + "/metrics", headers=auth())).text
    return int(float(next(
        line.split()[1] for line in text.splitlines()
        if line.startswith('firstbyte_router_shared_admissions_total{waited="none"}'))))


async def test_messages_stream_resumes_on_another_process(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path  # noqa: F811
) -> None:
    body = {"model": "test-model", "stream": True, "max_tokens": WORDS,
            "messages": [{"role": "user", "content": "hi"}]}
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix="fb-endpoints:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        # A first stream leaves A spare slots of the backend: the one under test is admitted
        # without waiting for Redis, its id sent once its claim (with its metadata) landed.
        warm = {**body, "max_tokens": 1}
        assert (await client.post(a.url + "/v1/messages", json=warm,
                                  headers=auth())).status_code == 200
        at_once = await _admitted_at_once(client, a.url)
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
        assert await _admitted_at_once(client, a.url) == at_once + 1
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


async def test_responses_stream_resumes_over_websocket_on_another_process(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path  # noqa: F811
) -> None:
    """A Responses stream cut on A is read on over B's WebSocket: each event's JSON once, in
    order, ``sequence_number`` contiguous from 0."""
    body = {"model": "test-model", "stream": True, "max_output_tokens": WORDS, "input": "hi"}
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix="fb-endpoints-ws:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        first = b""
        async with client.stream("POST", a.url + "/v1/responses", json=body,
                                 headers=auth()) as response:
            assert response.status_code == 200
            stream_id = response.headers[STREAM_HEADER]
            async for piece in response.aiter_raw():
                first += piece
                if first.count(b"event: response.output_text.delta") >= 3:
                    break
        before = _events(first[: first.rindex(b"\n\n") + 2])
        rest: list[tuple[int, dict[str, Any]]] = []
        wss = b.url.replace("https://", "wss://") + "/v1/ws"
        async with ws_connect(wss, ssl=client_tls(tls_files), additional_headers=auth()) as ws:
            await ws.send(json.dumps({"type": "resume", "stream": stream_id,
                                      "after": before[-1][0]}))
            assert json.loads(await ws.recv()) == {"type": "start", "stream": stream_id}
            while (message := json.loads(await ws.recv()))["type"] == "event":
                rest.append((message["seq"], message["data"]))
            assert message["type"] == "done"
    seqs = [seq for seq, _, _ in before] + [seq for seq, _ in rest]
    assert seqs == list(range(1, len(seqs) + 1))
    data = [d for _, _, d in before] + [d for _, d in rest]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert data[-1]["type"] == "response.completed"
    assert "".join(d.get("delta", "") for d in data if d["type"].endswith("text.delta")) == (
        " ".join(f"w{i}" for i in range(WORDS))
    )


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
async def test_a_killed_producer_ends_a_named_stream_with_its_own_error_event(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
    path: str,
) -> None:
    """Router A dies mid-stream (SIGKILL); a reader on B gets what A produced, then the
    format's own ``event: error`` with ``stream_lost`` (which the anthropic SDK raises), and
    no ``[DONE]``."""
    body = {"model": "test-model", "stream": True, "max_tokens": 400, "max_output_tokens": 400,
            "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix=f"fb-lost{path[4:]}:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as client:
        first = b""
        async with client.stream("POST", a.url + path, json=body, headers=auth()) as response:
            stream_id = response.headers[STREAM_HEADER]
            async for piece in response.aiter_raw():
                first += piece
                if first.count(b"delta") >= 6:
                    break
        before = _events(first[: first.rindex(b"\n\n") + 2])
        os.killpg(a.process.pid, signal.SIGKILL)
        resumed = await client.get(
            f"{b.url}/v1/streams/{stream_id}",
            headers={**auth(), "last-event-id": str(before[-1][0])},
        )
    assert resumed.status_code == 200
    assert b"[DONE]" not in resumed.content
    after = _events(resumed.content)
    _, name, data = after[-1]
    assert name == "error"
    code = data["error"]["code"] if path == "/v1/messages" else data["code"]
    assert code == error_codes.STREAM_LOST
    seqs = [s for s, _, _ in before + after]
    assert seqs == list(range(1, len(seqs) + 1))


async def _read_then_kill(
    events: AsyncIterator[Any], a: RouterProcess, count: int
) -> list[Any]:
    """The first ``count`` events of a stream on router A, then A killed (SIGKILL) while
    its upstream still streams: the stream's producer is lost mid-stream."""
    read = [await events.__anext__() for _ in range(count)]
    os.killpg(a.process.pid, signal.SIGKILL)
    return read


async def test_the_openai_sdk_reads_a_lost_responses_stream_s_error_numbered_next(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
) -> None:
    """``client.responses.create(stream=True)`` on A, A killed, the stream read on from B with
    the SDK's own stream class (what ``create`` returns): after A's events the SDK yields a
    :class:`ResponseErrorEvent` with ``stream_lost``, the router's message, and the next
    ``sequence_number`` (not 0), every number once and in order."""
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix="fb-sdk-lost-r:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as http:
        on_a = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=API_KEY, http_client=http,
                                  max_retries=0)
        on_b = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key=API_KEY, http_client=http,
                                  max_retries=0)
        stream = await on_a.responses.create(
            model="test-model", input="hi", max_output_tokens=400, stream=True
        )
        stream_id = stream.response.headers[STREAM_HEADER]
        before = await _read_then_kill(stream.__aiter__(), a, 6)
        # Event N of the stream has Last-Event-ID N: the SDK yields every event it is sent.
        resumed = await on_b.get(
            f"/streams/{stream_id}", cast_to=Response, stream=True,
            stream_cls=openai.AsyncStream[ResponseStreamEvent],
            options={"headers": {"last-event-id": str(len(before))}},
        )
        after = [event async for event in resumed]
    events = before + after
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert before[0].type == "response.created"
    *read_on, error = after
    assert {e.type for e in read_on} <= {"response.output_text.delta"}
    assert isinstance(error, ResponseErrorEvent)
    assert error.code == error_codes.STREAM_LOST
    assert "stopped before it finished" in error.message


async def test_the_anthropic_sdk_raises_a_lost_messages_stream_s_error(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
) -> None:
    """``client.messages.create(stream=True)`` on A, A killed, the stream read on from B with
    the SDK's own stream class: it yields A's events, then raises its status error for the
    ``event: error``, whose body is Anthropic's error shape with ``stream_lost``."""
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix="fb-sdk-lost-m:"
    ) as (a, b), httpx2.AsyncClient(verify=client_tls(tls_files), timeout=30) as http:
        on_a = anthropic.AsyncAnthropic(base_url=a.url, api_key=API_KEY, http_client=http,
                                        max_retries=0)
        on_b = anthropic.AsyncAnthropic(base_url=b.url, api_key=API_KEY, http_client=http,
                                        max_retries=0)
        stream = await on_a.messages.create(
            model="test-model", max_tokens=400, stream=True,
            messages=[{"role": "user", "content": "hi"}],
        )
        stream_id = stream.response.headers[STREAM_HEADER]
        before = await _read_then_kill(stream.__aiter__(), a, 6)
        # The SDK skips the upstream's one ping (event 3), which the router numbers too.
        resumed = await on_b.get(
            f"/v1/streams/{stream_id}", cast_to=Message, stream=True,
            stream_cls=anthropic.AsyncStream[RawMessageStreamEvent],
            options={"headers": {"last-event-id": str(len(before) + 1)}},
        )
        after: list[Any] = []

        async def read_on() -> None:
            async for event in resumed:
                after.append(event)

        with pytest.raises(anthropic.APIStatusError) as raised:
            await read_on()
    assert before[0].type == "message_start"
    assert [e.type for e in after] == ["content_block_delta"] * len(after)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "api_error"
    assert body["error"]["code"] == error_codes.STREAM_LOST
    assert "stopped before it finished" in body["error"]["message"]
    assert "stopped before it finished" in raised.value.message


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_the_openai_sdk_raises_a_lost_chat_or_completions_stream_s_error(
    redis_server: RedisServer, tls_files: dict[str, str], tmp_path: Path,  # noqa: F811
    path: str,
) -> None:
    """The same for chat and completions streams: after A's chunks, the SDK raises its
    ``APIError`` for the router's ``data: {"error": ...}`` event, ``stream_lost`` its code."""
    async with running_formats_upstream(delay_s=0.05) as up, running_pair(
        tmp_path, tls_files, redis_server.url, up.url, key_prefix=f"fb-sdk-lost-{path[4:].replace('/', '-')}:"
    ) as (a, b), httpx.AsyncClient(verify=client_tls(tls_files), timeout=30) as http:
        on_a = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=API_KEY, http_client=http,
                                  max_retries=0)
        on_b = openai.AsyncOpenAI(base_url=b.url + "/v1", api_key=API_KEY, http_client=http,
                                  max_retries=0)
        chunk: Any
        if path == "/v1/chat/completions":
            stream: Any = await on_a.chat.completions.create(
                model="test-model", max_tokens=400, stream=True,
                messages=[{"role": "user", "content": "hi"}],
            )
            cast_to, chunk = ChatCompletion, ChatCompletionChunk
        else:
            stream = await on_a.completions.create(
                model="test-model", prompt="hi", max_tokens=400, stream=True
            )
            cast_to, chunk = Completion, Completion
        stream_id = stream.response.headers[STREAM_HEADER]
        before = await _read_then_kill(stream.__aiter__(), a, 6)
        resumed = await on_b.get(
            f"/streams/{stream_id}", cast_to=cast_to, stream=True,
            stream_cls=openai.AsyncStream[chunk],
            options={"headers": {"last-event-id": str(len(before))}},
        )
        after: list[Any] = []

        async def read_on() -> None:
            async for event in resumed:
                after.append(event)

        with pytest.raises(openai.APIError) as raised:
            await read_on()
    assert len(before) == 6
    assert all(isinstance(e, chunk) for e in after)
    assert "stopped before it finished" in raised.value.message
    assert raised.value.code == error_codes.STREAM_LOST
