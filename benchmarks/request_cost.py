"""The router's CPU per request in context: what a request costs while streams relay.

``bench router_overhead`` reads a request's cost as what the router spends per stream beyond
its relay mid-stream: a difference of two figures. This measures it directly. ``--streams``
long streams from the sim relay steadily through the router (a child process, configured,
logging and tuned as the benchmark's), and windows of ``--window-s`` alternate between the
streams alone and the streams with ``--workers`` clients sending short requests
(``--tokens`` tokens each) back to back. A request's cost is the router's CPU in a window
with the requests, less the mean of the windows without them either side of it, over the
requests that ended in it. That is the cost where the request's code and data are cold, as
in the benchmark's levels; ``chunk_instructions`` counts the same work's instructions warm.

    PYTHONPATH=$PWD python -m firstbyte.benchmarks.request_cost

Prints one JSON object: ``relay_us_per_chunk`` (the windows without requests),
``request_ms`` (the median over the windows with them), ``request_ms_windows`` and the
counts. CPU is read from ``/proc`` at the kernel's tick (10 ms): a window of 2 s with ~100
requests reads a request to ~0.1 ms. Not part of ``firstbyte bench``: a tool for judging a
change to the request path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from typing import Any

import httpx

from firstbyte.benchmarks.scenarios import _mid_stream
from firstbyte.benchmarks.scenarios import router_overhead as bench

__all__ = ["main"]


class _Count:
    """Short requests ended so far and what failed (the long streams' chunks are counted in
    a :class:`~firstbyte.benchmarks.scenarios._mid_stream` round record)."""

    def __init__(self) -> None:
        self.requests = 0
        self.failed: list[str] = []


def _long_body(tokens: int, seed: int) -> dict[str, Any]:
    return {
        "model": "sim-llama-7b",
        "messages": [{"role": "user", "content": bench.PROMPT}],
        "stream": True,
        "max_tokens": tokens,
        "ignore_eos": True,
        "seed": seed,
    }


async def _shorts(
    client: httpx.AsyncClient, url: str, tokens: int, seed: int, count: _Count,
    stop: asyncio.Event,
) -> None:
    n = 0
    while not stop.is_set():
        try:
            await bench._one(client, url, tokens, seed * 100_000 + n)
            count.requests += 1
        except (httpx.HTTPError, ValueError) as exc:
            count.failed.append(f"{type(exc).__name__}: {exc}"[:200])
            return
        n += 1


async def _measure(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    windows = 2 * args.rounds + 1  # quiet, busy, quiet, ..., quiet
    # The long streams outlast every window (the sim's ITL at 100 streams is ~22 ms).
    tokens = int((windows * args.window_s + 3.0) * 60)
    longs = bench._h1_clients(args.streams)
    shorts = bench._h1_clients(args.workers)
    count = _Count()
    record = _mid_stream._Round()
    async with contextlib.AsyncExitStack() as stack:
        for client in longs + shorts:
            await stack.enter_async_context(client)
        # Warm up: every connection opened, the router's paths taken once.
        await asyncio.gather(*(bench._one(c, url, 2, i) for i, c in enumerate(longs + shorts)))
        streams = [
            asyncio.create_task(
                _mid_stream._stream(client, url, _long_body(tokens, 7_000 + i), record)
            )
            for i, client in enumerate(longs)
        ]
        for _ in range(1200):  # up to 60 s for every long stream's first chunk
            if len(record.firsts) == args.streams or record.failed:
                break
            await asyncio.sleep(0.05)
        else:
            count.failed.append("the long streams did not all start within 60 s")
        await asyncio.sleep(0.5)  # past the first chunks' loop turns
        quiet: list[tuple[float, int]] = []  # (CPU s, chunks) of each window without requests
        busy: list[tuple[float, int, int]] = []  # (CPU s, chunks, requests) with them
        for window in range(windows if not (count.failed or record.failed) else 0):
            stop = asyncio.Event()
            workers = []
            if window % 2:
                workers = [
                    asyncio.create_task(_shorts(c, url, args.tokens, window * 100 + i, count, stop))
                    for i, c in enumerate(shorts)
                ]
            cpu0, chunks0, requests0 = bench._cpu_seconds(pid), record.chunks, count.requests
            await asyncio.sleep(args.window_s)
            cpu1, chunks1, requests1 = bench._cpu_seconds(pid), record.chunks, count.requests
            stop.set()
            await asyncio.gather(*workers)
            if window % 2:
                busy.append((cpu1 - cpu0, chunks1 - chunks0, requests1 - requests0))
            else:
                quiet.append((cpu1 - cpu0, chunks1 - chunks0))
            if any(task.done() for task in streams):
                count.failed.append("a long stream ended before the last window")
                break
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    per_request = [
        (cpu - (quiet[i][0] + quiet[i + 1][0]) / 2) / requests * 1000
        for i, (cpu, _, requests) in enumerate(busy)
        if requests and i + 1 < len(quiet)
    ]
    quiet_chunks = sum(chunks for _, chunks in quiet)
    return {
        "streams": args.streams,
        "workers": args.workers,
        "tokens": args.tokens,
        "window_s": args.window_s,
        "relay_us_per_chunk": (
            sum(cpu for cpu, _ in quiet) / quiet_chunks * 1e6 if quiet_chunks else None
        ),
        "request_ms": round(statistics.median(per_request), 3) if per_request else None,
        "request_ms_windows": [round(ms, 3) for ms in per_request],
        "requests": sum(requests for _, _, requests in busy),
        "errors": sorted(set(count.failed + record.failed))[:5],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=100, help="long streams relaying")
    parser.add_argument("--workers", type=int, default=10, help="clients sending short requests")
    parser.add_argument("--tokens", type=int, default=2, help="tokens of a short request")
    parser.add_argument("--window-s", type=float, default=2.0, help="length of a window")
    parser.add_argument(
        "--rounds", type=int, default=3, help="windows with requests (each between two without)"
    )
    args = parser.parse_args(argv)
    for name in ("streams", "workers", "tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.window_s <= 0:
        parser.error("--window-s must be positive")
    started = time.monotonic()
    seqs = str(2 * (args.streams + args.workers))
    with (
        bench._server(bench._SIM, bench.PROFILE, seqs, str(bench.IDLE_S)) as sim,
        bench._server(bench._ROUTER, json.dumps(bench._router_config(sim.url, "auto"))) as router,
    ):
        result = asyncio.run(_measure(args, router.url, router.pid))
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result))
    if result["errors"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
