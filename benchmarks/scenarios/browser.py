"""Headless Chromium vs the Python SDK, same cells and geographies: TTFT, paint, round trips.

The world of ``bench transports`` (:mod:`firstbyte.benchmarks.scenarios.transports`: a router
with an ``instant`` sim in us-east-1, clients in namespaces at several distances behind the
WAN emulator), plus a web page on its own origin beside the router (the application: it mints
the page's client token; the router's CORS allows that origin). In each client host the browser
client streams in headless Chromium (:mod:`._browser_runner`: each transport cold — a fresh
browser context per request —, cold with intent prewarm — the same, but the page warms on
the user's focus of the prompt box, who types for 2 s before sending — and warm — a
preconnected page with a kept-alive connection)
and the Python SDK streams the matching cells (:mod:`._client_runner`). Per cell and
geography it reports both side by side: TTFT, the browser's paint time, round trips to the
first byte (measured against the SDK's theory), the CORS preflights Chromium sent, and what the
browser adds. HTTP/3: Chromium forced onto QUIC for the router's origin
(``--origin-to-force-quic-on``), trusting its certificate by key; the report says what Chromium
negotiated.

In the farthest geography it also measures a long conversation's next message where users
are: the region has a second sim, ``h100-7b`` (its own model name; the router routes by
model), and fetch-SSE over HTTP/2 streams from it (:data:`HISTORY_CELLS`, browser only): a
short prompt on a warm page (the floor), and an ~8K-token history of English prose plus the
next message, warmed on intent (the connection and the prompt, while the user types 2 s),
with the client's request compression (default) and without. A history over TCP's initial
window pays a round trip to upload; gzip brings it under. The report's second sentence says
what that message costs over the floor.

Without root or /dev/net/tun it runs on loopback (no round trips to see); without Chromium it
cannot run and says how to install it.
"""

from __future__ import annotations

import asyncio
import math
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from firstbyte.benchmarks.browser import chromium_path
from firstbyte.benchmarks.scenarios import _rtt_theory as theory
from firstbyte.benchmarks.scenarios._browser_runner import (
    HISTORY_PROFILE,
    HISTORY_TOKENS,
)
from firstbyte.benchmarks.scenarios.transports import (
    CDF_GEOGRAPHY,
    GEOGRAPHIES,
    REGION_HOST,
    Geography,
    _emulator,
)
from firstbyte.benchmarks.stats import percentile, summarize
from firstbyte.benchmarks.world import LOOPBACK_LIMITS, World, WorldError, choose_mode
from firstbyte.client_sdk.timings import Timings

__all__ = ["HISTORY_CELLS", "SDK_CELL", "cells", "next_message", "run", "run_browser"]

MAX_TOKENS = 8
QUICK_GEOGRAPHIES = ("local", CDF_GEOGRAPHY)
"""``--quick``: the 0 ms local cost and the ~150 ms path the browser is compared on."""
SDK_CELL = {"sse-fetch": "sse", "eventsource": "sse", "websocket": "websocket",
            "longpoll": "longpoll"}
"""The Python SDK's transport for each browser transport (EventSource reads SSE)."""
HISTORY_CELLS = ("sse-fetch/2/short-7b", "sse-fetch/2/history-7b",
                 "sse-fetch/2/history-7b-uncompressed")
"""A long conversation's next message on the h100-7b sim, farthest geography, browser only
(:mod:`._browser_runner`): the floor, warmed on intent and compressed, and uncompressed."""
MISSING_CHROMIUM = ("browser: chromium not found: install the system package "
                    "(Debian/Ubuntu: apt-get install chromium) and run again")


def cells(quick: bool) -> list[str]:
    """The browser cells: ``TRANSPORT/HTTP/MODE``; the SDK's are :func:`sdk_cell` of them."""
    if quick:
        return ["sse-fetch/2/cold", "sse-fetch/2/intent", "sse-fetch/2/warm",
                "eventsource/2/cold", "websocket/1.1/cold", "websocket/1.1/warm",
                "longpoll/2/cold", "sse-fetch/3/cold"]
    out = []
    for transport in ("sse-fetch", "eventsource", "longpoll"):
        out += [f"{transport}/2/cold", f"{transport}/2/intent", f"{transport}/2/warm"]
    return [*out, "websocket/1.1/cold", "websocket/1.1/intent", "websocket/1.1/warm",
            "sse-fetch/3/cold", "sse-fetch/3/intent", "sse-fetch/3/warm"]


