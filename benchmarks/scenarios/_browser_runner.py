"""Run the browser client in headless Chromium for benchmark cells; one JSON line per request.

``python -m firstbyte.benchmarks.scenarios._browser_runner --page URL --cert PEM
--cell sse-fetch/2/cold ...``

The browser counterpart of :mod:`firstbyte.benchmarks.scenarios._client_runner`, run the same
way inside an emulated client host (:mod:`firstbyte.benchmarks.world`), so Chromium's every
handshake crosses the emulator. A *cell* is ``TRANSPORT/HTTP/MODE``: transport ``sse-fetch``,
``eventsource``, ``websocket`` or ``longpoll`` (the browser client's); HTTP ``1.1``, ``2`` or
``3`` (what the cell expects Chromium to negotiate: 3 starts a Chromium forced onto QUIC for
the router's origin); mode

- ``cold``: every request on a fresh page in a fresh browser context (own cache and
  connection pool): the page's load, then the stream's DNS, handshakes and CORS preflight;
- ``intent``: as ``cold``, but the page warms on intent (``client.warmOnIntent``): the user
  focuses the prompt box and types for ``INTENT_S`` (a keystroke every 0.2 s) before the
  measured request is sent, so its connection was opened ahead of it;
- ``warm``: one page with ``<link rel="preconnect">`` to the router, one unmeasured stream
  (its connection stays open, its preflight answer is cached), then every request on it.

A long conversation's next message, on the region's ``h100-7b`` sim (:data:`HISTORY_MODEL`),
fetch-SSE only (:data:`HISTORY_MODES`):

- ``short-7b``: as ``warm``, a short prompt: the floor;
- ``history-7b``: as ``intent``, but the page warms the prompt too (``warmOnIntent`` with the
  conversation: an ~8K-token history of English prose, :mod:`._english`, its own per request),
  and the measured message is that history and the user's next message; the client compresses
  bodies over 10 KiB (its default);
- ``history-7b-uncompressed``: the same with ``compressRequests: false``.

Their lines add ``usage`` (the sim's prompt and cached tokens) and ``body_bytes`` (the
measured request's body as Chromium sent it).

Each request prints ``{"cell", "rep", "timings": {...}, "preflights": n}`` (``preflights``:
the CORS ``OPTIONS`` requests Chromium sent for it) or ``"error"``; then ``{"done": true}``.
Chromium trusts the routers' certificate by its key (``--ignore-certificate-errors-spki-list``,
which covers QUIC too).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from firstbyte.benchmarks._parent import exit_with_parent
from firstbyte.benchmarks.browser import (
    TYPE_KEY,
    Browser,
    BrowserError,
    Page,
    intent_script,
    launch,
    spki_flag,
)
from firstbyte.benchmarks.browser import stream_script as script_for
from firstbyte.benchmarks.scenarios._english import conversation
from firstbyte.router.sim.profiles import get_profile

__all__ = ["HISTORY_MODEL", "HISTORY_MODES", "HISTORY_PROFILE", "TRANSPORTS", "main",
           "parse_cell"]

TRANSPORTS = ("sse-fetch", "eventsource", "websocket", "longpoll")
READY = """new Promise((resolve) => { const t = () => window.fb ? resolve(window.bench)
  : setTimeout(t, 5); t(); })"""
_PROMPT = [{"role": "user", "content": "Say hello in a few words."}]
HISTORY_MODES = ("short-7b", "history-7b", "history-7b-uncompressed")
"""The long conversation's cells (fetch-SSE, on the h100-7b sim); see the module's doc."""
MODES = ("cold", "intent", "warm", *HISTORY_MODES)
HISTORY_PROFILE = "h100-7b"
HISTORY_MODEL = get_profile(HISTORY_PROFILE).model
"""The model the region's second sim serves (the router routes by model)."""
HISTORY_TOKENS = 8000
NEXT = {"role": "user", "content": "And what about the next step?"}
INTENT_S = 2.0
"""How long the user types in an ``intent`` cell before sending."""
KEYSTROKE_S = 0.2


def parse_cell(spec: str) -> tuple[str, str, str]:
    """``sse-fetch/2/cold`` -> its parts; ValueError naming what is wrong."""
    parts = spec.split("/")
    if len(parts) != 3 or parts[0] not in TRANSPORTS or parts[1] not in ("1.1", "2", "3") \
            or parts[2] not in MODES:
        raise ValueError(f"cell {spec!r}: expected TRANSPORT/HTTP/MODE with TRANSPORT one of "
                         f"{', '.join(TRANSPORTS)}, HTTP 1.1, 2 or 3, MODE "
                         f"{', '.join(MODES)}")
    if parts[2] in HISTORY_MODES and parts[0] != "sse-fetch":
        raise ValueError(f"cell {spec!r}: expected TRANSPORT/HTTP/MODE with TRANSPORT "
                         f"sse-fetch for MODE {parts[2]}")
    return parts[0], parts[1], parts[2]


def _emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


