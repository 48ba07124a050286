"""The endpoints vLLM serves besides chat, each in its wire format, read by the official SDKs
(``openai`` and ``anthropic``) talking straight to a real sim on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from firstbyte.protocol.sse import DONE, SSEDecoder
from firstbyte.router.sim.server import SimServer, sim_server
from tests.router.conftest import client_tls

MODEL = "m"
SYSTEM = "You answer in one short sentence. " * 40
"""~400 tokens, shared by requests to show the prefix cache."""


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with sim_server("instant", served_model_names=[MODEL], seed=3) as server:
        yield server


@pytest.fixture
async def oai(sim: SimServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{sim.url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest.fixture
async def claude(sim: SimServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(
        base_url=sim.url, api_key="sk-ant-unused", max_retries=0
    ) as client:
        yield client


async def raw_events(url: str, path: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """The (event, data) pairs of a streamed answer, decoded from the bytes as sent (an event
    without an ``event:`` line is a ``message``)."""
    async with httpx.AsyncClient() as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join([piece async for piece in r.aiter_raw()])
    assert b"\r" not in raw
    return [(e.event, e.data) for e in SSEDecoder().receive_data(raw)]


async def read_until_cut(
    c: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[bytes, bool]:
    """What a streamed answer sent, and whether the connection broke off before its end."""
    raw = b""
    try:
        async with c.stream("POST", url, json=body) as r:
            async for piece in r.aiter_raw():
                raw += piece
    except httpx.RemoteProtocolError:
        return raw, True
    return raw, False


# -- /v1/completions ------------------------------------------------------------------------


async def test_chat_with_ignore_eos_runs_to_max_tokens(oai: openai.AsyncOpenAI) -> None:
    # vLLM's extra parameter, as the openai SDK sends it (extra_body).
    messages: Any = [{"role": "user", "content": "hi"}]
    natural = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=900)
    forced = await oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=900, extra_body={"ignore_eos": True}
    )
    assert natural.choices[0].finish_reason == "stop"
    assert natural.usage is not None
    assert natural.usage.completion_tokens < 900
    assert forced.choices[0].finish_reason == "length"
    assert forced.usage is not None
    assert forced.usage.completion_tokens == 900


async def test_completions_streamed_and_not_with_the_openai_sdk(oai: openai.AsyncOpenAI) -> None:
    whole = await oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert whole.object == "text_completion"
    assert whole.model == MODEL
    (choice,) = whole.choices
    assert choice.finish_reason == "length"
    assert len(choice.text.split()) == 6
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (4, 6)

    stream = await oai.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6
    assert "".join(texts) == choice.text  # the same prompt gives the same text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:5])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 10
    assert {c.id for c in chunks} == {chunks[0].id}


async def test_completions_framing_is_vllms(sim: SimServer) -> None:
    body = {"model": MODEL, "prompt": [17, 18, 19], "max_tokens": 2, "stream": True}
    events = await raw_events(sim.url, "/v1/completions", body)
    assert events[-1] == ("message", DONE)
    assert {name for name, _ in events} == {"message"}  # no event: lines, as OpenAI
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * 2
    assert "usage" not in chunks[0]  # only when stream_options asks for it
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert chunks[1]["choices"][0]["stop_reason"] is None


# -- /v1/responses --------------------------------------------------------------------------

RESPONSE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 5,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def test_responses_stream_typed_events_with_the_openai_sdk(
    oai: openai.AsyncOpenAI,
) -> None:
    stream = await oai.responses.create(
        model=MODEL, input="Why is the sky blue?", instructions=SYSTEM, max_output_tokens=5,
        stream=True,
    )  # fmt: skip
    events = [event async for event in stream]
    assert [e.type for e in events] == RESPONSE_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed = events[-1]
    assert completed.type == "response.completed"
    response = completed.response
    assert response.output_text == deltas
    assert response.model == MODEL
    assert response.status == "incomplete"  # cut at max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.output_tokens == 5
    assert response.usage.input_tokens > 300
    item_ids = {e.item_id for e in events if e.type == "response.output_text.delta"}
    assert item_ids == {response.output[0].id}

    again = await oai.responses.create(
        model=MODEL, input="And the sea?", instructions=SYSTEM, max_output_tokens=5
    )
    assert again.status == "incomplete"
    assert len(again.output_text.split()) == 5
    assert again.usage is not None
    assert again.usage.input_tokens_details.cached_tokens >= 300  # the shared instructions


async def test_responses_take_a_function_calls_turns_with_the_openai_sdk(
    oai: openai.AsyncOpenAI,
) -> None:
    """The second request of a tool loop carries the model's ``function_call`` and its
    ``function_call_output`` (and a ``reasoning`` item), as vLLM takes them; they count as
    prompt tokens."""
    turn = [{"role": "user", "content": "Weather in Paris?"}]
    first = await oai.responses.create(model=MODEL, input=turn, max_output_tokens=3)  # type: ignore[arg-type]
    calls = [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny, 24 C"},
    ]
    second = await oai.responses.create(
        model=MODEL, input=turn + calls, max_output_tokens=3,  # type: ignore[arg-type]
        tools=[{"type": "function", "name": "weather", "strict": False,
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
    )  # fmt: skip
    assert first.usage is not None
    assert second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{oai.base_url}responses",
                         json={"model": MODEL, "input": [{"type": "message", "content": "x"}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[0].role"


async def test_stop_strings_end_the_output_before_them_with_both_sdks(
    oai: openai.AsyncOpenAI, claude: anthropic.AsyncAnthropic
) -> None:
    """Chat's and completions' ``stop`` and Messages' ``stop_sequences`` end the text just
    before the first stop string (vLLM's rule), streamed or not; Messages says which one."""
    messages: Any = [{"role": "user", "content": "Tell me about rivers."}]
    full = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                             extra_body={"ignore_eos": True})
    text = full.choices[0].message.content or ""
    stop = " " + text.split()[5]
    before = text[: text.find(stop)]
    cut = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                            stop=[stop, "never said"],
                                            extra_body={"ignore_eos": True})
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (before, "stop")
    chunks = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=40,
                                               stop=stop, stream=True,
                                               extra_body={"ignore_eos": True})
    streamed = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
    assert streamed == before

    anthropic_messages: Any = messages
    said = await claude.messages.create(model=MODEL, max_tokens=40, messages=anthropic_messages)
    said_text = said.content[0].text  # type: ignore[union-attr]
    stop = " " + said_text.split()[3]
    answer = await claude.messages.create(model=MODEL, max_tokens=40, stop_sequences=[stop],
                                          messages=anthropic_messages)
    assert answer.content[0].text == said_text[: said_text.find(stop)]  # type: ignore[union-attr]
    assert (answer.stop_reason, answer.stop_sequence) == ("stop_sequence", stop)
    async with claude.messages.stream(model=MODEL, max_tokens=40, stop_sequences=[stop],
                                      messages=anthropic_messages) as stream:
        final = await stream.get_final_message()
    assert [block.text for block in final.content] == [  # type: ignore[union-attr]
        block.text for block in answer.content]  # type: ignore[union-attr]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)

    done = await oai.completions.create(model=MODEL, prompt="Rivers", max_tokens=30, stop="zz")
    assert done.choices[0].finish_reason in ("stop", "length")  # no stop string said: as before