def sdk_cell(cell: str) -> str:
    """The Python SDK's matching cell: an intent-prewarmed page is compared with the SDK's
    warm connection (its ``prewarm``), the rest mode for mode."""
    transport, http, mode = cell.split("/")
    return f"{SDK_CELL[transport]}/{http}/{'warm' if mode == 'intent' else mode}"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def run_browser(quick: bool, *, force_loopback: bool = False,
                      geographies: Sequence[str] | None = None,
                      repeat: int | None = None) -> dict[str, Any]:
    """Measure every cell in every geography, browser and SDK; results in
    :mod:`firstbyte.benchmarks.report`'s shape."""
    if chromium_path() is None:
        raise WorldError(MISSING_CHROMIUM)
    mode, why = choose_mode(force_loopback)
    if mode == "loopback":
        _log(f"browser: LOOPBACK MODE ({why}). {LOOPBACK_LIMITS}")
        geos = [Geography("loopback", "client and router on 127.0.0.1", None)]
        emulator = None
    else:
        names = geographies or (QUICK_GEOGRAPHIES if quick else
                                [n for n in GEOGRAPHIES if n != "lossy-long"])
        geos = [GEOGRAPHIES[n] for n in names]
        if geos[0].client_aws is not None:
            geos.insert(0, GEOGRAPHIES["local"])  # the local cost is always measured
        emulator = _emulator(geos)
    repeat = repeat or (2 if quick else 5)
    measured = cells(quick)
    sdk_cells = list(dict.fromkeys(sdk_cell(c) for c in measured))
    lines: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    far = max(geos, key=lambda g: g.rtt_ms)
    async with World(regions=[REGION_HOST], clients=[g.host for g in geos], emulator=emulator,
                     browser_pages=True, extra_sims=[HISTORY_PROFILE]) as world:
        region = world.regions[REGION_HOST]
        assert region.page_url is not None
        for g in geos:
            _log(f"browser: {g.name} ({g.description}, RTT {g.rtt_ms:g} ms): "
                 f"{len(measured)} browser cells and {len(sdk_cells)} SDK cells x {repeat}")
            argv = [sys.executable, "-m", "firstbyte.benchmarks.scenarios._browser_runner",
                    "--page", region.page_url, "--router", region.url,
                    "--cert", world.cert_file, "--repeat", str(repeat),
                    "--max-tokens", str(MAX_TOKENS)]
            for cell in [*measured, *(HISTORY_CELLS if g is far else ())]:
                argv += ["--cell", cell]
            for line in await world.run_lines(g.host, argv, "Chromium", 600.0):
                lines.setdefault((g.name, "browser", line["cell"]), []).append(line)
            for line in await world.run_client(
                    g.host, REGION_HOST, sdk_cells, repeat=repeat, max_tokens=MAX_TOKENS,
                    request_timeout_s=30.0, time_limit_s=600.0):
                lines.setdefault((g.name, "sdk", line["cell"]), []).append(line)
    return _results(mode, why, geos, measured, lines, repeat, far)


def _timings(lines: Sequence[dict[str, Any]]) -> list[Timings]:
    return [msgspec.convert(line["timings"], Timings) for line in lines if "timings" in line]


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return round(percentile(got, 50), 1) if got else None


def _median_int(values: Sequence[int | None]) -> int | None:
    got = _median([v for v in values if v is not None])
    return None if got is None else round(got)


