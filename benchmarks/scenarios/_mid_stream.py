"""CPU per relayed chunk in the middle of streams, for ``bench router_overhead``.

A proxy's CPU per chunk over whole streams mixes two costs: relaying a chunk, and each
request's work (its head parsed, admitted, routed, its stream set up and finished) spread
over the stream's chunks. This measures the first alone: ``concurrency`` streams start
together, every one asking for the same number of tokens (``ignore_eos``: the sim runs each
to its limit), and the proxy's CPU time is read in the window where every stream has had its
first chunk and none has ended, so no request starts or ends in it. What a target costs per
chunk over whole streams beyond that is its work per request.

The window's CPU comes from ``/proc`` at the kernel's tick (100 Hz): over a window of a few
seconds at ~4,000 chunks a second, a round reads a target's CPU per chunk to a few percent.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from firstbyte.benchmarks.progress import Progress
from firstbyte.protocol import paths

SAMPLE_S = 0.05
"""How often the window's clock, chunk count and CPU time are read."""

EDGE_S = 0.1
"""Kept off each end of the window: the last first chunk's and the first end's loop turns."""

MIN_WINDOW_S = 0.5
"""A round whose window is shorter is not counted (its CPU is a few ticks)."""


@dataclass
class _Round:
    """One target's round: when each stream had its first chunk and ended, and the samples
    (time, chunks so far, CPU seconds so far)."""

    firsts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    samples: list[tuple[float, int, float]] = field(default_factory=list)
    chunks: int = 0
    failed: list[str] = field(default_factory=list)

    def window(self) -> tuple[float, int, float] | None:
        """(seconds, chunks, CPU seconds) over the window, None if it is too short or a
        stream failed."""
        if self.failed or not self.firsts or len(self.ends) < len(self.firsts):
            return None
        start, end = max(self.firsts) + EDGE_S, min(self.ends) - EDGE_S
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < MIN_WINDOW_S:
            return None
        (t0, c0, cpu0), (t1, c1, cpu1) = inside[0], inside[-1]
        return t1 - t0, c1 - c0, cpu1 - cpu0


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: _Round
) -> None:
    """One stream: its chunks counted into ``record`` as they arrive (every ``data:``
    event, the role chunk and the end's included: both targets relay the same bytes)."""
    now = time.perf_counter
    try:
        async with client.stream("POST", url + paths.CHAT_COMPLETIONS, json=body) as response:
            response.raise_for_status()
            first = True
            async for piece in response.aiter_raw():
                record.chunks += piece.count(b"data: ")
                if first:
                    record.firsts.append(now())
                    first = False
        record.ends.append(now())
    except httpx.HTTPError as exc:
        record.failed.append(f"{type(exc).__name__}: {exc}"[:200])


async def _one_round(
    clients: list[httpx.AsyncClient], url: str, cpu: Callable[[], float], max_tokens: int,
    prompt: str, seed: int,
) -> _Round:
    record = _Round()
    bodies = [
        {
            "model": "sim-llama-7b",
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "seed": seed * 100_000 + i,
        }
        for i in range(len(clients))
    ]
    streams = asyncio.gather(
        *(_stream(client, url, body, record) for client, body in zip(clients, bodies, strict=True))
    )
    while not streams.done():
        record.samples.append((time.perf_counter(), record.chunks, cpu()))
        await asyncio.wait([streams], timeout=SAMPLE_S)
    await streams
    return record


async def measure(
    targets: dict[str, str],
    cpu_of: dict[str, Callable[[], float]],
    *,
    concurrency: int,
    rounds: int,
    max_tokens: int,
    prompt: str,
    make_clients: Callable[[int], list[httpx.AsyncClient]],
    bar: Progress,
) -> dict[str, dict[str, Any]]:
    """Each target's CPU per chunk mid-stream (``targets``: name -> base URL; ``cpu_of``:
    name -> its processes' CPU seconds so far), its rounds alternating over the targets.

    Per target: ``cpu_us_per_chunk`` (the windows' CPU over their chunks, all rounds
    together), ``rounds_us_per_chunk`` (each counted round's), ``rounds_counted``,
    ``window_s`` (the windows' total length), ``chunks`` and ``errors``."""
    got: dict[str, list[_Round]] = {name: [] for name in targets}
    clients = {name: make_clients(concurrency) for name in targets}
    async with contextlib.AsyncExitStack() as stack:
        for group in clients.values():
            for client in group:
                await stack.enter_async_context(client)
        for name, url in targets.items():  # warm up: open every connection
            await _one_round(clients[name], url, cpu_of[name], 4, prompt, 0)
        for r in range(rounds):
            for name, url in targets.items():
                got[name].append(
                    await _one_round(clients[name], url, cpu_of[name], max_tokens, prompt, 1 + r)
                )
                bar.advance()
    out: dict[str, dict[str, Any]] = {}
    for name, records in got.items():
        windows = [w for w in (record.window() for record in records) if w is not None]
        seconds = sum(w[0] for w in windows)
        chunks = sum(w[1] for w in windows)
        cpu = sum(w[2] for w in windows)
        out[name] = {
            "cpu_us_per_chunk": cpu * 1e6 / chunks if chunks else None,
            "rounds_us_per_chunk": [w[2] * 1e6 / w[1] for w in windows if w[1]],
            "rounds_counted": len(windows),
            "window_s": seconds,
            "chunks": chunks,
            "errors": sorted({e for record in records for e in record.failed})[:5],
        }
    return out
