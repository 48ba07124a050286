"""The direct write path: a caught-up SSE reader is written from the producer's append.

Sans sockets: the bytes a reader sends are the same whether events went through the body
writer or the reader's own path, for every reader of a stream, a late one, one whose writer
refuses (behind), named events, and idle heartbeats. Over real sockets (HTTP/1.1 on the
default server): a stream is written directly and whole, a reader that stops reading makes
the router fall back (its transport buffer stays at the high-water mark, not the stream's
size) and still gets every event once, and a second reader and a resumed reader each get
every event once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from firstbyte.protocol import error_codes
from firstbyte.protocol.sse import HEARTBEAT, SSEDecoder
from firstbyte.router.asgi import stream_body
from firstbyte.router.hosting import uvicorn_limits
from firstbyte.router.pipeline.proxy import DRAIN_CANCEL
from firstbyte.router.readers import sse_events
from firstbyte.router.serve import RouterEndpoints
from firstbyte.router.streams import Stream, StreamStore, owner_of
from tests.router.conftest import RouterFactory, auth
from tests.router.streamtext import sse_text
from tests.router.upstream import Upstream, running_upstream

ALICE = owner_of("sk-alice-000000")


class Writer:
    """A body writer that keeps what it was given; refuses while ``behind``."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.behind = False
        self.refused = 0

    def __call__(self, body: bytes) -> bool:
        if self.behind:
            self.refused += 1
            return False
        self.parts.append(body)
        return True


async def read_all(
    stream: Stream, after: int, writer: Writer | None, heartbeat_s: float = 30.0
) -> bytes:
    """What a reader sends: the directly written parts and the yielded ones, in order (the
    writer is only called while the reader waits, so appending both to one list keeps it)."""
    out: list[bytes] = []
    if writer is not None:
        writer.parts = out
    async for piece in sse_events(stream, after, heartbeat_s=heartbeat_s, direct=writer):
        out.append(piece)
    return b"".join(out)


async def produce(stream: Stream, payloads: list[bytes], gap_s: float = 0.002) -> None:
    for payload in payloads:
        await asyncio.sleep(gap_s)
        stream.append(payload, 0.0)
    stream.finish(0.0)


CHAT = [b'{"n":%d}' % i for i in range(20)]


async def test_direct_and_plain_readers_send_the_same_bytes() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.append(CHAT[0], 0.0)
    direct, late = Writer(), Writer()
    plain_reader = asyncio.create_task(read_all(stream, 0, None))
    direct_reader = asyncio.create_task(read_all(stream, 0, direct))
    producer = asyncio.create_task(produce(stream, CHAT[1:10]))
    await asyncio.sleep(0.01)
    late_reader = asyncio.create_task(read_all(stream, 0, late))  # joins mid-stream
    await producer
    await asyncio.wait_for(asyncio.gather(plain_reader, direct_reader, late_reader), 5)
    plain = plain_reader.result()
    assert plain.startswith(b'id: 1\ndata: {"n":0}\n\n')
    assert plain.endswith(b"data: [DONE]\n\n")
    assert direct_reader.result() == plain
    assert late_reader.result() == plain
    # Most of it went out through the writer: every event after the first catch-up but [DONE].
    assert len(direct.parts) >= 2
    assert len(late.parts) >= 1
    assert stream.readers == 0
    assert not stream._taps


async def test_the_stream_end_goes_out_with_the_body_end_in_one_send() -> None:
    # The [DONE] event is the body's last part: it is sent with more_body false, so the
    # server writes it and the end of the body (HTTP/1.1's last chunk) at once.
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client stays
        raise AssertionError

    for named in (False, True):
        sent.clear()
        stream = store.create(ALICE, 0.0)
        payloads = [b"event: delta\ndata: {}" if named else CHAT[0]] * 3
        producer = asyncio.create_task(produce(stream, payloads))
        done = await asyncio.wait_for(
            stream_body(receive, send, 200, [], sse_events(stream, 0, heartbeat_s=30)), 5
        )
        await producer
        assert done
        assert [m.get("more_body") for m in sent[1:]] == [True] * (len(sent) - 2) + [False]
        last = sent[-1]["body"]
        body = b"".join(m["body"] for m in sent[1:])
        if named:  # a named stream ends with its own event: it carries the end, no [DONE]
            assert last.endswith(b"data: {}\n\n")
            assert b"[DONE]" not in body
        else:
            assert last.endswith(b"data: [DONE]\n\n")
            assert body.count(b"[DONE]") == 1
        assert body.count(b"id: ") == 3 + (not named)
        assert stream.readers == 0