def _results(mode: str, why: str | None, geos: Sequence[Geography], measured: Sequence[str],
             lines: dict[tuple[str, str, str], list[dict[str, Any]]],
             repeat: int, far: Geography) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    table: list[dict[str, Any]] = []
    for g in geos:
        for cell in measured:
            _, http, state = cell.split("/")
            sdk = sdk_cell(cell)
            for client, name in (("browser", cell), ("sdk", sdk)):
                got = lines.get((g.name, client, name), [])
                samples = _timings(got)
                run = {
                    "transport": f"{client} {name.split('/')[0]}",
                    "protocol": f"HTTP/{http}",
                    "geography": f"{g.name} {state}",
                    "cell": f"{client} {name}",
                    "state": state,
                    "place": g.name,
                    "rtt_ms": g.rtt_ms,
                    **summarize(samples,
                                duration_s=math.fsum(t.e2el_ms or 0 for t in samples) / 1000,
                                failed=sum(1 for line in got if "error" in line)),
                    "errors": [line["error"] for line in got if "error" in line][:3],
                }
                runs.append(run)
            table.append(_side_by_side(g, cell, lines))
    history = [_history_row(far, cell, lines.get((far.name, "browser", cell), []))
               for cell in HISTORY_CELLS]
    for row, cell in zip(history, HISTORY_CELLS, strict=True):
        got = lines.get((far.name, "browser", cell), [])
        samples = _timings(got)
        runs.append({
            "transport": "browser sse-fetch", "protocol": "HTTP/2",
            "geography": f"{far.name} {cell.split('/')[2]}", "cell": f"browser {cell}",
            "state": cell.split("/")[2], "place": far.name, "rtt_ms": far.rtt_ms,
            **summarize(samples,
                        duration_s=math.fsum(t.e2el_ms or 0 for t in samples) / 1000,
                        failed=row["failed"]),
            "errors": [line["error"] for line in got if "error" in line][:3],
        })
    headline = next_message(history)
    return {
        "scenario": "browser",
        "description": (first_message(table)["answer"] + " " + headline["answer"] + " "
                        + _description(mode, geos, repeat)),
        "summary": _summary(mode, table, _history_summary(headline)),
        "runs": runs,
        "browser_vs_sdk": table,
        "long_history": history,
        "notes": _notes(mode, why),
    }