class _Ask:
    """What one cell's requests ask: the model, the messages, the conversation warmed on
    intent (or none) and the client's options."""

    def __init__(self, mode: str, rep: int, max_tokens: int) -> None:
        self.model = "default"
        self.messages: list[dict[str, str]] = _PROMPT
        self.conversation: dict[str, Any] | None = None
        self.options: dict[str, Any] = {}
        if mode in HISTORY_MODES:
            self.model = HISTORY_MODEL
        if mode.startswith("history-7b"):
            # Its own history per request: nothing of it is cached before its warm-up.
            history = conversation(f"Conversation {rep} of {mode}.", HISTORY_TOKENS)
            self.messages = [*history, NEXT]
            self.conversation = {"model": self.model, "messages": history}
        if mode == "history-7b-uncompressed":
            self.options = {"compressRequests": False}
        self.request = {"model": self.model, "messages": self.messages, "max_tokens": max_tokens}


def _body_bytes(events: list[tuple[str, dict[str, Any]]], path: str) -> int | None:
    """The body of the last POST to ``path`` among ``events``, in bytes as sent."""
    found = None
    for method, p in events:
        request = p.get("request", {})
        if method == "Network.requestWillBeSent" and request.get("method") == "POST" \
                and urlsplit(request.get("url", "")).path.endswith(path):
            entries = request.get("postDataEntries") or []
            found = sum(len(base64.b64decode(e.get("bytes", ""))) for e in entries)
    return found


async def _stream(page: Page, transport: str, ask: _Ask) -> dict[str, Any]:
    """One measured stream on ``page``: the line to print (without cell and rep)."""
    bench = await page.evaluate(READY)
    mark = len(page.events())
    got = await page.evaluate(script_for(bench["router"], bench["token"], transport,
                                         ask.request, options=ask.options), timeout_s=60)
    events = page.events()[mark:]
    preflights = sum(1 for method, p in events
                     if method == "Network.requestWillBeSent"
                     and p.get("request", {}).get("method") == "OPTIONS")
    if "error" in got:
        return {"error": f"{got['error']}: {got.get('message')}"}
    line = {"timings": got["timings"], "preflights": preflights}
    if ask.model == HISTORY_MODEL:
        line["usage"] = got["usage"]
        line["body_bytes"] = _body_bytes(events, "/chat/completions")
    return line


async def _typing(page: Page, transport: str, ask: _Ask) -> None:
    """The user focuses the prompt box (intent: the page warms) and types for INTENT_S."""
    bench = await page.evaluate(READY)
    await page.evaluate(intent_script(bench["router"], bench["token"], transport,
                                      options=ask.options, conversation=ask.conversation))
    for _ in range(round(INTENT_S / KEYSTROKE_S)):
        await asyncio.sleep(KEYSTROKE_S)
        await page.evaluate(TYPE_KEY)


async def _cell(browser: Browser, page_url: str, spec: str, repeat: int,
                max_tokens: int) -> None:
    transport, _, mode = parse_cell(spec)
    if mode in ("cold", "intent", "history-7b", "history-7b-uncompressed"):
        for rep in range(repeat):
            ask = _Ask(mode, rep, max_tokens)
            try:
                async with browser.isolated_page(page_url) as page:
                    if mode != "cold":
                        await _typing(page, transport, ask)
                    _emit({"cell": spec, "rep": rep, **await _stream(page, transport, ask)})
            except BrowserError as exc:
                _emit({"cell": spec, "rep": rep, "error": str(exc)})
        return
    ask = _Ask(mode, 0, max_tokens)
    async with browser.isolated_page(page_url + "?warm=1") as page:
        warmup = await _stream(page, transport, ask)
        if "error" in warmup:
            print(f"browser runner: warm-up of {spec} failed: {warmup['error']}",
                  file=sys.stderr)
        for rep in range(repeat):
            _emit({"cell": spec, "rep": rep, **await _stream(page, transport, ask)})


async def run(args: argparse.Namespace, cert_pem: bytes) -> None:
    trust = spki_flag(cert_pem)
    cells = [parse_cell(c) for c in args.cell]
    router = urlsplit(args.router)
    groups = {
        "tcp": [c for c, (_, http, _) in zip(args.cell, cells, strict=True) if http != "3"],
        "quic": [c for c, (_, http, _) in zip(args.cell, cells, strict=True) if http == "3"],
    }
    for kind, specs in groups.items():
        if not specs:
            continue
        flags: tuple[str, ...] = (trust,)
        if kind == "quic":
            flags += ("--enable-quic", f"--origin-to-force-quic-on={router.netloc}")
        async with launch(flags) as browser:
            for spec in specs:
                await _cell(browser, args.page, spec, args.repeat, args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m firstbyte.benchmarks.scenarios._browser_runner")
    parser.add_argument("--page", required=True, help="the page's URL (another origin)")
    parser.add_argument("--router", required=True, help="the router's base URL (for QUIC)")
    parser.add_argument("--cert", required=True, help="the routers' certificate (PEM)")
    parser.add_argument("--cell", action="append", required=True, help="TRANSPORT/HTTP/MODE")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        for cell in args.cell:
            parse_cell(cell)
    except ValueError as exc:
        parser.error(str(exc))
    exit_with_parent(code=0)
    try:
        asyncio.run(run(args, Path(args.cert).read_bytes()))
    except BrowserError as exc:
        print(f"browser runner: {exc}", file=sys.stderr, flush=True)
        return 1
    _emit({"done": True})
    return 0


if __name__ == "__main__":
    sys.exit(main())
