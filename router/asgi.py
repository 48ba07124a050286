"""Thin ASGI plumbing: read a bounded body, send a whole response, stream with disconnect.

Everything here is ``async def app(scope, receive, send)`` level and knows nothing about
the router's logic.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, MutableMapping
from typing import Any

from firstbyte.tasks import cancel_and_wait

from . import chunkpath
from .hosting.body_writer import EXTENSION as BODY_WRITER
from .hosting.disconnected import EXTENSION as DISCONNECTED
from .hosting.uvicorn_send import EXTENSION as HEAD_BODY

__all__ = [
    "BODY_WRITER",
    "ASGIApp",
    "BodyTimeout",
    "ClientGone",
    "Disconnect",
    "LastPart",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "Started",
    "body_writer",
    "head_body",
    "header_dict",
    "read_body",
    "receive_now",
    "send_bytes",
    "stream_body",
    "unless_gone",
    "until_disconnect",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

Headers = list[tuple[str, str]] | tuple[tuple[str, str], ...]


def body_writer(scope: Scope) -> Callable[[bytes], bool] | None:
    """The server's ``firstbyte.body_writer`` extension, if it offers it: write a part of a
    streamed body from any callback (:mod:`firstbyte.router.hosting.body_writer`)."""
    extensions = scope.get("extensions")
    if not extensions:
        return None
    writer: Callable[[bytes], bool] | None = extensions.get(BODY_WRITER)
    return writer


def head_body(scope: Scope) -> bool:
    """Does the server take a body's first part with the response head, in one write (the
    ``firstbyte.head_body`` extension: :mod:`firstbyte.router.hosting.uvicorn_send`)?"""
    extensions = scope.get("extensions")
    return extensions is not None and HEAD_BODY in extensions


_HEADER_DICT = "firstbyte.header_dict"
"""Where :func:`header_dict` keeps what it decoded, in the request's scope."""

_NAMES: dict[bytes, str] = {}
"""Header names as :func:`header_dict` has them, by their bytes: the same few come with
every request, and a name's decoding and lower-casing cost ~1.3k instructions where the
lookup costs a tenth. Names only: a value may be a secret (``authorization``)."""
_MAX_NAMES = 512
"""Past this many names kept, a new one is decoded each time (a client sending made-up
names cannot grow the table)."""
_MAX_NAME_BYTES = 64
"""Longer names are decoded each time, never kept: the table stays under ~100 KB whatever
names clients send (a head may hold names of kilobytes)."""


_DECODE_HEADERS: Callable[[Any, dict[bytes, str]], dict[str, str] | None] | None = (
    chunkpath.DECODE_HEADERS
)
""":func:`header_dict`'s loop in one C call where it was built (``decode_headers`` in
``router/_chunkpath.c``: ~8k instructions a request in Python): a request's headers whose
names are all in :data:`_NAMES`, in a list of tuples of bytes; None for any other, which the
loop then decodes (learning its new names)."""


def header_dict(scope: Scope) -> dict[str, str]:
    """Request headers with lower-cased names (the last value of a repeated header wins).

    Decoded once a request (CORS and the request's context both ask): the same dict is
    returned each time, so it is read-only; copy it to change it."""
    found: dict[str, str] | None = scope.get(_HEADER_DICT)
    if found is None:
        if _DECODE_HEADERS is not None:
            found = _DECODE_HEADERS(scope.get("headers", []), _NAMES)
            if found is not None:
                scope[_HEADER_DICT] = found
                return found
        found = scope[_HEADER_DICT] = {}
        for k, v in scope.get("headers", []):  # a loop: a dict comprehension is a call
            name = _NAMES.get(k)
            if name is None:
                name = k.decode("latin-1").lower()
                if len(_NAMES) < _MAX_NAMES and len(k) <= _MAX_NAME_BYTES:
                    _NAMES[k] = name
            found[name] = v.decode("latin-1")
    return found


class ClientGone(Exception):
    """The client disconnected while the request body was being read."""


class BodyTimeout(Exception):
    """The next part of the request body did not come within the body timeout."""


Started = tuple[Iterator[Any], Any]
"""A ``receive()`` begun by :func:`receive_now` that has to wait: its steps (its
``__await__``), and what the first one yielded."""


def _receive_now(receive: Receive) -> Message | Started:
    """:func:`receive_now` where ``router/_chunkpath.c`` was not built."""
    steps = receive().__await__()
    try:
        waits_on = next(steps)  # not send(None): a bare iterator has no send
    except StopIteration as done:  # answered without waiting
        answered: Message = done.value
        return answered
    return steps, waits_on


