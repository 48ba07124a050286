"""The browser client's long-poll with an idle timeout below ``pollWaitS``, in headless
Chromium: a real ``firstbyte sim`` process (a slow head, then a mid-stream gap) behind a real
router.

The router answers ``POST /v1/streams?wait=S`` (the stream id, with the first batch) once the
wait is over or the first events came. Asked to wait longer than the client's idle timeout, a
slow head left the page without a stream id when its watchdog fired: the stall was waited out
blind (spending ``stallRetries``), and the later gap ended the stream with
``StreamStalledError``. The client asks for at most half its idle timeout, as the Python SDK
does (test_longpoll_wait.py), so the id comes first and the gap is resumed by it.
"""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import browser_on, stream_script, world
from tests.client_sdk.test_slow_head import sim_process, sim_requests

pytestmark = [pytest.mark.usefixtures("chromium"), pytest.mark.slow]

IDLE_S = 1.0
HEAD_DELAY_S = 1.25
"""The sim's head (and so its first token) comes this late: past the idle timeout, and before
the watchdog that starts with the ``201`` (at half the idle timeout) fires."""
GAP_S = 1.5
"""After 3 tokens the sim pauses this long: a stall the watchdog sees mid-stream."""
TOKENS = 12


async def test_a_long_poll_gets_its_stream_id_before_the_watchdog_and_resumes_by_it() -> None:
    async with sim_process(f"delay:ms={HEAD_DELAY_S * 1000:g}",
                           f"stall:after=3,ms={GAP_S * 1000:g}") as sim, \
            world(upstream=sim) as w:
        expected = await w.reference_text(TOKENS)  # one engine request, counted below
        token = await w.mint()
        async with browser_on(w) as page:
            before = await sim_requests(sim)
            mark = len(page.events())
            got = await page.evaluate(stream_script(
                f"{w.router_url}/v1", token, "longpoll", TOKENS,
                options={"idleTimeoutS": IDLE_S}))  # pollWaitS: 10, stallRetries: 1
            # An attempt sent again would reach the engine at the end of the sim's delay.
            await asyncio.sleep(HEAD_DELAY_S + 0.3)
            engine_requests = await sim_requests(sim) - before
            starts = [p["request"]["url"] for m, p in page.events()[mark:]
                      if m == "Network.requestWillBeSent" and p["request"]["method"] == "POST"]
            polls = [p["request"]["url"] for m, p in page.events()[mark:]
                     if m == "Network.requestWillBeSent"
                     and urlsplit(p["request"]["url"]).path.endswith("/poll")]
    assert "error" not in got, got
    # The gap after 3 tokens was resumed by the stream's id (stallRetries: 1, not spent on a
    # blind wait for the head), every token came once, and the model ran once.
    assert got["dom"] == expected
    assert got["seqs"] == sorted(set(got["seqs"]))
    assert got["timings"]["resumes"] >= 1
    assert engine_requests == 1.0
    # The start and every poll asked the router for half the idle timeout.
    assert len(starts) == 1, starts
    assert polls
    assert {parse_qs(urlsplit(url).query)["wait"][0] for url in starts + polls} == {"0.5"}
