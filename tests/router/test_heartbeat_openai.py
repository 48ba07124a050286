"""The official openai SDK through the real router across 6 s of upstream silence.

Heartbeats (every 0.3 s here: twenty of them in the gap, as at the default 15 s interval in a
5-minute tool call) fall inside the gap; the SDK must see none of them as an event.
Its decoder dispatches an empty event on a blank line once an ``id:`` was seen, so the old
heartbeat (``: ping`` and a blank line) made it raise ``JSONDecodeError`` mid-stream.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest

from firstbyte.benchmarks.cluster import RegionSpec, running_regions
from firstbyte.protocol.sse import HEARTBEAT
from firstbyte.router.sim.profiles import get_profile

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.3
GAP_S = 6.0


def region(sim: dict[str, Any]) -> list[RegionSpec]:
    limits = {"limits": {"heartbeat_interval_s": HEARTBEAT_S}}
    return [RegionSpec("tokyo", 35.68, 139.69, backends=1, sim=sim, config=limits)]


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def openai_stream(url: str, text: str, max_tokens: int) -> tuple[list[float], str, int]:
    """Content arrival times (from the request), the text, and usage's completion tokens."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-test") as client:
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model="sim",
            messages=messages(text),  # type: ignore[arg-type]
            stream=True,
            max_tokens=max_tokens,
            stream_options={"include_usage": True},
        )
        arrivals: list[float] = []
        out = ""
        tokens = -1
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    arrivals.append(time.perf_counter() - start)
                    out += choice.delta.content
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    return arrivals, out, tokens


async def heartbeats_seen(url: str, text: str, max_tokens: int) -> int:
    """The same kind of request read raw: how many heartbeats its byte stream carried."""
    body = {"model": "sim", "messages": messages(text), "stream": True, "max_tokens": max_tokens}
    async with httpx.AsyncClient(timeout=60) as client, client.stream(
        "POST", f"{url}/v1/chat/completions", json=body
    ) as response:
        assert response.status_code == 200
        raw = b"".join([piece async for piece in response.aiter_raw()])
    assert raw.rstrip().endswith(b"data: [DONE]")
    return raw.count(HEARTBEAT)


Seen = tuple[tuple[list[float], str, int], int]
"""What the SDK saw (arrival times, text, usage's tokens) and the heartbeats of the raw read."""


async def across_a_stall() -> Seen:
    """3 tokens, ``GAP_S`` of silence (a tool call, a stalled upstream), then the rest."""
    stall = f"stall:after=3,ms={GAP_S * 1000:g}"
    async with running_regions(region({"profile": "instant", "faults": [stall]})) as regions:
        url = regions["tokyo"].url
        return await asyncio.gather(
            openai_stream(url, "Plan a trip with a tool call.", 12),
            heartbeats_seen(url, "The same, read raw.", 12),
        )


def prompt_of_prefill(profile: str, seconds: float) -> str:
    """A prompt whose prefill takes about ``seconds`` on ``profile`` (5 chars a token)."""
    cost = get_profile(profile)
    n = 1
    while cost.prefill_s(n * 2) < seconds:
        n *= 2
    lo, hi = n, n * 2
    while hi - lo > 16:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost.prefill_s(mid) < seconds else (lo, mid)
    return " word" * hi


async def across_a_queue_wait() -> Seen:
    """One sequence at a time, taken by a prompt that prefills for ``GAP_S``: the SDK's request
    waits in the backend's queue, with heartbeats, before its first token."""
    sim = {"profile": "consumer-7b", "max_num_seqs": 1}
    async with running_regions(region(sim)) as regions:
        url = regions["tokyo"].url
        backend = regions["tokyo"].sims[0].url
        long_prompt = {"model": "sim", "messages": messages(prompt_of_prefill("consumer-7b", GAP_S)),
                       "max_tokens": 1}
        async with httpx.AsyncClient(timeout=60) as direct:
            occupant = asyncio.create_task(
                direct.post(f"{backend}/v1/chat/completions", json=long_prompt)
            )
            await asyncio.sleep(0.5)  # admitted: the only slot is taken
            seen = await asyncio.gather(
                openai_stream(url, "Queued behind a long prompt.", 6),
                heartbeats_seen(url, "Queued as well, read raw.", 6),
            )
            assert (await occupant).status_code == 200
    return seen


@pytest.fixture(scope="module")
def both() -> tuple[Seen, Seen]:
    """Both waits, side by side (separate regions): the module takes one, not two."""

    async def run() -> tuple[Seen, Seen]:
        return await asyncio.gather(across_a_stall(), across_a_queue_wait())

    return asyncio.run(run())


def test_openai_sdk_streams_across_a_stall(both: tuple[Seen, Seen]) -> None:
    (arrivals, text, tokens), pings = both[0]
    assert tokens == len(arrivals) == 12
    assert text
    gap = arrivals[3] - arrivals[2]
    assert gap >= GAP_S - 0.5, arrivals
    assert pings >= (GAP_S - 1) / HEARTBEAT_S - 2  # the heartbeats fell inside the gap


def test_openai_sdk_streams_across_a_queue_wait(both: tuple[Seen, Seen]) -> None:
    (arrivals, text, tokens), pings = both[1]
    assert tokens == len(arrivals) == 6
    assert text
    assert arrivals[0] >= GAP_S - 1.5, arrivals  # the first token came after the queue wait
    assert pings >= (GAP_S - 2) / HEARTBEAT_S - 2