async def test_responses_sse_has_event_lines_naming_each_type(sim: SimServer) -> None:
    body = {"model": MODEL, "input": [{"role": "user", "content": "hi"}], "stream": True,
            "max_output_tokens": 5}  # fmt: skip
    events = await raw_events(sim.url, "/v1/responses", body)
    assert [name for name, _ in events] == RESPONSE_EVENTS  # no [DONE] after completed
    for name, data in events:
        assert json.loads(data)["type"] == name


async def test_responses_created_and_in_progress_come_before_any_token() -> None:
    """As vLLM: the two events go out with the head; a stall before the first token leaves
    them, and only them, on the wire."""
    body = {"model": MODEL, "input": "hi", "stream": True}
    async with (
        sim_server("instant", served_model_names=[MODEL], faults=["stall:after=0"]) as sim,
        httpx.AsyncClient(timeout=10) as c,
        c.stream("POST", f"{sim.url}/v1/responses", json=body) as r,
    ):
        decoder, events = SSEDecoder(), []
        async for piece in r.aiter_raw():
            events += decoder.receive_data(piece)
            if len(events) >= 2:
                break
    assert [e.event for e in events] == ["response.created", "response.in_progress"]
    created = json.loads(events[0].data)
    assert created["sequence_number"] == 0
    assert created["response"]["status"] == "in_progress"
    assert created["response"]["output"] == []


# -- /v1/embeddings -------------------------------------------------------------------------


