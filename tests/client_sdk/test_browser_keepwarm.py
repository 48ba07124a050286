"""The browser's keep-warm (``warmOnIntent``) in headless Chromium: what counts as the user's
activity, and what a refused keep-warm does.

The browser client has one origin (no regions to set one aside, unlike the Python SDK's
keep-warm, test_keepwarm_health.py), so a refusal changes only the keep-warm's own pace:

- A keep-warm ``GET /v1/edge/warm`` is the client's own request, not the user's: it keeps the
  connection open but never keeps the keep-warm going, which stops ``idleS`` after the user's
  last intent or stream. Counting it as activity (it set the client's last use, which the
  warmer read as the user's) kept a visible page pinging forever.
- A ``429`` or ``503`` (a balancer or CDN in front of the router, the router's own ``503
  overloaded`` for a new connection to a same-origin page, or its ``503 draining`` while it
  shuts down) says when to come back: no warm goes before its ``Retry-After``, on intent
  either.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import KEY, World, browser_on, world
from tests.router.test_client_timings import metric

pytestmark = [pytest.mark.usefixtures("chromium"), pytest.mark.slow]

KEEP_WARM_S = 0.3
WARMER_PAGE = """(() => {
  const prompt = document.createElement("textarea");
  prompt.id = "prompt";
  document.body.append(prompt);
  const client = new fb.Client({ baseUrl: %(base)s, token: %(token)s });
  window.warmer = client.warmOnIntent(prompt, { keepWarmS: %(keep)s, idleS: %(idle)s });
  prompt.focus();
  return true;
})()"""
KEYSTROKE = """document.getElementById('prompt').dispatchEvent(
  new KeyboardEvent('keydown', {key: 'h'})); true"""


def warmer_page(base: str, token: str, idle_s: float) -> str:
    return WARMER_PAGE % {"base": repr(base), "token": repr(token), "keep": KEEP_WARM_S,
                          "idle": idle_s}


async def router_warms(router_url: str) -> float:
    """``GET /v1/edge/warm`` requests the router answered so far."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{router_url}/metrics",
                               headers={"authorization": f"Bearer {KEY}"})).text
    return metric(text, "firstbyte_router_requests_total", endpoint="warm", outcome="ok")


async def test_keep_warm_stops_idle_s_after_the_users_intent_not_after_its_own_pings() -> None:
    idle_s = 1.2
    async with world() as w:
        token = await w.mint()
        async with browser_on(w) as page:
            assert await page.evaluate(warmer_page(f"{w.router_url}/v1", token, idle_s))
            # The focus warms, then every KEEP_WARM_S until idle_s after it; then nothing.
            await asyncio.sleep(idle_s + 0.6)
            while_active = await router_warms(w.router_url)
            await asyncio.sleep(6 * KEEP_WARM_S)
            idle = await router_warms(w.router_url) - while_active
            await page.evaluate("window.warmer.stop(); true")
            assert page.problems() == []
    assert idle == 0, f"{idle} keep-warms after idleS (the user idle since the focus)"
    assert 2 <= while_active <= idle_s / KEEP_WARM_S + 2


