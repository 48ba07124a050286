"""CPU per non-streamed request (a whole answer), for ``bench router_overhead``.

Embeddings, and chat or completions without ``stream``, are answered whole: the proxy reads
the upstream's answer to its end and sends it on. An application sends them by the
thousand, so their cost per request is a proxy's bill as much as its CPU per chunk is for
streams. Here ``concurrency`` closed-loop workers send short non-streamed chat requests, in
rounds alternating over the targets (nginx, the default router and its A/A twin, and with
``--baseline`` an earlier router beside today's on the same server), and each target's CPU
time over its round is divided by the requests it answered.

The CPU comes from ``/proc`` at the kernel's tick (100 Hz): a round of a few thousand
requests reads a target's CPU per request to a few percent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import httpx

from firstbyte.benchmarks.progress import Progress
from firstbyte.protocol import paths

MAX_TOKENS = 8
"""Tokens a request asks for: short answers, as a classifier's or a tool call's are."""


async def _worker(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], requests: int,
    failed: list[str],
) -> int:
    """Send ``requests`` requests one after another; the number answered 200 whole."""
    answered = 0
    for _ in range(requests):
        try:
            response = await client.post(url + paths.CHAT_COMPLETIONS, json=body)
            if response.status_code == 200 and response.json()["choices"]:
                answered += 1
            else:
                failed.append(f"HTTP {response.status_code}: {response.text[:120]}")
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            failed.append(f"{type(exc).__name__}: {exc}"[:200])
    return answered


async def _one_round(
    clients: list[httpx.AsyncClient], url: str, cpu: Callable[[], float], per_worker: int,
    prompt: str, failed: list[str],
) -> tuple[int, float]:
    """(requests answered, CPU seconds of the target) over one round."""
    body = {
        "model": "sim-llama-7b",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
    }
    before = cpu()
    answered = await asyncio.gather(
        *(_worker(client, url, body, per_worker, failed) for client in clients)
    )
    return sum(answered), cpu() - before


async def measure(
    targets: dict[str, str],
    cpu_of: dict[str, Callable[[], float]],
    *,
    concurrency: int,
    rounds: int,
    per_worker: int,
    prompt: str,
    make_clients: Callable[[int], list[httpx.AsyncClient]],
    bar: Progress,
) -> dict[str, dict[str, Any]]:
    """Each target's CPU per whole answer (``targets``: name -> base URL; ``cpu_of``: name ->
    its processes' CPU seconds so far), its rounds alternating over the targets.

    Per target: ``cpu_ms_per_request`` (all rounds' CPU over all their answers),
    ``rounds_ms_per_request``, ``requests`` (answered) and ``errors`` (the first five
    distinct, with ``failed``: how many)."""
    cpu_s = {name: 0.0 for name in targets}
    answered = {name: 0 for name in targets}
    each: dict[str, list[float]] = {name: [] for name in targets}
    failed: dict[str, list[str]] = {name: [] for name in targets}
    clients = {name: make_clients(concurrency) for name in targets}
    async with contextlib.AsyncExitStack() as stack:
        for group in clients.values():
            for client in group:
                await stack.enter_async_context(client)
        for name, url in targets.items():  # warm up: open every connection
            await _one_round(clients[name], url, cpu_of[name], 1, prompt, [])
        for _ in range(rounds):
            for name, url in targets.items():
                n, cpu = await _one_round(
                    clients[name], url, cpu_of[name], per_worker, prompt, failed[name]
                )
                answered[name] += n
                cpu_s[name] += cpu
                if n:
                    each[name].append(cpu * 1000 / n)
                bar.advance()
    return {
        name: {
            "cpu_ms_per_request": cpu_s[name] * 1000 / answered[name] if answered[name] else None,
            "rounds_ms_per_request": each[name],
            "requests": answered[name],
            "failed": len(failed[name]),
            "errors": sorted(set(failed[name]))[:5],
        }
        for name in targets
    }
