"""read_body's deadline between two parts of a body: a stall is a BodyTimeout, a cancel
from outside stays a cancel, and a part that comes in time leaves no timer behind."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from firstbyte.router.asgi import BodyTimeout, Message, read_body


def _parts(*bodies: bytes) -> list[Message]:
    return [
        {"type": "http.request", "body": b, "more_body": i < len(bodies) - 1}
        for i, b in enumerate(bodies)
    ]


async def test_parts_in_time_are_joined_and_leave_no_timer() -> None:
    queue = _parts(b"ab", b"cd", b"e")

    async def receive() -> Message:
        await asyncio.sleep(0)  # each part comes a loop turn later
        return queue.pop(0)

    assert await read_body(receive, 100, timeout_s=5.0) == b"abcde"
    # The timers were cancelled: the task is not cancelled later by a stale one.
    await asyncio.sleep(0.05)
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_stalled_body_is_a_body_timeout() -> None:
    stalled = asyncio.Event()

    async def receive() -> Message:
        await stalled.wait()
        return _parts(b"late")[0]

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BodyTimeout):
        await read_body(receive, 100, timeout_s=0.05)
    assert loop.time() - started >= 0.05
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_cancel_from_outside_is_not_a_timeout() -> None:
    async def receive() -> Message:
        await asyncio.Event().wait()
        raise AssertionError("never")

    reader = asyncio.create_task(read_body(receive, 100, timeout_s=5.0))
    await asyncio.sleep(0.01)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert reader.cancelled()



async def test_a_part_that_outlives_the_deadline_leaves_no_cancel_behind() -> None:
    """A receive() that takes the deadline's cancel and answers anyway (as a server may,
    finishing what it had): the part is read, and the task is not left marked cancelling,
    which would turn a later deadline's expiry into a plain cancel."""

    async def receive() -> Message:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return _parts(b"done")[0]

    assert await read_body(receive, 100, timeout_s=0.02) == b"done"
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0
