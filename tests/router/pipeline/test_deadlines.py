"""Deadlines on one loop timer: each runs when a timer of its own would have, in order of
its time; a cancelled one never does."""

from __future__ import annotations

import asyncio

from firstbyte.router.pipeline.deadlines import Deadlines


async def test_deadlines_run_at_their_time_in_order_and_cancelled_ones_never() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    ran: list[tuple[str, float]] = []
    start = loop.time()

    def late(name: str) -> None:
        ran.append((name, loop.time() - start))

    deadlines.call_later(0.15, late, "c")
    deadlines.call_later(0.05, late, "a")  # earlier than the armed one: the timer follows
    cancelled = deadlines.call_later(0.02, late, "never")
    deadlines.call_later(0.10, late, "b")
    Deadlines.cancel(cancelled)
    await asyncio.sleep(0.25)
    assert [name for name, _ in ran] == ["a", "b", "c"]
    for (_, at), due in zip(ran, (0.05, 0.10, 0.15), strict=True):
        assert due - 0.002 <= at < due + 0.05  # not before its time (the loop's ms)
    assert len(deadlines) == 0  # run or dropped: nothing kept


async def test_a_deadline_set_by_a_callback_and_one_after_all_ran() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    ran: list[str] = []

    def again(name: str) -> None:
        ran.append(name)
        if name == "first":
            deadlines.call_later(0.02, ran.append, "from the callback")

    deadlines.call_later(0.01, again, "first")
    await asyncio.sleep(0.08)
    assert ran == ["first", "from the callback"]
    deadlines.call_later(0.01, ran.append, "later")  # the timer was disarmed: armed again
    await asyncio.sleep(0.05)
    assert ran[-1] == "later"


async def test_a_failing_callback_is_reported_and_the_others_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[BaseException] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["exception"]))
    try:
        deadlines = Deadlines(loop)
        ran: list[str] = []

        def fail(_: object) -> None:
            raise RuntimeError("boom")

        deadlines.call_later(0.01, fail, None)
        deadlines.call_later(0.01, ran.append, "after")
        await asyncio.sleep(0.05)
        assert ran == ["after"]
        assert [str(exc) for exc in reported] == ["boom"]
    finally:
        loop.set_exception_handler(None)


async def test_close_cancels_every_deadline() -> None:
    loop = asyncio.get_running_loop()
    deadlines = Deadlines(loop)
    ran: list[str] = []
    deadlines.call_later(0.01, ran.append, "x")
    deadlines.close()
    await asyncio.sleep(0.03)
    assert ran == []
    assert len(deadlines) == 0
