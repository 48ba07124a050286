"""Instructions per relayed chunk, counted by callgrind: the router against the byte pipe
(and against a bare relay on uvicorn).

CPU seconds per chunk on this shared 2-core machine move by 20-40% from run to run; the
instructions a process executes for the same work do not. This runs the router (or
``bench router_overhead``'s Python byte pipe) under ``valgrind --tool=callgrind`` with
instrumentation off, warms it up with a pass of streams, then counts the instructions of
one measured pass only (``callgrind_control``) and divides by the chunks relayed. The
upstream is a fake inference server in this process that writes one chat chunk every
``--interval-ms`` per stream (slow enough that the instrumented target keeps up, so each
chunk is one read and one write, as at full speed); the clients are kept-alive raw sockets
here too. Two runs with different ``--chunks`` split the cost per request from the cost per
chunk; ``--redis`` keeps the router's state in a throwaway Valkey (only the router's
instructions are counted, not the server's).

    PYTHONPATH=$PWD python -m firstbyte.benchmarks.chunk_instructions --target router
    PYTHONPATH=$PWD python -m firstbyte.benchmarks.chunk_instructions --target pipe
    PYTHONPATH=$PWD python -m firstbyte.benchmarks.chunk_instructions --target bare
    PYTHONPATH=$PWD python -m firstbyte.benchmarks.chunk_instructions --redis

``gc_instructions_per_chunk`` is the cyclic GC's share of the measured pass; with a few
passes, whether one young collection falls inside it depends on where the collector's count
stood, so compare revisions by ``busy_instructions_per_chunk_without_gc`` (or use enough
passes to hold several collections).

``--target bare`` is :mod:`~firstbyte.benchmarks.bare_relay`: an ASGI relay on the same
uvicorn and loop with none of the router's features, the least any relay hosted there does.
With ``--no-valgrind`` each target's CPU per chunk (system calls included) can be set side
by side, alternating targets run after run on this noisy machine.

Not part of ``firstbyte bench``: a tool for judging a change to the data path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from firstbyte.benchmarks.bare_relay import BARE_RELAY
from firstbyte.benchmarks.conditions import process_cpu_seconds
from firstbyte.benchmarks.redis_server import running_redis
from firstbyte.benchmarks.scenarios.router_overhead import _PIPE, _ROUTER, _router_config

__all__ = ["gc_instructions", "main"]

_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"sim-llama-7b","choices":[{"index":0,"delta":{"content":" word"},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
_ROLE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"sim-llama-7b","choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
_USAGE = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"sim-llama-7b","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":%d,'
    b'"total_tokens":%d}}\n\n'
)
_REQUEST_BODY = json.dumps(
    {"model": "sim-llama-7b", "messages": [{"role": "user", "content": "hi"}], "stream": True}
).encode()


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _upstream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace
) -> None:
    """A fake inference server: every request on the connection gets ``--chunks`` chunks, and
    the usage chunk when it asks for one (``include_usage``: the router always does), as the
    sim and vLLM send it."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            body = await reader.readexactly(length)
            if not head.startswith(b"POST /v1/chat/completions "):
                # The router's load scrapes (/metrics) and probes: nothing to learn here.
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                continue
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n" + _chunked(_ROLE)
            )
            for _ in range(args.chunks):
                await asyncio.sleep(args.interval_ms / 1000)
                writer.write(_chunked(_CHUNK))
            if b'"include_usage":true' in body.replace(b" ", b""):
                writer.write(_chunked(_USAGE % (args.chunks, args.chunks + 9)))
            writer.write(_chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


class _Client:
    """One kept-alive client connection (as ``bench router_overhead``'s httpx clients)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(self) -> int:
        """One streamed request; returns the response's bytes."""
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.streams
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(_REQUEST_BODY), _REQUEST_BODY)
        )
        received = 0
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise ConnectionError("the target closed the connection")
            received += len(data)
            tail = (tail + data)[-64:]
            if tail.endswith(b"0\r\n\r\n") and b"[DONE]" in tail:
                return received

    def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()


async def _pass(clients: list[_Client]) -> int:
    sizes = await asyncio.gather(*(client.request() for client in clients))
    return sum(sizes)


