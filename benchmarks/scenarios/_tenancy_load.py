"""The load of ``bench tenancy``: a minimal HTTP/1.1 client (one connection per stream, as an
app backend or a NAT'd crowd opens them) that records, per stream, whose it was, its answer
and when it held a backend slot, so a phase can say who was served what share of the region.

Everything here runs on one asyncio loop in the benchmark's process; every request is bounded
in time (``STREAM_TIMEOUT_S``), every loop in count or time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Outcome",
    "Tally",
    "closed_loop",
    "max_min_fair",
    "percentile",
    "resume",
    "served_concurrency",
    "stream_once",
]

STREAM_TIMEOUT_S = 60.0
"""No single stream of a phase may take longer (a hung stream counts as an error)."""
_CODE = re.compile(rb'"code":\s*"([A-Za-z_]+)"')
_RETRY_AFTER = re.compile(rb"\r\nretry-after:\s*(\d+)", re.I)
_STREAM_ID = re.compile(rb"\r\nx-firstbyte-stream:\s*(\S+)", re.I)


@dataclass(slots=True)
class Outcome:
    """One request: who sent it, what came back, and when it held a slot (its answer's head
    to its end, on the loop's monotonic clock)."""

    flow: str
    started_at: float = 0.0
    status: int | None = None
    code: str | None = None
    error: str | None = None
    ttft_ms: float | None = None
    admitted_at: float | None = None
    ended_at: float | None = None
    retry_after_s: float | None = None
    stream_id: str | None = None
    tokens: int = 0
    """Content chunks read (the role chunk not counted)."""

    @property
    def served(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def refused(self) -> bool:
        return self.status is not None and self.status in (429, 503)


@dataclass
class Tally:
    """Every outcome of a phase, and the number of streams open right now (peak kept)."""

    outcomes: list[Outcome] = field(default_factory=list)
    live: int = 0
    peak_live: int = 0

    def by_flow(self) -> dict[str, list[Outcome]]:
        flows: dict[str, list[Outcome]] = {}
        for outcome in self.outcomes:
            flows.setdefault(outcome.flow, []).append(outcome)
        return flows

    def summary(self, outcomes: Sequence[Outcome] | None = None) -> dict[str, object]:
        """Counts by answer, TTFT percentiles of the served ones."""
        chosen = self.outcomes if outcomes is None else outcomes
        refusals = Counter(f"{o.status} {o.code or ''}".strip() for o in chosen if o.refused)
        errors = Counter(o.error or f"{o.status} {o.code or ''}".strip()
                         for o in chosen if not o.served and not o.refused)
        ttfts = [o.ttft_ms for o in chosen if o.ttft_ms is not None]
        return {
            "requests": len(chosen),
            "served": sum(1 for o in chosen if o.served),
            "refused": sum(refusals.values()),
            "refusals": dict(refusals),
            "errors": sum(errors.values()),
            "error_kinds": dict(errors.most_common(6)),
            "p50_ttft_ms": percentile(ttfts, 0.50),
            "p99_ttft_ms": percentile(ttfts, 0.99),
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``, rounded to 0.1, or None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def _request(path: str, body: bytes, headers: Mapping[str, str]) -> bytes:
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


async def stream_once(port: int, flow: str, body: Mapping[str, object],
                      headers: Mapping[str, str], tally: Tally) -> Outcome:
    """One streamed chat completion over a new connection, read to ``[DONE]``."""
    outcome = Outcome(flow, time.monotonic())
    tally.outcomes.append(outcome)
    try:
        await asyncio.wait_for(
            _stream(port, json.dumps(body).encode(), headers, tally, outcome), STREAM_TIMEOUT_S)
    except TimeoutError:
        outcome.error = f"no [DONE] in {STREAM_TIMEOUT_S:g} s"
    except (OSError, asyncio.IncompleteReadError, RuntimeError) as exc:
        outcome.error = f"{type(exc).__name__}: {str(exc)[:60]}".rstrip(": ")
    finally:
        if outcome.admitted_at is not None and outcome.ended_at is None:
            outcome.ended_at = time.monotonic()
    return outcome


async def _stream(port: int, body: bytes, headers: Mapping[str, str], tally: Tally,
                  outcome: Outcome) -> None:
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    tally.live += 1
    tally.peak_live = max(tally.peak_live, tally.live)
    try:
        writer.write(_request("/v1/chat/completions", body, headers))
        head = await reader.readuntil(b"\r\n\r\n")
        outcome.status = int(head.split(b" ", 2)[1])
        if outcome.status != 200:
            rest = b""
            with contextlib.suppress(TimeoutError, OSError, asyncio.IncompleteReadError):
                rest = await asyncio.wait_for(reader.read(4096), 5)
            found = _CODE.search(rest)
            outcome.code = found.group(1).decode() if found else None
            retry = _RETRY_AFTER.search(head)
            outcome.retry_after_s = float(retry.group(1)) if retry else None
            return
        outcome.admitted_at = time.monotonic()
        sid = _STREAM_ID.search(head)
        outcome.stream_id = sid.group(1).decode() if sid else None
        tail = b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError("closed before [DONE]")
            window = tail + data
            contents = window.count(b'"content":"') - window.count(b'"content":""')
            if contents and outcome.ttft_ms is None:
                outcome.ttft_ms = (time.monotonic() - started) * 1000
            # content chunks only: the role chunk's empty content is not a token
            outcome.tokens += data.count(b'"content":"') - data.count(b'"content":""')
            if b'"error"' in data:
                found = _CODE.search(data)
                raise RuntimeError("error event " + (found.group(1).decode() if found else ""))
            if b"[DONE]" in window:
                outcome.ended_at = time.monotonic()
                return
            tail = data[-16:]
    finally:
        tally.live -= 1
        writer.close()


async def resume(port: int, stream_id: str, headers: Mapping[str, str]) -> int | str:
    """``GET /v1/streams/{id}`` from the start: its status, or ``"done"`` when the whole
    stream was replayed to ``[DONE]``."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET /v1/streams/{stream_id} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     f"connection: close\r\n{extra}\r\n".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            return status
        body = await asyncio.wait_for(reader.read(-1), 30)
        return "done" if b"[DONE]" in body else status
    finally:
        writer.close()


async def closed_loop(port: int, flow: str, make_body: object, headers: Mapping[str, str],
                      tally: Tally, until: float, max_retry_wait_s: float,
                      think_s: float = 0.0) -> None:
    """One client of a flow: a stream after another until ``until`` (monotonic), ``think_s``
    between a served stream and the next (a user reading the answer); after a refusal it waits
    ``Retry-After`` (at most ``max_retry_wait_s``) before asking again."""
    assert callable(make_body)
    n = 0
    while time.monotonic() < until:
        outcome = await stream_once(port, flow, make_body(n), headers, tally)
        n += 1
        if outcome.served and think_s:
            await asyncio.sleep(max(0.0, min(think_s, until - time.monotonic())))
        elif outcome.refused:
            wait = min(outcome.retry_after_s or max_retry_wait_s, max_retry_wait_s)
            await asyncio.sleep(max(0.0, min(wait, until - time.monotonic())))
        elif not outcome.served:
            await asyncio.sleep(0.05)  # an error: do not spin on it


def served_concurrency(outcomes: Sequence[Outcome], start: float, end: float) -> float:
    """Mean number of this flow's streams holding a slot over ``[start, end]``: the time each
    served stream was open, clipped to the window, over the window's length."""
    held = 0.0
    for o in outcomes:
        if o.admitted_at is None or o.ended_at is None:
            continue
        held += max(0.0, min(o.ended_at, end) - max(o.admitted_at, start))
    return held / max(end - start, 1e-9)


def max_min_fair(capacity: float, demands: Mapping[str, float],
                 weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity`` (water-filling): no flow gets more than
    it asks, and what a flow leaves is shared by the others in proportion to their weights."""
    weights = weights or {}
    share = dict.fromkeys(demands, 0.0)
    open_flows = {f for f, d in demands.items() if d > 0}
    left = capacity
    while open_flows and left > 1e-9:
        total_w = sum(weights.get(f, 1.0) for f in open_flows)
        level = left / total_w
        capped = {f for f in open_flows
                  if demands[f] - share[f] <= level * weights.get(f, 1.0) + 1e-9}
        if not capped:
            for f in open_flows:
                share[f] += level * weights.get(f, 1.0)
            break
        for f in capped:
            left -= demands[f] - share[f]
            share[f] = demands[f]
        open_flows -= capped
    return share
