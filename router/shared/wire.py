"""Commands packed by hand and sent many to a round trip, on redis-py's pooled connections.

redis-py builds, sends and parses each command through several layers of Python: an
``EVALSHA`` cost the router ~100 µs of CPU (its pool, its encoder, a timeout armed per reply),
one prepacked among others in one send ~20 µs, and a reply parsed per relayed chunk ~4 µs
(there is no hiredis here). So the commands on a stream's path are packed here
(:func:`pack`), and each job's commands go out together:

- :class:`Calls` sends the calls of many callers (streams' admissions and releases; the
  stream writer's script calls, on a :class:`Calls` of its own) one batch in flight at a
  time, those made during a round trip together in the next, on a kept connection whose
  replies it parses in the data callback (:class:`ReplyChannel`);
- :class:`PackedScript` is a Lua script called by its digest, its body sent only if Redis
  lost it (a restart, ``SCRIPT FLUSH``).

Nothing here knows what the commands mean: :mod:`.admission` and :mod:`.streams` do.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import ConnectionPool
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, InvalidResponse, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .replies import ReplyParser

__all__ = [
    "Calls",
    "PackedScript",
    "ReplyChannel",
    "bulk",
    "check_shape",
    "pack",
    "pooled",
]

Arg = bytes | str | int | float

_Call = tuple[bytes, list["asyncio.Future[Any]"], float]
"""A queued call (:class:`Calls`): its commands, a future per reply, when it was made."""

Landed = Callable[[Exception | None], None]
"""Told when a batch's last reply came (None) or why it never will (:meth:`ReplyChannel.send`)."""


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%s\r\n" % (len(value), value)


