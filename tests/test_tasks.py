"""``firstbyte.tasks.cancel_and_wait``: stops a task, never swallows its caller's cancel."""

from __future__ import annotations

import asyncio

import pytest

from firstbyte.tasks import cancel_and_wait


async def slow_to_stop(stopped: asyncio.Event) -> None:
    """A task that takes a while to finish once cancelled (as closing a connection does)."""
    try:
        await asyncio.sleep(60)
    finally:
        await asyncio.sleep(0.05)
        stopped.set()


async def test_stops_the_task_and_returns() -> None:
    stopped = asyncio.Event()
    task = asyncio.create_task(slow_to_stop(stopped))
    await asyncio.sleep(0)
    await cancel_and_wait(task)
    assert task.cancelled()
    assert stopped.is_set()


async def test_the_callers_own_cancel_while_waiting_is_raised() -> None:
    stopped = asyncio.Event()
    helper = asyncio.create_task(slow_to_stop(stopped))
    await asyncio.sleep(0)
    after: list[str] = []

    async def owner() -> None:
        await cancel_and_wait(helper)
        after.append("ran on")  # what the suppress(CancelledError) spelling did

    task = asyncio.create_task(owner())
    await asyncio.sleep(0.01)  # owner is waiting for helper to stop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert after == []
    await stopped.wait()  # the helper still finished stopping
    assert helper.cancelled()


async def test_what_the_task_raised_is_raised() -> None:
    async def fails_on_cancel() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RuntimeError("closing failed") from None

    task = asyncio.create_task(fails_on_cancel())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="closing failed"):
        await cancel_and_wait(task)
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    await cancel_and_wait(done)  # already finished: returns at once
