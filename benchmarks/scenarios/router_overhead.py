"""Router added latency: TTFT and ITL direct to the sim against through the router, same run.

The sim (``h100-7b`` profile: ~10 ms per decode step, ``max_num_seqs`` above the highest level
so the sim batches every stream and never queues) and the router each run in their own
process, as in production; the load generator (httpx over HTTP/1.1 on loopback, kept-alive
connections, parsing with the SDK's SSE core) runs in this one. For each level (1, 100 and 500
concurrent streams) the targets are measured in alternating phases, so all see the same
machine: ``direct`` (the sim), ``nginx`` (``proxy_buffering off``, 2 workers, kept-alive
upstream connections) when it is installed, ``python-pipe`` (bytes piped in Python
on uvloop: the floor of CPU per chunk for a Python relay, see :data:`PIPE_TARGET`),
``bare-relay`` (a featureless ASGI relay on uvicorn, :data:`BARE_TARGET`), and the router
under each of its HTTP/1.1 servers.
Added latency is the difference of the percentiles (target minus direct). Optionally (full
runs) the same over TLS with HTTP/2 between the client and the router, next to the client
straight to a sim served over TLS + HTTP/2 (``direct-h2``): that run's tail is mostly the
HTTP/2 transport itself, which the direct-h2 row shows.

From 100 streams up the direct path is measured twice (``direct`` and ``direct-aa``,
alternating like the rest): the A/A difference is what the machine's noise alone makes of a
P99, the yardstick for the proxies' added P99; so is the default router (``auto`` and
``auto-aa``, two processes of the same configuration): what noise alone makes of its CPU per
chunk over the pipe's. Then each target takes several phases at the
highest level back to back (``sustained``): a proxy that falls behind under sustained load
shows it there as growing TTFT, CPU per chunk or errors from one phase to the next. Every
phase says what limited it (:func:`_limited_by`). The load generator's own cyclic GC is held
off during each phase (collected between phases): its full collections took 30-160 ms here
and landed on whichever target was running.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from firstbyte.benchmarks._parent import stop_process
from firstbyte.benchmarks.bare_relay import BARE_RELAY
from firstbyte.benchmarks.conditions import child_pids, machine_cpu, process_cpu_seconds
from firstbyte.benchmarks.errors import PartFailed
from firstbyte.benchmarks.gc_hold import gc_held_off
from firstbyte.benchmarks.progress import Progress
from firstbyte.benchmarks.scenarios import _baseline_router, _mid_stream, _whole
from firstbyte.benchmarks.stats import SLO, summarize
from firstbyte.client_sdk.timings import Timings
from firstbyte.protocol import paths
from firstbyte.protocol.openai import decode_chunk
from firstbyte.protocol.sse import DONE, SSEDecoder

__all__ = ["run"]

PROFILE = "h100-7b"
ROUTER_SERVERS = ("auto", "hypercorn", "uvicorn", "granian")
"""The router's ASGI servers measured side by side over HTTP/1.1 (``listen.server``: ``auto``,
the default, serves HTTP/1.1 with uvicorn's protocol behind hypercorn's listener; granian
through :func:`firstbyte.router.serve.granian_app` in its own process); the HTTP/2 + TLS run
uses hypercorn, which ``auto`` serves HTTP/2 with."""
NGINX_TARGET = "nginx"
NGINX_MISSING = (
    "nginx is not installed: no reference proxy in this run (apt-get install nginx-light)"
)
IDLE_S = 900.0
"""Keep-alive timeout of every server in the run (sim, routers, nginx): a target's client
connections sit idle while the other targets take their phases, longer than the servers'
defaults (30 s, 75 s), and a connection closed by the server as the next request arrives is
an error of the benchmark, not of the target."""
PROMPT = "Summarise the plot of Hamlet in one paragraph."
SLO_TTFT_MS = 200.0
ADDED_METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "p50_e2el_ms")
"""Percentiles compared, router minus direct: the first token's wait and tail, the tail of the
gaps between tokens, and the whole stream (what the relay adds over every chunk)."""
PIPE_TARGET = "python-pipe"
"""A byte pipe written in Python on the router's event loop (uvloop): one upstream connection
per client connection, bytes passed on untouched, no HTTP. Nothing relays a chunk in Python
for less, so its CPU per chunk next to nginx's and the router's tells the interpreter's and
the event loop's share of the router's cost from the router's own work
(``cC_TARGET_cpu_vs_pipe``)."""
BARE_TARGET = "bare-relay"
"""The least a relay hosted on uvicorn does (:mod:`firstbyte.benchmarks.bare_relay`): the
router's server and loop, each chunk one ASGI message, and no key, limit, placement, store,
metrics, log or heartbeat. Its CPU per chunk over the pipe's is what uvicorn and ASGI alone
cost a relay; the router's over it (``cC_auto_cpu_vs_bare_relay``) is what its features cost
beside that, in the same phases."""
BASELINE_SERVERS = ("hypercorn", "uvicorn")
"""The servers measured at the ``--baseline`` revision too (as ``baseline-SERVER``)."""
BASELINE_OF = {"auto": "hypercorn", "hypercorn": "hypercorn", "uvicorn": "uvicorn"}
"""Which baseline server each of today's is compared with: ``auto``, today's default, with
hypercorn, the default before it (and the server that served HTTP/1.1 under it)."""
AA_TARGET = "direct-aa"
"""The direct path measured a second time (100 streams), as the A/A control."""
ROUTER_AA_TARGET = "router/auto-aa"
"""A second default router (its own process, the same configuration), measured from 100
streams up beside the first: the A/A control of CPU per chunk. How far its ratio to the pipe
reads from ``auto``'s in the same run is what phase-to-phase noise alone makes of the
issue's 2x figure (``cC_auto_aa_cpu_vs_pipe`` next to ``cC_auto_cpu_vs_pipe``)."""
CPU_VS_PIPE_LIMIT = 2.0
"""Issue 26's target: the default router's CPU per relayed chunk at most this many times the
byte pipe's, at 100 and 500 streams (:func:`_cpu_verdict`)."""
FOREIGN_CPU_LIMIT = 0.15
"""A phase during which processes other than this benchmark's (client, sim, routers) used
more than this share of the machine's CPU time is measured again (see :data:`MAX_RERUNS`):
on this shared machine other work took 50-80% of both CPUs for seconds at a time, which put
0.5-1.5 s TTFTs into whichever target's phase it hit (the router's and the client's event
loops were both late by 50-250 ms while getting 10-20% of a CPU)."""
MAX_RERUNS = 2
"""At most this many repeats of one phase; the last attempt is kept whatever the load."""

