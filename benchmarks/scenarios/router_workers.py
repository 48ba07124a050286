"""Router scaling over processes: --workers 1 vs 2 with Redis, thousands of streams.

Every target runs in its own processes: the sim (``h100-7b``, ``--max-num-seqs`` high enough
that batching, not a cap, sets its pace), a real ``valkey-server``/``redis-server`` (no
persistence), and ``firstbyte router`` (uvicorn, plain HTTP/1.1) with ``--workers 1`` or
``--workers 2`` and ``--redis-url``, plus ``--workers 1`` without Redis (the in-memory default)
to price Redis per chunk. The load generator (this process, uvloop, a minimal HTTP/1.1 client:
one connection per stream, so SO_REUSEPORT spreads them) ramps N streams over ``ramp_s`` and
holds them (each ``max_tokens`` long enough to outlast the ramp). All routers run from the
start, and each level's phases alternate over the targets: direct, ``rounds`` rounds of the
memory router, the Redis router and the memory router again (every other round reversed; the
two-worker router once, after the first), then direct again (A/A controls of what noise and
drift alone do to the figures); each phase starts after a pause (:data:`SETTLE_S`) in which
the processes not measured finish their own deferred work, and the load generator's own
cyclic GC is held off during each phase (its full collections, 30-90 ms at 2,000 streams,
stalled every client at once).

Per target and level: TTFT P50/P99 (request sent to the first content chunk) and its mean,
split into the sim's engine's part (its own TTFT histogram) and the rest, errors, the
peak number of live streams, chunks relayed; the router's CPU per chunk (its processes'
utime+stime over the phase / chunks), Redis's CPU per chunk, and RSS of router and Redis per
1,000 live streams (sampled at the peak). Added latency is router minus direct at the same
level. A level is "held" when every stream finished without error and added TTFT P99 <= 20 ms;
the scaling figure is the largest level held with 2 workers over the largest held with 1
(none when one worker holds the highest level: nothing is left for a second to show), and,
apples to apples, chunks per router-CPU-second with 2 workers over 1. Redis against memory
(one worker each): TTFT P50 and P99 Redis minus memory and router CPU per chunk Redis over
memory, as medians over the rounds of Redis against the mean of its round's two memory phases
(one before it, one after: a steady drift of the machine's load cancels), next to the
same figures of the memory router's second phase against its first (its A/A control), and
whether they are within issue 26's target (+10 ms, +30 ms, x1.15), figure by figure read
with its A/A: met (within, and so is the A/A), NOT MET (past it by more than the A/A strays)
or inconclusive (the run's own noise is larger than the target); with the router's own
time per stream (its ``firstbyte_router_start_seconds``: arrival to the request written
upstream, without the sim's queue), the part of TTFT Redis can cost, and the TTFT mean's
delta (not a target figure: the sim answers in decode steps, ~245 ms at 2,000 streams, so
TTFT clusters a step apart and a few ms that move requests past a step's start move the P50
by tens of ms, the mean by about those ms).

On a 2-core machine the sim, Redis, the load generator and the router share the two cores:
each row names what limited it (``limit``): the first of the router (its busiest process),
the sim, the load generator and Redis that used at least 85% of a core over the phase, else
the machine (all of them together over 90% of its cores), else nothing (the latency is the
router's own). The CPU share of each and the load average (1 min, at the phase's end: other
work on a shared machine shows there) are in every row. Levels: 1,000 and 2,000 streams
(``--quick``: 50 and 100, shorter streams: a CI check that every part runs, not a figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from firstbyte.benchmarks.conditions import child_pids, process_cpu_seconds
from firstbyte.benchmarks.errors import PartFailed
from firstbyte.benchmarks.gc_hold import gc_held_off
from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import running_redis
from firstbyte.router.hosting.gc_tuning import CHECK_S

__all__ = ["run"]

ADDED_P99_LIMIT_MS = 20.0
BUSY = 0.85
"""A process that used this share of a core over a phase was the limit."""
PROMPT = b"Summarise the plot of Hamlet in one paragraph."
_CONTENT = re.compile(rb'"content":"[^"]')
"""A chat chunk with content: the role chunk's empty ``"content":""`` does not match, so a
read holding the role chunk and the first token together counts as the first token's."""
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except OSError:
        return 0


@dataclass
class _Proc:
    process: subprocess.Popen[bytes]

    def pids(self) -> list[int]:
        """The process and its workers (the supervisor forks them)."""
        return [self.process.pid, *child_pids(self.process.pid)]

    def cpu_s(self) -> float:
        return sum(process_cpu_seconds(p) for p in self.pids())

    def busiest_cpu_s(self) -> dict[int, float]:
        """CPU seconds per process (the supervisor and each worker)."""
        return {p: process_cpu_seconds(p) for p in self.pids()}

    def rss(self) -> int:
        return sum(_rss_bytes(p) for p in self.pids())


