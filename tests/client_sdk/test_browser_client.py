"""The browser client in headless Chromium against the real router and sim.

The page is served from its own loopback origin (listed in the router's ``[cors]``), imports
the client's modules from the router, and streams with a client token minted by "the
application's backend" (the test). Each transport must put the sim's text in the DOM exactly;
a proxy that cuts the connection mid-stream (the Python SDK's own cut proxy and cases) must
cost a resume and lose and repeat nothing; the Timings record has the Python SDK's fields in
their physical order; CORS and tokens refuse what they must, seen from the page.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trustme

from firstbyte.client_sdk.timings import Timings
from firstbyte.protocol.timings import implausible
from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import (
    KEY,
    OTHER_KEY,
    browser_on,
    spki_flag,
    stream_script,
    world,
)
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.client_sdk.test_client import MESSAGES
from tests.client_sdk.test_resume import CUT_AFTER, TOKENS
from tests.protocol.test_timings import IMPLAUSIBLE_CASES
from tests.protocol.test_timings import record as protocol_record
from tests.router.test_client_timings import NETWORK, REJECTED, TTFT, metric

pytestmark = pytest.mark.usefixtures("chromium")

TRANSPORTS = ["sse-fetch", "eventsource", "websocket", "longpoll"]
# Chromium's WebSocket negotiates permessage-deflate: the 200-token stream is ~5 KB on the wire
# instead of ~40 KB, so its cut comes earlier to fall inside the stream as well.
CUTS = {"websocket": 2000}


def assert_ordered(t: dict[str, Any]) -> None:
    """The offsets in the order physics allows: sent, first byte, first token, painted."""
    assert t["request_sent_ms"] is not None
    assert 0 <= t["request_sent_ms"] <= t["first_byte_ms"] <= t["first_token_ms"], t
    assert t["first_token_ms"] <= t["render_ms"], t
    assert t["first_token_ms"] <= t["last_token_ms"], t
    assert len(t["inter_token_ms"]) == t["output_chunks"] - 1


async def test_every_transport_streams_the_sims_text_exactly() -> None:
    async with world() as w:
        expected = await w.reference_text(40)
        token = await w.mint()
        async with browser_on(w) as page:
            for transport in TRANSPORTS:
                got = await page.evaluate(stream_script(f"{w.router_url}/v1", token, transport,
                                                        40))
                assert "error" not in got, (transport, got)
                assert got["text"] == expected, transport
                assert got["dom"] == expected, transport  # every token painted once
                assert got["seqs"] == list(range(1, len(got["seqs"]) + 1)), transport
                t = got["timings"]
                assert t["transport"] == transport
                assert t["output_chunks"] == got["usage"]["completion_tokens"]
                assert t["region"] == "browser-test"
                assert t["stream_id"]
                assert t["resumes"] == 0
                assert_ordered(t)
            assert page.problems() == []


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_cut_mid_stream_loses_and_repeats_nothing(transport: str) -> None:
    async with world() as w:
        expected = await w.reference_text(TOKENS)
        token = await w.mint()
        cut_after = CUTS.get(transport, CUT_AFTER)
        async with TcpCutProxy(w.router_port, cut_after=cut_after) as proxy, \
                browser_on(w) as page:
            # The modules came from the router itself; the stream goes through the proxy.
            got = await page.evaluate(stream_script(
                f"http://127.0.0.1:{proxy.port}/v1", token, transport, TOKENS))
    assert "error" not in got, got
    assert proxy.cuts_done == 1
    assert proxy.connections >= 2  # the cut connection and the one the resume opened
    assert got["text"] == expected
    assert got["dom"] == expected
    assert got["seqs"] == list(range(got["seqs"][0], got["seqs"][0] + len(got["seqs"])))
    assert got["timings"]["output_chunks"] > 60  # the cut fell inside the stream
    if transport != "longpoll":
        # Long-poll retries a failed poll from its cursor, as the Python SDK does.
        assert got["timings"]["resumes"] >= 1


async def test_timings_have_the_python_fields_paint_and_long_tasks() -> None:
    async with world() as w:
        token = await w.mint()
        async with browser_on(w) as page:
            # The page is busy 120 ms right after the first token: one long task, and the
            # first token's frame cannot be painted before that work is done.
            got = await page.evaluate(stream_script(f"{w.router_url}/v1", token, "sse-fetch",
                                                    30, busy_ms=120))
    t = got["timings"]
    assert set(msgspec.structs.asdict(Timings())) <= set(t)  # every Python field, same name
    decoded = msgspec.convert(t, Timings)  # and the same types: POSTable as a Timings
    assert decoded.output_chunks == t["output_chunks"]
    assert_ordered(t)
    assert t["render_ms"] >= t["first_token_ms"] + 120
    assert t["long_tasks"] >= 1
    assert t["long_task_ms"] >= 120
    assert t["http_version"] == "HTTP/1.1"
    assert t["resource_timing"] == "full"  # Timing-Allow-Origin reached the page
    assert t["warm"] == (t["tcp_connect_ms"] is None)
    assert t["server_timing"]["queue"] >= 0  # Server-Timing exposed to the page
    assert t["navigation"]["http_version"] == "HTTP/1.1"


async def test_over_tls_phases_come_from_resource_timing(tmp_path: Path) -> None:
    """The page and the router over HTTPS (one trustme certificate, trusted by its key). The
    client's modules come from the page's server, which closes every connection: each module
    load is a fresh TLS connection whose DNS, TCP and TLS phases Resource Timing shows, in
    order. The stream itself is HTTP/2 with full Resource Timing, and cold: its start is a
    CORS simple request, so no preflight opened its connection before it (docs/browser.md,
    "What is measured")."""
    ca = trustme.CA()
    async with world(ca, str(tmp_path)) as w:
        token = await w.mint()
        async with browser_on(w, flags=(spki_flag(w),), modules=w.page_origin) as page:
            got = await page.evaluate(stream_script(f"{w.router_url}/v1", token, "sse-fetch",
                                                    20))
            module = await page.evaluate(f"""(async () => {{
              const timings = await import("{w.page_origin}/v1/edge/client/timings.js");
              const [entry] = performance.getEntriesByName(
                "{w.page_origin}/v1/edge/client/stream.js");
              return timings.phasesOf(entry, entry.startTime); }})()""")
    assert "error" not in got, got
    t = got["timings"]
    assert t["http_version"] == "HTTP/2", json.dumps(t)
    assert t["resource_timing"] == "full"
    assert not t["warm"]
    assert not t["prewarmed"]
    assert t["tls_handshake_ms"] > 0
    assert t["dns_ms"] + t["tcp_connect_ms"] + t["tls_handshake_ms"] <= t["request_sent_ms"] + 0.5
    assert_ordered(t)
    assert module["http_version"] == "HTTP/1.1"  # the test's page server
    assert not module["warm"]
    assert module["tls_handshake_ms"] > 0
    assert module["tcp_connect_ms"] >= 0
    setup = module["dns_ms"] + module["tcp_connect_ms"] + module["tls_handshake_ms"]
    assert setup <= module["request_sent_ms"] + 0.5  # the phases come before the request
    assert module["request_sent_ms"] <= module["first_byte_ms"]


async def test_reported_timings_land_in_the_client_histograms() -> None:
    """Each transport streams with ``reportTimings``; the router's /metrics counts every
    record in the client TTFT histogram under the transport the bytes came by (EventSource
    is ``sse``) and the HTTP version the page saw."""
    async with world() as w:
        token = await w.mint()
        async with browser_on(w) as page:
            for transport in TRANSPORTS:
                got = await page.evaluate(stream_script(f"{w.router_url}/v1", token, transport,
                                                        10, report=True))
                assert "error" not in got, (transport, got)
                assert got["reports"] == {"sent": 1, "failed": 0}, transport
            assert page.problems() == []
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{w.router_url}/metrics",
                                   headers={"authorization": f"Bearer {KEY}"})).text
    count = f"{TTFT}_count"
    assert metric(text, count, region="browser-test", transport="sse", http="1.1") == 2
    assert metric(text, count, transport="websocket", http="1.1") == 1
    assert metric(text, count, transport="longpoll", http="1.1") == 1
    assert metric(text, REJECTED) == 0
    # The router joined each record with its own stream: the network part was measured.
    assert metric(text, f"{NETWORK}_count") == 4


@pytest.mark.parametrize(("simple", "expected"), [(False, [1, 0, 0]), (True, [0, 0, 0])])
async def test_a_page_preflights_a_stream_once_then_uses_the_cached_answer(
        simple: bool, expected: list[int]) -> None:
    """A cross-origin stream with a bearer token needs a CORS preflight; the router's answer
    is cacheable (Access-Control-Max-Age), so the page's next streams on the same URL go
    without one: one round trip less on every warm request. (With ``cache: "no-store"``
    Chromium skipped its preflight cache and preflighted every stream.) With ``simpleStart``
    (the default) not even the first stream is preflighted."""
    async with world() as w:
        token = await w.mint()
        async with browser_on(w) as page:
            preflights = []
            for _ in range(3):
                mark = len(page.events())
                got = await page.evaluate(stream_script(f"{w.router_url}/v1", token,
                                                        "sse-fetch", 5,
                                                        options={"simpleStart": simple}))
                assert "error" not in got, got
                preflights.append(sum(
                    1 for method, p in page.events()[mark:]
                    if method == "Network.requestWillBeSent"
                    and p["request"]["method"] == "OPTIONS"))
    assert preflights == expected


async def test_a_websocket_serves_the_pages_next_stream() -> None:
    """A WebSocket stream that ended leaves its socket open: the client's next stream goes on
    it (one socket for three streams, the later ones warm), as the Python SDK's does."""
    async with world() as w:
        expected = await w.reference_text(10)
        token = await w.mint()
        async with browser_on(w) as page:
            got = [await page.evaluate(stream_script(f"{w.router_url}/v1", token, "websocket",
                                                     10)) for _ in range(3)]
            sockets = sum(1 for method, _ in page.events()
                          if method == "Network.webSocketCreated")
            assert page.problems() == []
    assert [g["text"] for g in got] == [expected] * 3
    assert [g["timings"]["warm"] for g in got] == [False, True, True]
    assert sockets == 1


