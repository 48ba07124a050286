"""Tenancy: one app's thousands of streams served, a full region shared fairly by key and user.

Every phase starts its own sims and ``firstbyte router`` (plain HTTP/1.1 on loopback, the
default server, limits at their defaults unless the phase names one) in their own processes,
and drives them from this process with a minimal HTTP/1.1 client, one connection per stream
(``_tenancy_load``). The phases, each the question an operator asks:

- ``one_app``: one key from one address ramps to 2,000 concurrent streams (``--quick``: 200)
  on a region with room for 4,096. Target: 0 refusals, 0 errors.
- ``fair_share``: the region at 2x its capacity (40 slots), three keys asking 8 : 8 : 64
  concurrent streams, equal weights; each key's served concurrency against its max-min fair
  share (users of the light keys think 0.3 s between answers, the heavy key is a batch job).
  ``weighted``: three batch keys asking 30 each with weights 1 : 1 : 2 (at 8 : 8 : 64 the
  weighted and the equal shares coincide, so the weights are shown where they decide),
  against 10 : 10 : 20. Target: within 10% of the fair share.
- ``subjects``: one key; 20 end users (``user`` in the request body) stream one after another
  on a region of 100 slots, alone and then beside one end user of the same key holding 500
  streams open. Target: the 20 see 0 refusals and their TTFT P99 within 10% of the run alone.
- ``store``: key A's long outputs fill a small store (4 MiB) while key B's finished streams
  wait to be resumed and B starts a new one every half second. Target: every B stream
  resumable from its first event and none of B's new streams refused.
- ``redis``: ``workers = 2`` sharing state through a real valkey-server: 2,000 streams started
  within one second (``--quick``: 200), then a steady load during which Redis is killed and
  started again. Target: 0 errors in the burst; no 500 and no stream lost that had started.
- ``backend_faults``: two sims under a steady load; one killed with ``kill -9``, and (a second
  run) one stopped with SIGSTOP so it accepts and never answers. Counted: failures before and
  after a first token, and the slowest first token (nothing should wait on the silent backend
  past its first-byte deadline).

A phase's target missed is a row in the report; a refusal where the region had room, an
error
that should never happen (a 500, a stream lost mid-way to a Redis restart, a B stream not
resumable) is a failed check (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from firstbyte.benchmarks.errors import PartFailed
from firstbyte.benchmarks.redis_server import running_redis
from firstbyte.benchmarks.scenarios._soak_procs import (
    FIRSTBYTE,
    Child,
    Sim,
    free_port,
    router_log_findings,
    toml,
)
from firstbyte.benchmarks.scenarios._tenancy_load import (
    Tally,
    closed_loop,
    max_min_fair,
    percentile,
    resume,
    served_concurrency,
    stream_once,
)

__all__ = ["add_arguments", "run"]

PHASES = ("one_app", "fair_share", "weighted", "subjects", "store", "redis", "backend_faults")
FAIR_TOLERANCE = 0.10
"""A key's served share counts as fair within this fraction of its max-min fair share."""
THINK_S = 0.3
"""A light key's user reads this long between an answer and the next question."""
HEAVY_RETRY_S = 0.1
"""The heavy key's clients (a batch job) ask again this soon after a refusal."""
KEYS = {name: f"sk-tenancy-{name}-0123456789" for name in ("a", "b", "c")}
MODEL = "sim-llama-7b"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--phases", default=",".join(PHASES), metavar="LIST",
        help=f"comma-separated phases to run (default: all: {','.join(PHASES)})",
    )


