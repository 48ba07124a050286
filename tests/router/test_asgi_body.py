"""read_body's deadline between two parts of a body: a stall is a BodyTimeout, a cancel
from outside stays a cancel, and a part that comes in time leaves no timer behind; a receive
begun by hand (receive_now) is read on by read_body the same way."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import pytest

from firstbyte.router import asgi, chunkpath
from firstbyte.router.asgi import BodyTimeout, ClientGone, Message, read_body, receive_now


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


async def test_a_body_already_in_arms_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receive() that answers without waiting (HTTP/1.1's body, in with its head) needs no
    deadline: no timer is armed; one that waits has its deadline as before."""
    loop = asyncio.get_running_loop()
    armed: list[float] = []
    call_later = loop.call_later

    def counting(delay: float, *args: object) -> asyncio.TimerHandle:
        armed.append(delay)
        return call_later(delay, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(loop, "call_later", counting)
    queue = _parts(b"ab", b"cd")

    async def at_once() -> Message:
        return queue.pop(0)

    assert await read_body(at_once, 100, timeout_s=5.0) == b"abcd"
    assert armed == []
    queue = _parts(b"ef", b"gh")

    async def later() -> Message:
        for _ in range(3):  # waits more than once: each step goes through
            await asyncio.sleep(0)
        return queue.pop(0)

    assert await read_body(later, 100, timeout_s=5.0) == b"efgh"
    assert armed == [5.0, 5.0]


async def test_a_receive_failing_before_or_after_a_wait_raises_its_error() -> None:
    async def at_once() -> Message:
        raise OSError("at once")

    async def after_a_wait() -> Message:
        await asyncio.sleep(0)
        raise OSError("after a wait")

    for receive, text in ((at_once, "at once"), (after_a_wait, "after a wait")):
        with pytest.raises(OSError, match=text):
            await read_body(receive, 100, timeout_s=5.0)
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


async def test_a_disconnect_already_in_is_client_gone() -> None:
    async def gone() -> Message:
        return {"type": "http.disconnect"}

    with pytest.raises(ClientGone):
        await read_body(gone, 100, timeout_s=5.0)


class _BareAwaitable:
    """An awaitable whose iterator has ``__next__`` only, no ``send`` or ``throw`` (as
    granian's receive() returns): it yields ``future`` until that is done."""

    def __init__(self, future: asyncio.Future[Message]) -> None:
        self.future = future

    def __await__(self) -> _BareAwaitable:
        return self

    def __iter__(self) -> _BareAwaitable:
        return self

    def __next__(self) -> asyncio.Future[Message]:
        if self.future.done():
            raise StopIteration(self.future.result())
        self.future._asyncio_future_blocking = True
        return self.future


async def test_a_receive_of_a_bare_awaitable_is_read_waiting_or_not() -> None:
    loop = asyncio.get_running_loop()
    parts = _parts(b"ab", b"cd", b"e")

    def receive() -> _BareAwaitable:
        future: asyncio.Future[Message] = loop.create_future()
        part = parts.pop(0)
        if part["body"] == b"cd":  # this one waits a loop turn
            loop.call_soon(future.set_result, part)
        else:
            future.set_result(part)
        return _BareAwaitable(future)

    assert await read_body(receive, 100, timeout_s=5.0) == b"abcde"  # type: ignore[arg-type]

    def stalled() -> _BareAwaitable:
        return _BareAwaitable(loop.create_future())

    with pytest.raises(BodyTimeout):
        await read_body(stalled, 100, timeout_s=0.02)  # type: ignore[arg-type]
    reader = asyncio.create_task(read_body(stalled, 100, timeout_s=5.0))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


def _later(queue: list[Message]) -> Callable[[], Awaitable[Message]]:
    async def receive() -> Message:
        await asyncio.sleep(0)  # each part comes a loop turn later
        return queue.pop(0)

    return receive


async def test_a_receive_begun_by_hand_is_read_on_as_one_not_begun() -> None:
    """receive_now answers a message at hand as it is; one that waits is handed to read_body
    (``first``), which reads the rest of it under the same deadline, then the next parts."""

    async def at_hand() -> Message:
        return _parts(b"whole")[0]

    assert receive_now(at_hand) == _parts(b"whole")[0]
    for timeout_s in (None, 5.0):
        receive = _later(_parts(b"ab", b"cd", b"e"))
        first = receive_now(receive)
        assert isinstance(first, tuple)  # it waits: begun, not answered
        assert await read_body(receive, 100, timeout_s=timeout_s, first=first) == b"abcde"
    assert await read_body(at_hand, 3, first=_parts(b"abcd", b"ef")[0]) == b"abcd"

    stalled = asyncio.Event()

    async def stalling() -> Message:
        await stalled.wait()
        return _parts(b"late")[0]

    with pytest.raises(BodyTimeout):
        await read_body(stalling, 100, timeout_s=0.02, first=receive_now(stalling))
    task = asyncio.current_task()
    assert task is not None
    assert task.cancelling() == 0


_BEGINNERS = [pytest.param(asgi._receive_now, id="python")] + (
    [pytest.param(chunkpath.RECEIVE_NOW, id="compiled")] if chunkpath.RECEIVE_NOW else []
)


@pytest.mark.parametrize("begin", _BEGINNERS)
async def test_receive_now_compiled_and_in_python_alike(
    begin: Callable[[object], object],
) -> None:
    """The compiled receive_now and the Python one answer alike: a coroutine's message at
    hand, a waiting one begun (its ``__await__`` iterator, read on by read_body), any other
    awaitable through its ``__await__`` (a bare iterator, as granian's receive() has it) and
    the errors of one that is none."""
    at_hand = _parts(b"whole")[0]

    async def answering() -> Message:
        return at_hand

    assert begin(answering) is at_hand
    receive = _later(_parts(b"ab", b"cd"))
    first = begin(receive)
    assert isinstance(first, tuple)
    assert type(first[0]).__name__ == "coroutine_wrapper"
    assert await read_body(receive, 100, first=first) == b"abcd"  # type: ignore[arg-type]

    class Bare:
        def __init__(self, steps: list[object], answer: object = None) -> None:
            self.steps, self.answer = steps, answer

        def __await__(self) -> object:
            return self

        def __next__(self) -> object:
            if self.steps:
                return self.steps.pop(0)
            raise StopIteration(self.answer) if self.answer is not None else StopIteration

    bare = Bare([None])
    assert begin(lambda: bare) == (bare, None)
    assert begin(lambda: Bare([], at_hand)) is at_hand
    assert begin(lambda: Bare([])) is None

    class NotAwaitable:
        pass

    class NoIterator:
        def __await__(self) -> object:
            return 3

    def failing() -> object:
        raise ValueError("no receive")

    for receive_of, error in (
        (NotAwaitable, AttributeError),
        (NoIterator, TypeError),
        (failing, ValueError),
    ):
        with pytest.raises(error) as raised:
            begin(receive_of)
        with pytest.raises(error) as expected:
            asgi._receive_now(receive_of)  # type: ignore[arg-type]
        assert str(raised.value) == str(expected.value)

    async def raising() -> Message:
        raise ClientGone

    with pytest.raises(ClientGone):
        begin(raising)
