"""How much the router adds, per server implementation: ``python -m firstbyte.router.overhead``.

Starts a sim (``instant`` profile, so every millisecond measured is IO and CPU, not model
time) and, one after the other, a router on hypercorn and on uvicorn (plain HTTP/1.1, both
as subprocesses), then streams the same requests sequentially over one kept-alive
HTTP/1.1 connection directly to the sim and through each router. Reports the added TTFT and
end-to-end latency (median and P90 of the per-request difference to the direct median) and
the router process's CPU time per streamed chunk (from ``/proc/PID/stat``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from firstbyte.client_sdk._core.sse import SSEDecoder

__all__ = ["main"]

_CLI = "import sys; from firstbyte.cli import main; sys.exit(main(sys.argv[1:]))"


@dataclass
class Run:
    label: str
    ttft_ms: list[float]
    e2e_ms: list[float]
    chunks: int
    cpu_s: float | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


async def _wait_healthy(url: str, process: asyncio.subprocess.Process) -> None:
    async with httpx.AsyncClient(trust_env=False) as client:
        for _ in range(200):
            if process.returncode is not None:
                raise RuntimeError(f"{url}: server exited with {process.returncode}")
            try:
                if (await client.get(url)).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url}: not healthy")


async def _measure(label: str, base: str, requests: int, tokens: int, pid: int | None) -> Run:
    body = {
        "model": "sim-instant",
        "messages": [{"role": "user", "content": "overhead"}],
        "stream": True,
        "max_tokens": tokens,
    }
    ttft: list[float] = []
    e2e: list[float] = []
    chunks = 0
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        for i in range(requests + 20):
            if i == 20:  # after warm-up
                cpu0 = _cpu_seconds(pid) if pid else 0.0
                chunks = 0
            body["seed"] = i
            decoder = SSEDecoder()
            start = time.perf_counter()
            first: float | None = None
            async with client.stream("POST", base + "/v1/chat/completions", json=body) as r:
                async for piece in r.aiter_raw():
                    for event in decoder.receive_data(piece):
                        chunks += 1
                        if first is None and _has_content(event.data):
                            first = time.perf_counter()
            end = time.perf_counter()
            if i >= 20 and first is not None:
                ttft.append((first - start) * 1000)
                e2e.append((end - start) * 1000)
    cpu = (_cpu_seconds(pid) - cpu0) if pid else None
    return Run(label, ttft, e2e, chunks, cpu)


def _has_content(data: str) -> bool:
    compact = data.replace(": ", ":")
    return '"content":"' in compact and '"content":""' not in compact


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _run(requests: int, tokens: int) -> list[Run]:
    sim_port = _free_port()
    sim = await asyncio.create_subprocess_exec(
        *(sys.executable, "-c", _CLI, "sim", "--port", str(sim_port), "--profile", "instant"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    runs: list[Run] = []
    try:
        sim_url = f"http://127.0.0.1:{sim_port}"
        await _wait_healthy(sim_url + "/v1/models", sim)
        runs.append(await _measure("direct to sim", sim_url, requests, tokens, None))
        for server in ("hypercorn", "uvicorn"):
            port = _free_port()
            router = await asyncio.create_subprocess_exec(
                *(sys.executable, "-c", _CLI, "router", "--upstream", sim_url,
                  "--port", str(port), "--insecure-plain-http", "--allow-anonymous", "--no-http3",
                  "--server", server),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                await _wait_healthy(url + "/healthz", router)
                runs.append(
                    await _measure(f"router on {server}", url, requests, tokens, router.pid)
                )
            finally:
                router.terminate()
                await router.wait()
    finally:
        sim.terminate()
        await sim.wait()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m firstbyte.router.overhead", description=__doc__
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    runs = asyncio.run(_run(args.requests, args.tokens))
    base = runs[0]
    base_ttft, base_e2e = statistics.median(base.ttft_ms), statistics.median(base.e2e_ms)
    print(f"{args.requests} sequential streams of {args.tokens} tokens, HTTP/1.1, loopback")
    print("| path | TTFT p50 ms | added TTFT p50 / p90 ms | E2E p50 ms | added E2E p50 ms |"
          " router CPU per chunk |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for run in runs:
        ttft, e2e = statistics.median(run.ttft_ms), statistics.median(run.e2e_ms)
        added = [t - base_ttft for t in run.ttft_ms]
        cpu = f"{run.cpu_s / run.chunks * 1e6:.0f} µs" if run.cpu_s is not None else "-"
        print(
            f"| {run.label} | {ttft:.2f} | {statistics.median(added):.2f} / {_pct(added, 0.9):.2f}"
            f" | {e2e:.2f} | {e2e - base_e2e:.2f} | {cpu} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
