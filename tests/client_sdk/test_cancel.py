"""An application's cancel of a task reading a stream is never lost.

Cancelling is how an application stops a stream it no longer wants (a user pressed stop, an
``asyncio.timeout`` around the request ran out). Two spellings in the SDK used to eat such a
cancel when it landed at the wrong moment, and the task ran on as if never cancelled:
``suppress(CancelledError)`` around awaiting the stream's reader while the stream closed, and
Python 3.11's ``asyncio.wait_for`` returning the result of a queue read that completed at the
moment of the cancel. Here cancels land around the ends of many requests; every one that came
before its request's end must end its task as cancelled.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY, Stack

MESSAGES = [{"role": "user", "content": "Tell me about latency."}]
ROUNDS = 150


async def read_all(client: AsyncClient) -> str:
    async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=4) as stream:
        return "".join([delta.text async for delta in stream])


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"),
                                                  ("websocket", "1.1")])
async def test_a_cancel_at_any_moment_of_a_stream_ends_the_task_cancelled(
    stack: Stack, transport: str, http: str,
) -> None:
    rng = random.Random(7)
    async with AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file,
                           transport=transport, http=http) as client:
        assert await read_all(client)
        # The cancel's moment follows the requests' length on this machine now (a cancelled
        # request costs the next one a new connection, so it varies): later after a cancel that
        # landed inside a request, earlier after one that came after its end. The cancels
        # cluster around the ends of requests, where both lost cancels lived, and land on both
        # sides of them.
        delay_s = 0.005
        outcomes = {"cancelled": 0, "lost": 0, "hung": 0, "finished first": 0}
        for _ in range(ROUNDS):
            task = asyncio.create_task(read_all(client))
            await asyncio.sleep(delay_s * rng.uniform(0.5, 1.5))
            requested = task.cancel()
            done, _ = await asyncio.wait([task], timeout=5.0)
            if not done:
                outcomes["hung"] += 1
                task.cancel()
            elif task.cancelled():
                outcomes["cancelled"] += 1
                delay_s *= 1.2
            elif requested:
                outcomes["lost"] += 1  # returned normally although cancelled while running
            else:
                outcomes["finished first"] += 1
                delay_s /= 1.2
        assert outcomes["lost"] == 0, outcomes
        assert outcomes["hung"] == 0, outcomes
        # The moments covered both: cancels inside requests, and requests done before them.
        assert outcomes["cancelled"] >= ROUNDS // 5, outcomes
        assert outcomes["finished first"] >= ROUNDS // 5, outcomes
        assert await read_all(client)  # and the client still serves
