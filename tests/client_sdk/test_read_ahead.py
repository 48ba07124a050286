"""A consumer slower than the server: the SDK reads ahead a bounded number of events, then lets
the transport push back, and still delivers every token once the consumer catches up."""

from __future__ import annotations

import asyncio

import pytest

from firstbyte.client_sdk import client as client_module
from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY, Stack
from tests.client_sdk.test_client import MESSAGES, reference_text

BOUND = 16
TOKENS = 256  # the sim's longest natural answer; this seed's is ~110 tokens, well past BOUND


async def test_read_ahead_is_bounded_for_a_slow_consumer(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "_QUEUE_ITEMS", BOUND)
    expected = await reference_text(stack, TOKENS)
    assert len(expected.split()) > 2 * BOUND
    client = AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file)
    async with client, client.stream(model="sim-instant", messages=MESSAGES,
                                     max_tokens=TOKENS, seed=11) as stream:
        # The whole answer is at the router within this pause ("instant" profile).
        await asyncio.sleep(1.0)
        queue = stream._queue
        assert queue.full()  # it did read ahead, up to the bound (counted in events)
        # ... and stopped there: a batch goes in whole, but only while there is room.
        items = list(queue._queue)  # type: ignore[attr-defined]
        last = items[-1]
        assert queue.qsize() - (len(last) if isinstance(last, list) else 1) < BOUND
        text = "".join([delta.text async for delta in stream])
    assert text == expected
