"""Prewarm in headless Chromium against the real router and sim: ``client.prewarm()`` opens
the connection (and, for a preflighted client, fills the preflight cache) so the first
message goes warm and preflight-free; ``warmOnIntent`` warms on focus, keeps warm while the
page is visible, stops while it is hidden (its window minimized) and warms again when it is
visible; the schedule behind it, with the clock passed in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import trustme

from firstbyte.benchmarks.browser import Page, prewarm_script
from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import browser_on, spki_flag, stream_script, world
from tests.client_sdk.test_client import MESSAGES

pytestmark = pytest.mark.usefixtures("chromium")


def sent(page: Page, mark: int, *, method: str | None = None, path: str | None = None
         ) -> list[str]:
    """The URLs of the requests the page sent since event ``mark`` (of ``method``, to
    ``path``)."""
    return [p["request"]["url"] for m, p in page.events()[mark:]
            if m == "Network.requestWillBeSent"
            and (method is None or p["request"]["method"] == method)
            and (path is None or p["request"]["url"].split("?")[0].endswith(path))]


def preflights(page: Page, method: str) -> list[str]:
    """The URLs of the CORS preflights the page sent for a ``method`` request, whenever their
    events arrived: DevTools may report a preflight after the request it was for, so after a
    mark taken once that request's promise resolved."""
    return [p["request"]["url"] for m, p in page.events()
            if m == "Network.requestWillBeSent" and p["request"]["method"] == "OPTIONS"
            and p["request"]["headers"].get("Access-Control-Request-Method") == method]


async def test_a_prewarmed_first_message_goes_warm_without_a_preflight(tmp_path: Path) -> None:
    """HTTPS and HTTP/2, the page on another origin: prewarm opens the connection with one
    GET /v1/edge/warm; the first stream then reuses it (no connect, no TLS), sends no
    OPTIONS, and its Timings say ``prewarmed``. A second stream is warm but not prewarmed."""
    async with world(trustme.CA(), str(tmp_path)) as w:
        token = await w.mint()
        base = f"{w.router_url}/v1"
        async with browser_on(w, flags=(spki_flag(w),), modules=w.page_origin) as page:
            mark = len(page.events())
            took = await page.evaluate(prewarm_script(base, token, "sse-fetch"))
            warm_requests = sent(page, mark)
            mark = len(page.events())
            first = await page.evaluate(stream_script(base, token, "sse-fetch", 5))
            first_preflights = sent(page, mark, method="OPTIONS")
            second = await page.evaluate(stream_script(base, token, "sse-fetch", 5))
            assert page.problems() == []
    assert took["ms"] > 0
    assert took["prompt"] is None  # no conversation given: the connection only
    assert warm_requests == [f"{base}/edge/warm"]
    assert "error" not in first, first
    t = first["timings"]
    assert t["http_version"] == "HTTP/2"
    assert t["warm"]
    assert t["prewarmed"]
    assert t["tls_handshake_ms"] is None
    assert first_preflights == []
    assert second["timings"]["warm"]
    assert not second["timings"]["prewarmed"]


async def test_a_preflighted_clients_prewarm_fills_the_preflight_cache() -> None:
    """``simpleStart: false``: the start sends Authorization, so it needs a preflight; the
    prewarm's OPTIONS has it cached, and the first stream sends none."""
    async with world() as w:
        token = await w.mint()
        base = f"{w.router_url}/v1"
        options = {"simpleStart": False}
        async with browser_on(w) as page:
            await page.evaluate(prewarm_script(base, token, "sse-fetch", options=options))
            got = await page.evaluate(stream_script(base, token, "sse-fetch", 5,
                                                    options=options))
            prewarm_options = sent(page, 0, method="OPTIONS", path="/chat/completions")
            assert page.problems() == []
    # The prewarm's plain OPTIONS and its preflight; none for the stream's POST.
    assert len(prewarm_options) == 2, prewarm_options
    assert len(preflights(page, "OPTIONS")) == 1
    assert "error" not in got, got
    assert preflights(page, "POST") == []
    assert got["timings"]["prewarmed"]


async def test_a_websocket_prewarm_opens_the_socket_the_stream_uses() -> None:
    async with world() as w:
        token = await w.mint()
        base = f"{w.router_url}/v1"
        async with browser_on(w) as page:
            await page.evaluate(prewarm_script(base, token, "websocket"))
            got = await page.evaluate(stream_script(base, token, "websocket", 5))
            sockets = sum(1 for m, _ in page.events() if m == "Network.webSocketCreated")
    assert "error" not in got, got
    assert got["timings"]["warm"]
    assert got["timings"]["prewarmed"]
    assert sockets == 1


KEEP_WARM_S = 0.5
INTENT_PAGE = """(() => {
  const prompt = document.createElement("textarea");
  prompt.id = "prompt";
  document.body.append(prompt);
  %s
  window.warmer = client.warmOnIntent(prompt, {keepWarmS: %s});
  return true;
})()"""


async def _until_visibility(page: Page, state: str) -> str:
    """Wait (up to 5 s) until the page's ``document.visibilityState`` is ``state``; then a
    moment more, so a warm sent just before the change is counted before, not after."""
    for _ in range(50):
        got: str = await page.evaluate("document.visibilityState")
        if got == state:
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.2)
    return got


async def _warms_during(page: Page, seconds: float) -> int:
    mark = len(page.events())
    await asyncio.sleep(seconds)
    return len(sent(page, mark, method="GET", path="/edge/warm"))


