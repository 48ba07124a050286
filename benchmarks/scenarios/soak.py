"""Soak: many keys, good and hostile clients, upstream faults; integrity, canary, memory.

One router (``firstbyte router --config``, TLS, its own process) in front of three sims (their
own processes, the same seed, so every request's output is known in advance). For the whole
run, good clients on eight keys stream through every transport of the firstbyte SDK and through
the official openai SDK; a canary on its own key streams one request after another in its own
process. Faults hit the upstreams: one sim is killed (SIGKILL) and restarted, the others stall,
drop connections mid-stream and answer 503 for a share of requests. Hostile clients come in
timed phases (slowloris heads, held bodies without a key, idle connections, raw TCP connections
that never start TLS, huge request heads, a greedy key, careless requests, HTTP/2 rapid reset,
oversized WebSocket frames, HTTP/3 early answers, idle QUIC connections, a QUIC Initial flood,
a removed key's client tokens), and one more upstream fault has a phase: a sim stopped with
SIGSTOP (a blackholed backend). The router's and sims' RSS and open files are sampled every
0.5 s; the report gives the router's RSS and descriptors and the canary's TTFT per phase.
Redis outages are ``bench tenancy``'s (its redis phase), not the soak's: the soak's router keeps
its state in memory.

The run fails (exit 1, after writing the report) when any key's tokens were lost, repeated or
seen by another key, when another key's stream could be read, or when the canary saw an error
the router made (upstream faults it relayed do not count; the canary retries those).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from firstbyte.benchmarks.progress import Progress
from firstbyte.benchmarks.scenarios._soak_canary import CANARY_KIND
from firstbyte.benchmarks.scenarios._soak_good import KINDS, Tally, good_worker
from firstbyte.benchmarks.scenarios._soak_hostile import ATTACKS, Target
from firstbyte.benchmarks.scenarios._soak_integrity import SIM_SEED, Ledger
from firstbyte.benchmarks.scenarios._soak_procs import (
    Child,
    MemorySampler,
    Sim,
    free_port,
    router_log_findings,
    start_router,
    toml,
)
from firstbyte.benchmarks.stats import percentile

__all__ = ["add_arguments", "run"]

QUICK_DURATION_S = 20.0
DEFAULT_DURATION_S = 150.0
GOOD_KEYS = 8
SIM_PROFILE = "h100-7b"
SIM_FAULTS: tuple[tuple[str, ...], ...] = (
    (),  # sim-0: no injected faults, but killed and restarted during the run
    ("stall:after=6,rate=0.04", "drop:after=8,rate=0.04"),
    ("error503:rate=0.05", "drop:after=3,rate=0.03"),
)
ROUTER_LIMITS = {"upstream_read_timeout_s": 3.0, "heartbeat_interval_s": 1.0}
"""The only router settings changed from the defaults: a stalled upstream becomes an error in
3 s instead of 300, and idle SSE streams get a heartbeat every second (so the clients meet
heartbeats during every stall)."""
KILL_DOWN_S = 1.0
BLACKHOLED_SIM = 2
"""The sim stopped with SIGSTOP in the "blackholed backend" phase (sim-0 is the one killed)."""
CANARY_MODULE = "firstbyte.benchmarks.scenarios._soak_canary"


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start: float
    end: float
    """Fractions of the run's duration."""
    attacks: tuple[str, ...]