async def test_embeddings_are_deterministic_unit_vectors(
    oai: openai.AsyncOpenAI, sim: SimServer
) -> None:
    # The SDK asks for base64 (float32) by default and decodes it.
    first = await oai.embeddings.create(model=MODEL, input=["the sky is blue", "the sea"])
    assert first.model == MODEL
    assert [d.index for d in first.data] == [0, 1]
    a, b = (d.embedding for d in first.data)
    assert len(a) == 384
    assert math.isclose(sum(x * x for x in a), 1.0, rel_tol=1e-5)
    assert abs(sum(x * y for x, y in zip(a, b, strict=True))) < 0.3  # nearly orthogonal
    assert first.usage.prompt_tokens == first.usage.total_tokens > 4
    floats = await oai.embeddings.create(
        model=MODEL, input="the sky is blue", encoding_format="float", dimensions=8
    )
    assert len(floats.data[0].embedding) == 8
    again = await oai.embeddings.create(model=MODEL, input="the sky is blue")
    assert again.data[0].embedding == pytest.approx(a, abs=1e-6)
    assert sim.engine.generation_tokens_total == 0  # no decode for a pooling request


async def test_an_embedding_costs_its_prefill_and_no_decode_step() -> None:
    words = " ".join(f"w{i}" for i in range(4000))  # ~8,000 tokens
    async with (
        sim_server("h100-7b", served_model_names=[MODEL]) as sim,
        httpx.AsyncClient(timeout=30) as c,
    ):
        start = time.perf_counter()
        r = await c.post(f"{sim.url}/v1/embeddings", json={"model": MODEL, "input": words})
        took = time.perf_counter() - start
        assert r.status_code == 200
        tokens = r.json()["usage"]["prompt_tokens"]
        assert tokens >= 4000
        assert took >= sim.engine.profile.prefill_s(tokens)  # a lower bound: it waited
        assert sim.engine.steps == 1
        assert sim.engine.generation_tokens_total == 0


# -- /v1/messages (Anthropic) ---------------------------------------------------------------

MESSAGE_EVENTS = [
    "message_start",
    "content_block_start",
    "ping",
    *["content_block_delta"] * 4,
    "content_block_stop",
    "message_delta",
    "message_stop",
]