async def test_intent_warms_keeps_warm_while_visible_and_stops_while_hidden() -> None:
    async with world() as w:
        token = await w.mint()
        base = f"{w.router_url}/v1"
        client = stream_script(base, token, "sse-fetch", 5).split("const stream")[0]
        client_lines = client.split("out.textContent = \"\";", 1)[1]
        async with browser_on(w) as page:
            assert await page.evaluate(INTENT_PAGE % (client_lines, KEEP_WARM_S))
            before_intent = await _warms_during(page, 2 * KEEP_WARM_S)
            mark = len(page.events())
            await page.evaluate("document.getElementById('prompt').focus(); true")
            await page.evaluate("""document.getElementById('prompt').dispatchEvent(
                new KeyboardEvent('keydown', {key: 'h'})); true""")
            await asyncio.sleep(0.2)
            on_intent = len(sent(page, mark, path="/edge/warm"))
            kept = await _warms_during(page, 4 * KEEP_WARM_S)
            await page.set_visible(False)
            state_hidden = await _until_visibility(page, "hidden")
            hidden = await _warms_during(page, 4 * KEEP_WARM_S)
            mark = len(page.events())
            await page.set_visible(True)
            await asyncio.sleep(0.3)
            on_visible = len(sent(page, mark, path="/edge/warm"))
            got = await page.evaluate(stream_script(base, token, "sse-fetch", 5))
            await page.evaluate("window.warmer.stop(); true")
            stopped = await _warms_during(page, 3 * KEEP_WARM_S)
            assert page.problems() == []
    assert before_intent == 0  # no intent, no request
    assert on_intent == 1  # focus warms; the keystroke right after does not again
    # Every KEEP_WARM_S while visible: at least 2 in 4 intervals on a busy machine, and never
    # more than one per interval.
    assert 2 <= kept <= 5
    assert state_hidden == "hidden"
    assert hidden == 0
    assert on_visible >= 1  # back from hidden after more than KEEP_WARM_S: warmed at once
    assert "error" not in got, got
    assert got["timings"]["warm"]
    assert got["timings"]["prewarmed"]
    assert stopped == 0


SCHEDULE = """(async () => {
  const { WarmSchedule } = await import("%s/v1/edge/client/warm.js");
  const s = new WarmSchedule({ keepWarmS: 20, idleS: 600 });
  const out = [];
  out.push(s.nextAt(0));            // no intent yet: nothing to keep warm
  out.push(s.intent(1));            // first intent: warm now
  s.warmed(1);
  out.push(s.intent(5));            // warmed 4 s ago: not again
  out.push(s.nextAt(5));            // keep-warm due 20 s after the warm
  out.push(s.visibility(false, 10));
  out.push(s.nextAt(10));           // hidden: no keep-warm
  out.push(s.intent(12));           // intent while hidden: no request
  out.push(s.visibility(true, 15)); // visible again, warmed 14 s ago: still warm
  out.push(s.visibility(false, 16));
  out.push(s.visibility(true, 50)); // visible after 49 s: warm at once
  s.warmed(50);
  out.push(s.nextAt(700));          // idle 688 s since the last intent: stop
  s.used(700);                      // a stream: intent and warmth
  out.push(s.nextAt(700));
  return out;
})()"""


async def test_the_warm_schedule_with_the_clock_passed_in() -> None:
    async with world() as w, browser_on(w) as page:
        got: list[Any] = await page.evaluate(SCHEDULE % w.router_url)
    assert got == [None, True, False, 21, False, None, False, False, False, True, None, 720], \
        json.dumps(got)


async def test_a_page_warms_the_prompt_without_a_preflight() -> None:
    """``prewarm({model, messages})`` from the page: the conversation goes to POST
    /v1/edge/warm as a simple request (no OPTIONS), the router answers what it warmed, and the
    next message finds its prefix cached on the backend it is routed to."""
    async with world() as w:
        token = await w.mint()
        base = f"{w.router_url}/v1"
        long_history = [{"role": "user", "content": "".join(f" w{i:03d}" for i in range(600))}]
        async with browser_on(w) as page:
            mark = len(page.events())
            got = await page.evaluate(prewarm_script(
                base, token, "sse-fetch", prompt={"model": "sim-instant",
                                                  "messages": long_history}))
            posts = sent(page, mark, method="POST", path="/edge/warm")
            preflights = sent(page, mark, method="OPTIONS")
            streamed = await page.evaluate(f"""(async () => {{
              const client = new fb.Client({{baseUrl: "{base}", token: "{token}"}});
              const stream = client.stream({{model: "sim-instant", max_tokens: 2,
                messages: {json.dumps([*long_history, *MESSAGES])}}});
              for await (const _ of stream);
              return stream.usage; }})()""")
            assert page.problems() == []
    assert got["prompt"]["warmed"] is True, got
    assert got["prompt"]["prompt_tokens"] >= 600
    assert len(posts) == 1
    assert preflights == []
    assert streamed["prompt_tokens_details"]["cached_tokens"] >= 592  # whole 16-token blocks


async def test_a_cold_pages_long_poll_stream_sends_no_preflight() -> None:
    """Long-poll from a cold page on another origin: the start and every poll are simple
    requests (the token in the URL, no header), so the page sends no OPTIONS at all, and the
    stream is whole."""
    async with world() as w:
        token = await w.mint()
        base = f"{w.router_url}/v1"
        expected = await w.reference_text(40)
        async with browser_on(w) as page:
            mark = len(page.events())
            got = await page.evaluate(stream_script(base, token, "longpoll", 40))
            polls = sent(page, mark, method="GET", path="/poll")
            preflights = sent(page, mark, method="OPTIONS")
            assert page.problems() == []
    assert "error" not in got, got
    assert got["text"] == expected
    assert polls, "the stream ended in its first batch: no poll was sent to check"
    assert preflights == []