PHASES = (
    Phase("connection holders", 0.15, 0.45, ("slowloris", "held_bodies", "idle_connections")),
    Phase("huge heads", 0.15, 0.25, ("huge_heads",)),
    Phase("HTTP/3 early answer", 0.20, 0.30, ("h3_early_answer",)),
    Phase("greedy key", 0.30, 0.55, ("greedy_key",)),
    Phase("blackholed backend", 0.35, 0.45, ("blackholed_backend",)),
    Phase("careless requests", 0.45, 0.70, ("bad_requests",)),
    Phase("pre-TLS holders", 0.50, 0.60, ("pre_tls_holders",)),
    Phase("rapid reset", 0.60, 0.75, ("rapid_reset",)),
    Phase("QUIC idle", 0.62, 0.72, ("quic_idle",)),
    Phase("oversized websocket frames", 0.70, 0.85, ("websocket_oversized",)),
    Phase("revoked tokens", 0.74, 0.80, ("revoked_tokens",)),
    Phase("QUIC Initial flood", 0.80, 0.85, ("quic_flood",)),
)
"""Hostile phases; the first 15 % and the last 15 % of the run have none (baseline, recovery).
The phases that hold connections from 127.0.0.1 (connection holders, pre-TLS holders, QUIC
idle) do not overlap, so that together they stay under ``max_connections_per_client``; the
QUIC flood comes last, as its half-open handshakes hold places of 127.0.0.1 until
``client_header_timeout_s`` (the recovery shows what that costs the good clients)."""
KILLS = (0.25, 0.50, 0.80)
"""When sim-0 is killed (fractions of the run); quick runs kill it once, at half time."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration-s",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help=f"length of the run in seconds (default {DEFAULT_DURATION_S:g}, "
        f"--quick {QUICK_DURATION_S:g}); start-up and teardown add ~10 s",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def run(quick: bool, duration_s: float | None = None) -> dict[str, Any]:
    """Run the soak; results as :mod:`firstbyte.benchmarks.report` takes them, with
    ``failed_checks`` listing what makes the run fail."""
    duration = duration_s if duration_s is not None else (
        QUICK_DURATION_S if quick else DEFAULT_DURATION_S)
    with tempfile.TemporaryDirectory(prefix="firstbyte-soak-") as tmp:
        return asyncio.run(_soak(Path(tmp), duration, scale=1 if quick else 3, quick=quick))


def _certificates(tmp: Path) -> tuple[str, str, str]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    files = tuple(str(tmp / name) for name in ("ca.pem", "cert.pem", "key.pem"))
    ca.cert_pem.write_to_path(files[0])
    cert.private_key_and_cert_chain_pem.write_to_path(files[1])
    cert.private_key_pem.write_to_path(files[2])
    return files  # type: ignore[return-value]


@dataclass(slots=True)
class _World:
    """The router, the sims and the router's config; the fault phases' hooks
    (:class:`~firstbyte.benchmarks.scenarios._soak_target.WorldHooks`)."""

    tmp: Path
    ca_file: str
    port: int
    sims: list[Sim]
    router: Child
    keys: dict[str, str]
    """role (good-00.., canary, hostile, revoked) -> API key"""
    config: dict[str, Any]
    tally: Tally = field(default_factory=Tally)

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def revoked_key(self) -> str:
        return self.keys["revoked"]

    def _blackholed(self) -> Child | None:
        return self.sims[BLACKHOLED_SIM].child

    def stop_upstream(self) -> str:
        child = self._blackholed()
        if child is not None:
            child.proc.send_signal(signal.SIGSTOP)
        return self.sims[BLACKHOLED_SIM].name

    def continue_upstream(self) -> None:
        child = self._blackholed()
        if child is not None and child.proc.poll() is None:
            child.proc.send_signal(signal.SIGCONT)

    def good_failures(self) -> tuple[int, int]:
        return len(self.tally.failed_at), len(self.tally.gave_up_at)

    def good_slowest_first_token_ms(self, since: float) -> float | None:
        return max((ms for t, ms in self.tally.first_tokens if t > since), default=None)

    def remove_key(self) -> None:
        keys = [k for k in self.config["auth"]["api_keys"] if k != self.revoked_key]
        self.config["auth"] = self.config["auth"] | {"api_keys": keys}
        (self.tmp / "router.toml").write_text(toml(self.config))
        self.router.proc.send_signal(signal.SIGHUP)

    def pids(self) -> dict[str, int]:
        found = {"router": self.router.pid}
        found |= {sim.name: sim.child.pid for sim in self.sims if sim.child is not None}
        return found


@contextlib.asynccontextmanager
async def _world(tmp: Path) -> Any:
    ca_file, certfile, keyfile = _certificates(tmp)
    keys = {f"good-{i:02d}": f"sk-soak-good-{i:02d}-{secrets.token_hex(8)}"
            for i in range(GOOD_KEYS)}
    keys |= {role: f"sk-soak-{role}-{secrets.token_hex(8)}"
             for role in ("canary", "hostile", "revoked")}
    sims = [Sim(f"sim-{i}", ["--profile", SIM_PROFILE, "--seed", str(SIM_SEED),
                             *(f"--fault={spec}" for spec in faults)], tmp)
            for i, faults in enumerate(SIM_FAULTS)]
    try:
        for sim in sims:
            await sim.start()
        port = free_port()
        config = {
            "region": "soak",
            "listen": {"host": "127.0.0.1", "port": port, "certfile": certfile,
                       "keyfile": keyfile, "http3": True},
            "auth": {"api_keys": list(keys.values()), "token_secret": secrets.token_hex(32)},
            "limits": ROUTER_LIMITS,
            "upstreams": [{"url": sim.url, "name": sim.name} for sim in sims],
        }
        (tmp / "router.toml").write_text(toml(config))
        router = await start_router(tmp / "router.toml", f"https://127.0.0.1:{port}", ca_file,
                                    tmp / "router.log")
        try:
            yield _World(tmp, ca_file, port, sims, router, keys, config)
        finally:
            router.stop()
    finally:
        for sim in sims:
            sim.stop()


async def _soak(tmp: Path, duration: float, *, scale: int, quick: bool) -> dict[str, Any]:
    async with _world(tmp) as world:
        ledger, tally = Ledger(), world.tally
        stream_ids: list[tuple[str, str]] = []
        sampler = MemorySampler(world.pids)
        started = time.monotonic()
        until = started + duration
        sampling = asyncio.create_task(sampler.run(started))
        canary = Child("canary", [sys.executable, "-m", CANARY_MODULE, world.base_url,
                                  world.keys["canary"], world.ca_file, str(duration)],
                       tmp / "canary.jsonl", stderr=tmp / "canary.log")
        target = Target("127.0.0.1", world.port, world.ca_file, world.keys["hostile"], scale,
                        world, stream_ids)
        hostile: dict[str, Counter[str]] = {}
        kills = KILLS if not quick else (0.5,)
        workers_per_key = 1 if quick else 2
        good = [
            good_worker(KINDS[(i + 3 * w) % len(KINDS)], key, role, world.base_url,
                        world.ca_file, until, ledger, tally, stream_ids,
                        lambda n: 16 + (n * 7) % 48)
            for i, (role, key) in enumerate(
                (r, k) for r, k in world.keys.items() if r.startswith("good-"))
            for w in range(workers_per_key)
        ]
        with Progress(int(duration), "soak") as bar:
            ticking = asyncio.create_task(_tick(bar, duration))
            try:
                await asyncio.gather(
                    *good,
                    *(_phase(phase, target, started, duration, hostile) for phase in PHASES),
                    *(_kill_at(world.sims[0], started + f * duration) for f in kills),
                )
                await asyncio.to_thread(canary.proc.wait, 60)
            finally:
                world.continue_upstream()
                ticking.cancel()
                sampling.cancel()
                canary.stop()
        elapsed = time.monotonic() - started
        findings = router_log_findings(tmp / "router.log")
    return _results(
        duration=duration, elapsed=elapsed, quick=quick, scale=scale, ledger=ledger,
        tally=tally, hostile=hostile, sampler=sampler,
        canary=_read_lines(tmp / "canary.jsonl"), findings=findings, kills=len(kills),
        workers=len(good), started=started)


async def _tick(bar: Progress, duration: float) -> None:
    for _ in range(int(duration)):
        await asyncio.sleep(1)
        bar.advance()


async def _phase(phase: Phase, target: Target, started: float, duration: float,
                 found: dict[str, Counter[str]]) -> None:
    await asyncio.sleep(max(0.0, started + phase.start * duration - time.monotonic()))
    end = started + phase.end * duration
    results = await asyncio.gather(*(ATTACKS[name](target, end) for name in phase.attacks))
    for name, counts in zip(phase.attacks, results, strict=True):
        found[name] = counts


async def _kill_at(sim: Sim, when: float) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    await sim.crash(KILL_DOWN_S)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    lines = path.read_bytes().splitlines() if path.exists() else []
    return [msgspec.json.decode(line) for line in lines if line.strip()]


def _canary_windows(lines: Sequence[dict[str, Any]], duration: float,
                    windows: int) -> list[dict[str, Any]]:
    """Canary TTFT and errors per time window, with the phases active in it."""
    width = duration / windows
    rows = []
    for w in range(windows):
        lo, hi = w * width, (w + 1) * width
        inside = [line for line in lines if lo <= line["t"] < hi]
        ttfts = [line["ttft_ms"] for line in inside if line["ttft_ms"] is not None]
        active = [p.name for p in PHASES if p.start * duration < hi and p.end * duration > lo]
        rows.append({
            "label": f"{lo:.0f}-{hi:.0f} s",
            "requests": len(inside),
            "p50_ttft": round(percentile(ttfts, 50), 1) if ttfts else None,
            "p99_ttft": round(percentile(ttfts, 99), 1) if ttfts else None,
            "router_errors": sum(_router_errors(line) for line in inside),
            "upstream_faults": sum(1 for line in inside for e in line["errors"] if e[1]),
            "hostile": ", ".join(active) or "-",
        })
    return rows


def _phase_rows(lines: Sequence[dict[str, Any]], samples: Sequence[tuple[float, float, int]],
                failed_at: Sequence[float], duration: float) -> list[dict[str, Any]]:
    """Per phase (and the quiet baseline and recovery): the router's RSS and open descriptors
    at its start, peak and end, the canary's TTFT and errors, and the good clients' failed
    tries, over the phase's planned window. ``samples`` are the router's ``(t, MB, fds)``;
    ``failed_at`` are seconds since the start.

    Start and end are the last samples at or before the window opens and closes (the state
    then, before a later phase adds to it); the sampler shares a busy event loop, so a window
    of a second may hold no sample of its own and show its start's."""
    first, last = min(p.start for p in PHASES), max(p.end for p in PHASES)
    windows = [("baseline (no hostile phase)", 0.0, first),
               *((p.name, p.start, p.end) for p in PHASES),
               ("recovery (no hostile phase)", last, 1.0)]
    rows = []
    for name, start, end in windows:
        lo, hi = start * duration, end * duration
        inside = _spanning(samples, lo, hi)
        canary = [line for line in lines if lo <= line["t"] < hi]
        ttfts = [line["ttft_ms"] for line in canary if line["ttft_ms"] is not None]
        rows.append({
            "label": name,
            "window": f"{lo:.0f}-{hi:.0f} s",
            "rss_start_mb": round(inside[0][1], 1) if inside else None,
            "rss_peak_mb": round(max(s[1] for s in inside), 1) if inside else None,
            "rss_end_mb": round(inside[-1][1], 1) if inside else None,
            "fds_start": inside[0][2] if inside else None,
            "fds_peak": max(s[2] for s in inside) if inside else None,
            "fds_end": inside[-1][2] if inside else None,
            "canary_n": len(canary),
            "canary_p50_ms": round(percentile(ttfts, 50), 1) if ttfts else None,
            "canary_max_ms": round(max(ttfts), 1) if ttfts else None,
            "canary_router_errors": sum(_router_errors(line) for line in canary),
            "good_failed_tries": sum(1 for t in failed_at if lo <= t < hi),
        })
    return rows