@contextlib.contextmanager
def _spawn(args: list[str], ready: str, count: int = 1, log: Path | None = None) -> Iterator[_Proc]:
    """Start ``python -m firstbyte ARGS`` and wait for ``count`` stderr lines with ``ready``."""
    with tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False) as handle:
        path = Path(handle.name) if log is None else log
    process = subprocess.Popen(
        [sys.executable, "-m", "firstbyte", *args],
        stdout=path.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while path.read_text(errors="replace").count(ready) < count:
            if process.poll() is not None or time.monotonic() > deadline:
                raise PartFailed(f"firstbyte {args[0]} did not start", path.read_text())
            time.sleep(0.05)
        yield _Proc(process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
        path.unlink(missing_ok=True)


@dataclass
class _Load:
    ttft_ms: list[float] = field(default_factory=list)
    head_ms: list[float] = field(default_factory=list)
    """Request start to the response's head: the part of TTFT before the router answers
    (queued in the kernel or the router's loop, then its own time to admit and route)."""
    errors: int = 0
    chunks: int = 0
    live: int = 0
    peak_live: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)


async def _stream(port: int, body: bytes, load: _Load) -> None:
    """One streamed completion over a new HTTP/1.1 connection, read to ``[DONE]``."""
    started = time.perf_counter()
    writer = None
    first = False
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        load.live += 1
        load.peak_live = max(load.peak_live, load.live)
        head = await reader.readuntil(b"\r\n\r\n")
        load.head_ms.append((time.perf_counter() - started) * 1000)
        if not head.startswith(b"HTTP/1.1 200"):
            # the status and the error's code (the router's reason): what to look into
            answer = await asyncio.wait_for(reader.read(4096), 5)
            code = re.search(rb'"code":\s*"([a-z_]+)"', answer)
            status = head.split(b"\r\n", 1)[0].decode(errors="replace")
            raise RuntimeError(f"{status} {code.group(1).decode() if code else ''}".rstrip())
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError("closed before [DONE]")
            window = tail + data
            if not first and _CONTENT.search(window):
                first = True
                load.ttft_ms.append((time.perf_counter() - started) * 1000)
            load.chunks += data.count(b"\ndata: ") + data.startswith(b"data: ")
            if b"[DONE]" in window:
                return
            if b'"error"' in data:
                raise RuntimeError("error event")
            tail = data[-16:]
    except Exception as exc:
        load.errors += 1
        kind = type(exc).__name__ + ": " + str(exc)[:80]
        load.error_kinds[kind] = load.error_kinds.get(kind, 0) + 1
    finally:
        if writer is not None:
            load.live -= 1
            writer.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _redis_info(url: str, section: str) -> dict[str, Any]:
    import redis

    info: dict[str, Any] = redis.Redis.from_url(url).info(section)
    return info


def _redis_exchanges(url: str) -> dict[str, int]:
    """Redis's counts so far (one ``INFO``): the reads it has processed from its clients (a
    round trip each, or a part of a large one) and the scripts it has run, by digest
    (``EVALSHA``: admissions and releases) and with their body (``EVAL``: the stream
    writer's calls)."""
    info = _redis_info(url, "all")

    def calls(command: str) -> int:
        stats = info.get(f"cmdstat_{command}")
        return int(stats["calls"]) if isinstance(stats, dict) else 0

    return {"reads": int(info.get("total_reads_processed", 0)),
            "evalsha": calls("evalsha"), "eval": calls("eval")}


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _machine_busy_s() -> float:
    """CPU seconds every process on the machine has used (``/proc/stat``, all CPUs)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICK


def _limit(shares: dict[str, float], cpus: int) -> str:
    """What limited a phase, from each part's share of one core (see the module docstring)."""
    for part in ("router", "sim", "load generator", "redis"):
        if shares.get(part, 0.0) >= BUSY:
            return f"{part} CPU"
    if shares["machine"] >= 0.9 * cpus:
        return f"machine CPU (other work: {shares['other processes']:.1f} cores)"
    return "-"


START = "firstbyte_router_start_seconds"
"""The router's own time per stream: request arrival to its request written to the upstream
(router/metrics.py): what Redis can add, without the sim's queue that TTFT also holds."""


ENGINE_TTFT = "vllm:time_to_first_token_seconds"
"""The sim's own TTFT: a request's arrival at its engine to its first token, engine time (its
queue and prefill), without its HTTP serving, the router or the load generator."""


def _scrape(port: int) -> str:
    """The ``/metrics`` of the server on ``port`` (one process: with several workers,
    whichever answered)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return str(answer.read().decode())


ADMISSIONS = "firstbyte_router_shared_admissions_total"
"""The router's admissions with shared state, by what they waited for (``redis``, ``none``)."""


def _counter(port: int, name: str) -> dict[str, float]:
    """Counter family ``name`` from the ``/metrics`` of the server on ``port``, by its one
    label's value."""
    values: dict[str, float] = {}
    for line in _scrape(port).splitlines():
        if line.startswith(name + "{"):
            label = line.split('="', 1)[1].split('"', 1)[0]
            values[label] = float(line.rsplit(" ", 1)[1])
    return values


def _histogram(port: int, name: str = START) -> tuple[list[tuple[float, float]], float, float]:
    """Histogram ``name`` from the ``/metrics`` of the server on ``port``: cumulative (bound,
    count) pairs, sum and count (one process: with several workers, whichever answered)."""
    text = _scrape(port)
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
        elif line.startswith(name + "_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count = float(line.rsplit(" ", 1)[1])
    return buckets, total, count


def _start_figures(
    before: tuple[list[tuple[float, float]], float, float],
    after: tuple[list[tuple[float, float]], float, float],
) -> dict[str, float | None]:
    """Mean, P50 and P99 (ms) of the streams one phase started, from two scrapes; the
    percentiles interpolate linearly inside a bucket (START_BUCKETS_S: 0.5 ms up to 3 ms)."""
    count = after[2] - before[2]
    if count <= 0:
        return {"router_start_mean_ms": None, "router_start_p50_ms": None,
                "router_start_p99_ms": None}
    cumulative = [(b, c - c0) for (b, c), (_, c0) in zip(after[0], before[0], strict=True)]

    def quantile(q: float) -> float:
        rank, low, below = q * count, 0.0, 0.0
        for bound, seen in cumulative:
            if seen >= rank:
                if bound == float("inf"):
                    return low * 1000
                share = (rank - below) / (seen - below) if seen > below else 1.0
                return (low + (bound - low) * share) * 1000
            low, below = bound, seen
        return low * 1000

    return {
        "router_start_mean_ms": round((after[1] - before[1]) / count * 1000, 3),
        "router_start_p50_ms": round(quantile(0.5), 3),
        "router_start_p99_ms": round(quantile(0.99), 3),
    }


def _measure(
    port: int, n: int, ramp_s: float, max_tokens: int, router: _Proc | None,
    redis_pid: int | None, redis_url: str | None, sim: _Proc, sim_port: int,
    scrape: bool = False,
) -> dict[str, Any]:
    # One process's /metrics: with several workers two scrapes may reach two of them.
    start0 = _histogram(port) if scrape else None
    admissions0 = _counter(port, ADMISSIONS) if scrape and redis_url else None
    engine0 = _histogram(sim_port, ENGINE_TTFT)
    router_cpu0 = router.cpu_s() if router else 0.0
    per_process0 = router.busiest_cpu_s() if router else {}
    sim_cpu0 = sim.cpu_s()
    self_cpu0 = _self_cpu_s()
    machine0 = _machine_busy_s()
    redis_cpu0 = process_cpu_seconds(redis_pid) if redis_pid else 0.0
    exchanges0 = _redis_exchanges(redis_url) if redis_url else None
    peak: dict[str, int] = {"router_rss": 0, "redis_rss": 0, "live": 0}

    async def sample(load: _Load) -> None:
        while True:
            await asyncio.sleep(0.25)
            if load.live >= peak["live"]:
                peak["live"] = load.live
                peak["router_rss"] = router.rss() if router else 0
                peak["redis_rss"] = _rss_bytes(redis_pid) if redis_pid else 0

    async def main() -> _Load:
        load = _Load()
        sampler = asyncio.ensure_future(sample(load))
        try:
            real = await _phase_into(port, n, ramp_s, max_tokens, load)
        finally:
            sampler.cancel()
        return real

    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner, gc_held_off():
        started = time.monotonic()
        load = runner.run(main())
        wall_s = time.monotonic() - started
    router_cpu = (router.cpu_s() - router_cpu0) if router else 0.0
    redis_cpu = (process_cpu_seconds(redis_pid) - redis_cpu0) if redis_pid else 0.0
    exchanges: dict[str, float | None] = {"reads": None, "evalsha": None, "eval": None}
    if exchanges0 is not None and redis_url:
        exchanges1 = _redis_exchanges(redis_url)
        exchanges = {k: round((exchanges1[k] - exchanges0[k]) / n, 2) for k in exchanges0}
    busiest = max(
        (cpu - per_process0.get(pid, 0.0) for pid, cpu in router.busiest_cpu_s().items()),
        default=0.0,
    ) if router else 0.0
    shares = {
        "router": busiest / wall_s,
        "sim": (sim.cpu_s() - sim_cpu0) / wall_s,
        "load generator": (_self_cpu_s() - self_cpu0) / wall_s,
        "redis": redis_cpu / wall_s,
    }
    ours = sum(shares.values()) - shares["router"] + router_cpu / wall_s
    shares["machine"] = (_machine_busy_s() - machine0) / wall_s
    shares["other processes"] = max(0.0, shares["machine"] - ours)
    if router:
        shares["router total"] = router_cpu / wall_s
    engine1 = _histogram(sim_port, ENGINE_TTFT)
    engine_count = engine1[2] - engine0[2]
    engine_ms = (engine1[1] - engine0[1]) / engine_count * 1000 if engine_count > 0 else None
    mean_ttft = statistics.fmean(load.ttft_ms) if load.ttft_ms else None
    starts = _start_figures(start0, _histogram(port)) if start0 else {
        "router_start_mean_ms": None, "router_start_p50_ms": None, "router_start_p99_ms": None}
    at_once = None
    if admissions0 is not None:
        admissions1 = _counter(port, ADMISSIONS)
        went = {k: admissions1.get(k, 0.0) - admissions0.get(k, 0.0) for k in ("none", "redis")}
        if sum(went.values()) > 0:
            at_once = round(went["none"] / sum(went.values()), 3)
    chunks = max(load.chunks, 1)
    live_k = max(peak["live"], 1) / 1000
    return {
        "streams": n,
        "errors": load.errors,
        "error_kinds": load.error_kinds,
        "peak_live": load.peak_live,
        "chunks": load.chunks,
        "wall_s": round(wall_s, 2),
        "p50_ttft_ms": _pct(load.ttft_ms, 0.5),
        "p99_ttft_ms": _pct(load.ttft_ms, 0.99),
        "mean_ttft_ms": mean_ttft,
        "sim_ttft_mean_ms": engine_ms,
        "outside_sim_mean_ms": None if mean_ttft is None or engine_ms is None
        else mean_ttft - engine_ms,
        "p50_head_ms": _pct(load.head_ms, 0.5),
        "p99_head_ms": _pct(load.head_ms, 0.99),
        "router_cpu_us_per_chunk": round(router_cpu / chunks * 1e6, 1) if router else None,
        "router_chunks_per_cpu_s": round(load.chunks / router_cpu) if router_cpu else None,
        "redis_cpu_us_per_chunk": round(redis_cpu / chunks * 1e6, 1) if redis_pid else None,
        "redis_reads_per_stream": exchanges["reads"],
        "redis_evalsha_per_stream": exchanges["evalsha"],
        "redis_eval_per_stream": exchanges["eval"],
        "router_rss_mb_per_1000_live": round(peak["router_rss"] / live_k / 2**20, 1)
        if router else None,
        "redis_rss_mb_per_1000_live": round(peak["redis_rss"] / live_k / 2**20, 1)
        if redis_pid else None,
        "redis_used_memory_mb": round(_redis_info(redis_url, "memory")["used_memory"] / 2**20, 1)
        if redis_url else None,
        **starts,
        "admitted_at_once": at_once,
        "cpu_share": {part: round(share, 2) for part, share in shares.items()},
        "limit": _limit(shares, os.cpu_count() or 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


async def _phase_into(port: int, n: int, ramp_s: float, max_tokens: int, load: _Load) -> _Load:
    tasks = []
    for i in range(n):
        body = (
            b'{"model":"sim-llama-7b","stream":true,"max_tokens":%d,"seed":%d,'
            b'"messages":[{"role":"user","content":"%s %d"}]}' % (max_tokens, i, PROMPT, i)
        )
        tasks.append(asyncio.ensure_future(_stream(port, body, load)))
        await asyncio.sleep(ramp_s / n)
    await asyncio.gather(*tasks)
    return load


def _router_config(path: Path, sim_url: str, port: int, workers: int, redis_url: str | None,
                   n_max: int) -> Path:
    # Each router its own keys: they are separate deployments sharing one Redis server.
    state = ""
    if redis_url:
        state = f'[state]\nredis_url = "{redis_url}"\nkey_prefix = "{path.stem}:"\n'
    path.write_text(
        f"""
[[upstreams]]
url = "{sim_url}"
[listen]
host = "127.0.0.1"
port = {port}
insecure_plain_http = true
server = "uvicorn"
workers = {workers}
[auth]
allow_anonymous = true
[limits]
upstream_max_connections = {n_max + 64}
[routing]
backend_max_in_flight = {n_max + 64}
backend_max_waiting = {4 * n_max}
{state}"""
    )
    return path


AA_TARGET = "direct-aa"
ROUTERS = (("router-1-memory", 1, False), ("router-1-redis", 1, True),
           ("router-2-redis", 2, True))
"""(name, workers, whether they share state through Redis) of each router under test."""
MEMORY, REDIS = "router-1-memory", "router-1-redis"
MEMORY_AA = "router-1-memory-aa"
"""The memory router measured again in every round: the A/A control of Redis vs memory."""
REDIS_TARGET = {"added_p50_ttft_ms": 10.0, "added_p99_ttft_ms": 30.0, "cpu_ratio": 1.15}
"""Redis at the speed of memory (issue 26): TTFT P50 and P99 within these of memory mode,
router CPU per chunk within this ratio of it."""
ROUNDS, QUICK_ROUNDS = 6, 2
"""Rounds of memory, Redis and memory again (one worker each) per level. At 2,000 streams
the TTFT P50 (~300 ms, the sim's batching queue) moves by tens of ms between phases of one
target: a figure from one phase each cannot tell +10 ms; the median of per-round deltas
can, with its A/A the same way."""

SETTLE_S = 2 * CHECK_S + 1.0
"""The pause before each phase (full runs). A process serving nothing runs a due full
collection of its GC within two of its quiet-time checks (:mod:`firstbyte.router.hosting.
gc_tuning`, every ``CHECK_S``; the sim's too), and its collection takes ~0.1 s: without the
pause, the routers not measured ran theirs (~100 ms of a core each at 2,000 streams) a
second or two into the next target's phase, in its ramp, on the two cores it shares."""


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of stream counts: {text!r}") from exc
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"not a list of stream counts: {text!r}")
    return levels


def _rounds(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive number of rounds: {text!r}")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--levels", type=_levels, default=None, metavar="N,N",
        help="stream counts to ramp (default 1000,2000; --quick 50,100), e.g. 2000 alone"
        " while looking into one level",
    )
    parser.add_argument(
        "--rounds", type=_rounds, default=None, metavar="N",
        help=f"rounds of memory / Redis / memory again per level (default {ROUNDS};"
        f" --quick {QUICK_ROUNDS})",
    )


def _round_order(i: int) -> tuple[str, ...]:
    """Round ``i``'s phases; every other round runs backwards, so a drift over a round adds
    to the Redis delta in one round what it takes from it in the next."""
    order = (MEMORY, REDIS, MEMORY_AA)
    return order if i % 2 == 0 else order[::-1]


def run(
    quick: bool, levels: tuple[int, ...] | None = None, rounds: int | None = None
) -> dict[str, Any]:
    levels = levels or ((50, 100) if quick else (1000, 2000))
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    # Long enough to outlast the ramp at every level (a step of the sim's batch at 2,000
    # streams is ~130 ms), short enough for the rounds to fit in ~10 minutes.
    max_tokens = 40 if quick else 100
    ramp_s = 1.0 if quick else 2.0
    n_max = max(levels)
    results: dict[str, Any] = {
        "levels": list(levels),
        "rounds": rounds,
        "max_tokens": max_tokens,
        "ramp_s": ramp_s,
        "cpus": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "targets": {},
    }
    per_round: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="firstbyte-workers-") as tmp,
        running_redis() as rs,
        contextlib.ExitStack() as stack,
    ):
        sim_port = free_port()
        sim_args = ["sim", "--port", str(sim_port), "--max-num-seqs", str(n_max + 64),
                    "--queue-limit", str(4 * n_max), "--server", "uvicorn"]
        sim = stack.enter_context(_spawn(sim_args, "127.0.0.1"))
        sim_url = f"http://127.0.0.1:{sim_port}"
        # Every router runs from the start, so each level's phases alternate over the targets
        # (drift in the sim or the machine then lands on every target alike), and direct is
        # measured again last (A/A: what noise and drift alone make of the figures).
        routers: dict[str, tuple[int, _Proc, str | None]] = {}
        for name, workers, shared in ROUTERS:
            port = free_port()
            redis_url = rs.url if shared else None
            config = _router_config(Path(tmp) / f"{name}.toml", sim_url, port, workers,
                                    redis_url, n_max)
            proc = stack.enter_context(
                _spawn(["router", "--config", str(config)], " serving http://", workers)
            )
            routers[name] = (port, proc, redis_url)
        for n in levels:
            # direct, the rounds (two workers after the first: it is measured once), direct
            order = ["direct", *_round_order(0), "router-2-redis"]
            for i in range(1, rounds):
                order += _round_order(i)
            for name in (*order, AA_TARGET):
                time.sleep(0.0 if quick else SETTLE_S)
                if name in routers or name == MEMORY_AA:
                    port, proc, redis_url = routers[MEMORY if name == MEMORY_AA else name]
                    row = _measure(port, n, ramp_s, max_tokens, proc,
                                   rs.pid if redis_url else None, redis_url, sim, sim_port,
                                   scrape=name != "router-2-redis")
                else:
                    row = _measure(sim_port, n, ramp_s, max_tokens, None, None, None, sim,
                                   sim_port)
                per_round.setdefault(name, {}).setdefault(str(n), []).append(row)
                print(f"{name} {n}: {row}", file=sys.stderr, flush=True)
    results["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    order_of_targets = ("direct", MEMORY, REDIS, "router-2-redis", MEMORY_AA, AA_TARGET)
    for name in order_of_targets:
        results["targets"][name] = {
            level: _combine(rows) for level, rows in per_round[name].items()
        }
    results["redis_vs_memory"] = {
        level: _versus(per_round[REDIS][level], per_round[MEMORY][level],
                       per_round[MEMORY_AA][level]) for level in per_round[MEMORY]
    }
    _summarise(results)
    return results


ROUND_KEYS = ("p50_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "outside_sim_mean_ms", "p50_head_ms",
              "router_cpu_us_per_chunk", "router_start_mean_ms", "router_start_p50_ms",
              "router_start_p99_ms", "errors", "load_avg_1m")
"""A round's figures kept in its target's row (``per_round``), in the order measured."""


def _combine(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One target's row at one level from its rounds: the median of each figure, errors and
    chunks summed, each round's main figures under ``per_round``."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[-1])
    for key, value in rows[0].items():
        values = [row[key] for row in rows]
        if key in ("errors", "chunks"):
            out[key] = sum(values)
        elif key == "error_kinds":
            kinds: dict[str, int] = {}
            for row in rows:
                for kind, count in row[key].items():
                    kinds[kind] = kinds.get(kind, 0) + count
            out[key] = kinds
        elif key == "cpu_share":
            out[key] = {part: round(statistics.median(r[key].get(part, 0.0) for r in rows), 2)
                        for part in value}
        elif key == "limit":
            out[key] = max(set(values), key=values.count)
        elif isinstance(value, int | float) and None not in values:
            middle = statistics.median(values)
            out[key] = round(middle) if isinstance(value, int) else middle
    out["rounds"] = len(rows)
    out["per_round"] = [{key: row[key] for key in ROUND_KEYS} for row in rows]
    return out


def _summarise(results: dict[str, Any]) -> None:
    targets = results["targets"]
    direct = targets["direct"]
    held: dict[str, int] = {}
    for name, rows in targets.items():
        if name == "direct":
            continue
        router = name != AA_TARGET
        for level, row in rows.items():
            base = direct[level]
            added = None
            if row["p99_ttft_ms"] is not None and base["p99_ttft_ms"] is not None:
                added = row["p99_ttft_ms"] - base["p99_ttft_ms"]
                row["added_p50_ttft_ms"] = row["p50_ttft_ms"] - base["p50_ttft_ms"]
            row["added_p99_ttft_ms"] = added
            if not router:
                continue
            ok = row["errors"] == 0 and added is not None and added <= ADDED_P99_LIMIT_MS
            row["held"] = ok
            if ok:
                held[name] = max(held.get(name, 0), int(level))
    results["held_streams"] = held
    one, two = held.get("router-1-redis", 0), held.get("router-2-redis", 0)
    # One worker holding the highest level tested leaves nothing for a second to show.
    separated = bool(one) and one < max(results["levels"])
    results["scaling_held"] = round(two / one, 2) if separated else None
    if one and not separated:
        results["scaling_note"] = (
            f"one worker held the highest level ({one} streams): these levels do not separate"
            " 1 from 2 workers, so there is no scaling figure"
        )
    top = str(max(results["levels"]))
    eff1 = targets["router-1-redis"][top]["router_chunks_per_cpu_s"]
    eff2 = targets["router-2-redis"][top]["router_chunks_per_cpu_s"]
    results["redis_cost_us_per_chunk"] = {
        level: (
            None
            if targets["router-1-redis"][level]["router_cpu_us_per_chunk"] is None
            else round(
                targets["router-1-redis"][level]["router_cpu_us_per_chunk"]
                - targets["router-1-memory"][level]["router_cpu_us_per_chunk"],
                1,
            )
        )
        for level in targets["router-1-memory"]
    }
    results["chunks_per_router_cpu_s"] = {"1": eff1, "2": eff2}
    versus = results["redis_vs_memory"][top]
    results["summary"] = {
        "streams held, 1 worker (Redis)": one or None,
        "streams held, 2 workers (Redis)": two or None,
        "scaling (held, 2 workers / 1)": results["scaling_held"],
        "router chunks per CPU-second, 1 worker": eff1,
        "router chunks per CPU-second, 2 workers": eff2,
        f"Redis's cost to the router at {top} streams, µs/chunk":
            results["redis_cost_us_per_chunk"].get(top),
        f"Redis vs memory at {top} streams, TTFT P50 / P99 ms (A/A: memory vs memory)":
            f"{_signed(versus['added_p50_ttft_ms'])} / {_signed(versus['added_p99_ttft_ms'])}"
            f" (A/A {_signed(versus['aa_p50_ttft_ms'])} / {_signed(versus['aa_p99_ttft_ms'])})",
        f"Redis vs memory at {top} streams, TTFT mean ms, and the part outside the sim's engine"
        " (A/A; not target figures)":
            f"{_signed(versus['added_mean_ttft_ms'])},"
            f" {_signed(versus['added_outside_sim_mean_ms'])}"
            f" (A/A {_signed(versus['aa_mean_ttft_ms'])},"
            f" {_signed(versus['aa_outside_sim_mean_ms'])})",
        f"Redis vs memory at {top} streams, router CPU per chunk (A/A)":
            f"{_ratio(versus['cpu_ratio'])} (A/A {_ratio(versus['aa_cpu_ratio'])})",
        f"Redis vs memory at {top} streams, the router's own time per stream (arrival to"
        " upstream request), mean / P99 ms (A/A)":
            f"{_signed(versus['added_start_mean_ms'], 2)} /"
            f" {_signed(versus['added_start_p99_ms'], 2)}"
            f" (A/A {_signed(versus['aa_start_mean_ms'], 2)} /"
            f" {_signed(versus['aa_start_p99_ms'], 2)})",
        f"Redis router's admissions at {top} streams that waited for no round trip":
            versus.get("admitted_at_once"),
        f"Redis vs memory at {top} streams, time to the response head P50 ms (A/A)":
            f"{_signed(versus['added_p50_head_ms'])}"
            f" (A/A {_signed(versus['aa_p50_head_ms'])})",
        f"Redis at the speed of memory at {top} streams (P50 +10 ms, P99 +30 ms, CPU x1.15;"
        " each level's in the text above)": versus["target"],
        "load average at the start (1 min)": results["load_avg_at_start"][0],
        "load average at the end (1 min)": results["load_avg_at_end"][0],
    }
    # The report prints the description above its summary: the whole table goes there.
    results["description"] = (
        f"--workers 1 vs 2 with Redis, and 1 in memory, at {results['levels']} streams;"
        f" held = 0 errors and added TTFT P99 <= {ADDED_P99_LIMIT_MS:g} ms.\n\n"
        + _markdown(results)
    )


def _versus(
    redis: list[dict[str, Any]], memory: list[dict[str, Any]], again: list[dict[str, Any]]
) -> dict[str, Any]:
    """Redis against memory at one level over the rounds: the median of the per-round
    differences (TTFT, the router's own time per stream) and ratios (router CPU per chunk),
    and the same of the memory router against itself (the A/A: what noise and drift alone
    make of them); each round's TTFT P50 deltas too, to show the spread.

    Each round measures Redis between its two memory phases (memory, Redis, memory again,
    or the reverse), so Redis is read against their mean: a machine whose load drifts
    through a round (a shared 2-core one does: in one full run the memory router's CPU per
    chunk went from 28 to 47 µs over the rounds) moves both memory phases, one before and
    one after, and their mean cancels a steady drift that a single neighbour adds to or
    takes from the figure. The A/A is the second memory phase against the first (two phases
    apart: the drift of a whole round, a conservative measure of noise)."""

    def base(key: str, bracketed: bool) -> list[float | None]:
        """Per round, the memory figure a phase is read against: the mean of the round's
        two memory phases (a Redis phase, between them) or the first one's (the A/A)."""
        out: list[float | None] = []
        for m, a in zip(memory, again, strict=True):
            if m[key] is None or (bracketed and a[key] is None):
                out.append(None)
            else:
                out.append((float(m[key]) + float(a[key])) / 2 if bracketed else float(m[key]))
        return out

    def diffs(rows: list[dict[str, Any]], key: str, bracketed: bool) -> list[float]:
        return [float(x[key]) - b for x, b in zip(rows, base(key, bracketed), strict=True)
                if x[key] is not None and b is not None]

    def ratios(rows: list[dict[str, Any]], bracketed: bool) -> list[float]:
        key = "router_cpu_us_per_chunk"
        return [float(x[key]) / b for x, b in zip(rows, base(key, bracketed), strict=True)
                if x[key] and b]

    def median(values: list[float], digits: int = 1) -> float | None:
        return round(statistics.median(values), digits) if values else None

    out: dict[str, Any] = {"rounds": len(memory)}
    for prefix, rows, b in (("added", redis, True), ("aa", again, False)):
        out[f"{prefix}_p50_ttft_ms"] = median(diffs(rows, "p50_ttft_ms", b))
        out[f"{prefix}_p99_ttft_ms"] = median(diffs(rows, "p99_ttft_ms", b))
        out[f"{prefix}_mean_ttft_ms"] = median(diffs(rows, "mean_ttft_ms", b))
        out[f"{prefix}_outside_sim_mean_ms"] = median(diffs(rows, "outside_sim_mean_ms", b))
        out[f"{prefix}_start_mean_ms"] = median(diffs(rows, "router_start_mean_ms", b), 3)
        out[f"{prefix}_start_p99_ms"] = median(diffs(rows, "router_start_p99_ms", b), 3)
        out[f"{prefix}_p50_head_ms"] = median(diffs(rows, "p50_head_ms", b))
    out["cpu_ratio"] = median(ratios(redis, True), 3)
    out["admitted_at_once"] = median(
        [float(r["admitted_at_once"]) for r in redis if r.get("admitted_at_once") is not None], 3)
    out["aa_cpu_ratio"] = median(ratios(again, False), 3)
    out["p50_ttft_deltas_ms"] = [round(d, 1) for d in diffs(redis, "p50_ttft_ms", True)]
    out["aa_p50_ttft_deltas_ms"] = [round(d, 1) for d in diffs(again, "p50_ttft_ms", False)]
    figures = [out[key] for key in REDIS_TARGET]
    if None in figures or None in [out[_FIGURES[key][0]] for key in REDIS_TARGET] \
            or any(r["errors"] for r in redis):
        out["target"] = "not measured"
    else:
        verdicts = {key: _verdict(out[key], out[_FIGURES[key][0]], limit, key == "cpu_ratio")
                    for key, limit in REDIS_TARGET.items()}
        out["target_by_figure"] = verdicts
        out["target"] = ("NOT MET" if "NOT MET" in verdicts.values()
                         else "met" if set(verdicts.values()) == {"met"} else "inconclusive")
    return out


_FIGURES = {"added_p50_ttft_ms": ("aa_p50_ttft_ms", "P50"),
            "added_p99_ttft_ms": ("aa_p99_ttft_ms", "P99"), "cpu_ratio": ("aa_cpu_ratio", "CPU")}
"""Each target figure's A/A counterpart and its name in the summary."""


def _verdict(value: float, aa: float, limit: float, ratio: bool) -> str:
    """One target figure against its limit, read with its A/A (what noise alone made of the
    same figure in the same run): ``met`` within the limit in a run whose A/A is within it
    too; ``NOT MET`` past the limit by more than the A/A strays from no difference;
    ``inconclusive`` otherwise (the run's noise is larger than the limit it is to resolve:
    a 2,000-stream ramp on 2 shared cores can move a memory router's TTFT P50 by hundreds
    of ms from one phase to the next)."""
    noise = abs(aa - 1.0) if ratio else abs(aa)
    margin = limit - 1.0 if ratio else limit
    if value <= limit and noise <= margin:
        return "met"
    if value > limit + noise:
        return "NOT MET"
    return "inconclusive"


def _by_figure(versus: dict[str, Any]) -> str:
    by = versus.get("target_by_figure")
    if not by:
        return ""
    return " (" + ", ".join(f"{name} {by[key]}" for key, (_, name) in _FIGURES.items()) + ")"


def _signed(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def _shares(share: dict[str, float]) -> str:
    router = "-"
    if "router total" in share:
        router = f"{share['router']:.0%} / {share['router total']:.0%}"
    return (f"{router}, {share['sim']:.0%}, {share['load generator']:.0%},"
            f" {share['redis']:.0%}, {share['other processes']:.0%}")


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _markdown(results: dict[str, Any]) -> str:
    lines = [
        "| target | streams | rounds | errors | peak live | TTFT P50 / P99 ms |"
        " TTFT mean ms (the sim's engine + outside it) |"
        " added P50 / P99 ms | response head P50 ms | router's own time per stream, mean / P99 ms |"
        " router CPU µs/chunk | Redis CPU µs/chunk |"
        " Redis reads / stream (EVALSHA, EVAL) | RSS MB/1k live (router, Redis) | held |"
        " CPU of a core: router (busiest / all), sim, load gen, Redis, others | limit | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results["targets"].items():
        for level, r in rows.items():
            lines.append(
                f"| {name} | {level} | {r.get('rounds', 1)} | {r['errors']} | {r['peak_live']} |"
                f" {_fmt(r['p50_ttft_ms'])} / {_fmt(r['p99_ttft_ms'])} |"
                f" {_fmt(r['mean_ttft_ms'])} ({_fmt(r['sim_ttft_mean_ms'])} +"
                f" {_fmt(r['outside_sim_mean_ms'])}) |"
                f" {_fmt(r.get('added_p50_ttft_ms'))} / {_fmt(r.get('added_p99_ttft_ms'))} |"
                f" {_fmt(r['p50_head_ms'])} |"
                f" {_fmt(r['router_start_mean_ms'], 2)} / {_fmt(r['router_start_p99_ms'], 2)} |"
                f" {_fmt(r['router_cpu_us_per_chunk'])} | {_fmt(r['redis_cpu_us_per_chunk'])} |"
                f" {_fmt(r.get('redis_reads_per_stream'), 2)}"
                f" ({_fmt(r.get('redis_evalsha_per_stream'), 2)},"
                f" {_fmt(r.get('redis_eval_per_stream'), 2)}) |"
                f" {_fmt(r['router_rss_mb_per_1000_live'])},"
                f" {_fmt(r['redis_rss_mb_per_1000_live'])}"
                f" | {r.get('held', '-')} | {_shares(r['cpu_share'])} | {r['limit']} |"
                f" {r['load_avg_1m']:.1f} |"
            )
    lines.append("")
    lines.append(
        f"Held (0 errors, added TTFT P99 <= {ADDED_P99_LIMIT_MS:g} ms): {results['held_streams']};"
        f" scaling (2 workers / 1, held streams): {results['scaling_held']}"
        f"{' (' + results['scaling_note'] + ')' if 'scaling_note' in results else ''};"
        f" router chunks per CPU-second at the top level: {results['chunks_per_router_cpu_s']};"
        f" Redis's cost to the router, µs per chunk: {results['redis_cost_us_per_chunk']}."
        f" Redis vs memory (1 worker; medians over the rounds of Redis against the mean of its"
        f" round's two memory phases: TTFT P50 / P99 ms"
        f" (mean, mean outside the sim's engine), router CPU per chunk, the router's own time"
        f" per stream mean / P99 ms, time to the response head P50 ms; A/A: the memory router"
        f" again; each round's P50 delta in brackets): " + "; ".join(
            f"{level}: {_signed(v['added_p50_ttft_ms'])} / {_signed(v['added_p99_ttft_ms'])}"
            f" ({_signed(v['added_mean_ttft_ms'])}, {_signed(v['added_outside_sim_mean_ms'])}),"
            f" {_ratio(v['cpu_ratio'])}, {_signed(v['added_start_mean_ms'], 2)} /"
            f" {_signed(v['added_start_p99_ms'], 2)}, {_signed(v['added_p50_head_ms'])}"
            f" {v['p50_ttft_deltas_ms']}"
            f" (A/A {_signed(v['aa_p50_ttft_ms'])} / {_signed(v['aa_p99_ttft_ms'])}"
            f" ({_signed(v['aa_mean_ttft_ms'])}, {_signed(v['aa_outside_sim_mean_ms'])}),"
            f" {_ratio(v['aa_cpu_ratio'])}, {_signed(v['aa_start_mean_ms'], 2)} /"
            f" {_signed(v['aa_start_p99_ms'], 2)}, {_signed(v['aa_p50_head_ms'])}"
            f" {v['aa_p50_ttft_deltas_ms']}) {v['target']}{_by_figure(v)}"
            for level, v in results["redis_vs_memory"].items()
        ) + "."
        f" Load average (1, 5, 15 min) at the start: {results['load_avg_at_start']}, at the end:"
        f" {results['load_avg_at_end']} on {results['cpus']} CPUs."
    )
    return "\n".join(lines)
