"""Every endpoint through the real router with the official SDKs, only ``base_url`` changed.

The ``openai`` SDK (chat completions, completions, Responses, embeddings) and the
``anthropic`` SDK (``messages.stream``, ``messages.create``; ``x-api-key`` also works), streamed
and not, over HTTP/1.1 and HTTP/2 with TLS, across upstream silences long enough for several
router heartbeats. A streamed answer is the upstream's bytes, event for event (``event:``
lines included), plus our ``id:`` lines and heartbeat comments; a Responses or Messages stream
cut by its client resumes from ``Last-Event-ID`` with no event lost or repeated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from firstbyte.protocol.headers import STREAM_HEADER
from firstbyte.protocol.sse import HEARTBEAT, SSEDecoder
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.streams import owner_of
from tests.router.conftest import API_KEY, RouterFactory, auth, client_tls
from tests.router.formats_upstream import (
    CONTENT,
    _messages,
    _responses,
    running_formats_upstream,
)

HEARTBEAT_S = 0.2
GAP_S = 0.9
"""Upstream silence after the 2nd word: four heartbeats or so fall inside it."""

_ID_LINE = re.compile(rb"^id: \d+\n", re.MULTILINE)


@pytest.fixture(params=["1.1", "2"])
def http_version(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def gapped(start_router: RouterFactory) -> AsyncIterator[RouterEndpoints]:
    """A router over an upstream that goes silent for :data:`GAP_S` after two words."""
    async with running_formats_upstream(gap_after=2, gap_s=GAP_S) as up, start_router(
        [up.url], limits={"heartbeat_interval_s": HEARTBEAT_S}
    ) as router:
        yield router


def _http(
    tls_files: dict[str, str], version: str, seen: list[str], lib: Any = httpx
) -> Any:
    """An httpx client of ``version`` (the anthropic SDK's is ``httpx2``, httpx's fork)."""

    async def record(response: Any) -> None:
        seen.append(response.http_version)

    return lib.AsyncClient(
        verify=client_tls(tls_files),
        http1=version == "1.1",
        http2=version == "2",
        timeout=30,
        event_hooks={"response": [record]},
    )


async def test_openai_sdk_through_every_endpoint(
    gapped: RouterEndpoints, tls_files: dict[str, str], http_version: str
) -> None:
    seen: list[str] = []
    async with _http(tls_files, http_version, seen) as http, openai.AsyncOpenAI(
        base_url=gapped.openai_base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        chat = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in chat:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        assert text == "w0 w1 w2 w3"
        assert usage is not None
        assert usage.completion_tokens == 4

        whole = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert whole.choices[0].message.content == "w0 w1 w2"

        completion = await client.completions.create(
            model="test-model", prompt="once upon", max_tokens=4, stream=True
        )
        assert "".join([c.choices[0].text async for c in completion if c.choices]) == (
            "w0 w1 w2 w3"
        )
        plain = await client.completions.create(model="test-model", prompt="x", max_tokens=2)
        assert plain.choices[0].text == "w0 w1"

        events = [
            e
            async for e in await client.responses.create(
                model="test-model", input="hello", max_output_tokens=5, stream=True
            )
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        assert events[-1].type == "response.completed"
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert "".join(deltas) == "w0 w1 w2 w3 w4"
        assert events[-1].response.usage is not None
        assert events[-1].response.usage.output_tokens == 5
        response = await client.responses.create(
            model="test-model", input="hello", max_output_tokens=2
        )
        assert response.output_text == "w0 w1"

        embedding = await client.embeddings.create(model="test-model", input=["a", "b"])
        assert [d.embedding for d in embedding.data] == [[0.25, -0.5, 0.0], [0.25, -0.5, 1.0]]
    assert seen
    assert set(seen) == {f"HTTP/{http_version}"}


async def test_anthropic_sdk_through_messages(
    gapped: RouterEndpoints, tls_files: dict[str, str], http_version: str
) -> None:
    seen: list[str] = []
    async with _http(tls_files, http_version, seen, httpx2) as http, anthropic.AsyncAnthropic(
        base_url=gapped.base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        async with client.messages.stream(
            model="test-model",
            max_tokens=5,
            messages=[{"role": "user", "content": "hello"}],
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        assert text == "w0 w1 w2 w3 w4"
        assert final.usage.input_tokens == 3
        assert final.usage.output_tokens == 5
        assert final.stop_reason == "max_tokens"

        message = await client.messages.create(
            model="test-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
        )
        assert message.content[0].type == "text"
        assert message.content[0].text == "w0 w1 w2"
    assert seen
    assert set(seen) == {f"HTTP/{http_version}"}

    async with _http(tls_files, http_version, [], httpx2) as http, anthropic.AsyncAnthropic(
        base_url=gapped.base_url, api_key="sk-wrong", http_client=http, max_retries=0
    ) as wrong:
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(
                model="test-model", max_tokens=3, messages=[{"role": "user", "content": "hi"}]
            )


def _upstream_bytes(path: str, words: int) -> bytes:
    body = {"max_tokens": words}
    generate = _responses if path == "/v1/responses" else _messages
    return b"".join(e.removeprefix(CONTENT) for e in generate([f"w{i}" for i in range(words)], body))


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_a_stream_is_the_upstreams_bytes_plus_ids_and_heartbeats(
    gapped: RouterEndpoints, tls_files: dict[str, str], path: str
) -> None:
    body = {"model": "test-model", "stream": True, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    async with httpx.AsyncClient(
        verify=client_tls(tls_files), timeout=30
    ) as client, client.stream(
        "POST", gapped.base_url + path, json=body, headers=auth()
    ) as response:
        assert response.status_code == 200
        raw = b"".join([piece async for piece in response.aiter_raw()])
    # The upstream's silence was kept open by heartbeats (whole lines: "event: ping" of
    # Anthropic's own ping event ends with the same bytes).
    heartbeat = re.compile(b"^" + re.escape(HEARTBEAT), re.MULTILINE)
    assert len(heartbeat.findall(raw)) >= 2
    ids = [int(n) for n in re.findall(rb"^id: (\d+)$", raw, re.MULTILINE)]
    assert ids == list(range(1, len(ids) + 1))
    stripped = _ID_LINE.sub(b"", heartbeat.sub(b"", raw))
    assert stripped == _upstream_bytes(path, 4)
    assert b"[DONE]" not in raw


def _events(raw: bytes) -> list[tuple[str, str, dict[str, Any]]]:
    return [(e.id or "", e.event, json.loads(e.data)) for e in SSEDecoder().receive_data(raw)]


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
async def test_cut_mid_stream_then_resume_loses_and_repeats_nothing(
    start_router: RouterFactory, tls_files: dict[str, str], path: str, http_version: str
) -> None:
    words = 12
    body = {"model": "test-model", "stream": True, "max_tokens": words,
            "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    async with running_formats_upstream(delay_s=0.05) as up, start_router(
        [up.url]
    ) as router, httpx.AsyncClient(
        verify=client_tls(tls_files), timeout=30, http1=http_version == "1.1",
        http2=http_version == "2",
    ) as client:
        first = b""
        async with client.stream("POST", router.base_url + path, json=body,
                                 headers=auth()) as response:
            assert response.status_code == 200
            assert response.http_version == f"HTTP/{http_version}"
            stream_id = response.headers[STREAM_HEADER]
            async for piece in response.aiter_raw():
                first += piece
                if first.count(b"text_delta") + first.count(b"output_text.delta") >= 3:
                    break  # the client goes away mid-stream (the response is closed)
        before = _events(first[: first.rindex(b"\n\n") + 2])
        assert before
        assert not any(
            name in ("response.completed", "message_stop") for _, name, _ in before
        )
        last_id = before[-1][0]
        resumed = await client.get(
            router.base_url + f"/v1/streams/{stream_id}",
            headers={**auth(), "last-event-id": last_id},
        )
        assert resumed.status_code == 200
        after = _events(resumed.content)
        past_the_end = await client.get(
            router.base_url + f"/v1/streams/{stream_id}",
            headers={**auth(), "last-event-id": after[-1][0]},
        )
    events = before + after
    assert [int(i) for i, _, _ in events] == list(range(1, len(events) + 1))
    expected = _events(_upstream_bytes(path, words))
    assert [(name, data) for _, name, data in events] == [
        (name, data) for _, name, data in expected
    ]
    if path == "/v1/responses":
        assert [d["sequence_number"] for _, _, d in events] == list(range(len(events)))
    # Resumed after its terminal event, a named stream has nothing more (no [DONE]).
    assert past_the_end.status_code == 200
    assert past_the_end.content == b""


async def test_messages_takes_x_api_key_and_refuses_on_the_head(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """The key as ``x-api-key`` (Anthropic's header, which anthropic SDKs before 2.x send)
    works on ``/v1/messages`` and only there; a wrong one is 401, a bad body 400."""
    async with running_formats_upstream() as up, start_router([up.url]) as router:
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
            body = {"model": "test-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}
            ok = await client.post(router.base_url + "/v1/messages", json=body,
                                   headers={"x-api-key": API_KEY})
            assert ok.status_code == 200, ok.text
            assert ok.json()["content"][0]["text"] == "w0 w1"
            refused = await client.post(router.base_url + "/v1/messages", json=body,
                                        headers={"x-api-key": "sk-nope"})
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            # x-api-key is the Messages API's header only.
            other = await client.post(
                router.base_url + "/v1/completions",
                json={"model": "test-model", "prompt": "x", "max_tokens": 1},
                headers={"x-api-key": API_KEY},
            )
            assert other.status_code == 401
            # A request with no key is told of both headers /v1/messages takes.
            keyless = await client.post(router.base_url + "/v1/messages", json=body)
            assert keyless.status_code == 401
            assert "'x-api-key: KEY'" in keyless.json()["error"]["message"]
            bad = await client.post(router.base_url + "/v1/messages", headers=auth(),
                                    json={"model": "test-model", "messages": []})
            assert bad.status_code == 400
            assert bad.json()["error"]["code"] == "invalid_request"
        assert [path for path, _, _ in up.received] == ["/v1/messages"]


async def test_access_lines_name_the_endpoint_and_its_usage(
    start_router: RouterFactory, tls_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Each format's tokens come from its own events (Responses' ``response.completed``,
    Messages' ``message_start`` and ``message_delta``) or its JSON reply."""
    caplog.set_level(logging.INFO, logger="firstbyte.access")
    calls = [
        ("/v1/responses", {"input": "hi", "max_output_tokens": 5, "stream": True}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                          "stream": True}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
        ("/v1/embeddings", {"input": "hi"}),
    ]
    async with running_formats_upstream() as up, start_router([up.url]) as router:
        async with httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
            for path, body in calls:
                answer = await client.post(router.base_url + path, headers=auth(),
                                           json={"model": "test-model", **body})
                assert answer.status_code == 200
        for _ in range(100):  # a stream's line is written when its stream ends
            if len(caplog.records) >= len(calls):
                break
            await asyncio.sleep(0.05)
    fields = [record.fields for record in caplog.records]  # type: ignore[attr-defined]
    got = sorted(
        (f["endpoint"], f["input_tokens"], f["output_tokens"], f["outcome"]) for f in fields
    )
    assert got == sorted([
        ("responses", 3, 5, "ok"), ("messages", 3, 4, "ok"), ("messages", 3, 2, "ok"),
        ("completions", 3, 3, "ok"), ("embeddings", 2, None, "ok"),
    ])


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/v1/responses", {"type": "error", "code": "upstream_eof"}),
        ("/v1/messages", {"type": "error", "error": {"type": "api_error", "code": "upstream_eof"}}),
        ("/v1/completions", {"error": {"type": "server_error", "code": "upstream_eof"}}),
    ],
)
async def test_an_upstream_gone_mid_stream_ends_it_with_the_formats_error_event(
    start_router: RouterFactory, tls_files: dict[str, str], path: str, error: dict[str, Any]
) -> None:
    body = {"model": "test-model", "stream": True, "max_tokens": 6, "prompt": "x",
            "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    async with running_formats_upstream(cut_after=2) as up, start_router(
        [up.url]
    ) as router, httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
        answer = await client.post(router.base_url + path, json=body, headers=auth())
    assert answer.status_code == 200
    events = SSEDecoder().receive_data(answer.content)
    if path == "/v1/completions":  # OpenAI's error chunk, then [DONE]
        assert events[-1].data == "[DONE]"
        events = events[:-1]
    else:
        assert b"[DONE]" not in answer.content
    name, data = events[-1].event, json.loads(events[-1].data)
    assert name == ("message" if path == "/v1/completions" else "error")
    for key, value in error.items():
        if isinstance(value, dict):
            assert {k: data[key][k] for k in value} == value
        else:
            assert data[key] == value


