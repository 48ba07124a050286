"""An HTTP/2 stream's send clock (:class:`StreamWindowTimers`): when it runs and what stops
it, on a loop whose timers are only recorded (the live attack is in
``tests/router/attacks/test_http2.py``)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from firstbyte.router.hosting.send_timeout import StreamWindowTimers


class _Handle:
    def __init__(self, callback: Any, args: tuple[Any, ...]) -> None:
        self.callback, self.args, self.cancelled = callback, args, False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert not self.cancelled
        self.callback(*self.args)


class _Loop:
    """``call_later`` recorded, fired by the test."""

    def __init__(self) -> None:
        self.handles: list[_Handle] = []

    def call_later(self, delay_s: float, callback: Any, *args: Any) -> _Handle:
        assert delay_s == 60.0
        handle = _Handle(callback, args)
        self.handles.append(handle)
        return handle


def _timers() -> tuple[StreamWindowTimers, _Loop, list[int]]:
    loop, expired = _Loop(), []
    timers = StreamWindowTimers(cast(asyncio.AbstractEventLoop, loop), 60.0, expired.append)
    return timers, loop, expired


def test_a_stream_with_data_and_no_window_is_reset_when_its_clock_runs_out() -> None:
    timers, loop, expired = _timers()
    timers.visited(1, taken=0, waiting=100, window=0)
    timers.visited(1, taken=0, waiting=200, window=0)  # more data, still shut: same clock
    assert len(loop.handles) == 1
    assert timers.running() == {1}
    loop.handles[0].fire()
    assert expired == [1]
    assert timers.running() == frozenset()


def test_any_byte_taken_starts_the_clock_afresh() -> None:
    timers, loop, _ = _timers()
    timers.visited(1, taken=0, waiting=100, window=0)
    timers.visited(1, taken=1, waiting=99, window=0)  # a byte of window, then shut again
    assert [h.cancelled for h in loop.handles] == [True, False]
    timers.visited(1, taken=99, waiting=0, window=0)  # all there was: not waiting
    assert loop.handles[1].cancelled
    assert timers.running() == frozenset()


def test_no_clock_while_the_window_is_open_or_nothing_waits() -> None:
    timers, loop, _ = _timers()
    timers.visited(1, taken=16384, waiting=50_000, window=48_000)  # TCP's to time, not this
    timers.visited(3, taken=0, waiting=0, window=0)  # the app has sent nothing yet
    assert loop.handles == []
    assert timers.running() == frozenset()


def test_streams_have_clocks_of_their_own() -> None:
    timers, loop, expired = _timers()
    timers.visited(1, taken=0, waiting=10, window=0)
    timers.visited(3, taken=0, waiting=10, window=0)
    timers.stop(1)  # ended
    assert loop.handles[0].cancelled
    assert timers.running() == {3}
    loop.handles[1].fire()
    assert expired == [3]
