"""The browser client in headless Chromium, with a response head slower than its idle timeout:
a real ``firstbyte sim --fault delay:ms=...`` process behind a real router.

The router answers a stream's request once its upstream answered (SSE's head, long-poll's
``201``, WebSocket's ``started``), so an upstream slow to answer (a queue, a long prefill)
leaves the client with no stream id when its idle timeout fires. Sending the request again then
ran the model once per stall. The router still answers a probe, so it holds the request: the
client waits for that answer, as the Python SDK does (test_slow_head.py), and every token
arrives once from one engine request. (EventSource's stream is made by a ``POST /v1/streams``
answered at once, and long-poll's start is answered at its ``wait``: either stall has a stream id
and is resumed by it, one resume.) A router that answers nothing (a frozen relay in front of it)
still gets the request again.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import browser_on, stream_script, world
from tests.client_sdk.test_silent_server import FreezingProxy
from tests.client_sdk.test_slow_head import sim_process, sim_requests

pytestmark = [pytest.mark.usefixtures("chromium"), pytest.mark.slow]

HEAD_DELAY_S = 1.5
"""How late the sim answers every request (its ``delay`` fault): past the client's idle timeout."""
IDLE_S = 1
TOKENS = 12
TRANSPORTS = ["sse-fetch", "eventsource", "websocket", "longpoll"]
POLL_WAIT_S = 0.3
"""Long-poll's ``wait``: its start's ``201`` (the stream id) comes at 0.3 s, so the watchdog's
stall comes at 1.3 s, 0.2 s before the head and 0.1 s into a poll (polls end at 0.3 s steps),
which the resume cancels. At the default wait (``IDLE_S / 2``) the stall fell at the head's own
time and at a poll's end: which came first was a race, and so was whether a poll was cut."""
RESUMED_BY_ID = {"eventsource", "longpoll"}


async def test_a_head_later_than_the_idle_timeout_is_waited_for_not_sent_again() -> None:
    async with sim_process(f"delay:ms={HEAD_DELAY_S * 1000:g}") as sim, \
            world(upstream=sim) as w:
        expected = await w.reference_text(TOKENS)  # one engine request, counted below
        token = await w.mint()
        outcomes: dict[str, tuple[float, str | None, str | None, int | None, int]] = {}
        async with browser_on(w) as page:
            for transport in TRANSPORTS:
                before, problems = await sim_requests(sim), len(page.problems())
                got = await page.evaluate(stream_script(
                    f"{w.router_url}/v1", token, transport, TOKENS,
                    options={"idleTimeoutS": IDLE_S, "stallRetries": 3,
                             "pollWaitS": POLL_WAIT_S}))
                # An attempt abandoned during the sim's delay reaches its engine at the end
                # of that delay: count once every attempt would have.
                await asyncio.sleep(HEAD_DELAY_S + 0.3)
                outcomes[transport] = (
                    await sim_requests(sim) - before, got.get("dom"),
                    got.get("error") and f"{got['error']}: {got['message']}",
                    got["timings"]["resumes"],
                    len(page.problems()) - problems,  # failed loads: the probe is not one
                )
    # The EventSource closed at its stall (resumed by its id) is its one aborted load, and the
    # poll in flight at long-poll's stall is its one.
    assert outcomes == {
        transport: (1.0, expected, None, int(transport in RESUMED_BY_ID),
                    int(transport in RESUMED_BY_ID))
        for transport in TRANSPORTS
    }


async def test_a_router_that_answers_nothing_gets_the_request_again() -> None:
    # No answer to the request, and none to the probe that follows (through the same frozen
    # relay): the router is wedged or the path dead, so the request is sent again (and stalls
    # again here), unlike a router that answers the probe (above).
    async with world() as w:
        token = await w.mint()
        proxy = FreezingProxy(w.router_port)
        proxy.frozen = True
        listening = await asyncio.start_server(proxy.handle, "127.0.0.1", 0)
        proxy.port = listening.sockets[0].getsockname()[1]
        async with listening, browser_on(w) as page:  # the modules come from the router
            try:
                got = await page.evaluate(stream_script(
                    f"http://127.0.0.1:{proxy.port}/v1", token, "sse-fetch", TOKENS,
                    options={"idleTimeoutS": 0.5, "stallRetries": 1}))
            finally:
                with contextlib.suppress(Exception):
                    proxy.close()
    assert got["error"] == "StreamStalledError", got
    assert got["message"] == (
        "no event for 0.5 s (heartbeats do not count) after event 0; resumed 1 times")