async def test_the_pages_plausibility_rule_is_the_routers() -> None:
    """report.js drops what the router would refuse, by the same rule: every case of the
    protocol's test gives the same answer in the page (NaN and infinity have no JSON form);
    a record keeps only the wire fields, EventSource reported as ``sse``."""
    cases = [fields for fields, _ in IMPLAUSIBLE_CASES
             if all(not isinstance(v, float) or math.isfinite(v) for v in fields.values())]
    cases.append({})
    records = [msgspec.to_builtins(protocol_record(**fields)) for fields in cases]
    async with world() as w, browser_on(w) as page:
        got = await page.evaluate(f"""(async () => {{
              const report = await import("{w.router_url}/v1/edge/client/report.js");
              const answers = {json.dumps(records)}.map((r) => report.implausible(r));
              const mapped = report.timingsRecord({{transport: "eventsource",
                http_version: "HTTP/2", region: "r", first_token_ms: 5, render_ms: 6,
                dns_ms: null, inter_token_ms: [1], navigation: {{}}, long_tasks: 0}});
              const ws = report.timingsRecord({{transport: "websocket", http_version: "",
                region: "r", first_token_ms: 5}});
              return {{answers, mapped, ws}}; }})()""")
    assert got["answers"] == [implausible(protocol_record(**fields)) for fields in cases]
    assert got["mapped"] == {"transport": "sse", "http_version": "HTTP/2", "region": "r",
                             "first_token_ms": 5, "render_ms": 6}
    assert got["ws"]["http_version"] == "HTTP/1.1"


