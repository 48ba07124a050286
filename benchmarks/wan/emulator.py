"""The WAN emulator's public API: emulated hosts, the links between them, processes inside them.

```python
async with Emulator(
    hosts=[Host("client-tokyo", "192.0.2.10"), Host("region-us", "198.51.100.10")],
    rtt_ms={("client-tokyo", "region-us"): 150.0},
    loss_pct=0.0, jitter_ms=0.0, rate_mbit=None,
) as wan:
    server = await wan.spawn("region-us", [sys.executable, "-m", "...server..."])
    result = await wan.run("client-tokyo", [sys.executable, "-c", "..."])
    report = wan.precision()      # configured vs measured RTT per pair, for the run's report
```

Each host is a network namespace with one address; a packet from A to B is delayed by
``rtt_ms[(A, B)] / 2`` each way (the pair is unordered; pairs not given get ``default_rtt_ms``),
plus optional jitter (one way, uniform in +-``jitter_ms``, never reordering), loss (``loss_pct``
per direction, seeded) and a rate limit (``rate_mbit`` per direction of each pair; the pairs
do not share bandwidth). ``links`` overrides single directions with full
:class:`~firstbyte.benchmarks.wan.delayline.LinkParams`. A synchronous ``with Emulator(...)`` works
too.

Processes spawned in a host are killed on exit, with everything else inside its namespace.
Needs root and ``/dev/net/tun`` (:class:`~firstbyte.benchmarks.wan.netns.WanUnavailable` otherwise).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import subprocess
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Literal

from firstbyte.benchmarks.stats import percentile
from firstbyte.benchmarks.wan.delayline import NS_PER_MS, LinkParams
from firstbyte.benchmarks.wan.netns import Network, WanError, python_env, validate_hosts

PARALLEL_PROBES = 4


@dataclass(frozen=True)
class Host:
    """An emulated host: a namespace with one IPv4 address in a documentation prefix."""

    name: str
    ip: str
    congestion_control: str | None = None
    """Its TCP congestion control (e.g. :data:`CLIENT_CONGESTION_CONTROL`); None: this
    machine's default."""


CLIENT_CONGESTION_CONTROL = "cubic"
"""What an emulated client host runs: CUBIC is the default of Windows, macOS, iOS, Android and
Linux, so it is what users' devices send requests with, whatever this machine's default is
(BBR paces a request body out over tens of milliseconds where CUBIC sends its first window at
once)."""


@dataclass(frozen=True)
class RunResult:
    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class PairPrecision:
    """Configured vs measured round trip between two hosts.

    ``error_ms`` = median - configured: what a benchmark run through the emulator saw, host
    included. ``floor_error_ms`` = fastest - configured: what the emulator itself adds. A
    busy host only ever delays a packet, so the floor is the emulator's systematic error
    (a delay applied twice, timers rounded up, a packet released early) even on an hour
    when other processes push the median up by milliseconds."""

    src: str
    dst: str
    method: str  # "udp" (echo datagram), "tcp-connect" (SYN to SYN-ACK), "tcp-request"
    configured_rtt_ms: float
    samples: int
    lost: int
    median_ms: float
    p90_ms: float
    error_ms: float
    min_ms: float
    floor_error_ms: float


@dataclass(frozen=True)
class PrecisionReport:
    """The emulator's precision in one run; ``max_abs_error_ms`` over all pairs and methods."""

    pairs: list[PairPrecision]
    forwarder: dict[str, Any]

    @property
    def max_abs_error_ms(self) -> float:
        return max((abs(p.error_ms) for p in self.pairs), default=0.0)

    @property
    def max_abs_floor_error_ms(self) -> float:
        """The emulator's own error: the fastest round trip's, worst over pairs and methods."""
        return max((abs(p.floor_error_ms) for p in self.pairs), default=0.0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pairs": [asdict(p) for p in self.pairs],
            "max_abs_error_ms": self.max_abs_error_ms,
            "max_abs_floor_error_ms": self.max_abs_floor_error_ms,
            "forwarder": self.forwarder,
        }

    def render(self) -> str:
        lines = [
            f"{'pair':<40} {'method':<11} {'configured':>10} {'min':>9} {'median':>9} {'p90':>9} "
            f"{'error':>8} {'n':>4} {'lost':>4}"
        ]
        for p in self.pairs:
            lines.append(
                f"{p.src + ' -> ' + p.dst:<40} {p.method:<11} {p.configured_rtt_ms:>8.2f}ms "
                f"{p.min_ms:>7.2f}ms {p.median_ms:>7.2f}ms {p.p90_ms:>7.2f}ms "
                f"{p.error_ms:>+6.2f}ms {p.samples:>4} {p.lost:>4}"
            )
        late = self.forwarder.get("lateness_us", {})
        if late:
            lines.append(
                f"forwarder release lateness: p50 {late['p50']:.0f} us, p99 {late['p99']:.0f} us, "
                f"max {late['max']:.0f} us over {late['samples']} packets"
            )
        return "\n".join(lines)


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


