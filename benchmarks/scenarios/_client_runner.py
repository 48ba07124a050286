"""Run the SDK for benchmark cells and print one JSON line of :class:`Timings` per request.

``python -m firstbyte.benchmarks.scenarios._client_runner --url URL --cacert CA --cell sse/2/cold
...``

A *cell* is ``TRANSPORT/HTTP/MODE``: transport ``sse``, ``websocket`` or ``longpoll``; HTTP
``1.1``, ``2`` or ``3``; mode

- ``cold``: every request on a new client (new connection: DNS, TCP + TLS or QUIC handshake);
- ``warm``: one client, prewarmed once; every request reuses the open connection;
- ``0rtt`` (HTTP/3): one client that made one request to get a session ticket; before each
  request the QUIC connection is dropped, so the request opens a new connection and goes out
  as 0-RTT early data on the resumed session.

Each request prints ``{"cell": ..., "rep": i, "timings": {...}, "client_cpu_ms": x}`` (or
``"error"`` instead of ``"timings"``); the run ends with ``{"done": true}``. Before the
measured requests, each (transport, HTTP) pair makes one unmeasured request so that first-use
costs in this process (lazy imports, code paths run once) are not charged to the first cell.
With ``--url`` given more than once the SDK gets every region (``AsyncClient([...])``) and
chooses as it does for applications: a prewarmed (``warm``) cell probes each region's round
trip and streams from the fastest; ``timings.region`` names the region that served.
``--no-probe`` takes the choice away from the probe (a client entering at a region of the
caller's choosing): a ``warm`` cell opens its connection to the first ``--url`` only, with no RTT
probe and no periodic re-probe, so requests go to the first region until a router's
``x-firstbyte-better-region`` hint names another of the given regions (the SDK then prefers
and prewarms that one; ``timings.better_region`` shows the hint).
The benchmark runs this inside an emulated client host (:mod:`firstbyte.benchmarks.world`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal, cast

import msgspec

from firstbyte.benchmarks._parent import exit_with_parent
from firstbyte.client_sdk import StreamDelta
from firstbyte.client_sdk.client import AsyncClient, HTTPVersion, TransportName
from firstbyte.client_sdk.timings import Timings

__all__ = ["Cell", "main", "parse_cell"]

Mode = Literal["cold", "warm", "0rtt"]
_PROMPT = [{"role": "user", "content": "Say hello in a few words."}]


@dataclass(frozen=True)
class Cell:
    transport: TransportName
    http: HTTPVersion
    mode: Mode

    def __str__(self) -> str:
        return f"{self.transport}/{self.http}/{self.mode}"


def parse_cell(spec: str) -> Cell:
    """``sse/2/cold`` -> :class:`Cell`; ValueError naming what is wrong."""
    parts = spec.split("/")
    if len(parts) != 3:
        raise ValueError(f"cell {spec!r}: expected TRANSPORT/HTTP/MODE, e.g. sse/2/cold")
    transport, http, mode = parts
    if transport not in ("sse", "websocket", "longpoll"):
        raise ValueError(f"cell {spec!r}: transport must be sse, websocket or longpoll")
    if http not in ("1.1", "2", "3"):
        raise ValueError(f"cell {spec!r}: HTTP version must be 1.1, 2 or 3")
    if mode not in ("cold", "warm", "0rtt"):
        raise ValueError(f"cell {spec!r}: mode must be cold, warm or 0rtt")
    if transport == "websocket" and http != "1.1":
        raise ValueError(f"cell {spec!r}: WebSocket runs over HTTP/1.1")
    if mode == "0rtt" and http != "3":
        raise ValueError(f"cell {spec!r}: 0-RTT is an HTTP/3 (QUIC) mode")
    return Cell(cast(TransportName, transport), cast(HTTPVersion, http), cast(Mode, mode))


class _Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        urls: list[str] = args.url
        self.url: str | list[str] = urls[0] if len(urls) == 1 else urls
        self.cacert: str | None = args.cacert
        self.api_key: str | None = args.api_key
        self.screen = os.open(os.devnull, os.O_WRONLY)  # closed with the process
        self.model: str = args.model
        self.max_tokens: int = args.max_tokens
        self.timeout_s: float = args.timeout
        self.no_probe: bool = args.no_probe

    def client(self, cell: Cell) -> AsyncClient:
        options: dict[str, Any] = {"reprobe_interval_s": None} if self.no_probe else {}
        return AsyncClient(
            self.url, self.api_key, transport=cell.transport, http=cell.http,
            ca_file=self.cacert, idle_timeout_s=self.timeout_s,
            connect_timeout_s=self.timeout_s, max_resumes=0, stall_retries=0,
            poll_wait_s=min(10.0, self.timeout_s), **options,
        )

    async def prewarm(self, client: AsyncClient, cell: Cell) -> None:
        if not self.no_probe:
            await client.prewarm()
            return
        # The first region's connection only: no probe ranks the regions.
        pool, origin = client.pool, client.origin
        target = (pool.websockets(origin, client.headers) if cell.transport == "websocket"
                  else pool.session(origin, cell.http))
        await client.pool.prewarm(target, 1)

    def render(self, delta: StreamDelta) -> None:
        """Show the first token as a terminal client would: one write(2) of its text (to
        /dev/null, so the measurement has a real render phase and no output to clutter)."""
        os.write(self.screen, delta.text.encode())

    async def one(self, client: AsyncClient) -> tuple[Timings, float]:
        """One streamed request on ``client``; its timings and this process's CPU time."""
        cpu = time.process_time()
        async with client.stream(
            model=self.model, messages=_PROMPT, max_tokens=self.max_tokens,
            on_first_token=self.render,
        ) as stream:
            async for _ in stream:
                pass
        return stream.timings, (time.process_time() - cpu) * 1000.0

    async def cold_one(self, cell: Cell) -> tuple[Timings, float]:
        async with self.client(cell) as client:
            return await self.one(client)

    async def run_cell(self, cell: Cell, repeat: int) -> None:
        if cell.mode == "cold":
            for rep in range(repeat):
                await self.emit(cell, rep, self.cold_one(cell))
            return
        async with self.client(cell) as client:
            try:
                if cell.mode == "warm":
                    await asyncio.wait_for(self.prewarm(client, cell), self.timeout_s)
                else:
                    # One request for the session ticket the 0-RTT requests resume with.
                    await asyncio.wait_for(self.one(client), self.timeout_s)
            except Exception as exc:
                for rep in range(repeat):
                    self.write(cell, rep, error=f"set-up failed: {type(exc).__name__}: {exc}")
                return
            for rep in range(repeat):
                if cell.mode == "0rtt":
                    await client.pool.session(client.origin, "3").reset()
                await self.emit(cell, rep, self.one(client))

    async def emit(self, cell: Cell, rep: int, work: Any) -> None:
        try:
            timings, cpu_ms = await asyncio.wait_for(work, self.timeout_s)
        except Exception as exc:  # one failed request is a data point, not the end of the run
            self.write(cell, rep, error=f"{type(exc).__name__}: {exc}")
        else:
            self.write(cell, rep, timings=msgspec.to_builtins(timings), client_cpu_ms=cpu_ms)

    @staticmethod
    def write(cell: Cell, rep: int, **fields: Any) -> None:
        line = {"cell": str(cell), "rep": rep, **fields}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