FETCH_FROM_PAGE = """(async (url, init) => {
  try {
    const r = await fetch(url, init);
    return {status: r.status, stream: r.headers.get("x-firstbyte-stream"),
            body: await r.text()};
  } catch (err) { return {blocked: err.name}; }
})"""


async def test_an_unlisted_origin_is_blocked_by_the_browser(
        caplog: pytest.LogCaptureFixture) -> None:
    async with world() as w:
        token = await w.mint()
        init = {"method": "POST", "headers": {"authorization": f"Bearer {token}",
                                              "content-type": "application/json"},
                "body": json.dumps({"model": "sim-instant", "max_tokens": 3, "stream": True,
                                    "messages": [{"role": "user", "content": "hi"}]})}
        url = f"{w.router_url}/v1/chat/completions"
        listed_page = browser_on(w)
        async with listed_page as page:
            listed = await page.evaluate(f"{FETCH_FROM_PAGE}({json.dumps(url)}, "
                                         f"{json.dumps(init)})")
        # Same page, same router, but served as http://localhost:PORT: not in allow_origins.
        async with browser_on(w, origin=f"http://localhost:{w.page_port}") as page:
            unlisted = await page.evaluate(f"{FETCH_FROM_PAGE}({json.dumps(url)}, "
                                           f"{json.dumps(init)})")
            # Through the client: the browser says only "Failed to fetch"; the error says
            # the stream never started and what that may be, not that it "broke".
            client = await page.evaluate(stream_script(f"{w.router_url}/v1", token,
                                                       "sse-fetch", 3))
    assert listed["status"] == 200
    assert listed["stream"]  # x-firstbyte-stream is exposed to the page
    assert "[DONE]" in listed["body"]
    assert unlisted == {"blocked": "TypeError"}
    assert client["error"] == "StreamBrokenError", client
    assert client["message"].startswith("stream not started: 6 tries failed: "), client
    assert client["message"].endswith("(the router is unreachable, or this page's origin is"
                                      " not in its cors.allow_origins)"), client
    assert any("localhost" in r.getMessage() and "cors.allow_origins" in r.getMessage()
               for r in caplog.records)