class Emulator:
    """An emulated WAN between :class:`Host` s; see the module docstring for the model."""

    def __init__(
        self,
        hosts: Sequence[Host],
        rtt_ms: dict[tuple[str, str], float] | None = None,
        *,
        default_rtt_ms: float = 0.0,
        loss_pct: float = 0.0,
        jitter_ms: float = 0.0,
        rate_mbit: float | None = None,
        links: dict[tuple[str, str], LinkParams] | None = None,
        seed: int = 0,
    ) -> None:
        self.hosts = list(hosts)
        validate_hosts([(h.name, h.ip) for h in self.hosts])  # early: no root needed to fail
        names = [h.name for h in self.hosts]
        self._rtt: dict[tuple[str, str], float] = {}
        for (a, b), rtt in (rtt_ms or {}).items():
            if a not in names or b not in names:
                raise ValueError(f"rtt_ms names a pair {a!r}, {b!r} that is not among {names}")
            if rtt < 0:
                raise ValueError(f"rtt_ms[{a!r}, {b!r}] must be >= 0, got {rtt}")
            self._rtt[_pair(a, b)] = float(rtt)
        self.default_rtt_ms = default_rtt_ms
        self.link_params: dict[tuple[str, str], LinkParams] = {}
        for a, b in itertools.permutations(names, 2):
            self.link_params[(a, b)] = LinkParams(
                delay_ns=round(self._rtt.get(_pair(a, b), default_rtt_ms) * NS_PER_MS / 2),
                jitter_ns=round(jitter_ms * NS_PER_MS),
                loss_pct=loss_pct,
                rate_bps=None if rate_mbit is None else rate_mbit * 1e6,
            )
        for key, params in (links or {}).items():
            if key not in self.link_params:
                raise ValueError(f"links names {key}, which is not a pair of distinct hosts")
            self.link_params[key] = params
        self.seed = seed
        self._net: Network | None = None
        self._procs: list[asyncio.subprocess.Process | subprocess.Popen[Any]] = []
        self._echo_ports: dict[tuple[str, str], int] = {}

    # -- configuration -------------------------------------------------------------------

    def configured_rtt_ms(self, a: str, b: str) -> float:
        """The round trip configured between ``a`` and ``b`` (without jitter or queueing)."""
        return (self.link_params[(a, b)].delay_ns + self.link_params[(b, a)].delay_ns) / 1e6

    def ip(self, host: str) -> str:
        for h in self.hosts:
            if h.name == host:
                return h.ip
        raise KeyError(f"no host {host!r}")

    @property
    def network(self) -> Network:
        if self._net is None:
            raise WanError("the emulator is not running; use `with Emulator(...)` or start()")
        return self._net

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> Emulator:
        """Create the namespaces and start forwarding (blocking; a few tens of ms per host)."""
        if self._net is None:
            self._net = Network.start(
                [(h.name, h.ip) for h in self.hosts], self.link_params, seed=self.seed,
                congestion={
                    h.name: h.congestion_control for h in self.hosts if h.congestion_control
                },
            )
            atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Kill every process in the hosts, stop forwarding, delete the namespaces (idempotent)."""
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        self._procs.clear()
        self._echo_ports.clear()
        if self._net is not None:
            self._net.stop()
            self._net = None
            atexit.unregister(self.stop)

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Emulator:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Reap our asyncio children in this loop before the namespaces go away.
        procs = [p for p in self._procs if isinstance(p, asyncio.subprocess.Process)]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        for proc in procs:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5.0)
        await asyncio.to_thread(self.stop)

    # -- processes -----------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside ``host`` (for callers using subprocess)."""
        return [*self.network.exec_prefix(host), *argv]

    async def spawn(
        self, host: str, argv: Sequence[str], **kwargs: Any
    ) -> asyncio.subprocess.Process:
        """Start ``argv`` inside ``host`` (kwargs go to ``asyncio.create_subprocess_exec``);
        it is killed when the emulator stops."""
        proc = await asyncio.create_subprocess_exec(*self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    async def run(
        self,
        host: str,
        argv: Sequence[str],
        *,
        time_limit_s: float = 60.0,
        input: bytes | None = None,
    ) -> RunResult:
        """Run ``argv`` inside ``host`` to completion and collect its output; killed (and
        :class:`TimeoutError` raised) after ``time_limit_s`` seconds."""
        proc = await self.spawn(
            host,
            argv,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(input), time_limit_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise TimeoutError(f"{argv[0]} in {host} did not finish in {time_limit_s} s") from None
        finally:
            self._procs.remove(proc)
        return RunResult(proc.returncode or 0, out.decode(), err.decode())

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Synchronous :meth:`spawn`: ``subprocess.Popen`` inside ``host``."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run_sync(self, host: str, argv: Sequence[str], *, time_limit_s: float = 60.0) -> RunResult:
        """Synchronous :meth:`run`."""
        proc = subprocess.run(
            self.command(host, argv), capture_output=True, text=True, timeout=time_limit_s
        )
        return RunResult(proc.returncode, proc.stdout, proc.stderr)

    def stats(self) -> dict[str, Any]:
        """The forwarder's packet counters and release lateness (microseconds)."""
        return self.network.stats()

    # -- precision -----------------------------------------------------------------------

    def echo_port(self, host: str, proto: Literal["udp", "tcp"]) -> int:
        """The port of an echo server (started on first use) inside ``host``."""
        key = (host, proto)
        if key not in self._echo_ports:
            argv = [
                sys.executable,
                "-m",
                "firstbyte.benchmarks.wan.echo",
                "serve",
                "--proto",
                proto,
                "--bind",
                self.ip(host),
            ]
            proc = self.popen(host, argv, stdout=subprocess.PIPE, text=True, env=python_env())
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise WanError(f"the {proto} echo server in {host} did not start")
            self._echo_ports[key] = int(json.loads(line)["port"])
        return self._echo_ports[key]

    def probe(
        self, src: str, dst: str, method: Literal["udp", "tcp"], count: int
    ) -> list[PairPrecision]:
        """Measure ``count`` round trips from ``src`` to ``dst`` through the emulator: one
        result for ``udp`` (echo), two for ``tcp`` (``tcp-connect``: SYN to SYN-ACK, and
        ``tcp-request``: one line and its echo on the open connection)."""
        port = self.echo_port(dst, method)
        configured = self.configured_rtt_ms(src, dst)
        if method == "udp":
            # Pace pings so that a few are in flight at once but the link is never busy.
            interval = max(5.0, min(50.0, configured / 4))
            # A reply this late is lost (loss tests would otherwise wait 5 s for each run).
            give_up = 1.0 + 4 * configured / 1000 + 2 * self.link_params[(src, dst)].jitter_ns / 1e9
            args = ["udp-ping", "--interval-ms", f"{interval:g}", "--timeout", f"{give_up:g}"]
        else:
            args = ["tcp-probe"]
        argv = [sys.executable, "-m", "firstbyte.benchmarks.wan.echo", *args, "--to", self.ip(dst)]
        argv += ["--port", str(port), "--count", str(count)]
        proc = subprocess.run(
            self.command(src, argv),
            capture_output=True,
            text=True,
            timeout=60 + count * configured / 100,
            env=python_env(),
        )
        if proc.returncode != 0:
            raise WanError(f"probe {src} -> {dst} ({method}) failed: {proc.stderr.strip()}")
        data = json.loads(proc.stdout)
        series = (
            {"udp": data["rtt_ms"]}
            if method == "udp"
            else {"tcp-connect": data["connect_ms"], "tcp-request": data["request_ms"]}
        )
        out = []
        for name, samples in series.items():
            median = percentile(samples, 50) if samples else float("nan")
            fastest = min(samples) if samples else float("nan")
            out.append(
                PairPrecision(
                    src=src,
                    dst=dst,
                    method=name,
                    configured_rtt_ms=configured,
                    samples=len(samples),
                    lost=int(data.get("lost", 0)),
                    median_ms=median,
                    p90_ms=percentile(samples, 90) if samples else float("nan"),
                    error_ms=median - configured,
                    min_ms=fastest,
                    floor_error_ms=fastest - configured,
                )
            )
        return out

    def precision(
        self,
        pairs: Iterable[tuple[str, str]] | None = None,
        *,
        count: int = 20,
        methods: Sequence[Literal["udp", "tcp"]] = ("udp",),
    ) -> PrecisionReport:
        """Configured vs measured RTT for ``pairs`` (default: every pair of hosts), by UDP echo
        and/or TCP connect, plus the forwarder's release lateness. Blocking; include the
        result in every benchmark report."""
        if pairs is None:
            pairs = list(itertools.combinations([h.name for h in self.hosts], 2))
        jobs: list[tuple[str, str, Literal["udp", "tcp"]]] = [
            (a, b, m) for a, b in pairs for m in methods
        ]
        for _, b, m in jobs:
            self.echo_port(b, m)  # start the servers one by one, before probing in parallel
        # A few pairs at once: probes mostly wait on the delay, so a large profile's report
        # takes seconds rather than minutes, without loading the machine's two CPUs.
        with ThreadPoolExecutor(max_workers=PARALLEL_PROBES) as pool:
            per_job = list(pool.map(lambda job: self.probe(job[0], job[1], job[2], count), jobs))
        return PrecisionReport([r for results in per_job for r in results], self.stats())

    async def aprecision(
        self,
        pairs: Iterable[tuple[str, str]] | None = None,
        *,
        count: int = 20,
        methods: Sequence[Literal["udp", "tcp"]] = ("udp",),
    ) -> PrecisionReport:
        """:meth:`precision` without blocking the event loop."""
        return await asyncio.to_thread(self.precision, pairs, count=count, methods=methods)