async def test_events_appended_together_go_out_in_one_write_as_the_same_bytes() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.append(CHAT[0], 0.0)
    direct = Writer()
    plain_reader = asyncio.create_task(read_all(stream, 0, None))
    direct_reader = asyncio.create_task(read_all(stream, 0, direct))
    await asyncio.sleep(0.01)  # both caught up: the direct one waits in relay_live
    before = len(direct.parts)
    stream.extend(CHAT[1:6], 0.0)  # one upstream read's events
    assert len(direct.parts) == before + 1  # written at once, as one part
    stream.extend(CHAT[6:10], 0.0)
    stream.extend([CHAT[10]], 0.0)
    assert len(direct.parts) == before + 3
    stream.finish(0.0)
    await asyncio.wait_for(asyncio.gather(plain_reader, direct_reader), 5)
    plain = plain_reader.result()
    assert plain.count(b"\nid: ") + 1 == 12  # eleven events and [DONE], each framed
    assert direct_reader.result() == plain
    assert not stream._taps


async def test_add_has_the_effects_of_extend() -> None:
    # The fused append (Stream.add) against extend: the same bytes to a direct reader and
    # to a plain one, the same store and owner charges, every event mirrored once.
    runs = []
    for fused in (False, True):
        store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
        stream = store.create(ALICE, 0.0)
        mirrored: list[int] = []
        stream.mirror = lambda _stream, event, seqs=mirrored: seqs.append(event.seq)
        stream.append(CHAT[0], 0.0)
        direct = Writer()
        readers = [
            asyncio.create_task(read_all(stream, 0, None)),
            asyncio.create_task(read_all(stream, 0, direct)),
        ]
        await asyncio.sleep(0.01)  # both caught up
        for batch in (CHAT[1:2], CHAT[2:6], CHAT[6:7]):
            if fused:
                stream.add(batch, time.perf_counter())
            else:
                stream.extend(batch, 0.0)
        stream.finish(0.0)
        plain, written = await asyncio.wait_for(asyncio.gather(*readers), 5)
        runs.append(
            (plain, written, len(direct.parts), stream.size_bytes, store.total_bytes,
             store.owner_bytes(ALICE), mirrored, stream.last_seq)
        )
    assert runs[0] == runs[1]
    assert runs[1][0] == runs[1][1]
    assert runs[1][6] == list(range(1, 9))


async def test_a_reader_behind_falls_back_to_its_own_path_and_misses_nothing() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    writer = Writer()
    reader = asyncio.create_task(read_all(stream, 0, writer))
    for i, payload in enumerate(CHAT):
        await asyncio.sleep(0.002)
        writer.behind = 5 <= i < 12  # its connection is full for a while
        stream.append(payload, 0.0)
    stream.finish(0.0)
    sent = await asyncio.wait_for(reader, 5)
    assert writer.refused >= 1
    events = SSEDecoder().receive_data(sent)
    assert [e.id for e in events] == [str(i) for i in range(1, 22)]
    assert [e.data.encode() for e in events[:-1]] == CHAT


async def test_named_events_framed_alike_on_both_paths() -> None:
    named = [
        b'event: response.created\ndata: {"type":"response.created"}',
        *(b'event: response.output_text.delta\ndata: {"d":%d}' % i for i in range(5)),
        b'event: response.completed\ndata: {"type":"response.completed"}',
    ]
    outs = []
    for writer in (None, Writer()):
        store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
        stream = store.create(ALICE, 0.0)
        reader = asyncio.create_task(read_all(stream, 0, writer))
        await produce(stream, named)
        outs.append(await asyncio.wait_for(reader, 5))
    assert outs[0] == outs[1]
    assert b"[DONE]" not in outs[0]
    assert outs[0].startswith(b"id: 1\nevent: response.created\n")