async def test_tokens_refused_in_the_page() -> None:
    async with world(auth={"client_token_max_ttl_s": 30.0}) as w:
        expired = await w.mint(ttl_s=1)
        await asyncio.sleep(1.1)
        other = await w.mint(OTHER_KEY)
        base = f"{w.router_url}/v1"
        async with browser_on(w) as page:
            gone = await page.evaluate(stream_script(base, expired, "sse-fetch", 5))
            ws_gone = await page.evaluate(stream_script(base, expired, "eventsource", 5))
            # The browser hides a refused upgrade's status (1006): the client asks for it.
            socket_gone = await page.evaluate(stream_script(base, expired, "websocket", 5))
            poll_gone = await page.evaluate(stream_script(base, expired, "longpoll", 5))
            # A fresh token of the other key cannot resume this key's stream.
            fresh = await w.mint()
            started = await page.evaluate(f"""(async () => {{
              const r = await fetch("{base}/streams", {{method: "POST",
                headers: {{authorization: "Bearer {fresh}", "content-type": "application/json"}},
                body: JSON.stringify({{model: "sim-instant", max_tokens: 3,
                                       messages: [{{role: "user", "content": "hi"}}]}})}});
              return (await r.json()).stream; }})()""")
            foreign = await page.evaluate(FETCH_FROM_PAGE + f"""("{base}/streams/{started}",
              {{headers: {{authorization: "Bearer {other}"}}}})""")
    assert gone["error"] == "APIError"
    assert (gone["status"], gone["code"]) == (401, "client_token_expired")
    assert ws_gone["error"] == "APIError"
    assert ws_gone["status"] == 401
    for refused in (socket_gone, poll_gone):
        assert refused["error"] == "APIError", refused
        assert (refused["status"], refused["code"]) == (401, "client_token_expired")
    assert foreign["status"] == 404
    assert json.loads(foreign["body"])["error"]["code"] == "stream_not_found"


def _retry_script(base_url: str, token: str, transport: str, max_tokens: int,
                  retries: int) -> str:
    """Stream once with a new client of ``retries``; the text, or the error seen."""
    options = {"baseUrl": base_url, "token": token, "transport": transport, "idleTimeoutS": 10,
               "retries": retries}
    request = {"model": "sim-instant", "messages": MESSAGES, "max_tokens": max_tokens,
               "seed": 11}
    return f"""(async () => {{
  const stream = new fb.Client({json.dumps(options)}).stream({json.dumps(request)});
  try {{
    for await (const _ of stream);
  }} catch (err) {{
    return {{ error: err.name, status: err.status ?? null, code: err.code ?? null,
             retryAfter: err.retryAfter ?? null, retried: stream.retry.used,
             waitedS: stream.retry.waitedS }};
  }}
  return {{ text: stream.text, timings: stream.timings }};
}})()"""


