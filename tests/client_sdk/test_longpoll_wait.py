"""Long-poll with an idle timeout below ``poll_wait_s``: real ``firstbyte sim`` and
``firstbyte router`` processes.

The router answers ``POST /v1/streams?wait=S`` (the stream id, with the first batch) once the
wait is over or the first events came. Asked to wait longer than the SDK's idle timeout, a
slow head or first token left the SDK without a stream id when its watchdog fired: the stall
was waited out blind (spending ``stall_retries``) instead of resumed by id. The SDK asks for
at most half its idle timeout, so the id comes first and a later stall is resumed by it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.test_client import MESSAGES
from tests.client_sdk.test_slow_head import router_before, sim_answer, sim_process, sim_requests

pytestmark = pytest.mark.slow

IDLE_S = 1.0
HEAD_DELAY_S = 1.25
"""The sim's head (and so its first token) comes this late: past the idle timeout, and before
the watchdog that starts with the ``201`` (at half the idle timeout) fires."""
GAP_S = 1.5
"""After 3 tokens the sim pauses this long: a stall the watchdog sees mid-stream."""
TOKENS = 12


async def test_longpoll_gets_its_stream_id_before_the_watchdog_and_resumes_by_it(
    tmp_path: Path, tls_files: tuple[str, str, str]
) -> None:
    ca_file = tls_files[0]
    async with (
        sim_process(f"delay:ms={HEAD_DELAY_S * 1000:g}", f"stall:after=3,ms={GAP_S * 1000:g}")
        as sim,
        router_before(sim, "longpoll-wait", tmp_path, tls_files) as port,
    ):
        expected = await sim_answer(sim, TOKENS)
        before = await sim_requests(sim)
        text = ""
        async with AsyncClient(
            f"https://localhost:{port}/v1", ROUTER_KEY, ca_file=ca_file,
            transport="longpoll", http="2", idle_timeout_s=IDLE_S,  # poll_wait_s: 10
        ) as client:
            started = time.monotonic()
            async with client.stream(model="sim-instant", messages=MESSAGES,
                                     max_tokens=TOKENS, seed=11) as stream:
                opened_s = time.monotonic() - started
                stream_id = stream.stream_id
                async for delta in stream:
                    text += delta.text
        await asyncio.sleep(0.3)
        engine_requests = await sim_requests(sim) - before
    # The 201 came after the SDK's wait (half the idle timeout), not after the slow head.
    assert stream_id is not None
    assert opened_s < IDLE_S
    # The gap after 3 tokens was resumed by that id (stall_retries: 1, not spent on a blind
    # wait for the head), and the model ran once.
    assert text == expected
    assert stream.stream_id == stream_id
    assert stream.timings.resumes >= 1
    assert engine_requests == 1.0


def test_the_wait_asked_for_is_at_most_half_the_idle_timeout() -> None:
    assert AsyncClient("https://localhost:1/v1", idle_timeout_s=1.0)._poll_wait_s == 0.5
    assert AsyncClient("https://localhost:1/v1", idle_timeout_s=30.0)._poll_wait_s == 10.0
    assert AsyncClient("https://localhost:1/v1", idle_timeout_s=30.0,
                       poll_wait_s=2.0)._poll_wait_s == 2.0
