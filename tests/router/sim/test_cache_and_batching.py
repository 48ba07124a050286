"""Prefix cache, continuous batching and overload, over real HTTP with the h100-7b profile.

Times are compared within one run with generous bounds (this machine is shared and noisy).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random

import httpx
import pytest

from firstbyte.router.sim.profiles import PROFILES, get_profile
from firstbyte.router.sim.server import sim_server
from firstbyte.router.sim.tokens import tokenize
from tests.router.sim.helpers import MODEL, chat_body, metric, stream_chat


def system_prompt(seed: int, tokens: int = 4000) -> str:
    """A deterministic system prompt of about ``tokens`` tokens."""
    rng = random.Random(seed)
    words = ["alpha", "river", "stone", "quiet", "north", "lamp", "glass", "paper", "cloud"]
    text = " ".join(rng.choice(words) + str(i % 7) for i in range(tokens // 2))
    assert abs(len(tokenize(text)) - tokens) < 50
    return text


async def test_shared_system_prompt_is_cached_and_cuts_ttft() -> None:
    system = system_prompt(1)
    async with sim_server("h100-7b", served_model_names=[MODEL]) as sim, httpx.AsyncClient() as client:
        await client.get(f"{sim.url}/health")  # connection warm before timing
        first = await stream_chat(
            client,
            sim.url,
            chat_body(
                "Question one?", system=system, max_tokens=2, stream_options={"include_usage": True}
            ),
        )
        second = await stream_chat(
            client,
            sim.url,
            chat_body(
                "A different question?",
                system=system,
                max_tokens=2,
                stream_options={"include_usage": True},
            ),
        )
        metrics = (await client.get(f"{sim.url}/metrics")).text
    usage1, usage2 = first.chunks[-1].usage, second.chunks[-1].usage
    assert usage1 is not None
    assert usage2 is not None
    assert usage1.cached_tokens == 0
    # Every full block of the shared part (system message + its template markers) is a hit.
    assert usage2.cached_tokens >= 3984
    assert usage2.cached_tokens % 16 == 0
    assert usage2.cached_tokens < usage2.prompt_tokens
    assert first.ttft_s is not None
    assert second.ttft_s is not None
    # Uncached: ~66 ms prefill + 10 ms decode; cached: ~10 ms. "Well under half".
    assert first.ttft_s >= 0.060
    assert second.ttft_s < first.ttft_s / 2
    assert metric(metrics, "vllm:prefix_cache_hits_total") == usage2.cached_tokens
    assert metric(metrics, "vllm:prefix_cache_queries_total") == (
        usage1.prompt_tokens + usage2.prompt_tokens
    )


async def test_tokenizing_is_charged_as_the_profile_says_cached_prefix_or_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A profile whose only cost is the frontend's tokenizer, slow enough to stand out of this
    # machine's noise: 500 us/token, so a ~400-token prompt takes ~0.2 s before its first token.
    slow = dataclasses.replace(
        get_profile("instant"), name="test-tokenizer", tokenize_per_token_s=500e-6
    )
    monkeypatch.setitem(PROFILES, slow.name, slow)
    system = system_prompt(3, tokens=400)
    async with sim_server(slow.name, served_model_names=[MODEL]) as sim, httpx.AsyncClient() as c:
        await c.get(f"{sim.url}/health")
        opts = {"max_tokens": 1, "stream_options": {"include_usage": True}}
        cold = await stream_chat(c, sim.url, chat_body("q", system=system, **opts))
        warm = await stream_chat(c, sim.url, chat_body("q2", system=system, **opts))
        short = await stream_chat(c, sim.url, chat_body("hi", **opts))
    cold_usage, warm_usage = cold.chunks[-1].usage, warm.chunks[-1].usage
    assert cold_usage is not None
    assert warm_usage is not None
    assert warm_usage.cached_tokens >= 384  # the prefix is cached: prefill skipped ...
    assert cold.ttft_s is not None
    assert warm.ttft_s is not None
    assert short.ttft_s is not None
    # ... but the text is tokenized anyway: both pay 500 us per prompt token (lower bounds).
    assert cold.ttft_s >= cold_usage.prompt_tokens * 500e-6
    assert warm.ttft_s >= warm_usage.prompt_tokens * 500e-6 >= 0.19
    assert short.ttft_s < 0.15  # ~10 tokens: 5 ms, a generous bound


async def test_cache_smaller_than_the_working_set_evicts() -> None:
    a, b = system_prompt(1), system_prompt(2)
    # 300 blocks = 4,800 tokens: room for one 4K system prompt, not two.
    async with sim_server("h100-7b", served_model_names=[MODEL], prefix_cache_blocks=300) as sim, httpx.AsyncClient() as c:
        opts = {"max_tokens": 1, "stream_options": {"include_usage": True}}
        await stream_chat(c, sim.url, chat_body("q", system=a, **opts))
        hit = await stream_chat(c, sim.url, chat_body("q2", system=a, **opts))
        await stream_chat(c, sim.url, chat_body("q", system=b, **opts))  # pushes a out
        gone = await stream_chat(c, sim.url, chat_body("q3", system=a, **opts))
        assert sim.engine.cache.evictions > 0
    hit_usage, gone_usage = hit.chunks[-1].usage, gone.chunks[-1].usage
    assert hit_usage is not None
    assert gone_usage is not None
    assert hit_usage.cached_tokens >= 3984
    assert gone_usage.cached_tokens == 0
    assert hit.ttft_s is not None
    assert gone.ttft_s is not None
    assert gone.ttft_s > 2 * hit.ttft_s


async def test_third_request_waits_for_a_slot_and_shows_in_metrics() -> None:
    tokens = 30  # ~30 * 10.3 ms = ~0.3 s per request
    async with sim_server("h100-7b", served_model_names=[MODEL], max_num_seqs=2) as sim, httpx.AsyncClient() as client:
        await client.get(f"{sim.url}/health")
        tasks = [
            asyncio.ensure_future(
                stream_chat(client, sim.url, chat_body(f"request {i}", max_tokens=tokens))
            )
            for i in range(3)
        ]
        waiting = running = 0.0
        for _ in range(100):
            await asyncio.sleep(0.01)
            text = (await client.get(f"{sim.url}/metrics")).text
            waiting = metric(text, "vllm:num_requests_waiting")
            running = metric(text, "vllm:num_requests_running")
            if waiting == 1 and running == 2:
                break
        results = await asyncio.gather(*tasks)
    assert (running, waiting) == (2, 1)
    assert all(r.status == 200 for r in results)
    assert all(len(r.chunks) == tokens + 2 for r in results)  # role + tokens + finish
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    durations = sorted(r.e2e_s - r.ttft_s for r in results if r.e2e_s and r.ttft_s)
    assert len(ttfts) == 3
    # The queued one's TTFT grows by about one request's duration (~0.3 s).
    assert ttfts[2] - ttfts[1] > 0.6 * durations[0]
    assert ttfts[2] - ttfts[1] < 3 * durations[-1]


async def test_past_the_queue_limit_it_answers_503() -> None:
    async with (
        sim_server("h100-7b", served_model_names=[MODEL], max_num_seqs=2, queue_limit=1) as sim,
        httpx.AsyncClient() as client,
    ):
        tasks = [
            asyncio.ensure_future(stream_chat(client, sim.url, chat_body(f"r{i}", max_tokens=40)))
            for i in range(3)
        ]
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(sim.engine.running) + len(sim.engine.waiting) == 3:
                break
        rejected = await stream_chat(client, sim.url, chat_body("one too many"))
        accepted = await asyncio.gather(*tasks)
        after = await stream_chat(client, sim.url, chat_body("later", max_tokens=2))
    assert rejected.status == 503
    error = json.loads(rejected.body)["error"]
    assert error["type"] == "server_error"
    assert "overloaded" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert [r.status for r in accepted] == [200, 200, 200]
    assert all(r.done for r in accepted)
    assert after.status == 200
    assert after.done