receive_now: Callable[[Receive], Message | Started] = chunkpath.RECEIVE_NOW or _receive_now
"""Begin ``receive()``: its message if it answers without waiting (a body come with its
head, HTTP/1.1's nearly always), else the :data:`Started` receive for :func:`read_body`'s
``first`` (a tuple, never a message). Begun by hand: a body at hand is then taken with no
coroutine made, where reading it through :func:`read_body` made two.

In one C call where it was built (``receive_now`` in ``router/_chunkpath.c``): a coroutine
stepped there returns its message with no StopIteration made and caught, and no frame of
this function (~3.5k instructions a request, ``chunk_instructions``)."""


async def read_body(
    receive: Receive,
    limit: int,
    *,
    timeout_s: float | None = None,
    drain_bytes: int = 64 << 20,
    first: Message | Started | None = None,
) -> bytes:
    """Read the request body; past ``limit`` bytes, keep only ``limit + 1`` (so the caller
    answers 413) but go on reading and discarding up to ``drain_bytes``: a client still
    sending (an HTTP/2 stream, say) then receives the 413 instead of a write error.

    :class:`BodyTimeout` if a wait for the next part lasts over ``timeout_s`` (nginx's
    ``client_body_timeout``: between two reads, not for the whole body). ``first``: the
    first message, or its receive begun (:func:`receive_now`), if the caller has it."""
    parts: list[bytes] = []
    size = 0
    while True:
        if first is None:
            message = await (receive() if timeout_s is None else _within(receive, timeout_s))
        elif isinstance(first, tuple):  # begun, waiting: the rest of that receive()
            started, first = first, None
            message = await (
                _rest(*started) if timeout_s is None else _within(receive, timeout_s, started)
            )
        else:
            message, first = first, None
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk: bytes = message.get("body", b"")
        if chunk:
            if size <= limit:
                parts.append(chunk)
            size += len(chunk)
        if not message.get("more_body", False) or size > drain_bytes:
            return b"".join(parts)[: limit + 1]


def _expire(task: asyncio.Task[Any], expired: list[bool]) -> None:
    expired.append(True)
    task.cancel()