async def test_a_rate_limited_stream_is_sent_again_after_retry_after() -> None:
    """The key's rate (1/s, burst 1) is spent just before the page's stream: the router
    answers 429 with ``Retry-After: 1``; the page waits that long and streams, on every
    transport (a WebSocket refusal carries its status). With ``retries: 0`` the page sees
    the 429."""
    async with world(limits={"requests_per_s_per_key": 1, "request_burst_per_key": 1}) as w:
        expected = await w.reference_text(8)
        token = await w.mint()
        body = {"model": "sim-instant", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1}
        async with httpx.AsyncClient(verify=False) as http, browser_on(w) as page:

            async def spend_the_rate() -> None:
                answer = await http.post(f"{w.router_url}/v1/chat/completions", json=body,
                                         headers={"authorization": f"Bearer {KEY}"})
                assert answer.status_code in (200, 429)
                if answer.status_code == 429:  # the token was already spent
                    await asyncio.sleep(float(answer.headers["retry-after"]))
                    await spend_the_rate()

            for transport in TRANSPORTS:
                await spend_the_rate()
                started = asyncio.get_running_loop().time()
                got = await page.evaluate(_retry_script(f"{w.router_url}/v1", token, transport,
                                                        8, 2))
                took_s = asyncio.get_running_loop().time() - started
                assert "error" not in got, (transport, got)
                assert got["text"] == expected, transport
                assert took_s >= 0.9, transport  # waited for Retry-After (1 s, whole seconds)
            await spend_the_rate()
            refused = await page.evaluate(_retry_script(f"{w.router_url}/v1", token,
                                                        "sse-fetch", 8, 0))
            # The browser logs each refused fetch; nothing else went wrong on the page.
            assert [p for p in page.problems() if "status of 429" not in p] == []
    assert (refused["status"], refused["code"]) == (429, "key_rate_limited")


async def test_a_websocket_refusal_is_waited_for_as_the_routers_retry_after_says() -> None:
    """The key's bucket holds one request a 100 s: the page's stream is refused with ~100 s,
    over SSE as ``Retry-After`` and over WebSocket as the ``error`` message's
    ``retry_after``. On both the page's APIError has that figure as ``retryAfter`` and the
    retry budget (5 s) decides no wait at all (none could end in a retry), where a 1 s
    backoff would have spent both retries waiting 3 s for nothing."""
    async with world(limits={"requests_per_s_per_key": 0.01, "request_burst_per_key": 1}) as w:
        token = await w.mint()
        body = {"model": "sim-instant", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 1}
        async with httpx.AsyncClient(verify=False) as http, browser_on(w) as page:
            spent = await http.post(f"{w.router_url}/v1/chat/completions", json=body,
                                    headers={"authorization": f"Bearer {KEY}"})
            assert spent.status_code == 200
            refused = {transport: await page.evaluate(_retry_script(
                f"{w.router_url}/v1", token, transport, 8, 2))
                for transport in ("sse-fetch", "websocket")}
    for transport, got in refused.items():
        assert (got["error"], got["status"], got["code"]) == (
            "APIError", 429, "key_rate_limited"), transport
        assert got["retryAfter"] > 90, transport
        assert (got["retried"], got["waitedS"]) == (0, 0), transport
    # The socket's refusal came after SSE's: the same bucket, a figure no larger.
    assert refused["websocket"]["retryAfter"] <= refused["sse-fetch"]["retryAfter"]


async def test_a_base_url_with_or_without_its_trailing_slash_builds_one_path() -> None:
    """A bare origin's pathname is "/": the client built "//chat/completions" from it."""
    async with world() as w, browser_on(w) as page:
        built = await page.evaluate("""(() => [
          "https://r.example/v1", "https://r.example/v1/", "https://r.example",
          "https://r.example/",
        ].map((baseUrl) => new fb.Client({baseUrl, token: "t"}).url("/v1/chat/completions")))()""")
    assert built == ["https://r.example/v1/chat/completions"] * 2 + [
        "https://r.example/chat/completions"] * 2


async def test_a_websocket_upgrade_refused_by_a_draining_router_is_its_503() -> None:
    """A draining router refuses a new upgrade ``503 draining`` (``Retry-After: 1``), which
    the browser hides (1006 before open): the page asks why, and its APIError is that 503,
    as over SSE, not a cut resent with the resume backoff."""
    async with world() as w:
        assert w.app is not None
        token = await w.mint()
        w.app.state.start_draining()
        async with browser_on(w) as page:
            got = {transport: await page.evaluate(_retry_script(
                f"{w.router_url}/v1", token, transport, 8, 0))
                for transport in ("sse-fetch", "websocket")}
    for transport, seen in got.items():
        assert (seen["error"], seen["status"], seen["code"], seen["retryAfter"]) == (
            "APIError", 503, "draining", 1), (transport, seen)