_SIM = """
import asyncio, sys
from firstbyte.router.sim.server import running_sim
async def main():
    # PROFILE MAX_NUM_SEQS IDLE_S [CERTFILE KEYFILE]: with a certificate, TLS (hypercorn: H2)
    tls = {"certfile": sys.argv[4], "keyfile": sys.argv[5]} if len(sys.argv) > 4 else {}
    async with running_sim(
        profile=sys.argv[1], max_num_seqs=int(sys.argv[2]), keep_alive_timeout_s=float(sys.argv[3]),
        **tls,
    ) as url:
        print(url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
asyncio.run(main())
"""

DIRECT_H2_TARGET = "direct-h2"
"""The TLS + HTTP/2 run's own baseline: the same client straight to a sim served over TLS +
HTTP/2, so the router's share of that run's latency is told apart from the transport's."""

_ROUTER = """
import asyncio, json, sys
from firstbyte.router.config import parse_config
from firstbyte.router.hosting import loop_factory
from firstbyte.router.observability.logs import configure
from firstbyte.router.serve import running_router
# Logs as `firstbyte router` has them (info: an access line per request, JSON), on stderr:
# stdout is the benchmark's pipe for the URL line.
configure("info", "json", sys.stderr)
async def main():
    # CONFIG_JSON: the router's configuration (_router_config)
    config = parse_config(json.loads(sys.argv[1]), "router_overhead")
    async with running_router(config, tune_gc=True) as ep:  # GC as `firstbyte router` has it
        print(ep.base_url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
with asyncio.Runner(loop_factory=loop_factory()) as runner:  # the loop `firstbyte router` uses
    runner.run(main())
"""


_PIPE = """
import asyncio, sys
from firstbyte.router.hosting import loop_factory
# UPSTREAM_HOST UPSTREAM_PORT: pipe every connection to the upstream, bytes untouched
UPSTREAM = (sys.argv[1], int(sys.argv[2]))
class Pipe(asyncio.Protocol):
    def __init__(self, peer=None):
        self.peer, self.transport, self.early = peer, None, []
    def connection_made(self, transport):
        self.transport = transport
        if self.peer is None:  # a client: dial the upstream, hold its bytes until connected
            asyncio.ensure_future(self.dial())
    async def dial(self):
        try:
            _, up = await asyncio.get_running_loop().create_connection(
                lambda: Pipe(self), *UPSTREAM)
        except OSError:
            self.transport.close()
            return
        self.peer = up
        for data in self.early:
            up.transport.write(data)
    def data_received(self, data):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.early.append(data)
    def connection_lost(self, exc):
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()
async def main():
    server = await asyncio.get_running_loop().create_server(Pipe, "127.0.0.1", 0, backlog=4096)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
with asyncio.Runner(loop_factory=loop_factory()) as runner:  # the router's loop
    runner.run(main())
"""


_ROUTER_GRANIAN = """
import json, os, signal, socket, sys, threading, time
from firstbyte.router.hosting import run_granian
from firstbyte.router.serve import CONFIG_ENV
# CONFIG_JSON: the same router as _ROUTER's (_router_config), served by granian in its own
# worker process (HTTP/1.1; with a certificate, TLS with HTTP/2 by ALPN)
config = json.loads(sys.argv[1])
listen = config["listen"]
tls = (listen["certfile"], listen["keyfile"]) if "certfile" in listen else None
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = listen["port"] = probe.getsockname()[1]
os.environ[CONFIG_ENV] = json.dumps(config)
def announce():
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    print(f"{'https' if tls else 'http'}://127.0.0.1:{port}", flush=True)
    sys.stdin.read()  # the benchmark closes stdin: stop
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=announce, daemon=True).start()
certs = {"certfile": tls[0], "keyfile": tls[1]} if tls else {}
run_granian("firstbyte.router.serve:granian_app", "127.0.0.1", port, **certs)
"""


@dataclass(frozen=True, slots=True)
class _Child:
    url: str
    pid: int
    log: Path | None = None
    """Where its stderr goes (a server snippet's: :func:`_server`)."""


def _cpu_seconds(pid: int) -> float:
    """CPU time of a process and its live child processes (nginx's workers), to the
    nanosecond (:func:`process_cpu_seconds`); 0 where it cannot be read."""
    return process_cpu_seconds(pid) + sum(_cpu_seconds(child) for child in child_pids(pid))


@contextmanager
def _server(code: str, *args: str) -> Iterator[_Child]:
    """Run a server snippet in a child process; yield its URL and pid; stop it on exit.

    Its stderr goes to a temporary file (``log``), not a pipe: nobody reads a pipe during the
    run, and a child that logged 64 KiB into one would block.
    """
    with tempfile.NamedTemporaryFile(mode="w+", prefix="bench-server-") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip()
            if not url.startswith("http"):
                proc.wait(timeout=15)
                log.seek(0)
                raise PartFailed("server did not start", log.read())
            yield _Child(url, proc.pid, Path(log.name))
        finally:
            if proc.stdin is not None:
                proc.stdin.close()  # the snippet exits when stdin closes
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _one(client: httpx.AsyncClient, url: str, max_tokens: int, seed: int) -> Timings:
    body = {
        "model": "sim-llama-7b",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": max_tokens,
        "seed": seed,
    }
    timings = Timings(warm=True)
    now = time.perf_counter
    start = now()
    last: float | None = None
    decoder = SSEDecoder()
    marks: dict[str, float] = {}

    async def trace(name: str, info: dict[str, Any]) -> None:
        # httpcore's trace hooks: when a connection was opened and the request written
        if name.endswith((".started", ".complete")):
            marks[name] = (now() - start) * 1000

    async with client.stream(
        "POST", url + paths.CHAT_COMPLETIONS, json=body, extensions={"trace": trace}
    ) as response:
        if "connection.connect_tcp.complete" in marks:
            timings.warm = False
            timings.tcp_connect_ms = (
                marks["connection.connect_tcp.complete"] - marks["connection.connect_tcp.started"]
            )
        for sent in ("http11.send_request_body.complete", "http2.send_request_body.complete"):
            if sent in marks:
                timings.request_sent_ms = marks[sent]
        timings.first_byte_ms = (now() - start) * 1000
        timings.http_version = response.http_version
        response.raise_for_status()
        async for piece in response.aiter_raw():
            for event in decoder.receive_data(piece):
                if event.data == DONE:
                    break
                chunk = decode_chunk(event.data)
                if not any(choice.delta.content for choice in chunk.choices):
                    continue
                t = (now() - start) * 1000
                if last is None:
                    timings.first_token_ms = t
                else:
                    timings.inter_token_ms.append(t - last)
                last = t
                timings.output_chunks += 1
    timings.last_token_ms = last
    return timings


