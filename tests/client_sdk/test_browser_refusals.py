"""Refusals the router writes before its app, read by a cross-origin page in headless Chromium.

A connection over its cap (``503 overloaded``, ``Retry-After: 1``, written by the server
after the request's head), an HTTP/2 head over its bounds (414, written before the app) and
memory shedding (503, written before the app's CORS layer) carry the CORS headers of the
page's (allowed) origin: the page's ``fetch`` reads the status, the error ``code`` and
``Retry-After``, which the browser client's retry rules need. Without them the page got a
``TypeError: Failed to fetch`` and nothing else.

The page's requests are simple ones (no preflight): a refused preflight fails whatever its
headers (a preflight must answer 2xx), so only the request itself can be read.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import trustme

from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import World, browser_on, spki_flag, world

pytestmark = [pytest.mark.usefixtures("chromium"), pytest.mark.slow]

FETCH = """(async () => {
  try {
    const r = await fetch(%(url)s, %(init)s);
    let code = null;
    try { code = (await r.json()).error.code; } catch (e) {}
    return { status: r.status, code, retryAfter: r.headers.get("retry-after") };
  } catch (e) { return { error: String(e) }; }
})()"""


async def _fetch(w: World, url: str, init: dict[str, Any] | None = None,
                 flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """``fetch(url)`` from the page (its modules from the page's origin: the router sees
    nothing of the browser before this request)."""
    async with browser_on(w, flags=flags, modules=w.page_origin) as page:
        got: dict[str, Any] = await page.evaluate(
            FETCH % {"url": json.dumps(url), "init": json.dumps(init or {})})
    return got


async def _holding_a_connection(w: World) -> asyncio.StreamWriter:
    """A connection from 127.0.0.1 (the browser's address too) that takes the one slot."""
    _, writer = await asyncio.open_connection("127.0.0.1", w.router_port)
    await asyncio.sleep(0.2)
    return writer


@pytest.mark.parametrize("server", ["auto", "hypercorn", "uvicorn"])
async def test_a_page_reads_the_503_of_a_refused_connection(server: str) -> None:
    async with world(listen={"server": server},
                     limits={"hard_max_connections_per_client": 1}) as w:
        holder = await _holding_a_connection(w)
        try:
            got = await _fetch(w, f"{w.router_url}/v1/models")
        finally:
            holder.close()
    assert got == {"status": 503, "code": "overloaded", "retryAfter": "1"}


async def test_a_page_reads_the_503_of_a_refused_http2_connection(tmp_path: Path) -> None:
    async with world(trustme.CA(), str(tmp_path),
                     limits={"hard_max_connections_per_client": 1}) as w:
        holder = await _holding_a_connection(w)
        try:
            got = await _fetch(w, f"{w.router_url}/v1/models", flags=(spki_flag(w),))
        finally:
            holder.close()
    assert got == {"status": 503, "code": "overloaded", "retryAfter": "1"}


async def test_a_page_reads_the_414_of_an_http2_head_over_its_bound(tmp_path: Path) -> None:
    async with world(trustme.CA(), str(tmp_path), limits={"max_request_line_bytes": 1024}) as w:
        got = await _fetch(w, f"{w.router_url}/v1/models?q={'a' * 2000}", flags=(spki_flag(w),))
    assert got == {"status": 414, "code": "request_line_too_long", "retryAfter": None}


async def test_a_page_reads_the_503_of_memory_shedding() -> None:
    # 1 MiB: always over. A text/plain POST is a simple request (no preflight).
    async with world(limits={"max_rss_bytes": 1 << 20}) as w:
        got = await _fetch(w, f"{w.router_url}/v1/chat/completions",
                           {"method": "POST", "body": "{}",
                            "headers": {"content-type": "text/plain"}})
    assert got == {"status": 503, "code": "overloaded", "retryAfter": "1"}