@types.coroutine
def _rest(steps: Iterator[Any], yielded: Any) -> Generator[Any, Any, Any]:
    """Await the rest of ``steps`` (an awaitable's ``__await__``), whose first step yielded
    ``yielded``: ``yield from`` as PEP 380 expands it, taken up after that first step. Its
    iterator may be a bare one, with no ``send`` or ``throw`` (granian's receive())."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            close = getattr(steps, "close", None)
            if close is not None:
                close()
            raise
        except BaseException as exc:  # a cancel, above all: it goes where steps wait
            throw = getattr(steps, "throw", None)
            if throw is None:
                raise
            try:
                yielded = throw(exc)
            except StopIteration as done:
                return done.value
        else:
            try:
                yielded = next(steps) if sent is None else steps.send(sent)  # type: ignore[attr-defined]
            except StopIteration as done:
                return done.value


async def _within(receive: Receive, timeout_s: float, started: Started | None = None) -> Message:
    """``receive()`` under a deadline on this task (:class:`BodyTimeout` past it), as
    ``asyncio.timeout`` has it for one await: a timer that cancels the task, the cancel
    taken back if it was the timer's. Not ``wait_for``, which wrapped each receive() in a
    task of its own; and not ``asyncio.timeout``, whose context manager cost a request ~5 µs
    (~36k instructions, ``chunk_instructions``) against ~1 µs for this timer.

    The timer is armed only if ``receive()`` has to wait: its first step is taken by hand,
    and a body already in (HTTP/1.1's, with its head, nearly always) is answered in it, with
    no time for a deadline to pass; arming and cancelling the timer cost that request ~9k
    instructions. ``started``: that first step, taken by the caller (:func:`receive_now`),
    which waits."""
    steps: Iterator[Any]
    if started is None:
        begun = receive_now(receive)
        if not isinstance(begun, tuple):  # answered without waiting
            return begun
        started = begun
    steps, waits_on = started
    task = asyncio.current_task()
    assert task is not None  # an ASGI app runs in a task
    expired: list[bool] = []
    timer = asyncio.get_running_loop().call_later(timeout_s, _expire, task, expired)
    try:
        message: Message = await _rest(steps, waits_on)
    except asyncio.CancelledError:
        if expired and task.uncancel() == 0:
            raise BodyTimeout from None
        raise
    finally:
        timer.cancel()
    if expired:  # receive() took the timer's cancel and answered anyway: take it back too
        task.uncancel()
    return message


_FUTURE = asyncio.Future
"""A plain future's type (the C one: what loops' ``create_future`` make)."""


async def until_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (every other message is dropped). Only for a
    request whose body was read."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Disconnect:
    """The client's disconnect, listened for by one task (or, where the server offers it, the
    ``firstbyte.disconnected`` future: :mod:`.hosting.disconnected`) for the rest of a
    request whose body was read: through the wait for the upstream's head
    (:meth:`unless_gone`) and the streamed body (:func:`stream_body`'s ``disconnect``). One
    listener where each phase had its own saves a task, its cancellation and an
    ``asyncio.wait`` per streamed request. :meth:`stop` it when the request is over."""

    __slots__ = ("listener",)

    def __init__(self, receive: Receive, scope: Scope | None = None) -> None:
        extensions = scope.get("extensions") if scope is not None else None
        gone: asyncio.Future[None] | None = (
            extensions.get(DISCONNECTED) if extensions else None
        )
        # The server's future where it offers one (uvicorn's HTTP/1.1: no task, no
        # cancellation at the end), else a task blocked in receive().
        self.listener: asyncio.Future[None] = (
            gone if gone is not None else asyncio.ensure_future(until_disconnect(receive))
        )

    async def unless_gone(self, work: asyncio.Future[Any]) -> bool:
        """Wait for ``work``; True if it finished first, False if the client went away first.
        A task is left running then (the caller decides whether to cancel it); a plain
        future (a result a callback will set, or not, as it finds it: nothing runs in it) is
        cancelled, as it is if this wait is."""
        listener = self.listener
        if work.done() or listener.done():
            return work.done()
        if type(work) is _FUTURE:
            # Awaited itself, and cancelled if the client goes: no future of this wait's own,
            # and no callback of work's that wakes it a loop turn later (~7k instructions a
            # request, the upstream head's wait).
            def cut(_: object) -> None:
                work.cancel()

            listener.add_done_callback(cut)
            try:
                await work
            except asyncio.CancelledError:
                task = asyncio.current_task(work.get_loop())
                if (
                    (task is not None and task.cancelling())  # this wait was cancelled
                    or not listener.done()
                    or listener.cancelled()
                ):
                    raise
                return False  # the client went: cut cancelled work
            finally:
                listener.remove_done_callback(cut)
            return True
        if not work.done() and not listener.done():
            # asyncio.wait(FIRST_COMPLETED) for two futures, without its sets, counter and
            # timeout handling.
            # work's own loop (the running one), not looked up: on Python 3.11 each
            # get_running_loop() is a getpid() system call.
            woken: asyncio.Future[None] = work.get_loop().create_future()

            def wake(_: object) -> None:
                if not woken.done():
                    woken.set_result(None)

            work.add_done_callback(wake)
            listener.add_done_callback(wake)
            try:
                await woken
            finally:
                work.remove_done_callback(wake)
                listener.remove_done_callback(wake)
        return work.done()

    def stop(self) -> None:
        """Stop listening (the request is over); nothing is received after."""
        self.listener.cancel()


async def unless_gone(receive: Receive, work: asyncio.Future[Any]) -> bool:
    """Wait for ``work`` while listening for the client's disconnect; True if ``work``
    finished first, False if the client went away first (``work`` is left running: the
    caller decides whether to cancel it). Only for a request whose body was read."""
    disconnect = Disconnect(receive)
    try:
        return await disconnect.unless_gone(work)
    finally:
        listener = disconnect.listener
        if not listener.done():
            await cancel_and_wait(listener)  # settled before the next receive (a stream's own)


_ENCODED_NAMES: dict[str, bytes] = {}
"""Response header names as sent, by the name: the same few go with every response, and a
name's ``encode`` cost ~350 instructions where the lookup costs a fraction (within
:data:`_MAX_NAMES` names of at most :data:`_MAX_NAME_BYTES`, as :data:`_NAMES`)."""


_ENCODE_HEADERS: (
    Callable[[Any, Any, dict[str, bytes]], list[tuple[bytes, bytes]] | None] | None
) = chunkpath.ENCODE_HEADERS
""":func:`_encode_headers` in one C call where it was built (``encode_headers`` in
``router/_chunkpath.c``: ~7k instructions a streamed answer in Python): headers whose names
are all in :data:`_ENCODED_NAMES`, in a list or tuple of tuples of str, values in Latin-1;
None for any other, which the loop then encodes (learning its new names, or raising)."""


def _encode_headers(
    headers: Headers, encoded: tuple[tuple[bytes, bytes], ...] = ()
) -> list[tuple[bytes, bytes]]:
    """``encoded`` (headers already in bytes), then ``headers`` encoded, in one list."""
    if _ENCODE_HEADERS is not None:
        done = _ENCODE_HEADERS(encoded, headers, _ENCODED_NAMES)
        if done is not None:
            return done
    out = list(encoded)
    names = _ENCODED_NAMES
    for k, v in headers:  # a loop: a list comprehension is a call
        try:  # a subscript, not get(): no call for a name seen before
            name = names[k]
        except (KeyError, TypeError):  # new, or not a name at all: encode() says which
            name = k.encode("latin-1")
            if len(names) < _MAX_NAMES and len(name) <= _MAX_NAME_BYTES:
                names[k] = name
        out.append((name, v.encode("latin-1")))
    return out


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: str = "application/json",
    headers: Headers = (),
) -> None:
    """Send a complete response."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type.encode("latin-1")),
                (b"content-length", str(len(body)).encode()),
                *_encode_headers(headers),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