def _history_row(g: Geography, cell: str, got: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One long-conversation cell: its TTFT and what the sim and Chromium saw of it."""
    ok = [line for line in got if "timings" in line]
    usage = [line.get("usage") or {} for line in ok]
    return {
        "geography": g.name,
        "rtt_ms": g.rtt_ms,
        "cell": cell,
        "browser_ttft_ms": _median([line["timings"].get("first_token_ms") for line in ok]),
        "requests": len(ok),
        "failed": sum(1 for line in got if "error" in line),
        "body_bytes": _median_int([line.get("body_bytes") for line in ok]),
        "prompt_tokens": _median([u.get("prompt_tokens") for u in usage]),
        "cached_tokens": _median([(u.get("prompt_tokens_details") or {}).get("cached_tokens")
                                  for u in usage]),
        "first_byte_ms": _median([line["timings"].get("first_byte_ms") for line in ok]),
        # The router's Server-Timing: "queue" runs from the request's head to its admission,
        # so it holds the body's upload; "upstream-headers" is the backend's part.
        "server_timing_ms": {
            name: _median([(line["timings"].get("server_timing") or {}).get(name)
                           for line in ok])
            for name in sorted({n for line in ok
                                for n in line["timings"].get("server_timing") or {}})},
        "warm": all(line["timings"].get("warm") for line in ok) if ok else None,
        "preflights": _median([line.get("preflights") for line in ok]),
    }


def next_message(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What an 8K-token conversation's next message costs over a short prompt: TTFT medians
    (ms) of the :data:`HISTORY_CELLS` rows, the ratios to the floor and ``answer``, one
    sentence."""
    by_mode = {row["cell"].split("/")[2]: row for row in rows}
    ttft = {mode: by_mode[mode]["browser_ttft_ms"] if mode in by_mode else None
            for mode in ("short-7b", "history-7b", "history-7b-uncompressed")}
    floor = ttft["short-7b"]

    def over(mode: str) -> float | None:
        got = ttft[mode]
        return None if got is None or not floor else round((got / floor - 1) * 100, 1)

    out: dict[str, Any] = {
        "geography": rows[0]["geography"] if rows else None,
        "rtt_ms": rows[0]["rtt_ms"] if rows else None,
        "short_ttft_ms": floor,
        "history_ttft_ms": ttft["history-7b"],
        "uncompressed_ttft_ms": ttft["history-7b-uncompressed"],
        "history_over_short_pct": over("history-7b"),
        "uncompressed_over_short_pct": over("history-7b-uncompressed"),
        "history_body_bytes": by_mode.get("history-7b", {}).get("body_bytes"),
        "uncompressed_body_bytes": by_mode.get("history-7b-uncompressed", {}).get("body_bytes"),
    }

    def said(mode: str) -> str:
        pct = over(mode)
        return ("not measured" if ttft[mode] is None
                else f"{ttft[mode]:g} ms" + ("" if pct is None else f", {pct:+g}%"))

    where = "" if out["rtt_ms"] is None else f" at {out['geography']} ({out['rtt_ms']:g} ms RTT)"
    out["answer"] = (
        f"An {HISTORY_TOKENS // 1000}K-token conversation's next message{where}, fetch-SSE "
        f"over HTTP/2 on the {HISTORY_PROFILE} sim, warmed on intent (2 s of typing), TTFT "
        f"median: {said('history-7b')} over a short prompt on a warm page "
        f"({'not measured' if floor is None else f'{floor:g} ms'}); uncompressed "
        f"{said('history-7b-uncompressed')}.")
    return out


def _history_summary(headline: dict[str, Any]) -> dict[str, Any]:
    return {
        "next message: short / 8K history / 8K uncompressed ttft_ms": (
            f"{headline['short_ttft_ms']} / {headline['history_ttft_ms']} / "
            f"{headline['uncompressed_ttft_ms']}"),
        "next message: 8K history / uncompressed over short %": (
            f"{headline['history_over_short_pct']} / "
            f"{headline['uncompressed_over_short_pct']}"),
        "next message: body bytes gzip / uncompressed": (
            f"{headline['history_body_bytes']} / {headline['uncompressed_body_bytes']}"),
    }


def _side_by_side(g: Geography, cell: str,
                  lines: dict[tuple[str, str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    """One row: the browser cell and the SDK's matching cell in one geography."""
    transport, http, _ = cell.split("/")
    sdk_name = sdk_cell(cell)
    browser_lines = lines.get((g.name, "browser", cell), [])
    browser = _timings(browser_lines)
    raw = [line["timings"] for line in browser_lines if "timings" in line]
    sdk = _timings(lines.get((g.name, "sdk", sdk_name), []))
    b_ttft = _median([t.first_token_ms for t in browser])
    s_ttft = _median([t.first_token_ms for t in sdk])
    # The Markdown summary shows a table's first 12 columns: the comparison comes first.
    row: dict[str, Any] = {
        "geography": g.name,
        "rtt_ms": g.rtt_ms,
        "cell": cell,
        "browser_ttft_ms": b_ttft,
        "sdk_ttft_ms": s_ttft,
        "browser_adds_ms": (round(b_ttft - s_ttft, 1)
                            if b_ttft is not None and s_ttft is not None else None),
        "paint_after_token_ms": _median([r["render_ms"] - r["first_token_ms"] for r in raw
                                         if r.get("render_ms") is not None
                                         and r.get("first_token_ms") is not None]),
        "preflights": _median([line.get("preflights") for line in browser_lines
                               if "timings" in line]),
        "theory_first_byte_rtts": theory.theory_first_byte(SDK_CELL[transport], http,
                                                           sdk_name.split("/")[2]),
        "browser_first_byte_rtts": None,
        "sdk_first_byte_rtts": None,
        "browser_http": ",".join(sorted({t.http_version or "HTTP/1.1 (ws)" for t in browser})),
        "sdk_cell": sdk_name,
        "paint_ms": _median([r.get("render_ms") for r in raw]),
        "browser_ttft_rtts": None,
        "sdk_ttft_rtts": None,
        "browser_first_byte_rtts_raw": None,
        "sdk_first_byte_rtts_raw": None,
        "long_tasks": _median([r.get("long_tasks") for r in raw]),
    }
    if g.client_aws is not None:
        local_b = _timings(lines.get(("local", "browser", cell), []))
        local_s = _timings(lines.get(("local", "sdk", sdk_name), []))
        theory_fb = row["theory_first_byte_rtts"]
        for who, got, base in (("browser", browser, local_b), ("sdk", sdk, local_s)):
            trips = theory.round_trips(got, base, g.rtt_ms, theory_fb, theory_fb)
            row[f"{who}_first_byte_rtts"] = trips.get("first_byte_rtts")
            row[f"{who}_ttft_rtts"] = trips.get("ttft_rtts")
            row[f"{who}_first_byte_rtts_raw"] = trips.get("first_byte_rtts_raw")
    return row


def _description(mode: str, geos: Sequence[Geography], repeat: int) -> str:
    where = ", ".join(f"{g.name} {g.rtt_ms:g} ms" for g in geos)
    how = ("router + instant sim (and an h100-7b sim for the long conversation) and the page's "
           "origin in a region namespace (us-east-1); "
           "headless Chromium and the Python SDK in client namespaces behind the WAN emulator"
           if mode == "emulated" else "LOOPBACK MODE: router, page, Chromium and SDK on "
           "127.0.0.1")
    return (f"The browser client in headless Chromium vs the Python SDK, same cells; {how}; "
            f"geographies: {where}; {repeat} requests per cell, {MAX_TOKENS} tokens each, "
            "TLS 1.3 with a per-run CA.")


def _trips(row: dict[str, Any] | None) -> float | None:
    """A row's browser round trips to the first byte (corrected, else raw), or None."""
    if row is None:
        return None
    got = row.get("browser_first_byte_rtts")
    return got if got is not None else row.get("browser_first_byte_rtts_raw")


def first_message(table: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What the first message costs and what prewarm saves: fetch-SSE over HTTP/2 in the
    farthest geography, cold page, cold page with intent prewarm and warm page (TTFT medians
    in ms, round trips to the first byte); ``answer`` says it in one sentence."""
    if not table:
        return {"answer": "First message: nothing measured."}
    far = max(r["rtt_ms"] for r in table)
    rows = {r["cell"].split("/")[2]: r for r in table
            if r["rtt_ms"] == far and r["cell"].startswith("sse-fetch/2/")}
    geo = next(iter(rows.values()))["geography"] if rows else table[0]["geography"]
    ttft = {mode: rows[mode]["browser_ttft_ms"] if mode in rows else None
            for mode in ("cold", "intent", "warm")}
    trips = {mode: _trips(rows.get(mode)) for mode in ("cold", "intent", "warm")}
    out: dict[str, Any] = {"geography": geo, "rtt_ms": far}
    for mode in ("cold", "intent", "warm"):
        out[f"{mode}_ttft_ms"] = ttft[mode]
        out[f"{mode}_first_byte_rtts"] = trips[mode]
    saved = (round(ttft["cold"] - ttft["intent"], 1)
             if ttft["cold"] is not None and ttft["intent"] is not None else None)
    saved_trips = (round(trips["cold"] - trips["intent"], 1)
                   if trips["cold"] is not None and trips["intent"] is not None else None)
    out["prewarm_saves_ms"] = saved
    out["prewarm_saves_rtts"] = saved_trips

    def said(mode: str) -> str:
        rt = "" if trips[mode] is None else f", {trips[mode]:g} round trips to the first byte"
        return "not measured" if ttft[mode] is None else f"{ttft[mode]:g} ms{rt}"

    answer = (f"First message, fetch-SSE over HTTP/2 at {geo} ({far:g} ms RTT), TTFT median: "
              f"cold page {said('cold')}; cold page with intent prewarm (2 s of typing) "
              f"{said('intent')}; warm page {said('warm')}.")
    if saved is not None:
        answer += f" Prewarm on intent saves {saved:g} ms"
        answer += "." if saved_trips is None else f" ({saved_trips:g} round trips)."
    out["answer"] = answer
    return out


def _summary(mode: str, table: Sequence[dict[str, Any]],
             history: dict[str, Any]) -> dict[str, Any]:
    headline = first_message(table)
    out: dict[str, Any] = {
        "first message: cold / intent / warm ttft_ms": (
            f"{headline['cold_ttft_ms']} / {headline['intent_ttft_ms']} / "
            f"{headline['warm_ttft_ms']}"),
        "first message: cold / intent / warm first_byte_rtts": (
            f"{headline['cold_first_byte_rtts']} / {headline['intent_first_byte_rtts']} / "
            f"{headline['warm_first_byte_rtts']}"),
        **history,
        "prewarm saves ms": headline["prewarm_saves_ms"],
        "prewarm saves rtts": headline["prewarm_saves_rtts"],
        "mode": mode,
    }
    for row in table:
        if row["rtt_ms"] == max(r["rtt_ms"] for r in table):
            key = f"{row['geography']} {row['cell']}"
            out[f"browser_ttft_ms {key}"] = row["browser_ttft_ms"]
            out[f"browser_adds_ms {key}"] = row["browser_adds_ms"]
            if "browser_first_byte_rtts" in row:
                out[f"first_byte_rtts browser/sdk {key}"] = (
                    f"{row['browser_first_byte_rtts']}/{row['sdk_first_byte_rtts']}")
    h3 = [row for row in table if row["cell"].startswith("sse-fetch/3/")]
    out["chromium_http3"] = ("negotiated" if h3 and all(r["browser_http"] == "HTTP/3"
                                                        for r in h3)
                             else "not negotiated: " + ",".join(r["browser_http"] for r in h3))
    return out


def _notes(mode: str, why: str | None) -> list[str]:
    notes = [
        "cold: a fresh browser context per request (own cache and connection pool): the page "
        "loads from its own origin (the client's modules too, so the router is untouched), then "
        "the stream pays DNS and the TCP + TLS (or QUIC) handshake; its start is a CORS simple "
        "request (text/plain body, client token in ?token=), so no preflight. intent: the same "
        "cold page, but the client warms on intent (warmOnIntent on the prompt box): the user "
        "focuses it and types for 2 s, the page's GET /v1/edge/warm opens the connection, then "
        "the measured stream reuses it. warm: one page "
        "with <link rel=preconnect crossorigin> to the router and one unmeasured stream first: "
        "the connection is kept alive. The SDK's cell for intent is its warm one (prewarm).",
        "first_byte_rtts: as in bench transports, (first byte - Server-Timing - the same cell's "
        "local cost at 0 ms) / RTT, medians; theory is the SDK's. Chromium's local cost of a "
        "cold page varies by tens of ms on a busy machine, so with few requests the corrected "
        "count wanders; *_rtts_raw subtracts only Server-Timing (an upper bound). "
        "EventSource starts its stream with POST /v1/streams (its first byte) and reads the "
        "tokens on a second request, GET /v1/streams/{id}: its TTFT costs one more round "
        "trip.",
        "browser_adds_ms: browser TTFT - SDK TTFT (medians); paint_after_token_ms: the first "
        "animation frame after the first token is in the DOM.",
        "WebSocket has no Resource Timing (its first byte is its first message) and needs no "
        "CORS preflight. A finished stream leaves its WebSocket open for the client's next "
        "stream (as the SDK's): warm, one round trip.",
        f"long_history (the farthest geography, browser only, the {HISTORY_PROFILE} sim): "
        "short-7b is a warm page's short prompt (the floor); history-7b is an intent cell whose "
        f"page warms the connection and the prompt (warmOnIntent with a ~{HISTORY_TOKENS}-token "
        "history of English prose from pydoc_data.topics, its own per request) while the user "
        "types 2 s, then sends that history and the next message, gzip-compressed by the "
        "client (its default: bodies over 10 KiB); history-7b-uncompressed the same with "
        "compressRequests: false. body_bytes: the measured request's body as Chromium sent it; "
        "prompt_tokens and cached_tokens: the sim's usage (the warm-up cached the history).",
        "theory_first_byte_rtts is the SDK's; a browser start is a simple request (no "
        "preflight), but long-poll's polls send Authorization and are preflighted (the "
        "preflight cache is per URL): the preflights column counts what Chromium sent.",
    ]
    if mode == "loopback":
        notes.insert(0, f"{LOOPBACK_LIMITS} Why loopback: {why}.")
    return notes


def run(quick: bool) -> dict[str, Any]:
    """The ``firstbyte bench browser`` scenario."""
    from firstbyte.cli import CLIError

    try:
        return asyncio.run(run_browser(quick))
    except WorldError as exc:
        raise CLIError(str(exc)) from None