async def _phase(
    clients: list[httpx.AsyncClient],
    url: str,
    *,
    concurrency: int,
    per_worker: int,
    max_tokens: int,
    seed: int,
) -> tuple[list[Timings], list[str], float]:
    """``concurrency`` closed-loop workers, ``per_worker`` streams each; returns the timings,
    the failures and the wall time. Lengths vary (0.5x-1.5x ``max_tokens``) and workers start
    staggered, so streams do not stay in lock-step; the same seed gives the same workload.
    """
    rnd = random.Random(seed)
    plans = [
        [max(2, int(max_tokens * rnd.uniform(0.5, 1.5))) for _ in range(per_worker)]
        for _ in range(concurrency)
    ]
    # Spread the first requests over about one stream's duration (~10 ms a token).
    delays = [rnd.uniform(0, max_tokens * 0.010) if concurrency > 1 else 0.0 for _ in plans]
    ok: list[Timings] = []
    failed: list[str] = []

    async def worker(index: int) -> None:
        await asyncio.sleep(delays[index])
        for n, tokens in enumerate(plans[index]):
            try:
                timings = await _one(clients[index], url, tokens, seed * 100_000 + index * 100 + n)
                ok.append(timings)
            except (httpx.HTTPError, ValueError) as exc:
                failed.append(f"{type(exc).__name__}: {exc}"[:200])

    with gc_held_off():
        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    return ok, failed, elapsed


async def _metered_phase(
    clients: list[httpx.AsyncClient],
    url: str,
    pids: dict[str, int],
    **phase: int,
) -> tuple[list[Timings], list[str], float, dict[str, float], float, float]:
    """:func:`_phase` with the CPU it cost: the timings, failures and wall time, then the CPU
    seconds of this process (``client``) and of each process in ``pids``, and the machine's
    busy and total CPU seconds over the phase."""
    machine = machine_cpu()
    before = {"client": time.process_time()}
    before |= {role: _cpu_seconds(pid) for role, pid in pids.items()}
    ok, bad, seconds = await _phase(clients, url, **phase)
    used = {"client": time.process_time() - before["client"]}
    used |= {role: _cpu_seconds(pid) - before[role] for role, pid in pids.items()}
    busy, total = (b - a for a, b in zip(machine, machine_cpu(), strict=True))
    return ok, bad, seconds, used, busy, total


async def _measure(
    targets: dict[str, str],
    *,
    concurrency: int,
    rounds: int,
    per_worker: int,
    max_tokens: int,
    make_clients: Callable[[int], list[httpx.AsyncClient]],
    bar: Progress,
    pids: dict[str, int],
    client_overrides: dict[str, Callable[[int], list[httpx.AsyncClient]]] | None = None,
    max_reruns: int = MAX_RERUNS,
) -> dict[str, dict[str, Any]]:
    """Alternate phases over ``targets`` (name -> base URL), same workload each; summarise.

    Every target has its own clients (``make_clients``, or its entry in ``client_overrides``),
    so its connections stay open from the warm-up through every phase.

    Each summary also has ``cpu_ms_per_stream``: CPU time of this process (``client``) and of
    each process in ``pids`` during that target's phases, divided by the streams completed;
    ``cores_used``: the same CPU time over the phases' wall time (1.0 = one whole core);
    ``machine_busy_share``: the busiest phase's share of all CPUs in use (anyone's);
    ``foreign_cpu_share``: the share of the machine's CPU that other processes used during
    its kept phases (mean); ``phases_rerun``: phases discarded and measured again because
    that share was over :data:`FOREIGN_CPU_LIMIT` (the rule is the same for every target;
    at most ``max_reruns`` a phase).
    """
    collected: dict[str, list[Timings]] = {name: [] for name in targets}
    errors: dict[str, list[str]] = {name: [] for name in targets}
    busy = dict.fromkeys(targets, 0.0)
    foreign: dict[str, list[float]] = {name: [] for name in targets}
    machine_share: dict[str, list[float]] = {name: [] for name in targets}
    reruns = dict.fromkeys(targets, 0)
    cpu: dict[str, dict[str, float]] = {
        name: dict.fromkeys(["client", *pids], 0.0) for name in targets
    }
    overrides = client_overrides or {}
    clients = {name: overrides.get(name, make_clients)(concurrency) for name in targets}
    async with contextlib.AsyncExitStack() as stack:
        for client in dict.fromkeys(c for group in clients.values() for c in group):
            await stack.enter_async_context(client)
        for name, url in targets.items():  # warm up: open the connections, fill prefix caches
            await _phase(
                clients[name], url, concurrency=concurrency, per_worker=1, max_tokens=4, seed=0
            )
        for r in range(rounds):
            for name, url in targets.items():
                for attempt in range(max_reruns + 1):
                    ok, bad, seconds, used, machine_busy, machine_total = await _metered_phase(
                        clients[name],
                        url,
                        pids,
                        concurrency=concurrency,
                        per_worker=per_worker,
                        max_tokens=max_tokens,
                        seed=1 + r,
                    )
                    share = max(0.0, machine_busy - sum(used.values())) / max(machine_total, 1e-9)
                    if share > FOREIGN_CPU_LIMIT and attempt < max_reruns:
                        reruns[name] += 1  # someone else's work ran here: measure it again
                        continue
                    foreign[name].append(share)
                    machine_share[name].append(machine_busy / max(machine_total, 1e-9))
                    busy[name] += seconds
                    for role, seconds_used in used.items():
                        cpu[name][role] += seconds_used
                    collected[name] += ok
                    errors[name] += bad
                    break
                bar.advance()
    out: dict[str, dict[str, Any]] = {}
    for name in targets:
        out[name] = summarize(
            collected[name],
            duration_s=busy[name],
            failed=len(errors[name]),
            slo=SLO(ttft_ms=SLO_TTFT_MS),
        )
        # a few distinct reasons, so a failed run explains itself in the report
        out[name]["errors"] = sorted(set(errors[name]))[:5]
        streams = max(len(collected[name]), 1)
        out[name]["cpu_ms_per_stream"] = {
            role: seconds * 1000 / streams for role, seconds in cpu[name].items()
        }
        out[name]["foreign_cpu_share"] = sum(foreign[name]) / max(len(foreign[name]), 1)
        out[name]["machine_busy_share"] = max(machine_share[name], default=0.0)
        out[name]["cores_used"] = {
            role: seconds / max(busy[name], 1e-9) for role, seconds in cpu[name].items()
        }
        out[name]["phases_rerun"] = reruns[name]
    return out