class LastPart(bytes):
    """A streamed body's last part, as a body's chunks iterator marks it (an SSE stream's
    ``[DONE]``): :func:`stream_body` sends it with the body's end (``more_body`` false),
    one write of the connection where a part and then the end were two."""

    __slots__ = ()


async def stream_body(
    receive: Receive,
    send: Send,
    status: int,
    headers: Headers,
    chunks: AsyncIterator[bytes],
    *,
    disconnect: Disconnect | None = None,
    first_at_hand: bool = False,
    encoded: tuple[tuple[bytes, bytes], ...] = (),
) -> bool:
    """Send ``chunks`` as one streamed response, each chunk flushed as it comes; a
    :class:`LastPart` ends it (whatever ``chunks`` would yield after it is not sent).

    "Send the stream" and "listen for disconnect" run side by side; whichever finishes first
    ends the other (starlette's pattern). Returns True if the body completed, False if the
    client went away first.

    The stream is sent from the calling task and only the listener is a task of its own,
    which cancels the caller when the client goes: one task per response fewer, and no
    ``asyncio.wait``/``gather`` bookkeeping, than a task for each side. ``disconnect``: the
    request's listener already running (the caller stops it), else one is started here.

    ``first_at_hand``: the server takes a first part with the head (:func:`head_body`) and
    ``chunks`` yields its first part without waiting (a stream with events already in it):
    the head goes out with that part, one write of the connection where they were two.

    ``encoded``: headers already in bytes (constants, encoded once), sent before ``headers``.
    """
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": _encode_headers(headers, encoded),
    }
    if not first_at_hand:
        await send(start)
    gone = False
    if disconnect is None:
        disconnect = Disconnect(receive)
        owned = True
    else:
        owned = False
    listener = disconnect.listener
    # The listener's loop is the running one: passed, current_task() skips looking it up
    # (on Python 3.11 a getpid() system call).
    sender = asyncio.current_task(listener.get_loop())
    assert sender is not None
    sending = True

    def on_gone(done: asyncio.Future[None]) -> None:
        nonlocal gone
        # Run by the loop after the listener ended: perhaps after the body was done.
        if sending and not done.cancelled() and done.exception() is None:
            gone = True
            sender.cancel()

    listener.add_done_callback(on_gone)
    try:
        if first_at_hand:
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = LastPart()  # no part: the end goes out after the head
            except Exception:
                await send(start)  # the head went out before the body failed, as always
                raise
            if type(first) is LastPart:
                await send(start)
                await send({"type": "http.response.body", "body": first, "more_body": False})
                return True
            start[HEAD_BODY] = first
            await send(start)
        async for chunk in chunks:
            if type(chunk) is LastPart:
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return True
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
    except asyncio.CancelledError:
        if not gone or sender.uncancel():
            raise  # cancelled from outside (a drain, the server) too: not ours to swallow
        return False
    except OSError:
        return False  # the client vanished mid-write
    finally:
        # Stopped before anything is awaited here: a disconnect from now on cancels nobody.
        sending = False
        listener.remove_done_callback(on_gone)
        if owned:
            listener.cancel()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()  # run the producer's cleanup (reader detach) now, not at GC
