"""Disconnect.unless_gone: the wait for a result (the upstream's head) while the client may
go: True when the result came first, False when the client went first, a cancel from
outside stays a cancel. A plain future is awaited itself and cancelled if the client goes
(nothing runs in it); a task is left running for the caller to decide."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from firstbyte.router.asgi import Disconnect, Message
from firstbyte.router.hosting.disconnected import EXTENSION as DISCONNECTED


async def _never() -> Message:
    await asyncio.Event().wait()
    raise AssertionError


def _disconnect() -> tuple[Disconnect, asyncio.Future[None]]:
    gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    return Disconnect(_never, {"extensions": {DISCONNECTED: gone}}), gone


async def test_a_result_first_is_true_and_leaves_the_listener_as_it_was() -> None:
    disconnect, gone = _disconnect()
    work: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(work.set_result, 7)
    assert await disconnect.unless_gone(work) is True
    assert work.result() == 7
    assert not gone.done()
    gone.set_result(None)  # the client goes later: nothing of the wait's is left to run
    await asyncio.sleep(0)
    assert work.result() == 7
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0


@pytest.mark.parametrize("kind", ["future", "task"])
async def test_a_client_gone_first_is_false(kind: str) -> None:
    disconnect, gone = _disconnect()
    loop = asyncio.get_running_loop()
    work: asyncio.Future[Any]
    work = loop.create_future() if kind == "future" else asyncio.ensure_future(_never())
    loop.call_soon(gone.set_result, None)
    assert await disconnect.unless_gone(work) is False
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0  # no cancel of ours left over
    if kind == "future":
        assert work.cancelled()  # a result nobody will read: set by nobody now
    else:
        await asyncio.sleep(0)
        assert not work.done()  # a task runs on: the caller decides
        work.cancel()


async def test_done_already_answers_without_waiting() -> None:
    disconnect, gone = _disconnect()
    work: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    work.set_result(1)
    gone.set_result(None)
    assert await disconnect.unless_gone(work) is True
    disconnect, gone = _disconnect()
    gone.set_result(None)
    pending: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    assert await disconnect.unless_gone(pending) is False
    assert not pending.done()


@pytest.mark.parametrize("client_gone_too", [False, True])
async def test_a_cancel_from_outside_stays_a_cancel(client_gone_too: bool) -> None:
    disconnect, gone = _disconnect()
    work: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(disconnect.unless_gone(work))
    await asyncio.sleep(0)
    waiting.cancel()
    if client_gone_too:
        gone.set_result(None)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert waiting.cancelled()


async def test_a_result_set_in_the_turn_the_client_went_is_true() -> None:
    # Both in one loop turn, in either order: the result is there when the wait ends.
    for result_first in (True, False):
        disconnect, gone = _disconnect()
        work: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def both(result_first: bool = result_first, work: Any = work, gone: Any = gone) -> None:
            if result_first:
                work.set_result(3)
                gone.set_result(None)
            else:
                gone.set_result(None)
                work.set_result(3)

        asyncio.get_running_loop().call_soon(both)
        assert await disconnect.unless_gone(work) is True
        assert work.result() == 3