async def test_heartbeat_counts_from_the_last_direct_write() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.append(CHAT[0], 0.0)
    writer = Writer()
    writer.parts = []
    reader = sse_events(stream, 0, heartbeat_s=0.2, direct=writer)
    assert (await reader.__anext__()).startswith(b"id: 1\n")
    heartbeat = asyncio.ensure_future(reader.__anext__())
    for payload in CHAT[1:6]:  # events every 0.1 s: no heartbeat while they come
        await asyncio.sleep(0.1)
        stream.append(payload, 0.0)
    last_event_at = time.monotonic()
    assert not heartbeat.done()
    assert await asyncio.wait_for(heartbeat, 5) == HEARTBEAT
    assert time.monotonic() - last_event_at >= 0.2 * 0.95  # idle a whole interval, not less
    assert len(writer.parts) == 5
    stream.finish(0.0)
    assert [piece async for piece in reader] == [b"id: 7\ndata: [DONE]\n\n"]


async def test_an_evicted_stream_releases_its_direct_reader() -> None:
    store = StreamStore(max_total_bytes=1 << 20, max_age_s=60)
    stream = store.create(ALICE, 0.0)
    stream.append(CHAT[0], 0.0)
    writer = Writer()
    reader = asyncio.create_task(read_all(stream, 0, writer))
    await asyncio.sleep(0.01)
    stream.append(CHAT[1], 0.0)
    assert stream._taps  # caught up: written directly
    store.evict(1000.0)  # past its age
    sent = await asyncio.wait_for(reader, 5)
    assert stream.evicted
    assert not stream._taps
    assert sent == b'id: 1\ndata: {"n":0}\n\nid: 2\ndata: {"n":1}\n\n'


# -- over sockets: HTTP/1.1 on the default server ----------------------------------------

Spy = dict[str, Any]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    """Counts the body writer's writes (and the events in each) and refusals, and the
    largest transport buffer a direct write left behind."""
    stats: Spy = {"written": 0, "refused": 0, "max_buffer": 0, "events": [], "max_write": 0,
                  "high_water": 0}
    real: Callable[[Any], Callable[[bytes], bool]] = uvicorn_limits.uvicorn_writer

    def spying(cycle: Any) -> Callable[[bytes], bool]:
        write = real(cycle)

        def counted(body: bytes) -> bool:
            ok = write(body)
            if ok:
                stats["written"] += 1
                stats["events"].append(body.count(b"\nid: ") + body.startswith(b"id: "))
                size = cycle.transport.get_write_buffer_size()
                stats["max_buffer"] = max(stats["max_buffer"], size)
                stats["max_write"] = max(stats["max_write"], len(body))
                stats["high_water"] = cycle.transport.get_write_buffer_limits()[1]
            else:
                stats["refused"] += 1
            return ok

        return counted

    monkeypatch.setattr(uvicorn_limits, "uvicorn_writer", spying)
    return stats


@contextlib.asynccontextmanager
async def routed(
    start_router: RouterFactory, **upstream_options: Any
) -> AsyncIterator[tuple[Upstream, RouterEndpoints]]:
    async with running_upstream(**upstream_options) as up, start_router(
        [up.url], tls=False
    ) as endpoints:
        yield up, endpoints


def body(tokens: int) -> dict[str, Any]:
    return {"model": "test-model", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "max_tokens": tokens}


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