def run(quick: bool, phases: str = ",".join(PHASES)) -> dict[str, Any]:
    chosen = [p.strip() for p in phases.split(",") if p.strip()]
    unknown = sorted(set(chosen) - set(PHASES))
    if unknown:
        raise ValueError(
            f"--phases: unknown phase {', '.join(unknown)}; known: {', '.join(PHASES)}")
    results: dict[str, Any] = {"scenario": "tenancy", "quick": quick, "phases": {},
                               "failed_checks": [], "runs": []}
    with tempfile.TemporaryDirectory(prefix="firstbyte-tenancy-") as tmp:
        for name in chosen:
            print(f"tenancy: {name} ...", file=sys.stderr, flush=True)
            phase_dir = Path(tmp) / name
            phase_dir.mkdir()
            row = asyncio.run(_PHASE_RUNNERS[name](phase_dir, quick))
            results["phases"][name] = row
            results["failed_checks"] += [f"{name}: {c}" for c in row.pop("failed_checks", [])]
            print(f"tenancy: {name}: {row.get('verdict')}", file=sys.stderr, flush=True)
    _summarise(results)
    return results


# --- processes ---------------------------------------------------------------------------


def _keys_table(weights: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The ``[auth]`` section: every benchmark key, with a weight where the phase gives one."""
    if not weights:
        return {"api_keys": list(KEYS.values())}
    return {"keys": [{"key": KEYS[name], "weight": weights.get(name, 1.0)} for name in KEYS]}


def _router_config(tmp: Path, port: int, upstreams: Sequence[Mapping[str, Any]],
                   auth: Mapping[str, Any], **sections: Mapping[str, Any]) -> Path:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port, "insecure_plain_http": True,
                   **sections.pop("listen", {})},
        "auth": dict(auth),
        **{name: dict(values) for name, values in sections.items()},
    }
    # Arrays of tables inside a section (``[[auth.keys]]``) and ``[[upstreams]]`` go last:
    # the tables above them must not fall into their last entry.
    nested = {f"{name}.{key}": config[name].pop(key) for name in list(config)
              for key, value in list(config[name].items())
              if isinstance(value, list) and value and all(isinstance(v, dict) for v in value)}
    text = toml(config) + toml(nested) + toml({"upstreams": list(upstreams)})
    path = tmp / "router.toml"
    path.write_text(text)
    return path


@contextlib.asynccontextmanager
async def _router(config: Path, port: int, log: Path, workers: int = 1) -> AsyncIterator[Child]:
    """The router, yielded once ``/healthz`` answers 200 (and, with workers, once each has
    started); stopped with SIGTERM at the end."""
    child = Child("router", [*FIRSTBYTE, "router", "--config", str(config)], log)
    try:
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(timeout=2) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    ok = (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code == 200
                    serving = _text(log).count(" serving http://")
                    if ok and serving >= workers:
                        break
                if child.proc.poll() is not None or time.monotonic() > deadline:
                    raise PartFailed("router did not become healthy", _text(log))
                await asyncio.sleep(0.1)
        yield child
    finally:
        child.stop()


def _text(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


@contextlib.asynccontextmanager
async def _sims(tmp: Path, n: int, args: Sequence[str]) -> AsyncIterator[list[Sim]]:
    sims = [Sim(f"sim{i}", [*args, "--served-model-name", MODEL], tmp) for i in range(n)]
    try:
        for sim in sims:
            await sim.start()
        yield sims
    finally:
        for sim in sims:
            if sim.child is not None and sim.child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(sim.child.pid, signal.SIGCONT)
            sim.stop()


def _body(n: int, max_tokens: int, user: str | None = None, tag: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL, "stream": True, "max_tokens": max_tokens, "seed": n,
        "messages": [{"role": "user", "content": f"Tell me about tenancy {tag} {n}."}],
    }
    if user is not None:
        body["user"] = user
    return body


def _auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def _log_findings(log: Path) -> dict[str, Any]:
    found = router_log_findings(log, limit=4)
    return {"tracebacks": found["tracebacks"], "error_lines": found["error_lines"],
            "examples": found["examples"]}


# --- phases ------------------------------------------------------------------------------


async def _one_app(tmp: Path, quick: bool) -> dict[str, Any]:
    n = 200 if quick else 2000
    ramp_s, max_tokens = (1.0, 60) if quick else (3.0, 300)
    port = free_port()
    async with _sims(tmp, 1, ["--max-num-seqs", "4096", "--queue-limit", "8192"]) as sims:
        config = _router_config(tmp, port, [{"url": sims[0].url, "max_in_flight": 4096}],
                                {"api_keys": [KEYS["a"]]})
        async with _router(config, port, tmp / "router.log"):
            tally = Tally()
            tasks = []
            for i in range(n):
                tasks.append(asyncio.ensure_future(
                    stream_once(port, "a", _body(i, max_tokens, tag="one-app"), _auth("a"),
                                tally)))
                await asyncio.sleep(ramp_s / n)
            await asyncio.gather(*tasks)
    summary = tally.summary()
    checks = []
    if summary["refused"] or summary["errors"]:
        checks.append(f"{summary['refused']} refused and {summary['errors']} errors of {n}"
                      f" streams from one key and one address on a region with room:"
                      f" {summary['refusals']} {summary['error_kinds']}")
    return {"streams": n, "ramp_s": ramp_s, "peak_live": tally.peak_live, **summary,
            "log": _log_findings(tmp / "router.log"), "failed_checks": checks,
            "verdict": "met" if not checks else "missed"}


async def _shares(tmp: Path, quick: bool, clients: Mapping[str, int],
                  weights: Mapping[str, float] | None) -> dict[str, Any]:
    """The region (40 slots) asked for more than it has: the light keys' users think
    ``THINK_S`` between answers, the clients of the key asking most (every key, when they ask
    alike) ask again at once and retry a refusal after ``HEAVY_RETRY_S`` (a batch job).
    Each key's served concurrency is set against its weighted max-min fair share of what the
    region served, a key's demand being what it would hold if never refused (clients x
    stream time / (stream time + think time))."""
    capacity = 40
    duration, warmup = (8.0, 2.0) if quick else (30.0, 5.0)
    port = free_port()
    sim_args = ["--max-num-seqs", str(capacity), "--queue-limit", "4096"]
    # The key asking most is a batch job (no think time); with equal asks, all are.
    think = {key: (0.0 if count == max(clients.values()) else THINK_S)
             for key, count in clients.items()}
    async with _sims(tmp, 1, sim_args) as sims:
        config = _router_config(tmp, port, [{"url": sims[0].url, "max_in_flight": capacity}],
                                _keys_table(weights), routing={"backend_max_waiting": 0})
        async with _router(config, port, tmp / "router.log"):
            tally = Tally()
            started = time.monotonic()
            until = started + duration
            loops = [
                closed_loop(port, key, _maker(key, 40), _auth(key), tally, until,
                            HEAVY_RETRY_S if not think[key] else 1.0, think[key])
                for key, count in clients.items() for _ in range(count)
            ]
            await asyncio.gather(*loops)
    window = (started + warmup, until)
    flows = tally.by_flow()
    served = {key: served_concurrency(flows.get(key, []), *window) for key in clients}
    total = sum(served.values())
    demands = {}
    for key, count in clients.items():
        held = [o.ended_at - o.admitted_at for o in flows.get(key, [])
                if o.admitted_at is not None and o.ended_at is not None]
        stream_s = sum(held) / len(held) if held else 0.0
        duty = stream_s / (stream_s + think[key]) if stream_s else 1.0
        demands[key] = count * duty
    fair = max_min_fair(total, demands, weights)
    rows = {}
    worst = 0.0
    for key in clients:
        deviation = abs(served[key] - fair[key]) / fair[key] if fair[key] else 0.0
        worst = max(worst, deviation)
        rows[key] = {
            "clients": clients[key], "think_s": think[key], "demand": round(demands[key], 2),
            "weight": (weights or {}).get(key, 1.0),
            "served_concurrency": round(served[key], 2), "fair_concurrency": round(fair[key], 2),
            "served_share": round(served[key] / total, 3) if total else None,
            "fair_share": round(fair[key] / total, 3) if total else None,
            "deviation": round(deviation, 3),
            **tally.summary(flows.get(key, [])),
        }
    within = worst <= FAIR_TOLERANCE and total > 0
    return {
        "capacity": capacity, "duration_s": duration, "measured_after_s": warmup,
        "served_total_concurrency": round(total, 2), "keys": rows,
        "worst_deviation": round(worst, 3), "log": _log_findings(tmp / "router.log"),
        "verdict": (f"within {FAIR_TOLERANCE:.0%} of max-min fair" if within
                    else f"worst key {worst:.0%} off its fair share"),
    }


def _maker(flow: str, max_tokens: int, user: str | None = None) -> Callable[[int], dict[str, Any]]:
    return lambda n: _body(n, max_tokens, user=user, tag=flow)


async def _fair_share(tmp: Path, quick: bool) -> dict[str, Any]:
    return await _shares(tmp, quick, {"a": 8, "b": 8, "c": 64}, None)


async def _weighted(tmp: Path, quick: bool) -> dict[str, Any]:
    return await _shares(tmp, quick, {"a": 30, "b": 30, "c": 30}, {"a": 1.0, "b": 1.0, "c": 2.0})


async def _subjects(tmp: Path, quick: bool) -> dict[str, Any]:
    capacity, users, abuser_streams = 100, 20, (200 if quick else 500)
    duration, warmup = (6.0, 2.0) if quick else (20.0, 5.0)
    rows: dict[str, Any] = {}
    for label, abuse in (("alone", False), ("beside the abuser", True)):
        port = free_port()
        sim_args = ["--max-num-seqs", str(capacity), "--queue-limit", "4096"]
        run_dir = tmp / label.replace(" ", "_")
        run_dir.mkdir()
        async with _sims(run_dir, 1, sim_args) as sims:
            config = _router_config(run_dir, port,
                                    [{"url": sims[0].url, "max_in_flight": capacity}],
                                    {"api_keys": [KEYS["a"]]}, routing={"backend_max_waiting": 0})
            async with _router(config, port, run_dir / "router.log"):
                tally = Tally()
                started = time.monotonic()
                until = started + duration
                clients = [closed_loop(port, "user", _maker("u", 20, f"user-{i}"), _auth("a"),
                                       tally, until, 1.0) for i in range(users)]
                if abuse:
                    clients += [closed_loop(port, "abuser", _maker("x", 200, "abuser"),
                                            _auth("a"), tally, until, 1.0)
                                for _ in range(abuser_streams)]
                await asyncio.gather(*clients)
        flows = tally.by_flow()
        served_users = flows.get("user", [])
        steady = [o for o in served_users if o.started_at >= started + warmup]
        rows[label] = {"users": tally.summary(served_users),
                       "users_after_warmup": tally.summary(steady),
                       "log": _log_findings(run_dir / "router.log")}
        if abuse:
            rows[label]["abuser"] = tally.summary(flows.get("abuser", []))
    alone, beside = rows["alone"]["users"], rows["beside the abuser"]["users"]
    ratio = None
    if alone["p99_ttft_ms"] and beside["p99_ttft_ms"]:
        ratio = round(beside["p99_ttft_ms"] / alone["p99_ttft_ms"], 3)
    steady_ratio = None
    alone_s, beside_s = (rows["alone"]["users_after_warmup"],
                         rows["beside the abuser"]["users_after_warmup"])
    if alone_s["p99_ttft_ms"] and beside_s["p99_ttft_ms"]:
        steady_ratio = round(beside_s["p99_ttft_ms"] / alone_s["p99_ttft_ms"], 3)
    met = beside["refused"] == 0 and beside["errors"] == 0 and ratio is not None and ratio <= 1.1
    return {"capacity": capacity, "users": users, "abuser_streams": abuser_streams,
            "duration_s": duration, "measured_after_s": warmup, "runs": rows,
            "users_p99_ttft_ratio": ratio, "users_p99_ttft_ratio_after_warmup": steady_ratio,
            "verdict": "met" if met else (
                f"missed: {beside['refused']} refusals, P99 TTFT ratio {ratio}")}


async def _store(tmp: Path, quick: bool) -> dict[str, Any]:
    duration = 6.0 if quick else 20.0
    a_clients, a_tokens = (8, 800) if quick else (16, 1500)
    port = free_port()
    async with _sims(tmp, 1, ["--max-num-seqs", "256", "--profile", "instant"]) as sims:
        config = _router_config(tmp, port, [{"url": sims[0].url}], _keys_table(),
                                streams={"max_total_bytes": 4 << 20})
        async with _router(config, port, tmp / "router.log"):
            tally = Tally()
            finished = [await stream_once(port, "b-finished", _body(i, 20, tag="b"), _auth("b"),
                                          tally) for i in range(8)]
            until = time.monotonic() + duration
            clients = [closed_loop(port, "a", _maker("a", a_tokens), _auth("a"), tally, until,
                                   1.0) for _ in range(a_clients)]
            # B starts a stream every half second: its own history stays well inside its
            # share, so whatever B loses, A's output took from it.
            clients.append(closed_loop(port, "b-new", _maker("b", 20), _auth("b"), tally, until,
                                       1.0, think_s=0.5))
            await asyncio.gather(*clients)
            resumed = [await resume(port, o.stream_id, _auth("b")) if o.stream_id else "no id"
                       for o in finished]
    flows = tally.by_flow()
    b_new = tally.summary(flows.get("b-new", []))
    lost = [r for r in resumed if r != "done"]
    checks = []
    if lost:
        checks.append(f"{len(lost)} of key B's {len(resumed)} finished streams not resumable"
                      f" while key A filled the store: {lost}")
    if b_new["refused"] or b_new["errors"]:
        checks.append(f"key B's new streams: {b_new['refusals']} {b_new['error_kinds']}")
    return {"store_bytes": 4 << 20, "a": tally.summary(flows.get("a", [])), "b_new": b_new,
            "b_resumed": {str(r): resumed.count(r) for r in set(resumed)},
            "log": _log_findings(tmp / "router.log"), "failed_checks": checks,
            "verdict": "met" if not checks else "missed"}


async def _redis(tmp: Path, quick: bool) -> dict[str, Any]:
    burst = 200 if quick else 2000
    steady_clients, steady_s = (20, 6.0) if quick else (100, 15.0)
    port = free_port()
    rows: dict[str, Any] = {}
    checks: list[str] = []
    with running_redis() as first:
        redis_port = first.port
        async with _sims(tmp, 1, ["--max-num-seqs", "4096", "--queue-limit", "8192"]) as sims:
            config = _router_config(
                tmp, port, [{"url": sims[0].url, "max_in_flight": 4096}],
                {"api_keys": [KEYS["a"]]}, listen={"workers": 2},
                state={"redis_url": first.url})
            async with _router(config, port, tmp / "router.log", workers=2):
                tally = Tally()
                tasks = []
                for i in range(burst):
                    tasks.append(asyncio.ensure_future(stream_once(
                        port, "burst", _body(i, 40, tag="burst"), _auth("a"), tally)))
                    await asyncio.sleep(1.0 / burst)
                await asyncio.gather(*tasks)
                rows["burst"] = {"streams": burst, **tally.summary()}
                if rows["burst"]["errors"] or rows["burst"]["refused"]:
                    checks.append(f"burst of {burst} with Redis: {rows['burst']['refusals']}"
                                  f" {rows['burst']['error_kinds']}")
                steady = Tally()
                until = time.monotonic() + steady_s
                clients = [closed_loop(port, "steady", _maker("s", 100), _auth("a"), steady,
                                       until, 1.0) for _ in range(steady_clients)]
                restart = asyncio.ensure_future(_restart_redis(first.pid, redis_port, steady_s))
                try:
                    await asyncio.gather(*clients)
                finally:
                    (await restart).close()
                rows["steady with a Redis restart"] = _restart_row(steady)
                row = rows["steady with a Redis restart"]
                if row["500s"] or row["lost_after_start"]:
                    checks.append(f"Redis restart: {row['500s']} answers 500,"
                                  f" {row['lost_after_start']} streams lost after they started")
            rows["log"] = _log_findings(tmp / "router.log")
    return {**rows, "failed_checks": checks, "verdict": "met" if not checks else "missed"}


def _restart_row(tally: Tally) -> dict[str, Any]:
    summary = tally.summary()
    return {
        **summary,
        "500s": sum(1 for o in tally.outcomes if o.status is not None and o.status >= 500
                    and o.status != 503),
        "lost_after_start": sum(1 for o in tally.outcomes if o.status == 200 and o.error),
        "served_after_restore": sum(1 for o in tally.outcomes[-50:] if o.served),
    }


async def _restart_redis(pid: int, port: int, steady_s: float) -> contextlib.ExitStack:
    """Kill the first server a third of the way in, start another on its port 1 s later
    (returned as the stack that stops it)."""
    await asyncio.sleep(steady_s / 3)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    await asyncio.sleep(1.0)
    stack = contextlib.ExitStack()
    await asyncio.to_thread(stack.enter_context, running_redis(port=port))
    return stack


async def _backend_faults(tmp: Path, quick: bool) -> dict[str, Any]:
    clients, duration = (20, 6.0) if quick else (40, 15.0)
    rows: dict[str, Any] = {}
    for fault in ("kill -9", "SIGSTOP"):
        run_dir = tmp / fault.replace(" ", "").replace("-", "")
        run_dir.mkdir()
        port = free_port()
        async with _sims(run_dir, 2, ["--max-num-seqs", "256"]) as sims:
            config = _router_config(run_dir, port, [{"url": s.url} for s in sims],
                                    {"api_keys": [KEYS["a"]]})
            async with _router(config, port, run_dir / "router.log"):
                tally = Tally()
                until = time.monotonic() + duration
                loops = [closed_loop(port, "a", _maker("f", 80), _auth("a"), tally, until, 1.0)
                         for _ in range(clients)]
                fault_at = duration / 3
                injector = asyncio.ensure_future(_inject(sims[1], fault, fault_at))
                started = time.monotonic()
                await asyncio.gather(*loops)
                await injector
        summary = tally.summary()
        after = [o for o in tally.outcomes if o.admitted_at is not None
                 and o.admitted_at >= started + fault_at]
        rows[fault] = {
            **summary,
            "failed_before_a_token": sum(1 for o in tally.outcomes if not o.served
                                         and not o.refused and o.tokens == 0),
            "failed_after_tokens": sum(1 for o in tally.outcomes if o.error and o.tokens > 0),
            "max_ttft_ms": max((o.ttft_ms for o in tally.outcomes if o.ttft_ms), default=None),
            "p99_ttft_after_fault_ms": percentile(
                [o.ttft_ms for o in after if o.ttft_ms is not None], 0.99),
            "log": _log_findings(run_dir / "router.log"),
        }
    return {"clients": clients, "duration_s": duration, "runs": rows,
            "verdict": ", ".join(f"{k}: {v['failed_before_a_token']} failed before a token,"
                                 f" {v['failed_after_tokens']} after"
                                 for k, v in rows.items())}


async def _inject(sim: Sim, fault: str, at: float) -> None:
    await asyncio.sleep(at)
    assert sim.child is not None
    if fault == "kill -9":
        sim.child.kill()
    else:
        os.kill(sim.child.pid, signal.SIGSTOP)


_PHASE_RUNNERS: dict[str, Callable[[Path, bool], Any]] = {
    "one_app": _one_app,
    "fair_share": _fair_share,
    "weighted": _weighted,
    "subjects": _subjects,
    "store": _store,
    "redis": _redis,
    "backend_faults": _backend_faults,
}


# --- report ------------------------------------------------------------------------------


def _summarise(results: dict[str, Any]) -> None:
    phases = results["phases"]
    summary: dict[str, Any] = {}
    lines = []
    if "one_app" in phases:
        p = phases["one_app"]
        summary["one key, one address: streams refused / errors"] = (
            f"{p['refused']} / {p['errors']} of {p['streams']}")
        lines.append(f"- **one_app**: {p['streams']} streams from one key and one address:"
                     f" {p['served']} served, {p['refused']} refused {p['refusals']},"
                     f" {p['errors']} errors {p['error_kinds']}; TTFT P50/P99"
                     f" {p['p50_ttft_ms']}/{p['p99_ttft_ms']} ms; peak live {p['peak_live']}.")
    for name in ("fair_share", "weighted"):
        if name in phases:
            p = phases[name]
            summary[f"{name}: worst key off its max-min fair share"] = p["worst_deviation"]
            cells = "; ".join(
                f"{k} asks {r['demand']} (weight {r['weight']:g}): served"
                f" {r['served_concurrency']} of fair {r['fair_concurrency']}"
                f" (refused {r['refused']})" for k, r in p["keys"].items())
            lines.append(f"- **{name}** (capacity {p['capacity']}, served in all"
                         f" {p['served_total_concurrency']}): {cells}. {p['verdict']}.")
    if "subjects" in phases:
        p = phases["subjects"]
        summary["subjects: other users' P99 TTFT beside the abuser / alone"] = (
            p["users_p99_ttft_ratio"])
        alone, beside = p["runs"]["alone"]["users"], p["runs"]["beside the abuser"]["users"]
        lines.append(
            f"- **subjects**: {p['users']} users alone: P99 TTFT {alone['p99_ttft_ms']} ms,"
            f" refused {alone['refused']}; beside one user holding {p['abuser_streams']}"
            f" streams: P99 {beside['p99_ttft_ms']} ms, refused {beside['refused']}"
            f" {beside['refusals']}; ratio {p['users_p99_ttft_ratio']}, after the first"
            f" {p['measured_after_s']:g} s {p['users_p99_ttft_ratio_after_warmup']}"
            f" (P50 alone / beside: {alone['p50_ttft_ms']} / {beside['p50_ttft_ms']} ms)."
            f" {p['verdict']}.")
    if "store" in phases:
        p = phases["store"]
        summary["store: B's finished streams resumed"] = p["b_resumed"]
        lines.append(f"- **store**: key B's finished streams on resume: {p['b_resumed']};"
                     f" B's new streams {p['b_new']['served']} served,"
                     f" {p['b_new']['refused']} refused; key A {p['a']['served']} served,"
                     f" {p['a']['refused']} refused {p['a']['refusals']}. {p['verdict']}.")
    if "redis" in phases:
        p = phases["redis"]
        b, s = p["burst"], p["steady with a Redis restart"]
        summary["redis: burst errors"] = b["errors"] + b["refused"]
        summary["redis restart: 500s / lost after start"] = (
            f"{s['500s']} / {s['lost_after_start']}")
        lines.append(
            f"- **redis** (workers = 2): a burst of {b['streams']} in 1 s: {b['served']} served,"
            f" {b['refused']} refused {b['refusals']}, {b['errors']} errors {b['error_kinds']};"
            f" Redis killed and restarted under load: {s['served']} served,"
            f" {s['refused']} refused {s['refusals']}, {s['500s']} answers 500,"
            f" {s['lost_after_start']} lost after they started. {p['verdict']}.")
    if "backend_faults" in phases:
        p = phases["backend_faults"]
        for fault, r in p["runs"].items():
            summary[f"{fault}: failed before a token / after"] = (
                f"{r['failed_before_a_token']} / {r['failed_after_tokens']}")
            lines.append(
                f"- **backend_faults, {fault}**: {r['served']} served; failed before a token"
                f" {r['failed_before_a_token']}, after tokens {r['failed_after_tokens']};"
                f" refused {r['refused']} {r['refusals']}; slowest first token"
                f" {r['max_ttft_ms'] and round(r['max_ttft_ms'])} ms; errors {r['error_kinds']}.")
    results["summary"] = summary
    results["description"] = (
        "Real traffic on one region: one app's thousands of streams, a full region shared by"
        " weighted max-min fairness across keys and across end users inside a key, the store"
        " shared by who fills it, Redis bursts and restarts, dead and silent backends.\n\n"
        + "\n".join(lines))
    results["notes"] = [
        "Clients honour Retry-After (at most 1 s) after a refusal and ask again: the fair-share"
        " phases measure what each key holds, not how often it asks.",
        "Served concurrency is the time each served stream held a slot (answer head to"
        " [DONE]) over the measured window, which starts after the warm-up.",
    ]