async def _main(args: argparse.Namespace, cells: list[Cell]) -> None:
    runner = _Runner(args)
    seen: set[tuple[str, str]] = set()
    for cell in cells:
        if (cell.transport, cell.http) not in seen:
            seen.add((cell.transport, cell.http))
            try:
                await asyncio.wait_for(runner.cold_one(cell), args.timeout)
            except Exception as exc:
                print(f"client runner: warm-up request for {cell} failed: {exc}", file=sys.stderr)
    for cell in cells:
        await runner.run_cell(cell, args.repeat)
    sys.stdout.write(json.dumps({"done": True}) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstbyte.benchmarks.scenarios._client_runner")
    parser.add_argument("--url", required=True, action="append",
                        help="the router's base URL (repeat: several regions, the SDK chooses)")
    parser.add_argument("--cacert", default=None, help="CA certificate (PEM)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="measured requests per cell")
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per request")
    parser.add_argument("--cell", action="append", default=[], metavar="T/H/M",
                        help="a cell to run (repeatable), e.g. sse/2/cold, sse/3/0rtt")
    parser.add_argument("--no-probe", action="store_true",
                        help="several --url: no RTT probe; start at the first region and move "
                             "only on a better-region hint")
    args = parser.parse_args(argv)
    try:
        cells = [parse_cell(spec) for spec in args.cell]
    except ValueError as exc:
        parser.error(str(exc))
    if not cells:
        parser.error("give at least one --cell")
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    exit_with_parent()
    asyncio.run(_main(args, cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