def _h1_clients(n: int) -> list[httpx.AsyncClient]:
    """One client with one kept-alive connection per worker.

    One shared pool of 100 connections would measure httpcore instead of the servers: its
    ``_assign_requests_to_connections`` scans every connection for every queued request, which
    cost ~15 ms of client CPU per stream at 100 streams here (cProfile: 14M ``is_idle`` calls).
    """
    limits = httpx.Limits(max_connections=1, keepalive_expiry=120)
    # They speak plain HTTP, but each would load the CA store into an SSL context of its own:
    # ~20 ms and ~0.6 MB a client, a minute and 2 GB for a full run's 3,000 clients.
    unused_tls = ssl.create_default_context()
    return [httpx.AsyncClient(limits=limits, timeout=60, verify=unused_tls) for _ in range(n)]


def _h2_clients(ca_pem: str) -> Callable[[int], list[httpx.AsyncClient]]:
    """All workers share one client: HTTP/2 multiplexes them over one TLS connection."""

    def make(n: int) -> list[httpx.AsyncClient]:
        limits = httpx.Limits(max_connections=1, keepalive_expiry=120)
        client = httpx.AsyncClient(http2=True, verify=ca_pem, limits=limits, timeout=60)
        return [client] * n

    return make


LEVELS = ((1, 4, 5), (100, 4, 2), (500, 3, 2))
"""(concurrency, alternating rounds, streams per worker per round) of a full run."""
QUICK_LEVELS = ((1, 1, 3), (100, 1, 1))
SUSTAINED = (500, 5, 2)
"""(concurrency, back-to-back phases, streams per worker per phase) of a full run."""
QUICK_SUSTAINED = (100, 2, 1)
MID_STREAM = (100, 4, 160)
"""(concurrency, alternating rounds, max_tokens) of the streams the byte pipe and the default
router (twice: ``auto`` and its A/A) take after the levels, all started together and run to
their limit: CPU per chunk read mid-stream (:mod:`._mid_stream`), and what the level of the
same concurrency costs per stream beyond it (the work per request)."""
QUICK_MID_STREAM = (100, 1, 64)
MID_STREAM_TARGETS = (PIPE_TARGET, "router/auto", ROUTER_AA_TARGET)
WHOLE = (100, 4, 20)
"""Non-streamed requests (:mod:`._whole`): concurrency, rounds, requests per worker a round."""
QUICK_WHOLE = (20, 1, 3)
SATURATED = 0.9
"""A process using this share of a core (or the machine this share of all its CPUs) limits
the figure: a Python process (load generator, sim, router) runs on one core at a time."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        type=_baseline_router.revision,
        default=None,
        metavar="REV",
        help="also run the router as it was at git revision REV (hypercorn and uvicorn, "
        "as baseline-SERVER) in the same alternating phases; the summary gives today's CPU "
        "per chunk as a ratio to it (cC_SERVER_cpu_vs_baseline; auto's against baseline "
        "hypercorn, the default then). Needs firstbyte installed "
        "from a git checkout (pip install -e .)",
    )


def run(quick: bool, baseline: str | None = None) -> dict[str, Any]:
    """Direct vs nginx vs the router at 1, 100 and 500 streams, interleaved; then each target
    under sustained load; added TTFT and ITL, CPU per chunk, errors, what limited each.
    ``baseline``: a commit whose router is measured beside today's (see
    :mod:`._baseline_router`)."""
    max_tokens = 16 if quick else 64
    levels = QUICK_LEVELS if quick else LEVELS
    sustained = QUICK_SUSTAINED if quick else SUSTAINED
    mid = QUICK_MID_STREAM if quick else MID_STREAM
    whole = QUICK_WHOLE if quick else WHOLE
    tls_rounds = 0 if quick else 2
    top = max(c for c, _, _ in levels)
    nginx = _nginx_binary()
    pipe = [PIPE_TARGET]  # quick runs too: the ratio to it is the figure CPU is judged by
    references = [*pipe, BARE_TARGET]  # measured at the levels only
    routers = [f"router/{name}" for name in ROUTER_SERVERS]
    then = [f"baseline-{name}" for name in BASELINE_SERVERS] if baseline else []
    proxies = ([NGINX_TARGET] if nginx else []) + references + routers + then
    targets = 1 + len(proxies)
    total = sum((targets + 2 * (c > 1)) * rounds for c, rounds, _ in levels)
    total += (targets - len(references) - len(then)) * sustained[1] + 4 * tls_rounds
    total += len(MID_STREAM_TARGETS) * mid[1]
    whole_targets = [
        *([NGINX_TARGET] if nginx else []), "router/auto", ROUTER_AA_TARGET,
        *(["router/uvicorn", "baseline-uvicorn"] if baseline else []),
    ]
    total += len(whole_targets) * whole[1]
    runs: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    overhead: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    notes: list[str] = [] if nginx else [NGINX_MISSING]
    # Room for every stream of the highest level plus the A/A target's: the sim never queues.
    seqs = str(2 * max(top, sustained[0]))
    idle = str(IDLE_S)
    with (
        Progress(total, "router_overhead") as bar,
        _server(_SIM, PROFILE, seqs, idle) as sim,
        contextlib.ExitStack() as stack,
    ):
        children = {
            f"router/{name}": stack.enter_context(
                _server(_ROUTER_GRANIAN, json.dumps(_router_config(sim.url)))
                if name == "granian"
                else _server(_ROUTER, json.dumps(_router_config(sim.url, name)))
            )
            for name in ROUTER_SERVERS
        }
        upstream = urlsplit(sim.url)
        at = (upstream.hostname or "127.0.0.1", str(upstream.port))
        children = {
            PIPE_TARGET: stack.enter_context(_server(_PIPE, *at)),
            BARE_TARGET: stack.enter_context(_server(BARE_RELAY, *at)),
        } | children
        if nginx:
            children = {NGINX_TARGET: stack.enter_context(_nginx(nginx, sim.url))} | children
        aa_config = json.dumps(_router_config(sim.url, "auto"))
        aa_router = stack.enter_context(_server(_ROUTER, aa_config))
        if baseline:
            sources = str(stack.enter_context(_baseline_router.checked_out(baseline)))
            for name in BASELINE_SERVERS:
                config = json.dumps(_router_config(sim.url, name))
                children[f"baseline-{name}"] = stack.enter_context(
                    _server(_baseline_router.SNIPPET, sources, config)
                )
        urls = {"direct": sim.url} | {name: child.url for name, child in children.items()}
        pids = {"sim": sim.pid} | {name: child.pid for name, child in children.items()}
        pids[ROUTER_AA_TARGET] = aa_router.pid
        at_mid: dict[str, dict[str, Any]] = {}  # the level mid-stream costs are taken from
        for concurrency, rounds, per_worker in levels:
            # the A/A controls only where tails and CPU are compared (1 stream has none to
            # speak of, and its CPU per chunk is mostly background work)
            aa = {AA_TARGET: sim.url, ROUTER_AA_TARGET: aa_router.url} if concurrency > 1 else {}
            measured = asyncio.run(
                _measure(
                    urls | aa,
                    concurrency=concurrency,
                    rounds=rounds,
                    per_worker=per_worker,
                    max_tokens=max_tokens,
                    make_clients=_h1_clients,
                    bar=bar,
                    pids=pids,
                    # quick runs check that it works, often beside other scenarios: no repeats
                    max_reruns=0 if quick else MAX_RERUNS,
                )
            )
            _collect(runs, summary, measured, concurrency, "HTTP/1.1")
            overhead += _overhead_rows(measured, concurrency)
            if concurrency == mid[0]:
                at_mid = measured
        with_aa = urls | {ROUTER_AA_TARGET: aa_router.url}
        steady = asyncio.run(
            _mid_stream.measure(
                {name: with_aa[name] for name in MID_STREAM_TARGETS},
                {name: functools.partial(_cpu_seconds, pids[name]) for name in MID_STREAM_TARGETS},
                concurrency=mid[0],
                rounds=mid[1],
                max_tokens=mid[2],
                prompt=PROMPT,
                make_clients=_h1_clients,
                bar=bar,
            )
        )
        summary |= _mid_stream_costs(steady, at_mid, mid[0])
        answers = asyncio.run(
            _whole.measure(
                {name: with_aa[name] for name in whole_targets},
                {name: functools.partial(_cpu_seconds, pids[name]) for name in whole_targets},
                concurrency=whole[0],
                rounds=whole[1],
                per_worker=whole[2],
                prompt=PROMPT,
                make_clients=_h1_clients,
                bar=bar,
            )
        )
        summary |= _whole_costs(answers, whole[0])
        relays = {name: url for name, url in urls.items() if name not in (*references, *then)}
        phases = _sustained(relays, pids, sustained, max_tokens, bar)
        _summarise_sustained(summary, phases)
        if tls_rounds:
            _tls(runs, summary, sim, max_tokens, tls_rounds, bar)
    _versus_pipe(summary, [c for c, _, _ in levels])
    conditions: dict[str, Any] = {}
    if baseline:
        conditions["baseline"] = _baseline_router.describe(baseline)
        _versus_baseline(summary, [c for c, _, _ in levels])
    levels_text = ", ".join(str(c) for c, _, _ in levels)
    return {
        "scenario": "router_overhead",
        "description": (
            f"Streams of {max_tokens // 2}-{max_tokens * 3 // 2} tokens from the sim "
            f"({PROFILE} profile, ~10 ms a token, own process, max_num_seqs {seqs}), direct, "
            f"through nginx (proxy_buffering off, 2 workers) when installed, through "
            f"{PIPE_TARGET} (bytes piped in Python on uvloop, no HTTP: the floor of "
            f"any Python relay's CPU per chunk), through {BARE_TARGET} (an ASGI relay on "
            "uvicorn with no feature: no key, limit, placement, store, metrics, log or "
            "heartbeat; levels only) and through the router (one process per ASGI "
            f"server: {', '.join(ROUTER_SERVERS)}) on loopback, in "
            f"alternating phases with the same workload; closed-loop workers ({levels_text}), "
            "plain HTTP/1.1 with kept-alive connections; then each target alone for "
            f"{sustained[1]} back-to-back phases at {sustained[0]} streams (sustained). "
            "Summary keys: cC_TARGET_added_* = target percentile minus direct percentile at "
            "concurrency C; cC_direct_aa_added_* = a second direct measurement minus the first "
            "(A/A: the noise floor); cC_auto_aa_* = a second default router, same "
            "configuration, its own process (A/A of CPU per chunk: its cpu_vs_pipe against "
            "auto's is what noise alone moves the ratio); "
            "cC_TARGET_vs_nginx_p50_ttft_ms / _p99_ttft_ms = the "
            "router's percentile minus nginx's in the same run (targets: at most 1 ms and 5 ms); "
            "cC_TARGET_cpu_us_per_chunk = the target's CPU time (all its "
            "processes) per relayed chunk; cC_TARGET_cpu_vs_pipe = that over "
            f"{PIPE_TARGET}'s in the same phases (the router's target: at most "
            f"{CPU_VS_PIPE_LIMIT:g}); cC_auto_cpu_vs_bare_relay / cC_auto_aa_cpu_vs_bare_relay "
            f"= the default router's CPU per chunk over {BARE_TARGET}'s in the same phases "
            "(what its features cost beside the server's own); "
            "cC_cpu_vs_pipe_target = that target at level C, from "
            "auto's and auto-aa's ratios: met when both are within it, NOT MET when both are "
            "past it, inconclusive when it lies between them; cpu_vs_pipe_target = over the "
            "levels (NOT MET if any is, met if all are); "
            "sustained_TARGET_* = over the sustained phases; "
            "c100_hypercorn_h2tls_added_vs_direct_h2_* = router over TLS + HTTP/2 minus the "
            "client straight to a TLS + HTTP/2 sim; mid_stream_* = after the levels, "
            f"{mid[1]} round{'s' * (mid[1] != 1)} of {mid[0]} streams of {mid[2]} tokens each, "
            "started together, "
            "for the byte pipe, auto and auto-aa: mid_stream_TARGET_cpu_us_per_chunk = the "
            "target's CPU per chunk in the window where every stream is under way and none "
            "has ended (the relay alone: no request starts or ends in it), "
            "mid_stream_TARGET_cpu_vs_pipe = that over the pipe's, "
            f"mid_stream_TARGET_rest_ms_per_stream = the target's CPU per stream at the "
            f"{mid[0]}-stream level beyond that cost of its chunks (its work per request); "
            f"whole_* = then {whole[1]} round{'s' * (whole[1] != 1)} of {whole[0]} "
            f"closed-loop workers sending {whole[2]} non-streamed chat requests each "
            f"({_whole.MAX_TOKENS} tokens, answered whole), alternating over "
            f"{', '.join(whole_targets)}: whole_TARGET_cpu_ms_per_request = its CPU per "
            "answer, whole_TARGET_vs_nginx = that over nginx's in the same rounds, "
            "whole_TARGET_failed = requests not answered 200."
        ),
        "summary": summary,
        "conditions": conditions,
        "overhead": overhead,
        "sustained": phases,
        "runs": runs,
        "notes": [
            *notes,
            "client, proxies and sim share this machine's 2 CPUs (and other work on it): the "
            "added latency at 100 and 500 streams includes each proxy's CPU competing with the "
            "sim and the client; limited_by in each row names what ran out (a process at "
            f">= {SATURATED:.0%} of a core, or the machine at >= {SATURATED:.0%} of its CPUs)",
            "CPU times come from /proc at 100 Hz: per-stream figures are +-10 ms / streams",
            "targets: added TTFT P50 within 1 ms of nginx's and P99 within 5 ms of nginx's at "
            "100 and 500 streams; zero errors in every phase",
            f"goodput SLO: TTFT <= {SLO_TTFT_MS:.0f} ms",
            f"a phase during which other processes used more than {FOREIGN_CPU_LIMIT:.0%} of "
            f"the machine's CPU is measured again (at most {MAX_RERUNS} times; not in --quick "
            "runs, not in the sustained phases), the same rule for every target; "
            "foreign_cpu_share and phases_rerun in each run say how loaded the machine was",
        ],
    }


def _router_config(
    sim_url: str, server: str | None = None, tls: tuple[str, str] | None = None
) -> dict[str, Any]:
    """The configuration of every router in the run (today's under ``server``, granian's
    without one, a ``--baseline`` revision's), as the TOML file would hold it; with ``tls``
    (certificate file, key file) it serves TLS."""
    listen: dict[str, Any] = {
        "port": 0, "http3": False, "insecure_plain_http": tls is None,
        "keep_alive_timeout_s": IDLE_S,
    }
    if server is not None:
        listen["server"] = server
    if tls is not None:
        listen |= {"certfile": tls[0], "keyfile": tls[1]}
    return {
        # every stream of the highest level must be admitted: the limit under test is
        # latency, not backpressure
        "upstreams": [{"url": sim_url, "max_in_flight": 1024}],
        "listen": listen,
        "routing": {"backend_max_waiting": 1024},
        "auth": {"allow_anonymous": True},  # a local benchmark: no keys to hand out
        # every client of the load generator comes from 127.0.0.1: no per-address cap
        "limits": {"max_connections_per_client": 65536},
    }


def _mid_stream_costs(
    steady: dict[str, dict[str, Any]], level: dict[str, dict[str, Any]], concurrency: int
) -> dict[str, Any]:
    """``mid_stream_*`` (see :mod:`._mid_stream`): each target's CPU per chunk mid-stream and
    its ratio to the pipe's, and what its CPU per stream at the level of the same
    concurrency (``level``) comes to beyond that cost of the stream's chunks: the work it
    does once a request, which a relay at the pipe's floor per chunk still pays."""
    out: dict[str, Any] = {"mid_stream_concurrency": concurrency}
    pipe = steady[PIPE_TARGET]["cpu_us_per_chunk"]
    for name, result in steady.items():
        key = name.split("/")[-1].replace("-", "_")
        per_chunk = result["cpu_us_per_chunk"]
        out[f"mid_stream_{key}_cpu_us_per_chunk"] = per_chunk
        out[f"mid_stream_{key}_rounds_counted"] = result["rounds_counted"]
        out[f"mid_stream_{key}_errors"] = len(result["errors"])
        if per_chunk is not None and pipe and name != PIPE_TARGET:
            out[f"mid_stream_{key}_cpu_vs_pipe"] = per_chunk / pipe
        at_level = level.get(name)
        if per_chunk is not None and at_level is not None:
            streams = max(at_level["completed"], 1)
            chunks = at_level["total_output_tokens"] / streams
            out[f"mid_stream_{key}_rest_ms_per_stream"] = (
                at_level["cpu_ms_per_stream"][name] - chunks * per_chunk / 1000
            )
    return out


def _whole_costs(answers: dict[str, dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """``whole_*`` (see :mod:`._whole`): each target's CPU per non-streamed request, and its
    ratio to nginx's where nginx ran."""
    out: dict[str, Any] = {"whole_concurrency": concurrency}
    nginx = answers.get(NGINX_TARGET, {}).get("cpu_ms_per_request")
    for name, result in answers.items():
        key = name.split("/")[-1].replace("-", "_")
        mine = result["cpu_ms_per_request"]
        out[f"whole_{key}_cpu_ms_per_request"] = mine
        out[f"whole_{key}_requests"] = result["requests"]
        out[f"whole_{key}_failed"] = result["failed"]
        if result["errors"]:
            out[f"whole_{key}_errors"] = result["errors"]
        if mine is not None and nginx and name != NGINX_TARGET:
            out[f"whole_{key}_vs_nginx"] = mine / nginx
    return out


def _versus_baseline(summary: dict[str, Any], levels: list[int]) -> None:
    """``cC_SERVER_cpu_vs_baseline``: today's CPU per chunk over the baseline revision's
    (the server :data:`BASELINE_OF` names), measured in the same phases."""
    for concurrency in levels:
        for name, old in BASELINE_OF.items():
            now = summary.get(f"c{concurrency}_{name}_cpu_us_per_chunk")
            then = summary.get(f"c{concurrency}_baseline_{old}_cpu_us_per_chunk")
            if now is not None and then:
                summary[f"c{concurrency}_{name}_cpu_vs_baseline"] = now / then


def _versus_pipe(summary: dict[str, Any], levels: list[int]) -> None:
    """``cC_TARGET_cpu_vs_pipe``: each target's CPU per chunk over :data:`PIPE_TARGET`'s in the
    same phases (the target for the router is at most :data:`CPU_VS_PIPE_LIMIT`);
    ``cC_auto_cpu_vs_bare_relay`` (and auto-aa's): the default router's over
    :data:`BARE_TARGET`'s; where the
    A/A router ran, ``cC_cpu_vs_pipe_target``: that target judged by
    :func:`_cpu_verdict`, and ``cpu_vs_pipe_target`` over the levels."""
    pipe_key = PIPE_TARGET.replace("-", "_")
    bare_key = BARE_TARGET.replace("-", "_")
    aa = ROUTER_AA_TARGET.removeprefix("router/").replace("-", "_")
    verdicts = []
    for concurrency in levels:
        pipe = summary.get(f"c{concurrency}_{pipe_key}_cpu_us_per_chunk")
        if not pipe:
            continue
        for name in (*ROUTER_SERVERS, aa, NGINX_TARGET, bare_key):
            mine = summary.get(f"c{concurrency}_{name}_cpu_us_per_chunk")
            if mine is not None:
                summary[f"c{concurrency}_{name}_cpu_vs_pipe"] = mine / pipe
        bare = summary.get(f"c{concurrency}_{bare_key}_cpu_us_per_chunk")
        for name in ("auto", aa):
            mine = summary.get(f"c{concurrency}_{name}_cpu_us_per_chunk")
            if bare and mine is not None:
                summary[f"c{concurrency}_{name}_cpu_vs_{bare_key}"] = mine / bare
        default = summary.get(f"c{concurrency}_auto_cpu_vs_pipe")
        again = summary.get(f"c{concurrency}_{aa}_cpu_vs_pipe")
        if default is not None and again is not None:
            verdict = _cpu_verdict(default, again)
            summary[f"c{concurrency}_cpu_vs_pipe_target"] = verdict
            verdicts.append(verdict)
    if verdicts:
        summary["cpu_vs_pipe_target"] = (
            "NOT MET" if "NOT MET" in verdicts
            else "met" if set(verdicts) == {"met"} else "inconclusive"
        )


def _cpu_verdict(default: float, again: float, limit: float = CPU_VS_PIPE_LIMIT) -> str:
    """The CPU target at one level, from two readings of the default router's ratio to the
    pipe in the same run (``auto`` and ``auto-aa``: the same code and configuration, two
    processes, their phases interleaved): ``met`` when both are within ``limit``, ``NOT MET``
    when both are past it, ``inconclusive`` when the limit lies between them (phase-to-phase
    noise alone moved the ratio by 0.05-0.22 between the two in full runs here, as much as
    the router stood from 2)."""
    if max(default, again) <= limit:
        return "met"
    if min(default, again) > limit:
        return "NOT MET"
    return "inconclusive"


def _limited_by(cores: dict[str, float], machine: float, target: str) -> str:
    """What limited a figure: the machine's CPUs, or one process at a core's worth."""
    mine = sorted(cores.items(), key=lambda item: -item[1])
    shares = ", ".join(f"{role} {share:.2f}" for role, share in mine if share >= 0.05)
    if machine >= SATURATED:
        return f"CPU: machine {machine:.0%} busy (cores: {shares})"
    for role, label in (("client", "the load generator"), ("sim", "the sim"), (target, target)):
        if cores.get(role, 0.0) >= SATURATED:
            return f"{label}: one core (cores: {shares})"
    return f"none saturated: the sim's decode steps (cores: {shares})"


def _overhead_rows(measured: dict[str, dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    """One row per target at one level: added TTFT, CPU per chunk, errors, the limit."""
    direct = measured["direct"]
    rows = []
    for name, result in measured.items():
        chunks = max(result["total_output_tokens"], 1)
        streams = max(result["completed"], 1)
        cpu_ms = result["cpu_ms_per_stream"].get(name, 0.0) * streams
        rows.append(
            {
                "label": name,
                "streams": concurrency,
                "added_ttft_p50_ms": result["p50_ttft_ms"] - direct["p50_ttft_ms"],
                "added_ttft_p99_ms": result["p99_ttft_ms"] - direct["p99_ttft_ms"],
                "ttft_p50_ms": result["p50_ttft_ms"],
                "cpu_us_per_chunk": cpu_ms * 1000 / chunks
                if name in result["cores_used"]
                else None,
                "errors": result["failed"],
                "limited_by": _limited_by(result["cores_used"], result["machine_busy_share"], name),
            }
        )
    pipe = next((row["cpu_us_per_chunk"] for row in rows if row["label"] == PIPE_TARGET), None)
    for row in rows:
        # The target of issue 26: a router's CPU per chunk at most 2x the byte pipe's.
        mine = row["cpu_us_per_chunk"]
        row["cpu_vs_pipe"] = mine / pipe if mine is not None and pipe else None
    return rows


def _sustained(
    urls: dict[str, str],
    pids: dict[str, int],
    plan: tuple[int, int, int],
    max_tokens: int,
    bar: Progress,
) -> list[dict[str, Any]]:
    """Each target alone for ``phases`` back-to-back phases of ``concurrency`` streams; one
    row per phase (TTFT, errors, CPU per chunk, what limited it)."""
    concurrency, phases, per_worker = plan
    rows: list[dict[str, Any]] = []
    for name, url in urls.items():
        measured = asyncio.run(
            _measure_phases(name, url, pids, concurrency, phases, per_worker, max_tokens, bar)
        )
        rows += measured
    direct = {row["phase"]: row for row in rows if row["label"] == "direct"}
    for row in rows:
        same = direct.get(row["phase"])
        if same is not None:
            row["added_ttft_p50_ms"] = row["ttft_p50_ms"] - same["ttft_p50_ms"]
            row["added_ttft_p99_ms"] = row["ttft_p99_ms"] - same["ttft_p99_ms"]
    return rows


async def _measure_phases(
    name: str,
    url: str,
    pids: dict[str, int],
    concurrency: int,
    phases: int,
    per_worker: int,
    max_tokens: int,
    bar: Progress,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    clients = _h1_clients(concurrency)
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        await _phase(clients, url, concurrency=concurrency, per_worker=1, max_tokens=4, seed=0)
        for index in range(phases):
            ok, bad, seconds, used, busy, total = await _metered_phase(
                clients,
                url,
                pids,
                concurrency=concurrency,
                per_worker=per_worker,
                max_tokens=max_tokens,
                seed=100 + index,
            )
            cores = {role: cpu / max(seconds, 1e-9) for role, cpu in used.items()}
            result = summarize(
                ok, duration_s=seconds, failed=len(bad), slo=SLO(ttft_ms=SLO_TTFT_MS)
            )
            chunks = max(result["total_output_tokens"], 1)
            rows.append(
                {
                    "label": name,
                    "phase": index + 1,
                    "streams": concurrency,
                    "ttft_p50_ms": result["p50_ttft_ms"],
                    "ttft_p99_ms": result["p99_ttft_ms"],
                    "cpu_us_per_chunk": used[name] * 1e6 / chunks if name in used else None,
                    "errors": len(bad),
                    "limited_by": _limited_by(cores, busy / max(total, 1e-9), name),
                    "error_reasons": sorted(set(bad))[:3],
                }
            )
            bar.advance()
    return rows


def _summarise_sustained(summary: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    for name in dict.fromkeys(row["label"] for row in rows):
        mine = [row for row in rows if row["label"] == name]
        key = f"sustained_{name.removeprefix('router/')}"
        summary[f"{key}_errors"] = sum(row["errors"] for row in mine)
        summary[f"{key}_worst_ttft_p50_ms"] = max(row["ttft_p50_ms"] for row in mine)
        cpu = [row["cpu_us_per_chunk"] for row in mine if row["cpu_us_per_chunk"] is not None]
        if cpu:
            summary[f"{key}_max_cpu_us_per_chunk"] = max(cpu)


def _nginx_binary() -> str | None:
    """The nginx executable, or None (the run then has no reference proxy and says so)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


_NGINX_CONF = """
daemon off;
worker_processes 2;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
{user}
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream sim {{
        server {upstream};
        keepalive 1024;
        keepalive_timeout {idle}s;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        keepalive_timeout {idle}s;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://sim;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 300s;
        }}
    }}
}}
"""


@contextmanager
def _nginx(binary: str, upstream_url: str) -> Iterator[_Child]:
    """nginx as a streaming reverse proxy to ``upstream_url`` (the reference proxy hop)."""
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nginx binds it next (a race with another program, unlikely here)
        conf = Path(tmp, "nginx.conf")
        conf.write_text(
            _NGINX_CONF.format(
                tmp=tmp,
                port=port,
                idle=int(IDLE_S),
                upstream=upstream_url.removeprefix("http://"),
                user="user root;" if os.geteuid() == 0 else "",
            )
        )
        log = Path(tmp, "error.log")
        proc = subprocess.Popen(
            [binary, "-p", tmp, "-c", str(conf), "-e", str(log)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        text = log.read_text() if log.exists() else ""
                        raise PartFailed("nginx did not start", text) from None
                    time.sleep(0.05)
            yield _Child(f"http://127.0.0.1:{port}", proc.pid)
        finally:
            stop_process(proc, timeout_s=15)


def _collect(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    measured: dict[str, dict[str, Any]],
    concurrency: int,
    protocol: str,
) -> None:
    """Add the runs and the added-latency summary; ``protocol`` is the client-to-router one
    (the direct path is always plain HTTP/1.1)."""
    direct = measured["direct"]
    tag = "" if protocol == "HTTP/1.1" else f" ({protocol} run)"
    rerun_key = f"c{concurrency}{'' if protocol == 'HTTP/1.1' else '_h2tls'}_phases_rerun"
    summary[rerun_key] = sum(result["phases_rerun"] for result in measured.values())
    for name, result in measured.items():
        runs.append(
            {
                "label": f"{name} c={concurrency}{tag}",
                "transport": "sse",
                "protocol": "HTTP/1.1" if name in ("direct", AA_TARGET) else protocol,
                "concurrency": concurrency,
            }
            | result
        )
        if name == "direct":
            continue
        key = f"c{concurrency}_{name.removeprefix('router/').replace('-', '_')}"
        if protocol != "HTTP/1.1":
            key += "_h2tls"
        for metric in ADDED_METRICS:
            summary[f"{key}_added_{metric}"] = result[metric] - direct[metric]
        if name in (AA_TARGET, DIRECT_H2_TARGET):
            continue
        nginx = measured.get(NGINX_TARGET)
        if nginx is not None and name != NGINX_TARGET:
            for metric in ("p50_ttft_ms", "p99_ttft_ms"):
                summary[f"{key}_vs_nginx_{metric}"] = result[metric] - nginx[metric]
        proxy_cpu = result["cpu_ms_per_stream"].get(name, 0.0)
        summary[f"{key}_cpu_ms_per_stream"] = proxy_cpu
        chunks = result["total_output_tokens"] / max(result["completed"], 1)
        summary[f"{key}_cpu_us_per_chunk"] = proxy_cpu * 1000 / max(chunks, 1)


def _tls(
    runs: list[dict[str, Any]],
    summary: dict[str, Any],
    sim: _Child,
    max_tokens: int,
    rounds: int,
    bar: Progress,
) -> None:
    """Client to router over TLS + HTTP/2 (router to sim stays plain HTTP/1.1), 100 streams;
    beside it the client straight to a TLS + HTTP/2 sim (:data:`DIRECT_H2_TARGET`)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("ca.pem", "cert.pem", "key.pem")}
        ca.cert_pem.write_to_path(paths["ca.pem"])
        cert.private_key_and_cert_chain_pem.write_to_path(paths["cert.pem"])
        cert.private_key_pem.write_to_path(paths["key.pem"])
        tls_args = (paths["cert.pem"], paths["key.pem"])
        idle = str(IDLE_S)
        with (
            _server(_ROUTER, json.dumps(_router_config(sim.url, "hypercorn", tls_args))) as router,
            _server(_ROUTER_GRANIAN, json.dumps(_router_config(sim.url, tls=tls_args))) as granian,
            _server(_SIM, PROFILE, "256", idle, *tls_args) as sim_tls,
        ):
            h2 = _h2_clients(paths["ca.pem"])
            routers = {"router/hypercorn": router, "router/granian": granian}
            measured = asyncio.run(
                _measure(
                    {"direct": sim.url, DIRECT_H2_TARGET: sim_tls.url}
                    | {name: child.url for name, child in routers.items()},
                    concurrency=100,
                    rounds=rounds,
                    per_worker=3,
                    max_tokens=max_tokens,
                    make_clients=_h1_clients,
                    client_overrides=dict.fromkeys([DIRECT_H2_TARGET, *routers], h2),
                    bar=bar,
                    pids={"sim": sim.pid, "sim-tls": sim_tls.pid}
                    | {name: child.pid for name, child in routers.items()},
                )
            )
    # "direct" is the plain sim (HTTP/1.1); direct-h2 and the router are the H2 ones.
    _collect(runs, summary, measured, 100, "HTTP/2+TLS")
    direct_h2 = measured[DIRECT_H2_TARGET]
    for name in ("hypercorn", "granian"):
        routed = measured[f"router/{name}"]
        for metric in ADDED_METRICS:
            summary[f"c100_{name}_h2tls_added_vs_direct_h2_{metric}"] = (
                routed[metric] - direct_h2[metric]
            )