async def test_http1_stream_is_written_directly_and_whole(
    start_router: RouterFactory, spy: Spy
) -> None:
    async with routed(start_router, delay_s=0.005) as (_, router), httpx.AsyncClient(
        timeout=30
    ) as client:
        response = await client.post(
            router.base_url + "/v1/chat/completions", json=body(40), headers=auth()
        )
        metrics = (await client.get(router.base_url + "/metrics", headers=auth())).text
    text, ids = sse_text(response.content)
    assert text == words(40)
    assert ids == [str(i) for i in range(1, len(ids) + 1)]
    assert spy["written"] >= 30  # the live chunks went out from the producer
    # The metrics page says which path the events took (each event counted once).
    counted = {
        path: int(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        for path in ("direct", "send")
        if line.startswith(f'firstbyte_router_sse_events_total{{path="{path}"}}')
    }
    assert counted["direct"] == sum(spy["events"]) >= 30, (counted, spy)
    assert counted["direct"] + counted["send"] == len(ids)


async def test_chunks_of_one_upstream_read_go_out_in_one_write(
    start_router: RouterFactory, spy: Spy
) -> None:
    # The upstream sends its chunks in bursts of 5 (five HTTP chunks, back to back): each
    # burst reaches the router in one read, and goes to the reader in one write, not five.
    tokens, burst = 40, 5
    async with routed(start_router, delay_s=0.02, burst=burst) as (_, router), httpx.AsyncClient(
        timeout=30
    ) as client:
        response = await client.post(
            router.base_url + "/v1/chat/completions", json=body(tokens), headers=auth()
        )
    text, ids = sse_text(response.content)
    assert text == words(tokens)
    assert ids == [str(i) for i in range(1, tokens + 4)]
    bursts = tokens // burst
    assert spy["written"] >= bursts - 2  # the live chunks went out from the producer
    assert max(spy["events"]) == burst, spy  # a whole burst, five HTTP chunks, in one write
    # A burst split over two reads (uvloop may send its first chunk ahead of the rest)
    # costs a write more, never one per chunk.
    assert spy["written"] <= 2 * bursts + 2, spy


async def test_slow_reader_falls_back_and_the_router_buffers_only_to_its_high_water(
    start_router: RouterFactory, spy: Spy
) -> None:
    tokens = 20_000  # ~3 MB of events, far past any socket and transport buffer
    async with routed(start_router) as (up, router):
        port = int(router.base_url.rsplit(":", 1)[1])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", port))
        payload = httpx.Request(
            "POST", "http://x/", json=body(tokens)
        ).content
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            f"authorization: {auth()['authorization']}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n"
        ).encode()
        await loop.sock_sendall(sock, head + payload)
        # Not reading: the upstream produces the whole stream into the store meanwhile.
        deadline = time.monotonic() + 60
        while up.completed < 1 and time.monotonic() < deadline:  # noqa: ASYNC110 (a counter)
            await asyncio.sleep(0.05)
        assert up.completed == 1
        received = bytearray()
        try:
            while not received.endswith(b"0\r\n\r\n") and time.monotonic() < deadline:
                data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
                if not data:
                    break
                received += data
        finally:
            sock.close()
    assert spy["refused"] >= 1  # the reader was behind: the producer stopped writing to it
    # One write past the mark at most (as ASGI send), not the megabytes the reader missed: a
    # write is taken only while the buffer is under the transport's high-water mark, and one
    # write is one upstream read's events (up to the event loop's read size, 256 KiB, when the
    # machine is slow enough for the upstream's bytes to pile up between reads).
    assert spy["max_buffer"] <= spy["high_water"] + spy["max_write"] + 32, spy
    assert spy["max_buffer"] < 1 << 20, spy
    head_end = received.index(b"\r\n\r\n") + 4
    text, ids = sse_text(_dechunk(bytes(received[head_end:])))
    assert text == words(tokens)
    assert ids == [str(i) for i in range(1, tokens + 4)]