def _spanning(samples: Sequence[tuple[float, float, int]], lo: float,
              hi: float) -> Sequence[tuple[float, float, int]]:
    """The samples from the last at or before ``lo`` to the last at or before ``hi``."""
    first = max((i for i, s in enumerate(samples) if s[0] <= lo), default=0)
    last = max((i for i, s in enumerate(samples) if s[0] <= hi), default=0)
    return samples[first:max(first, last) + 1]


def _router_errors(line: dict[str, Any]) -> int:
    """Errors of one canary request that the router made (not relayed upstream faults); a
    request that never succeeded counts even if every try was an upstream fault."""
    own = sum(1 for _cls, upstream in line["errors"] if not upstream)
    return own + (0 if own or not line["outcome"].startswith(("failed", "violation")) else 1)


def _results(*, duration: float, elapsed: float, quick: bool, scale: int, ledger: Ledger,
             tally: Tally, hostile: dict[str, Counter[str]], sampler: MemorySampler,
             canary: list[dict[str, Any]], findings: dict[str, Any], kills: int,
             workers: int, started: float) -> dict[str, Any]:
    good_rows: list[dict[str, Any]] = []
    for kind in sorted(tally.outcomes):
        outcomes = tally.outcomes[kind]
        good_rows.append({
            "label": kind,
            "requests": sum(outcomes.values()),
            "ok": outcomes["ok"],
            "retried_ok": outcomes["retried_ok"],
            "gave_up": sum(n for o, n in outcomes.items() if o.startswith("failed")),
            "violations": sum(n for o, n in outcomes.items() if o.startswith("violation")),
            "outcomes": dict(outcomes),
            "attempt_errors": dict(tally.attempt_errors.get(kind, {})),
        })
    error_rows = [
        {"label": kind, "class": cls, "count": n}
        for kind, counts in sorted(tally.attempt_errors.items()) for cls, n in counts.most_common()
    ] + [{"label": f"canary ({CANARY_KIND})", "class": cls, "count": n}
         for cls, n in Counter(e[0] for line in canary for e in line["errors"]).most_common()]
    hostile_rows = [{"label": name, "class": cls, "count": n}
                    for name, counts in hostile.items() for cls, n in sorted(counts.items())]
    leaks = sum(n for counts in hostile.values() for cls, n in counts.items() if "LEAK" in cls)
    memory = sampler.summary()
    router = next((row for row in memory if row["label"] == "router"), {})
    ttfts = [line["ttft_ms"] for line in canary if line["ttft_ms"] is not None]
    canary_errors = sum(_router_errors(line) for line in canary)
    checks = []
    if ledger.violations:
        checks.append(f"integrity: {ledger.violations} streams with lost, repeated, foreign or "
                      f"corrupt tokens ({'; '.join(ledger.examples[:3])})")
    if leaks:
        checks.append(f"integrity: another key's stream was readable {leaks} times")
    if canary_errors or not canary:
        checks.append(f"canary: {canary_errors} errors made by the router in "
                      f"{len(canary)} requests")
    summary = {
        "passed": not checks,
        "integrity_violations": ledger.violations + leaks,
        "tokens_lost": ledger.counts["lost"],
        "tokens_repeated": ledger.counts["repeated"],
        "cross_key_streams": ledger.counts["cross_key"] + leaks,
        "corrupt_streams": ledger.counts["corrupt"],
        "streams_judged": sum(ledger.counts.values()),
        "good_requests": sum(row["requests"] for row in good_rows),
        "good_ok": sum(row["ok"] for row in good_rows),
        "good_retried_ok": sum(row["retried_ok"] for row in good_rows),
        "good_gave_up": sum(row["gave_up"] for row in good_rows),
        "canary_requests": len(canary),
        "canary_router_errors": canary_errors,
        "canary_upstream_faults_retried": sum(1 for line in canary for e in line["errors"]
                                              if e[1]),
        "canary_p50_ttft_ms": percentile(ttfts, 50),
        "canary_p99_ttft_ms": percentile(ttfts, 99),
        "router_rss_first_mb": router.get("rss_first_mb"),
        "router_rss_max_mb": router.get("rss_max_mb"),
        "router_rss_final_mb": router.get("rss_final_mb"),
        "router_rss_growth_mb": router.get("rss_growth_mb"),
        "router_fds_max": router.get("fds_max"),
        "router_tracebacks": findings["tracebacks"],
        "router_error_log_lines": findings["error_lines"],
        "sim_kills": kills,
        "duration_s": round(elapsed, 1),
    }
    return {
        "scenario": "soak",
        "description": (
            f"{duration:g} s: a router (TLS, own process, default limits except "
            f"{ROUTER_LIMITS}) in front of {len(SIM_FAULTS)} sims ({SIM_PROFILE}, own "
            f"processes); {workers} good clients on {GOOD_KEYS} keys ({', '.join(KINDS)}), a "
            f"canary ({CANARY_KIND}, own key, own process), hostile phases "
            f"({'; '.join(p.name for p in PHASES)}) and upstream faults (sim-0 killed "
            f"{kills}x; sim-{BLACKHOLED_SIM} stopped (SIGSTOP) in its phase; "
            f"{'; '.join(' '.join(f) for f in SIM_FAULTS if f)})."
        ),
        "summary": summary,
        "failed_checks": checks,
        "runs": good_rows,
        "phases": _phase_rows(canary, sampler.samples.get("router", []),
                              [t - started for t in tally.failed_at], duration),
        "canary": _canary_windows(canary, duration, 8 if quick else 15),
        "memory": memory,
        "errors": error_rows,
        "hostile": hostile_rows,
        "router_log": findings,
        "integrity": dict(ledger.counts) | {"examples": ledger.examples},
        "rss_series": {role: [list(s) for s in samples]
                       for role, samples in sampler.samples.items()},
        "conditions": {
            "duration_s": duration, "scale": scale, "good_keys": GOOD_KEYS,
            "good_workers": workers, "client_kinds": list(KINDS), "sim_profile": SIM_PROFILE,
            "sim_faults": [list(f) for f in SIM_FAULTS], "kills": kills,
            "kill_down_s": KILL_DOWN_S, "router_limits": ROUTER_LIMITS,
            "blackholed_sim": f"sim-{BLACKHOLED_SIM}",
            "phases": [{"name": p.name, "start": p.start, "end": p.end,
                        "attacks": list(p.attacks)} for p in PHASES],
        },
        "notes": [
            "integrity: every stream's text is compared with the sim's deterministic output "
            "for that request; a try that ended in an error may stop short (it is retried), "
            "anything else that differs is a violation",
            "canary_router_errors counts the canary's failed tries that the router made; "
            "upstream faults it relayed (upstream_error, upstream_eof, the sims' injected "
            "503) are retried and counted apart",
            "hostile counts are what the router did to each hostile client (answered status, "
            "closed the connection, or held it until the phase ended)",
            "RSS and open files sampled from /proc every 0.5 s; growth = final - first sample",
            "phases: each phase's planned window (phases overlap; a row counts everything in "
            "its window): the router's RSS and open descriptors at the last sample before the "
            "window opens, the peak, and the last sample before it closes; the canary's TTFT "
            "P50 and max; the good clients' failed tries that ended in it",
            "Redis outages (stop, kill, freeze during a ramp) are bench tenancy's redis phase; "
            "the soak's router keeps its state in memory",
            "all processes share this machine's CPUs: canary TTFT includes that contention",
        ],
    }