class RefusingFront:
    """What a balancer or CDN in front of a page's router answers while it refuses: ``503``
    with ``Retry-After`` (and the CORS headers a front serving that page must add, or the page
    could not read it); keeps its connections open and notes when each request came."""

    def __init__(self, page_origin: str, retry_after: int | str) -> None:
        self.page_origin = page_origin
        self.retry_after = str(retry_after)
        self.arrivals: list[tuple[str, str, float]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = (b'{"error": {"message": "Service unavailable.", "type": "server_error",'
                b' "code": "overloaded"}}')
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target = head.decode("latin-1").split(" ", 2)[:2]
                self.arrivals.append((method, target.split("?")[0], time.monotonic()))
                writer.write(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    b"retry-after: %s\r\naccess-control-allow-origin: %s\r\n"
                    b"access-control-expose-headers: retry-after\r\ncontent-length: %d\r\n\r\n"
                    % (self.retry_after.encode(), self.page_origin.encode(), len(body))
                    + body)
                await writer.drain()
        writer.close()


@contextlib.asynccontextmanager
async def refusing_front(page_origin: str, retry_after: int | str
                         ) -> AsyncIterator[tuple[RefusingFront, str]]:
    front = RefusingFront(page_origin, retry_after)
    server = await asyncio.start_server(front.handle, "127.0.0.1", 0)
    async with server:
        yield front, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_refused_keep_warm_waits_its_retry_after_even_on_intent() -> None:
    retry_after_s = 2
    async with world() as w, refusing_front(w.page_origin, retry_after_s) as (front, url):
        token = await w.mint()
        async with browser_on(w) as page:  # the modules from the router, the warms to the front
            assert await page.evaluate(warmer_page(f"{url}/v1", token, 600))
            await asyncio.sleep(4 * KEEP_WARM_S)
            await page.evaluate(KEYSTROKE)  # intent, past KEEP_WARM_S, within the Retry-After
            await asyncio.sleep(retry_after_s + 0.8 - 4 * KEEP_WARM_S)
            await page.evaluate("window.warmer.stop(); true")
    warms = [at for method, path, at in front.arrivals if path == "/v1/edge/warm"]
    assert [(method, path) for method, path, _ in front.arrivals] == [("GET", "/v1/edge/warm")] * 2
    # The second came once the first's Retry-After was over, not KEEP_WARM_S after it.
    assert warms[1] - warms[0] >= retry_after_s - 0.05


REFUSED_SCHEDULE = """(async () => {
  const { WarmSchedule } = await import("%s/v1/edge/client/warm.js");
  const s = new WarmSchedule({ keepWarmS: 20, idleS: 600 });
  const out = [];
  out.push(s.intent(0));            // first intent: warm now
  s.warmed(0);
  s.refused(0.1, 60);               // 503, Retry-After: 60
  out.push(s.nextAt(1));            // not at 20: after the Retry-After
  out.push(s.intent(30));           // intent within it: no request
  out.push(s.visibility(false, 31), s.visibility(true, 59));  // nor on becoming visible
  out.push(s.intent(61));           // past it: warm
  s.warmed(61);
  s.refused(61.1, null);            // no Retry-After: the keep-warm's own pace
  out.push(s.nextAt(62));
  return out;
})()"""


async def test_the_schedule_after_a_refusal_with_the_clock_passed_in() -> None:
    async with world() as w, browser_on(w) as page:
        got = await page.evaluate(REFUSED_SCHEDULE % w.router_url)
    assert got == [True, 60.1, False, False, False, True, 81], got


DRAINING_PREWARM = """(async () => {
  const client = new fb.Client({ baseUrl: %(base)s, token: %(token)s });
  try {
    await client.prewarm();
    return { resolved: true };
  } catch (err) {
    return { name: err.constructor.name, status: err.status, code: err.code,
             retryAfter: err.retryAfter };
  }
})()"""
FAILED_LOAD_503 = "Failed to load resource: the server responded with a status of 503"


async def test_a_draining_routers_warm_refusal_is_read_and_waited_out() -> None:
    """The router's own ``503 draining`` to ``GET /v1/edge/warm`` (it answered 204 while
    draining, so a page kept a connection warm on a router that refused its next stream):
    cross-origin, the page reads it (the CORS headers of the router's answers), ``prewarm()``
    rejects with its APIError, and the keep-warm sends its next warm after the ``Retry-After``
    (1 s), not every ``keepWarmS``. Nothing else is a problem in the page: no unhandled
    rejection, only Chromium's own line for each load answered 503."""
    async with world() as w:
        assert w.app is not None
        token = await w.mint()
        async with browser_on(w) as page:
            assert await page.evaluate(warmer_page(f"{w.router_url}/v1", token, 600))
            await until_warms(w.router_url, 1)
            w.app.state.start_draining()
            drained_at = time.monotonic()
            await asyncio.sleep(2.5)
            warmer = await page.evaluate(
                "(() => { window.warmer.stop(); return { warms: window.warmer.warms,"
                " failures: window.warmer.failures }; })()")
            refused_warms = refused_count(w)
            elapsed_s = time.monotonic() - drained_at
            got = await page.evaluate(DRAINING_PREWARM % {
                "base": repr(f"{w.router_url}/v1"), "token": repr(token)})
            problems = page.problems()
    assert got == {"name": "APIError", "status": 503, "code": "draining", "retryAfter": 1}
    # At keepWarmS 0.3 s the warmer would have sent ~8 in 2.5 s; one a Retry-After at most.
    assert 1 <= refused_warms <= elapsed_s / 1.0 + 1, (refused_warms, elapsed_s)
    assert 1 <= warmer["failures"] <= refused_warms  # a warm in flight at stop() not yet
    assert all(FAILED_LOAD_503 in p for p in problems), problems


def refused_count(w: World) -> int:
    """``GET /v1/edge/warm`` requests the router refused ``draining`` so far."""
    assert w.app is not None
    requests = w.app.state.metrics.requests
    return sum(n for (e, o, _), n in requests.items() if (e, o) == ("warm", "draining"))


async def until_warms(router_url: str, n: int) -> None:
    for _ in range(200):
        if await router_warms(router_url) >= n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"fewer than {n} warms reached the router")


async def test_a_fronts_retry_after_as_an_http_date_is_read_as_seconds_from_now() -> None:
    """A balancer's or an upstream's ``503`` may say ``Retry-After`` as an HTTP-date (RFC 9110
    section 10.2.3), not seconds: the page's APIError has the seconds until it (``parseFloat``
    read the date as no figure at all, so the client fell back to its own backoff); the keep-
    warm and the retry budget wait it out as they would a number. An hour ahead, so no load on
    this machine moves it across a bound."""
    hour_ahead = email.utils.formatdate(time.time() + 3600, usegmt=True)
    async with world() as w, refusing_front(w.page_origin, hour_ahead) as (_, url):
        token = await w.mint()
        async with browser_on(w) as page:
            got = await page.evaluate(DRAINING_PREWARM % {
                "base": repr(f"{url}/v1"), "token": repr(token)})
    assert (got["name"], got["status"], got["code"]) == ("APIError", 503, "overloaded"), got
    assert 3000 < got["retryAfter"] <= 3600, got
