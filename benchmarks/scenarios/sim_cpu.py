"""The sim's own CPU cost: streamed chunks per CPU-second of the server process.

For each ASGI server the sim can run on (uvicorn with httptools, hypercorn, granian), start
``firstbyte sim --profile instant`` in a subprocess, drive it over HTTP/1.1 on loopback with
200 concurrent keep-alive streams from this process (a minimal raw-socket client, so the load
generator costs little), and read the server's CPU time (user + system, the process and its
children) from ``/proc/PID/stat`` before and after the measured window. The ``instant``
profile makes the engine free, so what is measured is the HTTP + SSE + scheduling cost per
chunk. Load is bounded: a time budget and a request budget per server.

Run: ``python -m firstbyte.benchmarks.scenarios.sim_cpu [--quick] [--servers uvicorn,granian]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from firstbyte.benchmarks._parent import stop_process
from firstbyte.benchmarks.conditions import process_cpu_seconds
from firstbyte.benchmarks.errors import PartFailed
from firstbyte.benchmarks.ports import free_port

__all__ = ["SERVERS", "TARGET_CHUNKS_PER_CPU_S", "main", "run"]

SERVERS = ("uvicorn", "hypercorn", "granian")
TARGET_CHUNKS_PER_CPU_S = 20_000
STREAMS = 200
MAX_TOKENS = 64


def _proc_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and all its live descendants (:func:`process_cpu_seconds`)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = _stat_fields(int(entry))
            children.setdefault(int(fields[1]), []).append(int(entry))
    total = 0.0
    stack = [pid]
    while stack:
        current = stack.pop()
        total += process_cpu_seconds(current)
        stack.extend(children.get(current, ()))
    return total


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/PID/stat after the command name (index 0 = state, 1 = ppid)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode()
    return raw[raw.rindex(")") + 2 :].split()


@contextlib.contextmanager
def _sim_process(server: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    cmd = [
        sys.executable, "-c",
        "import sys; from firstbyte.cli import main; sys.exit(main())",
        "sim", "--profile", "instant",
        "--host", "127.0.0.1", "--port", str(port), "--server", server,
        "--max-num-seqs", "256", "--queue-limit", "4096",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield proc
    finally:
        stop_process(proc)


def _request_bytes(i: int) -> bytes:
    body = json.dumps(
        {
            "model": "sim-instant",
            "messages": [{"role": "user", "content": f"Tell me about stream number {i}."}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
        }
    ).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


class _Load:
    """Keep-alive HTTP/1.1 streams; each reads a response until the chunked terminator."""

    def __init__(self, port: int, deadline: float, max_requests: int) -> None:
        self.port = port
        self.deadline = deadline
        self.max_requests = max_requests
        self.started = 0
        self.requests = 0
        self.chunks = 0
        self.complete = 0
        """Responses that ended with ``data: [DONE]``."""
        self.errors: list[str] = []

    async def stream(self, i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        request = _request_bytes(i)
        try:
            while time.monotonic() < self.deadline and self.started < self.max_requests:
                self.started += 1
                writer.write(request)
                data = b""
                while not data.endswith(b"\r\n0\r\n\r\n"):
                    piece = await reader.read(65536)
                    if not piece:
                        raise ConnectionError("server closed the connection")
                    data += piece
                if not data.startswith(b"HTTP/1.1 200"):
                    raise ConnectionError(data[:200].decode(errors="replace"))
                # role chunk, content chunks, final chunk, [DONE]
                self.chunks += data.count(b'{"content":"') - 1
                self.complete += data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
                self.requests += 1
        except (OSError, ConnectionError) as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            writer.close()


async def _wait_ready(port: int, proc: subprocess.Popen[bytes], within_s: float) -> None:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise PartFailed(f"sim exited with {proc.returncode}", err)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read(100)
        writer.close()
        if answer.startswith(b"HTTP/1.1 200"):
            return
        await asyncio.sleep(0.05)
    raise PartFailed("sim did not become ready")


async def _measure(server: str, seconds: float, max_requests: int) -> dict[str, Any]:
    port = free_port()
    with _sim_process(server, port) as proc:
        await _wait_ready(port, proc, 20.0)
        # Warm-up: one request per stream, so connections and code paths are hot.
        warm = _Load(port, time.monotonic() + 10.0, STREAMS)
        await asyncio.gather(*(warm.stream(i) for i in range(STREAMS)))
        load = _Load(port, time.monotonic() + seconds, max_requests)
        cpu0, wall0, own0 = _proc_cpu_s(proc.pid), time.monotonic(), time.process_time()
        await asyncio.gather(*(load.stream(i) for i in range(STREAMS)))
        cpu1, wall1, own1 = _proc_cpu_s(proc.pid), time.monotonic(), time.process_time()
    cpu = cpu1 - cpu0
    wall = wall1 - wall0
    return {
        "label": server,
        "server": server,
        "requests": load.requests,
        "chunks": load.chunks,
        "all_done": load.complete == load.requests,
        "wall_s": round(wall, 3),
        "server_cpu_s": round(cpu, 3),
        "loadgen_cpu_s": round(own1 - own0, 3),
        "chunks_per_cpu_s": round(load.chunks / cpu) if cpu > 0 else None,
        "chunks_per_s": round(load.chunks / wall) if wall > 0 else None,
        "errors": (warm.errors + load.errors)[:5],
    }


def run(quick: bool, servers: Sequence[str] = SERVERS) -> dict[str, Any]:
    """Measure every server in ``servers``; JSON-able results (see the module docstring)."""
    seconds, max_requests = (3.0, 2_000) if quick else (10.0, 20_000)
    results: list[dict[str, Any]] = []

    async def all_servers() -> None:
        for server in servers:
            try:
                results.append(await _measure(server, seconds, max_requests))
            except RuntimeError as exc:
                results.append({"label": server, "server": server, "error": str(exc)})

    asyncio.run(all_servers())
    ok = [r for r in results if r.get("chunks_per_cpu_s")]
    best = max(ok, key=lambda r: r["chunks_per_cpu_s"], default=None)
    return {
        "scenario": "sim_cpu",
        "description": (
            "The sim's own CPU cost: SSE content chunks streamed per CPU-second of the server"
            f" process, HTTP/1.1 on loopback, {STREAMS} concurrent keep-alive streams,"
            " profile instant."
        ),
        "quick": quick,
        "profile": "instant",
        "http": "HTTP/1.1",
        "streams": STREAMS,
        "max_tokens": MAX_TOKENS,
        "target_chunks_per_cpu_s": TARGET_CHUNKS_PER_CPU_S,
        "runs": results,
        "summary": {
            "best server": best["server"] if best else None,
            "best chunks per CPU-second": best["chunks_per_cpu_s"] if best else None,
            "target chunks per CPU-second": TARGET_CHUNKS_PER_CPU_S,
            "meets target": bool(best and best["chunks_per_cpu_s"] >= TARGET_CHUNKS_PER_CPU_S),
        },
        "notes": [
            "server CPU = user + system time of the server process and its children, from"
            " /proc/PID/stat, over the measured window (after one warm-up request per stream)",
            "the load generator is this process: a raw-socket HTTP/1.1 client",
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstbyte.benchmarks.scenarios.sim_cpu")
    parser.add_argument("--quick", action="store_true", help="short run (< 30 s), as CI runs")
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="comma-separated subset of " + ", ".join(SERVERS),
    )
    args = parser.parse_args(argv)
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = set(servers) - set(SERVERS)
    if unknown or not servers:
        parser.error(f"--servers: choose from {', '.join(SERVERS)}")
    result = run(args.quick, servers)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
