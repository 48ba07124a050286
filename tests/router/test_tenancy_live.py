"""Tenancy and capacity on a real router over loopback sockets, the sim as its upstream:
a greedy key gets its own 429 while another key is served; a live stream survives another key
filling the stream store; ``firstbyte router --upstream URL`` at its defaults serves 100
concurrent streams on a 256-slot sim without a 429."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections import Counter
from typing import Any

import httpx
import openai
import pytest

from firstbyte.cli import CLIError
from firstbyte.router.cli import add_arguments, config_from_args
from firstbyte.router.serve import running_router
from firstbyte.router.sim.server import sim_server
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth
from tests.router.streamtext import sim_text, sse_text


def chat(text: str, max_tokens: int, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "sim-llama-7b",
        "messages": [{"role": "user", "content": text}],
        "stream": stream,
        "max_tokens": max_tokens,
        "seed": 3,
    }


def _code(response: httpx.Response) -> str:
    error: dict[str, str] = json.loads(response.content)["error"]
    return error["code"]


async def _rejected(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    """``firstbyte_router_rejected_total`` by reason (summed over models), from ``/metrics``."""
    text = (await client.get(base + "/metrics", headers=auth())).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("firstbyte_router_rejected_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def test_a_greedy_key_gets_its_own_429_and_the_other_key_is_served(
    start_router: RouterFactory,
) -> None:
    # 256 slots and a decode step that grows with the batch: 100 streams of 120 tokens run
    # for seconds, side by side.
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url], tls=False, limits={"max_streams_per_key": 40}
    ) as router:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(limits=limits, timeout=60) as client:
            url = router.base_url + "/v1/chat/completions"

            stop = asyncio.Event()
            greedy_answers: list[httpx.Response] = []

            async def greedy(i: int) -> None:
                # Closed loop: a new stream as soon as one ends, a short pause after a 429
                # (a greedy client, not one that honours Retry-After).
                n = 0
                while not stop.is_set():
                    body = chat(f"greedy {i} {n}", 120)
                    answer = await client.post(url, json=body, headers=auth())
                    greedy_answers.append(answer)
                    n += 1
                    if answer.status_code == 429:
                        await asyncio.sleep(0.2)

            greedy_tasks = [asyncio.create_task(greedy(i)) for i in range(100)]
            await asyncio.sleep(0.5)  # the greedy key holds its 40 streams now
            expected = await sim_text(sim, chat("polite", 8))
            polite: list[httpx.Response] = []

            async def polite_worker(w: int) -> None:
                for _ in range(9):
                    polite.append(
                        await client.post(url, json=chat("polite", 8), headers=auth(OTHER_KEY))
                    )

            await asyncio.gather(*(polite_worker(w) for w in range(5)))
            stop.set()
            await asyncio.gather(*greedy_tasks)
            rejected = await _rejected(client, router.base_url)
    # The other key: 45 of 45 served, every one with the whole completion.
    assert Counter(r.status_code for r in polite) == {200: 45}
    assert all(sse_text(r.content)[0] == expected for r in polite)
    # The greedy key: its own 429 code with Retry-After beyond its 40; nothing else failed.
    statuses = Counter(r.status_code for r in greedy_answers)
    assert set(statuses) == {200, 429}, statuses
    assert statuses[200] >= 40
    refused = [r for r in greedy_answers if r.status_code == 429]
    assert {_code(r) for r in refused} == {"key_concurrency_exceeded"}
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    # The metric counts each refusal once, under its reason, and nothing else was refused.
    assert rejected == {"key_concurrency_exceeded": len(refused)}


async def test_a_live_stream_survives_another_key_filling_the_store(
    start_router: RouterFactory,
) -> None:
    # A store of 256 KiB that one key may fill entirely (its share is the whole store): the
    # byte bound alone has to keep the other key's live stream.
    async with sim_server("h100-7b") as sim, start_router(
        [sim.url],
        tls=False,
        streams={"max_total_bytes": 256 << 10},
        limits={"max_store_bytes_per_key": 256 << 10},
    ) as router:
        body = chat("tell me a long story", 150)
        expected = await sim_text(sim, body)
        sdk_http = httpx.AsyncClient()
        sdk = openai.AsyncOpenAI(
            base_url=router.openai_base_url, api_key=OTHER_KEY, http_client=sdk_http
        )
        filler = httpx.AsyncClient(timeout=30)
        try:
            stream = await sdk.chat.completions.create(
                model=body["model"],
                messages=body["messages"],
                stream=True,
                max_tokens=body["max_tokens"],
                seed=body["seed"],
            )
            text, chunks = "", 0
            detached: list[httpx.Response] = []
            async for chunk in stream:
                chunks += 1
                text += "".join(choice.delta.content or "" for choice in chunk.choices)
                if chunks in (5, 40, 80):  # the other key fills the store, three times over
                    detached += await asyncio.gather(
                        *(
                            filler.post(
                                router.base_url + "/v1/streams",
                                json=chat(f"filler {chunks} {i}", 400),
                                headers=auth(API_KEY),
                            )
                            for i in range(30)
                        )
                    )
        finally:
            await sdk.close()
            await sdk_http.aclose()
            await filler.aclose()
    assert text == expected  # every token, in order, once
    statuses = Counter(r.status_code for r in detached)
    assert statuses[201] >= 30  # the first round started
    assert statuses[429] > 0  # then its live streams filled the store: refused, not evicted
    assert {_code(r) for r in detached if r.status_code == 429} == {"stream_store_full"}


def _router_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


async def test_router_defaults_serve_100_concurrent_streams_on_a_256_slot_sim() -> None:
    async with sim_server("h100-7b") as sim:
        assert sim.engine.max_num_seqs == 256
        config = config_from_args(
            _router_args(
                "--upstream", sim.url, "--api-key", API_KEY, "--insecure-plain-http",
                "--port", "0",
            )
        )  # fmt: skip
        assert config.routing.backend_max_in_flight == 1024
        async with running_router(config) as router:
            limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
            async with httpx.AsyncClient(limits=limits, timeout=60) as client:
                url = router.base_url + "/v1/chat/completions"
                gate = asyncio.Semaphore(100)

                async def one(i: int) -> httpx.Response:
                    async with gate:
                        return await client.post(url, json=chat(f"load {i}", 32), headers=auth())

                answers = await asyncio.gather(*(one(i) for i in range(200)))
            peak = router.app.state.routing.tracker.backends[
                router.app.state.pool.backends[0].name]
    statuses = Counter(r.status_code for r in answers)
    assert statuses == {200: 200}, statuses
    assert all(r.content.endswith(b"data: [DONE]\n\n") for r in answers)
    assert peak.slots is None  # it never queued: nothing to learn, the cap stays the limit


def test_limit_flags_map_to_their_config_keys_and_errors_name_the_flag() -> None:
    args = _router_args(
        "--upstream", "http://127.0.0.1:9", "--api-key", API_KEY, "--insecure-plain-http",
        "--max-streams-per-key", "8", "--rate-per-key", "2.5", "--burst-per-key", "5",
        "--store-bytes-per-key", "1000000", "--max-in-flight", "300",
    )  # fmt: skip
    config = config_from_args(args)
    assert config.limits.max_streams_per_key == 8
    assert config.limits.requests_per_s_per_key == 2.5
    assert config.limits.request_burst_per_key == 5
    assert config.store_bytes_per_key() == 1_000_000
    assert config.routing.backend_max_in_flight == 300
    bad = _router_args(
        "--upstream", "http://127.0.0.1:9", "--api-key", API_KEY, "--insecure-plain-http",
        "--max-streams-per-key", "0",
    )  # fmt: skip
    with pytest.raises(CLIError) as caught:
        config_from_args(bad)
    assert str(caught.value).startswith("--max-streams-per-key: ")
    assert "\n" not in str(caught.value)
