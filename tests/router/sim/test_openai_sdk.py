"""The official ``openai`` SDK against a real sim over real HTTP on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from firstbyte.protocol.openai import decode_chunk
from firstbyte.protocol.sse import DONE, SSEDecoder
from firstbyte.router.sim.server import running_sim

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a terse assistant. " * 40},
    {"role": "user", "content": "Why is the sky blue?"},
]


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    async with running_sim("instant", seed=11) as url:
        yield url


@pytest.fixture
async def client(sim_url: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{sim_url}/v1", api_key="unused") as c:
        yield c


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-instant"]


async def test_non_streaming(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model="sim-instant",
        messages=MESSAGES,
        max_tokens=7,
        seed=1,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content is not None
    assert len(choice.message.content.split()) == 7
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 7
    assert completion.usage.prompt_tokens > 200
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 7


async def test_streaming_with_usage_and_cached_tokens(client: openai.AsyncOpenAI) -> None:
    async def stream_once() -> tuple[str, list[str | None], openai.types.CompletionUsage | None]:
        stream = await client.chat.completions.create(
            model="sim-instant",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            seed=5,
            max_tokens=1000,
        )
        text, reasons, usage = "", list[str | None](), None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reasons.append(str(chunk.choices[0].finish_reason or "") or None)
            else:
                usage = chunk.usage
        return text, reasons, usage

    text1, reasons1, usage1 = await stream_once()
    text2, _, usage2 = await stream_once()
    assert text1
    assert text1 == text2
    assert reasons1[-1] == "stop"  # it stopped on its own before 1000 tokens
    assert all(r is None for r in reasons1[:-1])
    assert usage1 is not None
    assert usage2 is not None
    assert usage1.completion_tokens == len(text1.split())
    assert usage1.prompt_tokens_details is not None
    assert usage2.prompt_tokens_details is not None
    assert usage1.prompt_tokens_details.cached_tokens == 0
    # The second request's prompt is in the cache: every full block but the last token's.
    cached = usage2.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert cached % 16 == 0
    assert usage2.prompt_tokens - 16 <= cached < usage2.prompt_tokens


async def test_different_seed_different_text(client: openai.AsyncOpenAI) -> None:
    texts = set()
    for seed in (1, 2):
        completion = await client.chat.completions.create(
            model="sim-instant",
            messages=MESSAGES,
            max_tokens=20,
            seed=seed,
        )
        texts.add(completion.choices[0].message.content)
    assert len(texts) == 2


async def test_sse_framing_is_openai_exact(sim_url: str) -> None:
    body = {"model": "sim-instant", "messages": MESSAGES, "stream": True, "max_tokens": 3}
    async with (
        httpx.AsyncClient() as c,
        c.stream("POST", f"{sim_url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = b"".join([piece async for piece in r.aiter_raw()])
    assert raw.endswith(b"data: [DONE]\n\n")
    assert b"\r" not in raw
    events = SSEDecoder().receive_data(raw)
    assert events[-1].data == DONE
    chunks = [decode_chunk(e.data) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.content for c in chunks[1:4])
    assert len(chunks) == 1 + 3 + 1  # role, three tokens, finish
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1
    assert all(c.model == "sim-instant" and c.object == "chat.completion.chunk" for c in chunks)
    assert b'"usage"' not in raw  # only when include_usage asks for it
