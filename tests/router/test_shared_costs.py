"""What one stream costs in Redis: commands and round trips per start, per chunk, per end.

The router runs in this process over real sockets on loopback, with a real ``valkey-server``;
every command it sends is read back from the bytes it writes to its Redis connections (a spy
on redis-py's ``send_packed_command``: one call is one round trip), so the counts do not
depend on timing. Printed with ``-s``: the figures docs/router.md quotes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection

from firstbyte.benchmarks.ports import free_port
from firstbyte.benchmarks.redis_server import RedisServer, running_redis
from firstbyte.router.config import parse_config
from firstbyte.router.serve import running_router
from firstbyte.router.shared import SharedState, connect
from firstbyte.router.shared.admission import (
    _ADMIT,
    _CLAIM,
    _RELEASE,
    Claim,
    SharedAdmission,
    Verdict,
)
from firstbyte.router.shared.errors import StateUnavailable
from firstbyte.router.shared.keys import Keys
from firstbyte.router.shared.wire import ReplyChannel
from firstbyte.router.streams import Stream
from tests.router.conftest import auth, router_config
from tests.router.redis_fixture import (  # noqa: F401 (fixtures)
    MakeAdmission,
    admitting,
    redis_server,
)
from tests.router.upstream import running_upstream

ADMIT_SHA = hashlib.sha1(_ADMIT.encode()).hexdigest().encode()
RELEASE_SHA = hashlib.sha1(_RELEASE.encode()).hexdigest().encode()
CLAIM_SHA = hashlib.sha1(_CLAIM.encode()).hexdigest().encode()
TOKENS = 40


def _commands(payload: bytes) -> Iterator[list[bytes]]:
    """The RESP commands (arrays of bulk strings) in ``payload``."""
    at = 0
    while at < len(payload):
        assert payload[at : at + 1] == b"*", payload[at : at + 20]
        end = payload.index(b"\r\n", at)
        count, at = int(payload[at + 1 : end]), end + 2
        command = []
        for _ in range(count):
            end = payload.index(b"\r\n", at)
            size = int(payload[at + 1 : end])
            command.append(payload[end + 2 : end + 2 + size])
            at = end + 2 + size + 2
        yield command


def _kind(command: list[bytes]) -> str:
    """What a command is for: a stream's admission (or claim), release or events; else the process's
    own housekeeping (lease, load elsewhere, connection set-up)."""
    name = command[0].upper()
    if name == b"EVALSHA" and command[1] == ADMIT_SHA:
        return "admit"
    if name == b"EVALSHA" and command[1] == RELEASE_SHA:
        return "release"
    if name == b"EVALSHA" and command[1] == CLAIM_SHA:
        return "claim"
    if name == b"EVAL" and b"XADD" in command[1]:  # the writer's script: which operations?
        count = int(command[2])
        kinds = command[6 + count :: 3]
        return "announce" if b"m" in kinds else "events"
    if name == b"HSET" and b"owner" in command:  # a stream's metadata, by redis-py's writer
        return "announce"
    if name in (b"XADD", b"XTRIM", b"HSET", b"PEXPIRE"):
        return "events"
    return "housekeeping"


@dataclass
class Spy:
    """Every command the process sends to Redis, with the round trip (send) it went in."""

    sends: list[list[str]] = field(default_factory=list)

    def mark(self) -> int:
        return len(self.sends)

    def since(self, mark: int) -> tuple[Counter[str], Counter[str]]:
        """Commands and round trips of each kind since ``mark`` (a round trip counts for
        every kind it carries)."""
        commands: Counter[str] = Counter()
        trips: Counter[str] = Counter()
        for kinds in self.sends[mark:]:
            commands.update(kinds)
            trips.update(set(kinds))
        return commands, trips


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    seen = Spy()
    send = Connection.send_packed_command

    async def counted(self: Connection, command: object, check_health: bool = True) -> None:
        payload = command if isinstance(command, bytes) else b"".join(command)  # type: ignore[arg-type]
        seen.sends.append([_kind(c) for c in _commands(payload)])
        await send(self, command, check_health)  # type: ignore[arg-type]

    monkeypatch.setattr(Connection, "send_packed_command", counted)
    channel_send = ReplyChannel.send

    def channel_counted(self: ReplyChannel, packed: bytes, futures: Any, landed: Any) -> None:
        seen.sends.append([_kind(c) for c in _commands(packed)])
        channel_send(self, packed, futures, landed)

    monkeypatch.setattr(ReplyChannel, "send", channel_counted)
    return seen


async def _commandstats(url: str) -> Counter[str]:
    """Commands Redis has run so far, by name (those a script ran included)."""
    redis = Redis.from_url(url)
    try:
        stats = await redis.info("commandstats")
    finally:
        await redis.aclose()
    return Counter({name.removeprefix("cmdstat_"): int(value["calls"])
                    for name, value in stats.items()})


@pytest.fixture
async def shared_router(redis_server: RedisServer) -> AsyncIterator[str]:  # noqa: F811
    async with running_upstream() as upstream:
        config = router_config(
            [upstream.url], None,
            state={"redis_url": redis_server.url, "key_prefix": f"c{secrets.token_hex(4)}:",
                   "lease_s": 60.0},
        )
        async with running_router(config) as endpoints:
            yield endpoints.base_url


async def _stream(http: httpx.AsyncClient, base: str, tokens: int) -> int:
    """One streamed completion read to its end; the number of SSE events."""
    body = {"model": "test-model", "messages": [{"role": "user", "content": "count"}],
            "stream": True, "max_tokens": tokens}
    async with http.stream("POST", base + "/v1/chat/completions", json=body,
                           headers=auth()) as response:
        assert response.status_code == 200
        text = (await response.aread()).decode()
    return text.count("\ndata: ") + text.startswith("data: ")


async def test_a_stream_costs_one_admission_one_release_and_a_few_writes(
    shared_router: str, spy: Spy, redis_server: RedisServer,  # noqa: F811
) -> None:
    """Per stream: no round trip before the request goes upstream (nothing in Redis can
    refuse it: the key has no cap nor rate, and this process holds spare slots of the
    backend, claimed by the first stream's admission); one claim sent meanwhile (the key's
    slot, and the stream's metadata, so its id can go out), no release (the backend's slot
    is kept spare, the key's is one), and its events written a batch to a script call, not
    a command per chunk; nothing else."""
    async with httpx.AsyncClient(timeout=20) as http:
        await _stream(http, shared_router, 2)  # connections made, scripts loaded
        await asyncio.sleep(0.1)
        mark = spy.mark()
        ran = await _commandstats(redis_server.url)
        streams, events = 5, 0
        for _ in range(streams):
            events += await _stream(http, shared_router, TOKENS)
        await asyncio.sleep(0.2)  # the last release and write are sent
    commands, trips = spy.since(mark)
    ran = await _commandstats(redis_server.url) - ran
    del ran["info"]
    print(f"\nRedis ran, per stream: { {k: round(v / streams, 1) for k, v in sorted(ran.items())} }")
    print(f"\nper stream of {events // streams} events: commands {dict(commands)},"
          f" round trips {dict(trips)} (over {streams} streams)")
    assert events >= streams * TOKENS
    assert ran["xadd"] == events  # every event its own entry: resume stays exact
    assert commands["admit"] == 0  # the critical path: no round trip
    assert commands["claim"] == streams  # sent while the request goes upstream
    assert trips["announce"] == 0  # its metadata goes in the claim, not a call of its own
    assert commands["release"] == streams  # the key's slot; the backend's is kept spare
    # The events: a batch per write. A command per chunk was 40+.
    assert commands["events"] <= 5 * streams, commands
    assert trips["events"] <= 5 * streams, trips


def _admit(admission: SharedAdmission, owner: bytes = b"k",
           backend_limit: int | None = None) -> Any:
    """An admission of ``owner`` (no key limits) on backend ``b0``, without affinity."""
    return admission.admit(Claim(owner, "b0", backend_limit))


async def test_a_burst_of_admissions_takes_two_round_trips(
    admitting: MakeAdmission, spy: Spy,  # noqa: F811
) -> None:
    """A burst of stream starts (a ramp's) is two sends and two reads for all of them: the
    first admission goes at once, in its caller's turn, and the other 49, made while it is in
    flight, together as soon as its reply is in. Each admission through redis-py was a round
    trip of its own and ~100 µs of the router's CPU."""
    rig = await admitting()
    redis, keys, admission = rig.redis, rig.keys, rig.admission
    await _admit(admission)  # the admissions' connection is open
    mark = spy.mark()
    answers = await asyncio.gather(*(_admit(admission, b"k%d" % (i % 3), 60) for i in range(50)))
    assert [a.verdict for a in answers] == [Verdict.ADMITTED] * 50
    commands, trips = spy.since(mark)
    assert commands["admit"] == 50
    assert trips["admit"] == 2
    assert [kinds.count("admit") for kinds in spy.sends[mark:]] == [1, 49]
    assert await redis.hget(keys.backend_load("b0"), "p1") == b"51"
    admission.release_key(b"k0")
    admission.release_backend("b0")
    await admission.background.drain()

    mark = spy.mark()
    for i in range(50):  # the ends of one turn: one round trip as well
        admission.release_key(b"k%d" % (i % 3))
        admission.release_backend("b0")
    await admission.background.drain()
    commands, trips = spy.since(mark)
    assert trips["release"] == 1
    assert await redis.hgetall(keys.backend_load("b0")) == {}


async def test_calls_made_while_a_batch_is_in_flight_go_in_the_next_one(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    """In a ramp a batch per loop turn was one send and one read each (two system calls,
    ~10% of a stream start's CPU) and, while others awaited their replies, a pooled
    connection of its own to take and open: calls made during a round trip now wait for it
    and go together in the next, on the same connection. Redis is paused meanwhile, so the
    first batch is in flight while the other nineteen admissions are made, one per loop
    turn, whatever the machine's speed; Redis counts the connections it accepted."""
    rig = await admitting()
    redis, keys, admission = rig.redis, rig.keys, rig.admission
    await _admit(admission)  # the admissions' connection is open
    accepted = (await redis.info("stats"))["total_connections_received"]
    trips = admission.batch.round_trips
    await redis.execute_command("CLIENT", "PAUSE", "300", "ALL")
    pending = []
    for _ in range(20):  # one admission per loop turn
        pending.append(asyncio.ensure_future(_admit(admission)))
        await asyncio.sleep(0.002)
    answers = await asyncio.gather(*pending)
    assert [a.verdict for a in answers] == [Verdict.ADMITTED] * 20
    assert admission.batch.round_trips - trips == 2
    assert (await redis.info("stats"))["total_connections_received"] == accepted
    assert await redis.hget(keys.backend_load("b0"), "p1") == b"21"


async def test_a_call_queued_behind_an_unanswered_batch_fails_within_its_own_timeout(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    """``state.timeout_s`` bounds each admission from the moment it is asked for, not from
    its batch's send: one queued behind a batch Redis does not answer (paused here) gets its
    ``503 state_unavailable`` one timeout after it came, not after the batch in front timed
    out and its own then did too (twice the timeout, less the gap between them)."""
    timeout_s = 1.0
    rig = await admitting(timeout_s=timeout_s)
    admission = rig.admission

    async def failed_after() -> float:
        """Seconds until the admission failed."""
        started = time.monotonic()
        with pytest.raises(StateUnavailable):
            await _admit(admission)
        return time.monotonic() - started

    await _admit(admission)
    await rig.redis.execute_command("CLIENT", "PAUSE", "2500", "ALL")
    first = asyncio.ensure_future(failed_after())
    await asyncio.sleep(0.1)  # its batch is in flight: this one waits behind it
    second = asyncio.ensure_future(failed_after())
    waited = await asyncio.gather(first, second)
    assert all(timeout_s * 0.9 <= w < timeout_s * 1.45 for w in waited), waited


async def test_an_admission_is_answered_in_two_loop_turns(
    admitting: MakeAdmission,  # noqa: F811
) -> None:
    """A stream's start awaits its admission, and in a ramp every loop turn relays the chunks
    ready then (a millisecond or more each): each turn the round trip takes is that much later
    a first byte. Sent in the caller's turn, read and parsed in the data callback, resumed:
    two turns. It was six (a callback started the task that sent; redis-py's send ran in a
    task of its own, ``asyncio.wait_for`` on Python 3.11), then four (redis-py's reading task
    woke a turn after the reply came, and the caller a turn after that), then three (a task
    sent each batch, its first step a turn after the call). Each turn here begins with 3 ms
    of work before the loop polls its sockets, as a busy router's does, so a reply sent
    meanwhile is seen at that poll whatever the send's place in its own turn (with the work
    after the send instead, the count varied from run to run: whether Redis had answered by
    the next poll)."""
    admission = (await admitting()).admission
    loop = asyncio.get_running_loop()
    selector = getattr(loop, "_selector", None)
    assert selector is not None, "this test counts the turns of asyncio's selector loop"
    poll = selector.select
    turns = 0

    def busy_turn(timeout: float | None = None) -> Any:  # a busy loop's turn: relaying
        nonlocal turns
        turns += 1
        time.sleep(0.003)
        return poll(timeout)

    await _admit(admission)
    selector.select = busy_turn
    try:
        taken = []
        for _ in range(10):
            await asyncio.sleep(0)
            before = turns
            answer = await _admit(admission)
            assert answer.verdict is Verdict.ADMITTED
            taken.append(turns - before)
        assert min(taken) <= 2, taken  # the fewest: what the code costs, not the machine
    finally:
        selector.select = poll

def _shared_state(redis: RedisServer, **state: Any) -> SharedState:
    """The shared state of a router on ``redis``, under a key prefix of its own (not started),
    with ``state`` added to its ``[state]`` table."""
    config = parse_config({
        "upstreams": [{"url": "http://127.0.0.1:9/v1"}], "auth": {"allow_anonymous": True},
        "listen": {"insecure_plain_http": True},
        "state": {"redis_url": redis.url, "key_prefix": f"w{secrets.token_hex(4)}:", **state},
    }, "test")
    shared = connect(config)
    assert shared is not None
    return shared


async def test_a_stream_in_redis_stays_near_its_bound_though_few_xadds_check_it(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """``state.max_events_per_stream`` bounds a stream in Redis (``XADD MAXLEN ~``), checked
    by its first event and every few after (the check was a fifth of Redis's work for an
    event): a stream of 1,000 events under a bound of 16 keeps about a node's worth (``~``
    trims whole nodes of 100 entries), and one under the default keeps every event."""
    shared = _shared_state(redis_server, max_events_per_stream=16)
    roomy = _shared_state(redis_server)
    try:
        for state in (shared, roomy):
            await state.start()
        bounded, whole = Stream("bounded", b"owner", 0.0), Stream("whole", b"owner", 0.0)
        for state, stream in ((shared, bounded), (roomy, whole)):
            state.streams.publish(stream)
            await state.streams.announced(stream)
            for n in range(1000):
                stream.append(b"data: %d" % n, 0.0)
        await asyncio.sleep(0.3)  # one write interval and its round trip
        kept = await shared.redis.xlen(shared.keys.events("bounded"))
        assert 16 <= kept <= 16 + 100 + 2, kept
        assert await roomy.redis.xlen(roomy.keys.events("whole")) == 1000
        last: Any = await shared.redis.xrevrange(shared.keys.events("bounded"), count=1)
        assert last[0][0] == b"1000-0"  # the newest kept, the oldest dropped
    finally:
        for state in (shared, roomy):
            await state.aclose()


async def test_the_writer_stops_within_its_time_though_redis_holds_a_write(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """A process that exits gives its writer ``timeout_s`` (2 s) to write what is queued, in
    all: a write Redis does not answer (paused here) is abandoned at that time, not held
    until the write's own timeout (10 s)."""
    shared = _shared_state(redis_server)
    try:
        await shared.start()
        stream = Stream("held", b"owner", 0.0)
        shared.streams.publish(stream)
        await shared.streams.announced(stream)
        await shared.redis.execute_command("CLIENT", "PAUSE", "4000", "WRITE")
        stream.append(b"data: 1", 0.0)
        await asyncio.sleep(0.1)  # the write is in flight, unanswered
        started = time.monotonic()
        await shared.streams.writer.aclose(timeout_s=0.5)
        assert time.monotonic() - started < 2.0
    finally:
        await shared.redis.execute_command("CLIENT", "UNPAUSE")
        await shared.aclose()


async def test_one_write_carries_metadata_events_and_ttft_and_fences_a_stream_declared_lost(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """The writer's script does each operation whatever the others do: a stream whose entries
    another process went past (declared lost) is refused and its upstream request cancelled,
    the other stream of the same write is written whole."""
    shared = _shared_state(redis_server)
    try:
        await shared.start()
        kept, lost = Stream("kept", b"owner-a", 0.0), Stream("lost", b"owner-b", 0.0)
        cancelled: list[str] = []
        for stream in (kept, lost):
            shared.streams.publish(stream)
            stream.cancel_producer = lambda s=stream: cancelled.append(s.id)
            await shared.streams.announced(stream)
        await shared.redis.xadd(shared.keys.events("lost"), {"d": "x"}, id="9-0")  # declared
        kept.upstream_ttft_ms = 12.5
        for n in range(3):
            for stream in (kept, lost):
                stream.append(b"data: %d" % n, 0.0)
        kept.finish(0.0)
        await asyncio.sleep(0.3)  # one write interval and its round trip
        entries: Any = await shared.redis.xrange(shared.keys.events("kept"))
        meta = await shared.redis.hgetall(shared.keys.meta("kept"))
        assert [e[0] for e in entries] == [b"1-0", b"2-0", b"3-0", b"4-0"]
        assert entries[-1][1] == {b"d": b"[DONE]"}
        assert meta[b"owner"] == b"owner-a"
        assert meta[b"proc"] == shared.process.encode()
        assert meta[b"ttft"] == b"12.500"
        assert await shared.redis.pttl(shared.keys.events("kept")) > 0
        assert cancelled == ["lost"]
        assert lost.mirror is None
        assert shared.streams.writer.fenced == 1
    finally:
        await shared.aclose()


async def test_the_first_admission_after_a_redis_restart_is_answered() -> None:
    """The turn's calls keep their last connection: after Redis restarts it is dead, and the
    next batch reconnects once, at once (as redis-py retries its own commands), instead of
    answering ``503 state_unavailable`` for the request that found it so."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(running_redis(port=port))
        redis = Redis.from_url(server.url)
        keys = Keys("restart:")
        admission = SharedAdmission(redis, keys, "p1", expiry_s=60, affinity_ttl_s=60)
        try:
            await admission.start()

            async def admit() -> Verdict:
                answer = await admission.admit(Claim(b"k", "b0", 100))
                return answer.verdict

            assert await admit() is Verdict.ADMITTED  # the batch's connection is kept
            stack.close()  # Redis killed, then started again, empty (its scripts too)
            stack.enter_context(running_redis(port=port))
            assert await admit() is Verdict.ADMITTED
            assert admission.failures == 0
        finally:
            await admission.aclose()
            await redis.aclose()


async def test_the_writer_packs_a_stream_key_once_and_forgets_past_its_bound(
    redis_server: RedisServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each stream's event key is packed once, not once a write (a write carries about one
    event of each live stream), and the keys kept stay bounded: past ``_NAMES_KEPT`` the
    writer forgets them all, and every event still lands under its own stream's key."""
    from firstbyte.router.shared import streams as shared_streams

    monkeypatch.setattr(shared_streams, "_NAMES_KEPT", 3)
    shared = _shared_state(redis_server)
    packed: list[str] = []

    class CountedKeys:  # the writer's keys, counting the event keys it packs
        def __getattr__(self, name: str) -> Any:
            return getattr(shared.keys, name)

        def events(self, stream_id: str) -> str:
            packed.append(stream_id)
            return shared.keys.events(stream_id)

    writer = shared.streams.writer
    writer._keys = CountedKeys()  # type: ignore[assignment]
    try:
        await shared.start()
        streams = [Stream(f"s{n}", b"owner", 0.0) for n in range(4)]
        for stream in streams:
            shared.streams.publish(stream)
            await shared.streams.announced(stream)

        async def write(*indexes: int) -> None:
            for i in indexes:
                streams[i].append(b"data: %d" % (len(streams[i].events) + 1), 0.0)
            await asyncio.wait_for(writer._idle.wait(), 10)  # written

        await write(0, 1, 2)  # three keys packed, three kept
        assert sorted(packed) == ["s0", "s1", "s2"]
        await write(0, 1)  # kept: not packed again
        assert sorted(packed) == ["s0", "s1", "s2"]
        await write(3)  # a fourth, kept too: over the bound from the next write
        assert sorted(packed) == ["s0", "s1", "s2", "s3"]
        await write(1)  # forgotten, s1's packed again and kept alone
        assert sorted(packed) == ["s0", "s1", "s1", "s2", "s3"]
        assert list(writer._names) == ["s1"]
        for stream, count in zip(streams, (2, 3, 1, 1), strict=True):
            entries: Any = await shared.redis.xrange(shared.keys.events(stream.id))
            assert [e[1][b"d"] for e in entries] == [b"data: %d" % n for n in
                                                     range(1, count + 1)], stream.id
    finally:
        await shared.aclose()


def test_a_redis_py_that_sets_no_writer_is_named_before_the_router_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The data-callback parse reaches the transport through redis-py's private ``_writer``;
    a redis-py without it is refused with one line naming its version, not a failure per
    admission."""
    import redis
    from redis.asyncio.connection import AbstractConnection

    from firstbyte.router.shared.wire import check_shape

    assert check_shape() is None
    monkeypatch.setattr(AbstractConnection, "__init__", lambda self, **kwargs: None)
    problem = check_shape()
    assert problem is not None
    assert problem.startswith(f"redis {redis.__version__} is not what router/shared/wire.py")
    assert "\n" not in problem