def _dechunk(data: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        line_end = data.index(b"\r\n", at)
        size = int(data[at:line_end], 16)
        if size == 0:
            return bytes(out)
        out += data[line_end + 2 : line_end + 2 + size]
        at = line_end + 2 + size + 2


async def test_second_reader_and_resumed_reader_over_http1_each_get_every_event_once(
    start_router: RouterFactory, spy: Spy
) -> None:
    tokens = 60
    async with routed(start_router, delay_s=0.01) as (_, router), httpx.AsyncClient(
        timeout=30
    ) as client:
        url = router.base_url
        first: list[tuple[str | None, str]] = []
        decoder = SSEDecoder()
        async with client.stream(
            "POST", url + "/v1/chat/completions", json=body(tokens), headers=auth()
        ) as response:
            stream_id = response.headers["x-firstbyte-stream"]
            second = asyncio.ensure_future(
                client.get(f"{url}/v1/streams/{stream_id}", headers=auth())
            )  # joins mid-stream, from the start
            async for piece in response.aiter_raw():
                first.extend((e.id, e.data) for e in decoder.receive_data(piece))
                if len(first) >= 5:
                    break  # the first reader drops its connection
        written = spy["written"]
        resumed = await client.get(
            f"{url}/v1/streams/{stream_id}", headers={**auth(), "last-event-id": "5"}
        )
        joined = await asyncio.wait_for(second, 30)
    all_text, all_ids = sse_text(joined.content)
    assert all_text == words(tokens)
    assert all_ids == [str(i) for i in range(1, tokens + 4)]
    rest_text, rest_ids = sse_text(resumed.content)
    assert rest_ids == [str(i) for i in range(6, tokens + 4)]
    head_text = sse_text(
        b"".join(b"id: %s\ndata: %s\n\n" % (i.encode(), d.encode()) for i, d in first[:5])
    )[0]
    assert head_text + rest_text == words(tokens)
    assert spy["written"] > written  # the readers after the drop were written directly too


async def test_a_streamed_response_costs_no_task_of_the_router(
    start_router: RouterFactory,
) -> None:
    # Per request, not per chunk, but a stream of 64 tokens spends about a third of its CPU
    # there: none (the producer runs in its upstream connection's callbacks when the pool
    # has one idle; the body is sent from the request's own task; the client's disconnect
    # is the server's future, firstbyte.disconnected, not a task blocked in receive(); the
    # model lists, once in, are not waited for through a task of wait_for).
    made: list[str] = []
    loop = asyncio.get_running_loop()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Task[Any]:
        # Made by a request's task (uvicorn's), of the router (not the test's upstream).
        current = asyncio.current_task()
        code = getattr(coro, "cr_code", None)
        if (
            current is not None
            and current.get_coro().__qualname__ == "RequestResponseCycle.run_asgi"
            and (code is None or "/tests/" not in code.co_filename)
        ):
            made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **options)

    async with routed(start_router) as (_, router), httpx.AsyncClient(timeout=30) as client:
        url = router.base_url + "/v1/chat/completions"
        await client.post(url, json=body(3), headers=auth())  # connections and lists warm
        loop.set_task_factory(counting)
        try:
            response = await client.post(url, json=body(20), headers=auth())
        finally:
            loop.set_task_factory(None)
    assert sse_text(response.content)[0] == words(20)
    assert made == [], made


async def test_a_producer_without_a_task_is_cancelled_as_its_task_was(
    start_router: RouterFactory,
) -> None:
    # A stream's producer runs in its upstream connection's callbacks (no task) when the
    # pool has an idle connection: its stream's cancel_producer does what Task.cancel did,
    # the upstream request is dropped, and the stream ends with the error event its cancel
    # names (here the drain's) after what it had, counted as such.
    async with routed(start_router) as (up, router), httpx.AsyncClient(timeout=30) as client:
        url = router.base_url + "/v1/chat/completions"
        await client.post(url, json=body(3), headers=auth())  # connections and lists warm
        up.pause = asyncio.Event()  # each stream waits after its first word
        answer = asyncio.ensure_future(client.post(url, json=body(20), headers=auth()))
        await _until(lambda: up.started == 2)
        await asyncio.sleep(0.05)  # its first word relayed
        state = router.app.state
        (stream,) = [s for s in state.store._streams.values() if not s.done]
        assert stream.cancel_producer is not None
        assert not state.proxy.producers  # no task
        stream.cancel_producer(DRAIN_CANCEL)
        response = await asyncio.wait_for(answer, 30)
        up.pause.set()  # the upstream finds its client gone at its next word
        await _until(lambda: up.cancelled == 1)
        requests = state.metrics.requests
    events = SSEDecoder().receive_data(response.content)
    assert sse_text(response.content)[0] == "w0"
    assert events[-1].data == "[DONE]"
    error = json.loads(events[-2].data)["error"]
    assert error["code"] == error_codes.DRAINING, error
    assert stream.done
    assert stream.cancel_producer is None
    assert requests[("chat", "draining", "test-model")] == 1, requests
    assert up.completed == 1  # the warm-up's