def _callgrind(pid: int, *options: str) -> None:
    subprocess.run(["callgrind_control", *options, str(pid)], check=True, capture_output=True)


def _totals(out: Path) -> int:
    """The instructions (``Ir``) of the last callgrind dump in ``out``."""
    return _events(out)["Ir"]


def _events(out: Path) -> dict[str, int]:
    """Every event total of the last callgrind dump in ``out``: ``Ir``, and with
    ``--cache-sim=yes`` the cache misses (``I1mr``, ``D1mr``, ``D1mw``, ``ILmr``, ``DLmr``,
    ``DLmw``) and data accesses (``Dr``, ``Dw``)."""
    path = sorted(out.glob("callgrind.out.*"), key=lambda p: p.stat().st_mtime)[-1]
    names: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith(("totals:", "summary:")):
            return dict(zip(names or ["Ir"], map(int, line.split()[1:]), strict=False))
    raise RuntimeError(f"no totals in {path}")


async def _measure(args: argparse.Namespace) -> dict[str, object]:
    server = await asyncio.start_server(lambda r, w: _upstream(r, w, args), "127.0.0.1", 0)
    upstream_port = server.sockets[0].getsockname()[1]
    out = Path(tempfile.mkdtemp(prefix="callgrind-"))
    if args.target == "router":
        config = _router_config(f"http://127.0.0.1:{upstream_port}")
        if args.redis_url:
            config["state"] = {"redis_url": args.redis_url, "key_prefix": f"ci{os.getpid()}:"}
        code, child_args = _ROUTER, [json.dumps(config)]
    else:
        code = BARE_RELAY if args.target == "bare" else _PIPE
        child_args = ["127.0.0.1", str(upstream_port)]
    command = [sys.executable, "-c", code, *child_args]
    if not args.no_valgrind:
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no",
            *(["--cache-sim=yes"] if args.cache_sim else []),
            f"--callgrind-out-file={out}/callgrind.out.%p", *command,
        ]
    proc = await asyncio.create_subprocess_exec(
        *command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert proc.stdout is not None
        url = (await asyncio.wait_for(proc.stdout.readline(), 300)).decode().strip()
        port = int(url.rsplit(":", 1)[1])
        clients = [_Client(port) for _ in range(args.streams)]
        await _pass(clients)  # warm-up: imports, pools, caches, connections
        await asyncio.sleep(0.5)
        idle_per_s = 0.0
        if not args.no_valgrind:
            await asyncio.to_thread(_callgrind, proc.pid, "-i", "on")
            if args.idle_s > 0:
                # What the process does with no stream (housekeeping ticks, load scrapes):
                # per second, taken off the measured pass, which lasts as long as its
                # streams do whatever a chunk costs.
                await asyncio.to_thread(_callgrind, proc.pid, "-z")
                idle_started = time.perf_counter()
                await asyncio.sleep(args.idle_s)
                await asyncio.to_thread(_callgrind, proc.pid, "-d")
                idle = await asyncio.to_thread(_totals, out)
                idle_per_s = idle / (time.perf_counter() - idle_started)
            await asyncio.to_thread(_callgrind, proc.pid, "-z")
        started, cpu_before = time.perf_counter(), process_cpu_seconds(proc.pid)
        received = 0
        for _ in range(args.passes):
            received += await _pass(clients)
        elapsed, cpu = time.perf_counter() - started, process_cpu_seconds(proc.pid) - cpu_before
        instructions = gc = 0
        events: dict[str, int] = {}
        if not args.no_valgrind:
            await asyncio.to_thread(_callgrind, proc.pid, "-d")
            await asyncio.to_thread(_callgrind, proc.pid, "-i", "off")
            events = await asyncio.to_thread(_events, out)
            instructions = events["Ir"]
            gc = await asyncio.to_thread(_gc_total, out)
        for client in clients:
            client.close()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        server.close()
    # the role chunk and [DONE] are relayed too
    chunks = args.passes * args.streams * (args.chunks + 2)
    misses: dict[str, float] = {}
    if args.cache_sim and events:
        # Of the measured pass, idle work included (small: see idle_instructions_per_s).
        # callgrind simulates a first level (I1, D1) and a last level (LL), no L2: most
        # first-level misses are second-level hits, ~10-15 cycles each on a current core.
        misses = {
            "I1_misses_per_chunk": round(events.get("I1mr", 0) / chunks, 1),
            "D1_misses_per_chunk": round(
                (events.get("D1mr", 0) + events.get("D1mw", 0)) / chunks, 1
            ),
            "LL_misses_per_chunk": round(
                (events.get("ILmr", 0) + events.get("DLmr", 0) + events.get("DLmw", 0)) / chunks, 2
            ),
        }
    return {
        "target": args.target,
        "state": "redis" if args.redis_url else "memory",
        "streams": args.streams,
        "chunks": chunks,
        "bytes_received": received,
        "seconds": round(elapsed, 2),
        "instructions_per_chunk": round(instructions / chunks),
        "idle_instructions_per_s": round(idle_per_s),
        "busy_instructions_per_chunk": round((instructions - idle_per_s * elapsed) / chunks),
        # The cyclic GC's young collections run every few thousand objects kept: over a short
        # pass one falls inside the window or not (~1.7M instructions, ~14k a chunk of 40
        # one-chunk streams) as a change moves the count by a little. Compare revisions by
        # the figure without it, or with passes long enough to hold several collections.
        "gc_instructions_per_chunk": round(gc / chunks),
        "busy_instructions_per_chunk_without_gc": round(
            (instructions - gc - idle_per_s * elapsed) / chunks
        ),
        # With --no-valgrind: the process's CPU time (system calls included) per chunk, noisy
        # on a shared machine, in 10 ms ticks: use thousands of chunks.
        "cpu_us_per_chunk": round(cpu * 1e6 / chunks, 1),
        "dump_dir": str(out),
    } | misses


_GC_LINE = re.compile(r"^\s*([\d,]+) \([^)]*\)\s+\S*:gc_collect_main(?:'\d+)? \[", re.M)


def gc_instructions(annotation: str) -> int:
    """The instructions spent in the cyclic GC's collections, from ``callgrind_annotate
    --inclusive=yes`` of a dump: ``gc_collect_main``'s inclusive count (the largest of its
    lines, a recursive call's being inside it), 0 if no collection ran."""
    counts = [int(m.group(1).replace(",", "")) for m in _GC_LINE.finditer(annotation)]
    return max(counts, default=0)


def _gc_total(out: Path) -> int:
    """:func:`gc_instructions` of the last callgrind dump in ``out``."""
    path = sorted(out.glob("callgrind.out.*"), key=lambda p: p.stat().st_mtime)[-1]
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
        check=True, capture_output=True, text=True,
    ).stdout
    return gc_instructions(annotated)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--target", choices=("router", "pipe", "bare"), default="router",
        help="the router, the byte pipe, or a bare ASGI relay on uvicorn (no features)",
    )
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--chunks", type=int, default=50, help="content chunks per stream")
    parser.add_argument(
        "--idle-s", type=float, default=10.0, help="measure the idle process this long first"
    )
    parser.add_argument("--passes", type=int, default=1, help="measured passes")
    parser.add_argument("--interval-ms", type=float, default=100.0)
    parser.add_argument(
        "--no-valgrind", action="store_true", help="no instruction count: CPU time only"
    )
    parser.add_argument(
        "--cache-sim", action="store_true",
        help="also simulate the caches (callgrind --cache-sim=yes, ~2x slower): first- and "
        "last-level misses per chunk",
    )
    parser.add_argument(
        "--redis", action="store_true",
        help="the router keeps its state in a throwaway Valkey/Redis (router only)",
    )
    args = parser.parse_args(argv)
    if args.redis and args.target != "router":
        parser.error("--redis is for --target router")
    os.environ.setdefault("PYTHONPATH", os.getcwd())
    with contextlib.ExitStack() as stack:
        args.redis_url = stack.enter_context(running_redis()).url if args.redis else None
        with contextlib.suppress(KeyboardInterrupt):
            print(json.dumps(asyncio.run(_measure(args))))


if __name__ == "__main__":
    main()