async def test_messages_stream_with_the_anthropic_sdk(claude: anthropic.AsyncAnthropic) -> None:
    async with claude.messages.stream(
        model=MODEL, max_tokens=4, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    assert len(texts) == 4
    assert final.content[0].type == "text"
    assert final.content[0].text == "".join(texts)
    assert final.stop_reason == "max_tokens"
    assert final.model == MODEL
    assert final.usage.output_tokens == 4
    assert final.usage.input_tokens > 300

    whole = await claude.messages.create(
        model=MODEL, max_tokens=4, system=SYSTEM,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    )  # fmt: skip
    assert whole.content[0].type == "text"
    assert whole.content[0].text == final.content[0].text  # the same conversation
    assert whole.stop_reason == "max_tokens"
    # Anthropic's usage: the prefix-cache hit is cache_read_input_tokens, apart from input.
    assert whole.usage.cache_read_input_tokens is not None
    assert whole.usage.cache_read_input_tokens >= 300
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 300


async def test_messages_events_in_anthropics_order(sim: SimServer) -> None:
    body = {"model": MODEL, "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    async with httpx.AsyncClient() as c:
        headers = {"x-api-key": "sk-ant-unused", "anthropic-version": "2023-06-01"}
        async with c.stream("POST", f"{sim.url}/v1/messages", json=body, headers=headers) as r:
            assert r.status_code == 200
            raw = b"".join([piece async for piece in r.aiter_raw()])
    events = [(e.event, json.loads(e.data)) for e in SSEDecoder().receive_data(raw)]
    assert [name for name, _ in events] == MESSAGE_EVENTS
    assert all(data["type"] == name for name, data in events)
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 4


# -- every endpoint -------------------------------------------------------------------------

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/embeddings": {"input": "hi"},
    "/v1/messages": {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize(
    ("path", "stream"),
    [(path, stream) for path in sorted(BODIES) for stream in (False, True)
     if not (stream and path == "/v1/embeddings")],  # embeddings are never streamed
)
async def test_unknown_model_is_vllms_404_on_every_endpoint(
    sim: SimServer, path: str, stream: bool
) -> None:
    body = {"model": "other", **BODIES[path], "stream": stream}
    async with httpx.AsyncClient() as c:
        r = await c.post(sim.url + path, json=body)
        ok = await c.post(sim.url + path, json={**body, "model": MODEL})
    assert r.status_code == 404
    message = "The model `other` does not exist."
    if path == "/v1/messages":  # vLLM's Anthropic endpoint translates the error
        assert r.json() == {"type": "error", "error": {"type": "NotFoundError", "message": message}}
    else:
        assert r.json() == {
            "error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}
        }
    assert ok.status_code == 200


@pytest.mark.parametrize("path", sorted(set(BODIES) - {"/v1/embeddings"}))
async def test_stream_null_is_one_json_answer(sim: SimServer, path: str) -> None:
    """``"stream": null`` is false, as OpenAI's ``boolean or null`` and vLLM take it."""
    async with httpx.AsyncClient() as c:
        r = await c.post(sim.url + path, json={"model": MODEL, **BODIES[path], "stream": None})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/responses", {"input": 3}, "input"),
        ("/v1/embeddings", {"input": ""}, "input"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
        # Token ids past an unsigned 32-bit int: the prefix cache's array raised, a 500.
        ("/v1/completions", {"prompt": [-1]}, "prompt[0]"),
        ("/v1/completions", {"prompt": [1 << 32]}, "prompt[0]"),
        ("/v1/embeddings", {"input": [[5, -1]]}, "input[0][1]"),
    ],
)
async def test_invalid_bodies_get_openais_400(
    sim: SimServer, path: str, body: dict[str, Any], param: str
) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(sim.url + path, json={"model": MODEL, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


async def test_messages_without_max_tokens_gets_anthropics_400(sim: SimServer) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(
            f"{sim.url}/v1/messages",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses", "/v1/messages"])
async def test_a_drop_fault_cuts_every_stream_mid_way(path: str) -> None:
    body = {"model": MODEL, **BODIES[path], "stream": True, "max_tokens": 8,
            "max_output_tokens": 8}  # fmt: skip
    async with (
        sim_server("instant", served_model_names=[MODEL], faults=["drop:after=2"]) as sim,
        httpx.AsyncClient() as c,
    ):
        raw, cut = await read_until_cut(c, sim.url + path, body)
    assert cut  # an abrupt end, not a complete response
    events = SSEDecoder().receive_data(raw)
    text = raw.decode()
    assert "[DONE]" not in text
    assert "response.completed" not in text
    assert "message_stop" not in text
    token_events = {
        "/v1/completions": "message",
        "/v1/responses": "response.output_text.delta",
        "/v1/messages": "content_block_delta",
    }
    assert sum(e.event == token_events[path] for e in events) == 2


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_an_injected_503_says_retry_after_in_each_apis_envelope(path: str) -> None:
    async with (
        sim_server("instant", served_model_names=[MODEL], faults=["error503:rate=1"]) as sim,
        httpx.AsyncClient() as c,
    ):
        r = await c.post(sim.url + path, json={"model": MODEL, **BODIES[path]})
        models = await c.get(f"{sim.url}/v1/models")
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    if path == "/v1/messages":
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "overloaded_error"
    else:
        assert r.json()["error"]["code"] == "service_unavailable"
    assert models.status_code == 200  # other routes keep being served


async def test_the_sdks_stream_every_format_over_http2(tls_files: dict[str, str]) -> None:
    """Over TLS the sim is hypercorn: HTTP/2 by ALPN for both SDKs' streams."""
    context = client_tls(tls_files)
    async with (
        sim_server(
            "instant", served_model_names=[MODEL], certfile=tls_files["certfile"],
            keyfile=tls_files["keyfile"],
        ) as sim,
        httpx.AsyncClient(http2=True, verify=context) as http,
    ):  # fmt: skip
        versions: list[str] = []

        async def seen(response: httpx.Response) -> None:
            versions.append(response.http_version)

        http.event_hooks["response"] = [seen]
        oai = openai.AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="k", http_client=http)
        events = [e async for e in await oai.responses.create(
            model=MODEL, input="hi", max_output_tokens=5, stream=True)]  # fmt: skip
        assert [e.type for e in events] == RESPONSE_EVENTS
        chunks = [c async for c in await oai.completions.create(
            model=MODEL, prompt="hi", max_tokens=3, stream=True)]  # fmt: skip
        assert len(chunks) == 3
        # anthropic's SDK runs on its own fork of httpx (httpx2), with the same options.
        async with anthropic.DefaultAsyncHttpxClient(
            http2=True, verify=context, event_hooks={"response": [seen]}
        ) as http_a:
            claude = anthropic.AsyncAnthropic(base_url=sim.url, api_key="k", http_client=http_a)
            async with claude.messages.stream(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            ) as stream:
                assert len([t async for t in stream.text_stream]) == 4
    assert versions == ["HTTP/2"] * 3


async def test_a_websocket_upgrade_is_refused_not_a_bare_500() -> None:
    """vLLM serves no WebSocket: under hypercorn the sim returned without a word and the
    client got a bare 500 (so `firstbyte probe --transport websocket` said 'answered 500')."""
    async with sim_server("instant", server="hypercorn") as sim:
        host, port = sim.url.split("://")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /v1/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
    assert status.split()[1] == b"403", status