async def test_a_body_that_ends_after_its_done_keeps_its_connection_without_a_task(
    start_router: RouterFactory,
) -> None:
    # A server that writes [DONE] and its chunked body's end apart (Starlette's
    # StreamingResponse does): the producer, with no task, reads on to the body's end, so
    # the connection goes back to the pool and the next stream goes on it.
    connections: list[int] = []
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    done = b"data: [DONE]\n\n"

    def chunked(data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")), 0
                )
                await reader.readexactly(length)
                if not head.startswith(b"POST /v1/chat/completions "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n" + chunked(chunk) + chunked(done)
                )
                await asyncio.sleep(0.05)
                writer.write(b"0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    made: list[str] = []
    loop = asyncio.get_running_loop()

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Task[Any]:
        if "Producer" in getattr(coro, "__qualname__", ""):
            made.append(coro.__qualname__)
        return asyncio.Task(coro, loop=loop, **options)

    try:
        async with start_router([f"http://127.0.0.1:{port}"], tls=False) as router, \
                httpx.AsyncClient(timeout=30) as client:
            url = router.base_url + "/v1/chat/completions"
            await client.post(url, json=body(1), headers=auth())  # a connection in the pool
            before = len(connections)
            loop.set_task_factory(counting)
            try:
                for _ in range(2):
                    response = await client.post(url, json=body(1), headers=auth())
                    assert sse_text(response.content)[0] == "hi"
            finally:
                loop.set_task_factory(None)
            await asyncio.sleep(0.1)
            after = len(connections)
            requests = router.app.state.metrics.requests
    finally:
        server.close()
    assert made == []
    assert after == before  # both streams on the pooled connection
    assert requests[("chat", "ok", "")] == 3, requests  # (a model no list names)


async def test_a_streamed_request_leaves_nothing_for_the_cyclic_gc(
    start_router: RouterFactory,
) -> None:
    # Its objects go by reference counting when it ends. The body writer in the request's
    # scope referred to the request cycle, which refers to the scope: that loop kept each
    # request's scope and context (and ~45 objects with them) until a collection of the
    # oldest generation, rare in a tuned router. And a finished stream, kept for resumes,
    # no longer holds its producer's task.
    async with routed(start_router) as (_, router), httpx.AsyncClient(timeout=30) as client:
        url = router.base_url + "/v1/chat/completions"
        await client.post(url, json=body(3), headers=auth())  # connections and lists warm
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                response = await client.post(url, json=body(5), headers=auth())
                assert sse_text(response.content)[0] == words(5)
            await asyncio.sleep(0.05)  # the producers' and the access log's ends
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left = collections.Counter(type(o).__qualname__ for o in gc.garbage)
            # uvicorn_limits' cycles are a subclass of uvicorn's (ReceivingCycle)
            left["RequestResponseCycle"] += sum(
                isinstance(o, RequestResponseCycle) for o in gc.garbage
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        streams = list(router.app.state.store._streams.values())
    assert left["RequestContext"] == 0, left.most_common(12)
    assert left["RequestResponseCycle"] == 0, left.most_common(12)
    assert len(streams) == 4
    assert all(s.done and s.cancel_producer is None for s in streams)


async def test_a_client_gone_before_the_head_stops_its_upstream_request(
    start_router: RouterFactory,
) -> None:
    # The one disconnect listener covers the wait for the upstream's head: a client that
    # hangs up then is counted as gone and its upstream request is dropped (the upstream,
    # let go afterwards, finds its client gone), and the next request streams whole.
    async with routed(start_router) as (up, router), httpx.AsyncClient(timeout=30) as client:
        url = router.base_url + "/v1/chat/completions"
        await client.post(url, json=body(3), headers=auth())  # connections and lists warm
        up.hold, up.delay_s = asyncio.Event(), 0.01  # a gap between words: it sees its client
        host, port = router.base_url.removeprefix("http://").rsplit(":", 1)
        payload = json.dumps(body(20)).encode()
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
            b"authorization: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s"
            % (auth()["authorization"].encode(), len(payload), payload)
        )
        await writer.drain()
        await _until(lambda: len(up.chat_requests) == 2)  # the upstream holds it: no head
        writer.close()
        gone = 0
        deadline = time.monotonic() + 10
        while not gone and time.monotonic() < deadline:
            metrics = (await client.get(router.base_url + "/metrics", headers=auth())).text
            gone = sum(
                int(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("firstbyte_router_requests_total")
                and 'outcome="client_gone"' in line
            )
        assert gone == 1
        up.hold.set()
        await _until(lambda: up.cancelled == 1)
        assert up.completed == 1  # the warm-up's, not this one's
        up.hold, up.delay_s = None, 0.0
        response = await client.post(url, json=body(5), headers=auth())
    assert sse_text(response.content)[0] == words(5)


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _counter(metrics: str, name: str, path: str) -> int:
    prefix = f'{name}{{path="{path}"}} '
    return sum(int(line[len(prefix) :]) for line in metrics.splitlines() if line.startswith(prefix))


async def test_fused_path_feeds_a_second_a_resumed_and_a_slow_reader_every_event_once(
    start_router: RouterFactory, spy: Spy
) -> None:
    # One stream: a token every 5 ms at first (one event a read: the fused path), read by
    # its own client, a second reader from the start and a reader resumed after event 5;
    # then the upstream floods while the first client stops reading, so the router's writes
    # to it are refused and it falls back to the store. Each gets every event once.
    tokens = 20_000
    async with routed(start_router, delay_s=0.005) as (up, router), httpx.AsyncClient(
        timeout=60
    ) as client:
        url = router.base_url
        port = int(url.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        received = bytearray()
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            payload = httpx.Request("POST", "http://x/", json=body(tokens)).content
            await loop.sock_sendall(
                sock,
                (
                    "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                    f"authorization: {auth()['authorization']}\r\n"
                    "content-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n\r\n"
                ).encode()
                + payload,
            )
            deadline = time.monotonic() + 60
            while received.count(b"\nid: ") < 10 and time.monotonic() < deadline:
                received += await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
            lines = bytes(received[: received.index(b"\r\n\r\n")]).decode().split("\r\n")
            stream_id = next(
                line.split(":", 1)[1].strip()
                for line in lines
                if line.lower().startswith("x-firstbyte-stream:")
            )
            second = asyncio.ensure_future(
                client.get(f"{url}/v1/streams/{stream_id}", headers=auth())
            )
            resumed = asyncio.ensure_future(
                client.get(
                    f"{url}/v1/streams/{stream_id}", headers={**auth(), "last-event-id": "5"}
                )
            )
            await asyncio.sleep(0.3)  # all three readers on the direct path, one event a read
            fast_before = _counter(
                (await client.get(url + "/metrics", headers=auth())).text,
                "firstbyte_router_relay_reads_total",
                "fast",
            )
            up.delay_s = 0.0  # the rest as fast as it goes; the first client reads no more
            while up.completed < 1 and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            assert up.completed == 1
            while not received.endswith(b"0\r\n\r\n") and time.monotonic() < deadline:
                data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
                if not data:
                    break
                received += data
        finally:
            sock.close()
        joined = await asyncio.wait_for(second, 60)
        rest = await asyncio.wait_for(resumed, 60)
        metrics = (await client.get(url + "/metrics", headers=auth())).text
    every = [str(i) for i in range(1, tokens + 4)]
    text, ids = sse_text(_dechunk(bytes(received[received.index(b"\r\n\r\n") + 4 :])))
    assert (text, ids) == (words(tokens), every)
    text, ids = sse_text(joined.content)
    assert (text, ids) == (words(tokens), every)
    assert sse_text(rest.content)[1] == every[5:]
    assert spy["refused"] >= 1  # the first client was behind: it fell back to the store
    # The per-token reads took the fused path (compiled, where it was built); counted as
    # the request ended.
    assert fast_before == 0
    fused = sum(
        _counter(metrics, "firstbyte_router_relay_reads_total", path)
        for path in ("fast", "compiled")
    )
    assert fused >= 20
    assert spy["written"] >= 20
    # The inter-token gaps of the fused path are observed: one per appended read after
    # the first content (each read brought at least one event, reads <= events).
    itl = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith(("firstbyte_route_itl_seconds_count", "firstbyte_route_itl_seconds_sum"))
    }
    assert 20 <= itl["firstbyte_route_itl_seconds_count"] <= tokens + 2, itl
    assert itl["firstbyte_route_itl_seconds_sum"] >= 0.005 * 15  # the first tokens' gaps