async def test_the_routers_responses_error_event_takes_the_streams_next_number(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """Read with the openai SDK: the ``error`` event the router adds when the upstream goes
    mid-stream carries ``sequence_number``, the next after the upstream's events."""
    seen: list[str] = []
    async with running_formats_upstream(cut_after=2) as up, start_router(
        [up.url]
    ) as router, _http(tls_files, "1.1", seen) as http, openai.AsyncOpenAI(
        base_url=router.openai_base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        events = [
            e
            async for e in await client.responses.create(
                model="test-model", input="hi", max_output_tokens=6, stream=True
            )
        ]
    assert events[0].type == "response.created"
    assert [e.type for e in events].count("response.output_text.delta") == 2
    error = events[-1]
    assert error.type == "error"
    assert error.code == "upstream_eof"
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_a_responses_stream_ended_by_the_drain_numbers_its_error_next(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """The ``draining`` error (the drain timed out; a cancel's is made the same way) too."""
    seen: list[str] = []
    async with running_formats_upstream(gap_after=2, gap_s=2) as up, start_router(
        [up.url]
    ) as router, _http(tls_files, "1.1", seen) as http, openai.AsyncOpenAI(
        base_url=router.openai_base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        events = []
        async for event in await client.responses.create(
            model="test-model", input="hi", max_output_tokens=6, stream=True
        ):
            events.append(event)
            if event.type == "response.output_text.delta" and event.delta.strip() == "w1":
                # The upstream is silent now: the drain times out on this stream.
                assert router.app.state.end_unfinished_streams() == 1
    error = events[-1]
    assert error.type == "error"
    assert error.code == "draining"
    assert [e.sequence_number for e in events] == list(range(len(events)))


TRIM_STORE_BYTES = 64 << 10
"""The store of the trim tests: a key's share is 16 KiB, a small part of one long stream."""
TRIM_WORDS = 3_000
"""Output of a trimmed stream: ~500 KB of Responses events, ~300 KB of Messages ones, far
more than the store and the 64 KiB an HTTP/2 stream holds while its client reads nothing.
Its upstream pauses after two words, for the client to read the first event in time."""


async def _stall_until_trimmed(router: RouterEndpoints, stream_id: str) -> None:
    """While the client reads nothing (its HTTP/2 window shuts), until its stream ended
    upstream with its history trimmed (bounded): past the router's reader of it, which
    cannot send while the window is shut, if not already as it raced the upstream."""
    stored = router.app.state.store.get(stream_id, owner_of(API_KEY))
    assert stored is not None
    for _ in range(600):
        if stored.done:
            break
        await asyncio.sleep(0.05)
    assert stored.done
    assert stored.trimmed > 0


async def test_an_openai_reader_behind_the_trim_point_gets_a_responses_error_event(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """The openai SDK reads one event of a Responses stream, then nothing while its key's
    share trims the stream's history past it; reading on, it gets what its connection held,
    then the ``stream_history_trimmed`` error as a Responses ``error`` event (the SDK's typed
    ``ResponseErrorEvent``, not an exception for a chat-shaped error), numbered after the
    stream's last event, with a gap where the dropped events were."""
    seen: list[str] = []
    async with running_formats_upstream(gap_after=2, gap_s=0.5) as up, start_router(
        [up.url], streams={"max_total_bytes": TRIM_STORE_BYTES}
    ) as router, _http(tls_files, "2", seen) as http, openai.AsyncOpenAI(
        base_url=router.openai_base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        stream = await client.responses.create(
            model="test-model", input="hi", max_output_tokens=TRIM_WORDS, stream=True
        )
        events: list[Any] = [await stream.__anext__()]
        await _stall_until_trimmed(router, stream.response.headers[STREAM_HEADER])
        events += [e async for e in stream]
    assert seen == ["HTTP/2"]
    *read, error = events
    assert read[0].type == "response.created"
    assert [e.sequence_number for e in read] == list(range(len(read)))
    assert len(read) < TRIM_WORDS // 2
    assert isinstance(error, openai.types.responses.ResponseErrorEvent)
    assert error.code == "stream_history_trimmed"
    assert "share of the stream store" in error.message
    dropped = re.match(r"Events (\d+) to (\d+) of this stream were dropped", error.message)
    assert dropped is not None, error.message
    first, last = int(dropped[1]), int(dropped[2])
    assert first == len(read) + 1  # the client's next event
    # Numbered after the last event in the store then (event N is numbered N - 1), which
    # comes after the last dropped; at most one past response.completed's, the stream's last.
    assert last < error.sequence_number <= TRIM_WORDS + 8


async def test_an_anthropic_reader_behind_the_trim_point_gets_an_anthropic_error_event(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """The same with the anthropic SDK on a Messages stream: the SDK raises its status error
    for the ``event: error`` (a chat-shaped ``data:`` event it skipped, ending the stream
    without a word)."""
    async with running_formats_upstream(gap_after=2, gap_s=0.5) as up, start_router(
        [up.url], streams={"max_total_bytes": TRIM_STORE_BYTES}
    ) as router, _http(tls_files, "2", [], httpx2) as http, anthropic.AsyncAnthropic(
        base_url=router.base_url, api_key=API_KEY, http_client=http, max_retries=0
    ) as client:
        stream = await client.messages.create(
            model="test-model", max_tokens=TRIM_WORDS, stream=True,
            messages=[{"role": "user", "content": "hello"}],
        )
        events: list[Any] = [await stream.__anext__()]
        await _stall_until_trimmed(router, stream.response.headers[STREAM_HEADER])

        async def read_on() -> None:
            async for event in stream:
                events.append(event)

        with pytest.raises(anthropic.APIStatusError) as raised:
            await read_on()
    assert events[0].type == "message_start"
    assert 1 < len(events) < TRIM_WORDS // 2
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "api_error"
    assert body["error"]["code"] == "stream_history_trimmed"
    message = body["error"]["message"]
    dropped = re.match(r"Events (\d+) to \d+ of this stream were dropped", message)
    assert dropped is not None, message
    assert int(dropped[1]) > len(events)  # after the events read (the SDK skips pings)


async def test_every_endpoint_is_held_to_the_keys_limits(
    start_router: RouterFactory, tls_files: dict[str, str]
) -> None:
    """The key's request rate, its streams in flight and the body limit apply to every API,
    each refusal OpenAI's error body with its own code (and ``Retry-After`` on a 429)."""
    calls = [
        ("/v1/embeddings", {"input": "hi"}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ]
    limits = {"requests_per_s_per_key": 0.01, "request_burst_per_key": 1,
              "max_body_bytes": 4096}
    async with running_formats_upstream() as up, start_router(
        [up.url], limits=limits
    ) as router, httpx.AsyncClient(verify=client_tls(tls_files), timeout=10) as client:
        for path, body in calls:
            too_big = await client.post(router.base_url + path, headers=auth(), json={
                "model": "test-model", **body, "pad": "x" * 5000})
            assert too_big.status_code == 413, path
            assert too_big.json()["error"]["code"] == "request_too_large"
        first = await client.post(router.base_url + calls[0][0], headers=auth(),
                                  json={"model": "test-model", **calls[0][1]})
        assert first.status_code == 200
        for path, body in calls:  # the bucket of one request is spent: every API is refused
            refused = await client.post(router.base_url + path, headers=auth(),
                                        json={"model": "test-model", **body})
            assert refused.status_code == 429, path
            assert refused.json()["error"]["code"] == "key_rate_limited"
            assert int(refused.headers["retry-after"]) >= 1
    assert [path for path, _, _ in up.received] == ["/v1/embeddings"]