def pack(*args: Arg) -> bytes:
    """One command in RESP (``pack("GET", key)``); numbers as redis-py writes them."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:  # a loop, not a generator: this runs per stream start
        if isinstance(arg, bytes):
            value = arg
        elif isinstance(arg, str):
            value = arg.encode()
        elif isinstance(arg, int):
            value = b"%d" % arg
        else:
            value = repr(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(value), value))
    return b"".join(out)


_NAMED_GET = "command_name" in inspect.signature(ConnectionPool.get_connection).parameters and (
    inspect.signature(ConnectionPool.get_connection).parameters["command_name"].default
    is inspect.Parameter.empty
)
"""redis-py 5.0-5.2 require a command name to hand out a connection; later ones warn if given."""


async def pooled(pool: ConnectionPool) -> Any:
    """A connection from ``pool`` (on every redis-py the pyproject range allows)."""
    if _NAMED_GET:
        return await pool.get_connection("EVALSHA")  # type: ignore[no-untyped-call]
    return await pool.get_connection()  # type: ignore[no-untyped-call,unused-ignore]


class PackedScript:
    """A Lua script, called by its digest (:meth:`evalsha`) or with its body (:meth:`eval`)."""

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        self.sha = hashlib.sha1(self.body).hexdigest().encode()

    def evalsha(self, keys: Sequence[Arg], args: Sequence[Arg]) -> bytes:
        return pack(b"EVALSHA", self.sha, len(keys), *keys, *args)

    def eval(self, keys: Sequence[Arg], args: Sequence[Arg]) -> bytes:
        """The call with the body: it runs (and is cached) whether Redis knew it or not."""
        return pack(b"EVAL", self.body, len(keys), *keys, *args)


def check_shape() -> str | None:
    """What of redis-py :class:`ReplyChannel` needs is missing (one line), or None.

    It takes a connected pooled connection's transport through the connection's private
    ``_writer`` (an :class:`asyncio.StreamWriter`, which every redis-py from 4.2 to 8 sets in
    ``AbstractConnection.__init__`` and ``connect``). Checked when the shared state starts:
    a redis-py without it stops the router with this line rather than failing each admission.
    """
    try:
        source = inspect.getsource(AbstractConnection.__init__)
    except (OSError, TypeError):
        source = ""
    if "self._writer" not in source:
        import redis

        return (
            f"redis {redis.__version__} is not what router/shared/wire.py expects:"
            " redis.asyncio.connection.AbstractConnection sets no _writer"
        )
    return None


class ReplyChannel(asyncio.Protocol):
    """A connected pooled connection, its replies parsed in the transport's data callback.

    While :class:`Calls` holds the connection, this protocol stands in for redis-py's on its
    transport (``set_protocol``, asyncio's public API for it): :meth:`send` writes a batch
    and queues its callers' futures, and :meth:`data_received` sets each one as its reply
    arrives. A caller thus resumes the loop turn after the reply comes, not two turns later
    through redis-py's reading task. :meth:`give_back` hands the transport back, whole.
    """

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self._transport: asyncio.Transport = connection._writer.transport
        self._theirs = self._transport.get_protocol()
        self._parser = ReplyParser()
        self._waiting: collections.deque[
            tuple[asyncio.Future[Any], Landed | None]
        ] = collections.deque()
        self.broken: Exception | None = None
        """Why the connection can carry no more (then it is closed)."""
        self.replies = 0
        """Replies received so far."""
        self.sent = 0
        """Commands sent so far (replies come in their order)."""
        self._transport.set_protocol(self)

    def send(self, packed: bytes, futures: Sequence[asyncio.Future[Any]], landed: Landed) -> None:
        """Write ``packed`` (one command per future); ``landed(None)`` is called once the last
        reply has arrived, or ``landed(why)`` once the connection broke first (at once if it
        is broken already). It is called from the data callback, not a turn later, so the
        next batch can go out at once."""
        if self.broken is not None:
            landed(self.broken)
            return
        last = len(futures) - 1
        for i, future in enumerate(futures):
            self._waiting.append((future, landed if i == last else None))
        self.sent += len(futures)
        self._transport.write(packed)

    def data_received(self, data: bytes) -> None:
        try:
            replies = self._parser.feed(data)
        except InvalidResponse as exc:
            self.fail(exc)
            return
        self.replies += len(replies)
        landed: Landed | None = None
        for reply in replies:
            if not self._waiting:
                self.fail(InvalidResponse("Redis sent a reply to no command"))
                return
            future, last = self._waiting.popleft()
            if not future.done():  # else its caller left meanwhile
                if isinstance(reply, ResponseError):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
            if last is not None:
                landed = last
        if landed is not None:  # after the loop: what it sends next is not matched to these
            landed(None)

    def eof_received(self) -> bool:
        self.fail(ConnectionError("Redis closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError(f"connection to Redis lost: {exc}" if exc else
                                  "connection to Redis lost"))
        self._theirs.connection_lost(exc)  # redis-py's reader learns it too

    def pause_writing(self) -> None:
        self._theirs.pause_writing()

    def resume_writing(self) -> None:
        self._theirs.resume_writing()

    def fail(self, exc: Exception) -> None:
        """Each batch still awaiting replies fails with ``exc`` (its sender decides what
        its callers get: a batch sent again keeps their futures); the connection closes."""
        if self.broken is None:
            self.broken = exc
        landed = [last for _, last in self._waiting if last is not None]
        self._waiting.clear()
        if not self._transport.is_closing():
            self._transport.close()
        for last in landed:
            last(exc)

    def give_back(self) -> bool:
        """Hand the transport back to redis-py's protocol: True if the connection is whole
        (no reply awaited or half read), else it stays closed."""
        if self.broken is None and not self._waiting and not self._parser.partial:
            self._transport.set_protocol(self._theirs)
            return True
        self.fail(ConnectionError("connection given back mid-reply"))
        return False


class Calls:
    """Commands sent by many callers, together, one batch in flight at a time.

    :meth:`call` queues one command and returns the future of its reply. With no batch in
    flight it goes at once, in the caller's turn; calls made while a batch awaits its replies
    go together in the next batch, sent from the data callback that read the last of those
    replies. In a ramp each batch then carries what came during one round trip, instead of
    one send and one read (two system calls, ~10% of a stream start's CPU here) per loop
    turn; a call waits at most the round trip in flight before its own goes. No task runs a
    batch: a stream's start awaits its admission, and in a ramp every loop turn relays the
    chunks ready then, so each turn between the call and its send, or between a reply and
    the next send, is that much later a first byte. Replies are parsed in the connection's
    data callback (:class:`ReplyChannel`), which is kept from batch to batch: the pool's
    hand-out and return cost as much CPU as a batch. Only opening a connection (the first
    call, or after Redis went away) takes a task.
    """

    def __init__(self, pool: ConnectionPool, timeout_s: float) -> None:
        self._pool = pool
        self._timeout_s = timeout_s
        self._queue: list[_Call] = []
        """Calls not sent yet: the commands, a future per reply, when they were made."""
        self._busy = False
        """A batch is in flight, or a connection is being opened for one."""
        self._opening: asyncio.Task[None] | None = None
        """Opens a connection, then sends the batch that waits for it."""
        self._channel: ReplyChannel | None = None
        """The connection the batches go on, until it breaks."""
        self._retiring: set[asyncio.Task[None]] = set()
        """Broken connections being closed and handed back to the pool."""
        self._drained: asyncio.Future[None] | None = None
        """Set when nothing is queued or in flight (:meth:`aclose` waits for it)."""
        self.round_trips = 0
        """Batches sent (each one round trip)."""
        self.commands = 0
        self.connections = 0
        """Connections opened (one, unless Redis went away)."""

    def call(self, packed: bytes) -> asyncio.Future[Any]:
        """Queue ``packed``; its future holds the reply (an error reply as its exception), or
        the exception that lost the batch."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._queue.append((packed, [future], loop.time()))
        if not self._busy:
            self._next()
        return future

    def call_many(self, packed: bytes, replies: int) -> list[asyncio.Future[Any]]:
        """Queue ``packed``, ``replies`` commands that go in one batch; a future per reply,
        in order, as :meth:`call`'s. Leaving (cancelling the first future) before they are
        sent withdraws them all."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(replies)]
        self._queue.append((packed, futures, loop.time()))
        if not self._busy:
            self._next()
        return futures

    async def script(self, script: PackedScript, keys: Sequence[Arg], args: Sequence[Arg]) -> Any:
        """Run ``script``: its reply, or the error it raised (a lost script is sent again with
        its body, once)."""
        try:
            return await self.call(script.evalsha(keys, args))
        except NoScriptError:
            return await self.call(script.eval(keys, args))

    def script_then(
        self, script: PackedScript, keys: Sequence[Arg], args: Sequence[Arg],
        done: Callable[[asyncio.Future[Any]], None],
    ) -> None:
        """Queue ``script`` now, as :meth:`script` without a task nor a caller waiting:
        ``done`` gets the future of its reply (sent again with its body, once, if Redis
        lost it)."""

        def first(reply: asyncio.Future[Any]) -> None:
            if not reply.cancelled() and isinstance(reply.exception(), NoScriptError):
                self.call(script.eval(keys, args)).add_done_callback(done)
            else:
                done(reply)

        self.call(script.evalsha(keys, args)).add_done_callback(first)

    def _next(self) -> None:
        """Send what is queued, as one batch: on the kept connection now, or through a task
        that opens one; else (nothing queued) the sender is idle."""
        self._busy = True
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            live = [call for call in batch if not call[1][0].done()]
            if not live:  # every caller cancelled before the send: nothing to claim
                continue
            # Each call's replies are due ``timeout_s`` after it was made, whatever it waited
            # for behind a batch in flight: the oldest call's deadline is the batch's.
            deadline = live[0][2] + self._timeout_s
            if loop.time() >= deadline:  # waited its whole time in the queue
                _fail(live, RedisTimeoutError(f"no reply from Redis in {self._timeout_s:g} s"))
                continue
            channel = self._channel
            if channel is not None and channel.broken is None:
                self._send_on(channel, live, deadline, retry=True)
            else:  # none yet, or it broke between batches (Redis went away)
                self._opening = asyncio.ensure_future(self._open_and_send(live, deadline))
            return
        self._busy = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def _send_on(
        self, channel: ReplyChannel, batch: list[_Call], deadline: float, *, retry: bool,
    ) -> None:
        """Send ``batch`` on ``channel``; when its replies are in, the next batch goes. If the
        connection breaks before any of its replies came and ``retry``, it goes again once,
        at once, on a new connection (Redis closed this one, a restart: as redis-py retries
        its own commands); never after a timeout, nor once a reply of it came."""
        futures = [future for call in batch for future in call[1]]
        self.round_trips += 1
        self.commands += len(futures)
        sent = channel.sent
        # One deadline for the whole batch, none per reply; a timer, not asyncio.timeout,
        # whose set-up and tear-down per batch cost several times more CPU.
        timer = asyncio.get_running_loop().call_at(deadline, self._late, channel)

        def landed(why: Exception | None) -> None:
            timer.cancel()
            if why is not None:
                self._retire(channel)
                if retry and isinstance(why, ConnectionError) and channel.replies <= sent:
                    self._opening = asyncio.ensure_future(self._open_and_send(batch, deadline))
                    return
                _fail(batch, why)
            self._next()

        channel.send(b"".join(call[0] for call in batch), futures, landed)

    async def _open_and_send(self, batch: list[_Call], deadline: float) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                channel = await self._open()
        except BaseException as exc:  # the batch is lost: each caller decides what that means
            self._opening = None
            if not isinstance(exc, Exception):  # cancelled (the loop is closing)
                _fail(batch + self._queue, ConnectionError("batch cancelled"))
                self._queue = []
                self._busy = False
                raise
            _fail(batch, exc)
            self._next()
        else:
            self._opening = None
            self._send_on(channel, batch, deadline, retry=False)

    def _late(self, channel: ReplyChannel) -> None:
        channel.fail(RedisTimeoutError(f"no reply from Redis in {self._timeout_s:g} s"))

    async def _open(self) -> ReplyChannel:
        connection = await pooled(self._pool)
        try:
            if not connection.is_connected:  # the pool connects what it hands out
                await connection.connect()
            channel = self._channel = ReplyChannel(connection)
        except BaseException:
            await self._drop(connection)
            raise
        self.connections += 1
        return channel

    def _retire(self, channel: ReplyChannel) -> None:
        """Close a broken connection and hand it back to the pool (once)."""
        if self._channel is channel:
            self._channel = None
            task = asyncio.ensure_future(self._drop(channel.connection))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _drop(self, connection: Any) -> None:
        await connection.disconnect()
        await self._pool.release(connection)

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Wait for the batches queued and in flight (a clean exit's releases reach Redis), up
        to ``timeout_s`` (default: the calls' own), then give the connection back."""
        if self._busy:
            self._drained = asyncio.get_running_loop().create_future()
            wait_s = self._timeout_s if timeout_s is None else timeout_s
            await asyncio.wait([self._drained], timeout=wait_s)
        if self._opening is not None:
            self._opening.cancel()
            await asyncio.wait([self._opening])
        if self._retiring:
            await asyncio.wait(self._retiring)
        channel, self._channel = self._channel, None
        if channel is not None:
            if channel.give_back():
                await self._pool.release(channel.connection)
            else:
                await self._drop(channel.connection)


def _fail(batch: Sequence[_Call], why: Exception) -> None:
    """Each caller of ``batch`` still waiting gets ``why``."""
    for _, futures, _ in batch:
        for future in futures:
            if not future.done():
                future.set_exception(why)
