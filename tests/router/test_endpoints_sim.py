"""The official SDKs through a real router in front of the sim as vLLM, every endpoint.

The sim (``firstbyte sim``, serving ``sim-a`` only) speaks each API in its own wire format;
the router is reached with only ``base_url`` changed, over HTTP/1.1 and HTTP/2 with TLS. A
stall of the sim after the second token is long enough for several router heartbeats. A
Responses and a Messages stream cut mid-way by the client resume from ``Last-Event-ID`` with
no event lost or repeated: the events equal an uncut run of the same request (the sim is
deterministic for a request and seed), ``sequence_number`` contiguous.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.sim.server import sim_server
from tests.router.conftest import API_KEY, RouterFactory, auth, client_tls

MODEL = "sim-a"
HEARTBEAT_S = 0.2
STALL = "stall:after=2,ms=900"


@pytest.fixture(params=["1.1", "2"])
def http_version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def stalling(start_router: RouterFactory) -> AsyncIterator[RouterEndpoints]:
    async with sim_server(
        "instant", seed=3, served_model_names=[MODEL], faults=[STALL]
    ) as sim, start_router([sim.url], limits={"heartbeat_interval_s": HEARTBEAT_S}) as router:
        yield router


def _http(tls_files: dict[str, str], version: str, seen: list[str], lib: Any = httpx) -> Any:
    async def record(response: Any) -> None:
        seen.append(response.http_version)

    return lib.AsyncClient(
        verify=client_tls(tls_files), http1=version == "1.1", http2=version == "2",
        timeout=30, event_hooks={"response": [record]},
    )


async def test_openai_sdk_through_the_router_to_the_sim(
    stalling: RouterEndpoints, tls_files: dict[str, str], http_version: str
) -> None:
    seen: list[str] = []
    async with _http(tls_files, http_version, seen) as http, openai.AsyncOpenAI(
        base_url=stalling.openai_base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in chat:
            pieces += [c.delta.content for c in chunk.choices if c.delta.content]
            usage = chunk.usage or usage
        assert usage is not None
        assert len(pieces) == usage.completion_tokens == 6

        completion = await client.completions.create(
            model=MODEL, prompt="once upon a time", max_tokens=5, stream=True
        )
        texts = [c.choices[0].text async for c in completion if c.choices and c.choices[0].text]
        assert len(texts) == 5
        plain = await client.completions.create(model=MODEL, prompt="x", max_tokens=3)
        assert plain.choices[0].text

        events = [
            e
            async for e in await client.responses.create(
                model=MODEL, input="hello", max_output_tokens=5, stream=True
            )
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert len([e for e in events if e.type == "response.output_text.delta"]) == 5
        response = await client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
        assert response.output_text

        embedding = await client.embeddings.create(model=MODEL, input=["a", "b"])
        assert len(embedding.data) == 2
        assert len(embedding.data[0].embedding) > 1

        with pytest.raises(openai.NotFoundError):  # vLLM's 404, passed through
            await client.completions.create(model="not-served", prompt="x", max_tokens=1)

        listed = [m.id async for m in client.models.list()]
        assert MODEL in listed
        retrieved = await client.models.retrieve(MODEL)  # GET /v1/models/{model}
        assert (retrieved.id, retrieved.object) == (MODEL, "model")
        with pytest.raises(openai.NotFoundError, match=r"not served"):
            await client.models.retrieve("not-served")
    assert set(seen) == {f"HTTP/{http_version}"}


async def test_anthropic_sdk_through_the_router_to_the_sim(
    stalling: RouterEndpoints, tls_files: dict[str, str], http_version: str
) -> None:
    seen: list[str] = []
    async with _http(tls_files, http_version, seen, httpx2) as http, anthropic.AsyncAnthropic(
        base_url=stalling.base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        async with client.messages.stream(
            model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hello"}]
        ) as stream:
            pieces = [piece async for piece in stream.text_stream]
            final = await stream.get_final_message()
        assert len(pieces) == final.usage.output_tokens == 6
        assert final.content[0].type == "text"
        assert final.content[0].text == "".join(pieces)

        message = await client.messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.usage.output_tokens == 3
    assert set(seen) == {f"HTTP/{http_version}"}


def _events(raw: bytes) -> list[tuple[int, str, dict[str, Any]]]:
    return [
        (int(e.id or 0), e.event, json.loads(e.data)) for e in SSEDecoder().receive_data(raw)
    ]


def _comparable(data: dict[str, Any]) -> str:
    """An event without what differs between two runs of one request (ids, times)."""
    text = json.dumps(data, sort_keys=True)
    for volatile in ("id", "created_at", "item_id"):
        for found in {str(v) for k, v in _walk(data) if k == volatile}:
            text = text.replace(found, "*")
    return text


def _walk(data: Any) -> list[tuple[str, Any]]:
    if isinstance(data, dict):
        return [(k, v) for k, v in data.items()] + [p for v in data.values() for p in _walk(v)]
    if isinstance(data, list):
        return [p for v in data for p in _walk(v)]
    return []


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_sim_stream_cut_then_resumed_equals_an_uncut_one(
    start_router: RouterFactory, tls_files: dict[str, str], path: str, http_version: str
) -> None:
    # 200 tokens at ~10 ms each: the stream is still running when the client leaves.
    body = {"model": MODEL, "stream": True, "max_tokens": 200, "max_output_tokens": 200,
            "messages": [{"role": "user", "content": "tell me"}], "input": "tell me"}
    del body["max_tokens" if path == "/v1/responses" else "max_output_tokens"]
    async with sim_server("h100-7b", seed=5, served_model_names=[MODEL]) as sim, start_router(
        [sim.url]
    ) as router, httpx.AsyncClient(
        verify=client_tls(tls_files), timeout=30, http1=http_version == "1.1",
        http2=http_version == "2",
    ) as client:
        # The sim draws each answer's natural length (8 to 256 tokens) from the request: take
        # the first prompt of a few whose answer is long enough to be cut in the middle.
        for attempt in range(20):
            prompt = f"tell me {attempt}"
            body.update(input=prompt, messages=[{"role": "user", "content": prompt}])
            if path == "/v1/responses":
                del body["messages"]
            else:
                del body["input"]
            whole = await client.post(router.base_url + path, json=body, headers=auth())
            assert whole.status_code == 200
            deltas = b"event: content_block_delta" if path == "/v1/messages" else (
                b"event: response.output_text.delta"
            )
            if whole.content.count(deltas) >= 40:
                break
        else:
            pytest.fail("no prompt of 20 made the sim answer 40 tokens or more")
        first = b""
        async with client.stream("POST", router.base_url + path, json=body,
                                 headers=auth()) as response:
            assert response.http_version == f"HTTP/{http_version}"
            stream_id = response.headers[STREAM_HEADER]
            async for piece in response.aiter_raw():
                first += piece
                if first.count(b"text_delta") + first.count(b"output_text.delta") >= 8:
                    break  # the client goes away mid-stream
        before = _events(first[: first.rindex(b"\n\n") + 2])
        resumed = await client.get(router.base_url + f"/v1/streams/{stream_id}",
                                   headers={**auth(), "last-event-id": str(before[-1][0])})
        assert resumed.status_code == 200
    events = before + _events(resumed.content)
    assert [seq for seq, _, _ in events] == list(range(1, len(events) + 1))
    assert events[-1][1] in ("message_stop", "response.completed", "response.incomplete")
    assert len(before) < len(events)  # the cut was mid-stream
    assert [(name, _comparable(data)) for _, name, data in events] == [
        (name, _comparable(data)) for _, name, data in _events(whole.content)
    ]
    if path == "/v1/responses":
        assert [d["sequence_number"] for _, _, d in events] == list(range(len(events)))
