"""uvicorn's send with the common case in fewer steps (router.hosting.uvicorn_send): for every
message sequence, the same bytes written, the same state of the request cycle, the same
errors and the same end-of-response calls as uvicorn's own ``send``, with the head written by
the compiled ``render_head`` and by the Python it stands in for; and the router's streamed
answers take it without falling back."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from firstbyte.benchmarks import chunk_instructions
from firstbyte.router import chunkpath
from firstbyte.router.asgi import LastPart, stream_body
from firstbyte.router.hosting import uvicorn_limits, uvicorn_send
from firstbyte.router.hosting.uvicorn_send import EXTENSION, fast_send
from tests.router.conftest import RouterFactory, auth
from tests.router.hosting.transports import KeepingTransport as Transport
from tests.router.streamtext import sse_text

DATE = [(b"date", b"Mon, 07 Dec 2026 09:00:00 GMT")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


def _cycle(
    method: str = "POST", keep_alive: bool = True, default_headers: Any = DATE
) -> tuple[RequestResponseCycle, Transport, list[str]]:
    transport = Transport()
    ended: list[str] = []
    scope: Any = {"type": "http", "method": method, "http_version": "1.1", "path": "/",
                  "query_string": b"", "client": ("127.0.0.1", 1), "headers": []}
    cycle = RequestResponseCycle(
        scope, transport, FlowControl(transport), logging.getLogger("t"),
        logging.getLogger("t.access"), False, list(default_headers), asyncio.Event(), False,
        keep_alive, lambda: ended.append("response"),
    )
    return cycle, transport, ended


@pytest.fixture(params=["compiled", "python"])
def head_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The response head written by the compiled render_head, then by the Python alone."""
    if request.param == "python":
        monkeypatch.setattr(uvicorn_send, "_RENDER_HEAD", uvicorn_send._render)
    else:
        assert chunkpath.RENDER_HEAD is not None, "firstbyte.router._chunkpath was not built"
        assert uvicorn_send._RENDER_HEAD is chunkpath.RENDER_HEAD
    return str(request.param)


_STATE = ("response_started", "response_complete", "chunked_encoding", "keep_alive",
          "expected_content_length", "waiting_for_100_continue")


async def _run(cycle: RequestResponseCycle, transport: Transport, ended: list[str],
               messages: list[dict[str, Any]]) -> tuple[Any, ...]:
    outcome: list[Any] = []
    for message in messages:
        try:
            await cycle.send(message)  # type: ignore[arg-type]
            outcome.append("ok")
        except Exception as exc:  # the same error, at the same message
            outcome.append((type(exc).__name__, str(exc)))
    state = tuple(getattr(cycle, name) for name in _STATE)
    return (b"".join(transport.writes), len(transport.writes), transport.closed,
            cycle.message_event.is_set(), tuple(ended), tuple(outcome), state)


def start(status: int = 200, headers: Any = SSE) -> dict[str, Any]:
    return {"type": "http.response.start", "status": status, "headers": headers}


def part(body: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": body, "more_body": more}


CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    "stream": ({}, [start(), part(b"id: 1\ndata: a\n\n"), part(b""), part(b"x", False)]),
    "stream-ends-empty": ({}, [start(), part(b"abc"), part(b"", False)]),
    "upper-case-names": ({}, [start(headers=[(b"X-Thing", b"V"), (b"Cache-Control", b"a")]),
                              part(b"", False)]),
    "no-keep-alive": ({"keep_alive": False}, [start(), part(b"a", False)]),
    "connection-close": ({}, [start(headers=[*SSE, (b"connection", b"close")]), part(b"a"),
                              part(b"b", False)]),
    "content-length": ({}, [start(headers=[(b"content-length", b"3")]), part(b"ab"),
                            part(b"c", False)]),
    "content-length-short": ({}, [start(headers=[(b"content-length", b"3")]),
                                  part(b"ab", False)]),
    "chunked-given": ({}, [start(headers=[(b"Transfer-Encoding", b"chunked")]),
                           part(b"a", False)]),
    "no-content": ({}, [start(204), part(b"", False)]),
    "not-modified": ({}, [start(304, []), part(b"", False)]),
    "head": ({"method": "HEAD"}, [start(), part(b"", False)]),
    "bad-value": ({}, [start(headers=[*SSE, (b"x-a", b"ok"), (b"x-b", b"a\r\nb: c")])]),
    "bad-value-first": ({}, [start(headers=[(b"x-b", b"\x00"), (b"bad name", b"v")])]),
    "bad-name": ({}, [start(headers=[*SSE, (b"bad name", b"v")])]),
    "bad-name-first": ({}, [start(headers=[(b"bad name", b"v"), (b"x-b", b"\x00")])]),
    "no-date": ({"default_headers": []}, [start(headers=[]), part(b"a", False)]),
    "unknown-status": ({}, [start(999)]),
    "no-status": ({}, [{"type": "http.response.start", "headers": []}]),
    "not-a-pair": ({}, [start(headers=[(b"x-a",)])]),
    "str-header": ({}, [start(headers=[("x-a", "v")])]),
    "body-first": ({}, [part(b"a")]),
    "start-twice": ({}, [start(), start()]),
    "after-the-end": ({}, [start(), part(b"a", False), part(b"b")]),
    "no-headers-key": ({}, [{"type": "http.response.start", "status": 200},
                            part(b"a", False)]),
    # Shapes the compiled head leaves to the Python: the same bytes either way.
    "list-pairs": ({}, [start(headers=[[b"x-a", b"v"], [b"cache-control", b"a"]]),
                        part(b"a", False)]),
    "tuple-of-headers": ({}, [start(headers=tuple(SSE)), part(b"a", False)]),
    "bytearray-value": ({}, [start(headers=[(b"x-a", bytearray(b"v"))]), part(b"a", False)]),
    "many-headers": ({}, [start(headers=[(b"x-%d" % i, b"v") for i in range(70)]),
                          part(b"a", False)]),
    "a-triple": ({}, [start(headers=[(b"x-a", b"v", b"w")])]),
    "bool-status": ({}, [start(True)]),  # type: ignore[arg-type]
    "server-header": ({"default_headers": [(b"server", b"uvicorn"), *DATE]},
                      [start(), part(b"a", False)]),
}


@pytest.mark.parametrize("case", CASES)
async def test_fast_send_does_what_uvicorns_send_does(case: str, head_path: str) -> None:
    options, messages = CASES[case]
    theirs = _cycle(**options)
    ours = _cycle(**options)
    fast_send(ours[0])
    assert await _run(*ours, messages) == await _run(*theirs, messages)


def test_the_compiled_head_is_the_pythons_or_none() -> None:
    """render_head writes what _render writes, or leaves the head to it (None): for heads it
    takes (learnt names, tuples of bytes) and for every shape it does not."""
    assert chunkpath.RENDER_HEAD is not None, "firstbyte.router._chunkpath was not built"
    uvicorn_send._bind()
    table, names = uvicorn_send._REFUSED_TABLE, uvicorn_send._NAMES
    line = b"HTTP/1.1 200 OK\r\n"
    uvicorn_send._render(line, DATE, SSE, names, table, b"\r\n", None)  # names learnt
    taken = [
        (DATE, SSE, b"\r\n", None), ([], [], b"", None), (DATE, tuple(SSE), b"x", b"first"),
        (DATE, SSE, b"t", b""), (DATE, SSE, b"t", LastPart(b"end")),
        ([], [(b"date", b"\t\x80\xff" * 100)], b"", b"\x00" * 300),
    ]
    for defaults, headers, tail, first in taken:
        compiled = chunkpath.RENDER_HEAD(line, defaults, headers, names, table, tail, first)
        assert compiled is not None
        assert compiled == uvicorn_send._render(line, defaults, headers, names, table, tail,
                                                first)
    left = [
        (DATE, [(b"x-never-seen", b"v")], None), (DATE, [[b"date", b"v"]], None),
        (DATE, [(b"date", bytearray(b"v"))], None), (DATE, [(b"date", b"a\nb")], None),
        (DATE, [(b"date", b"v", b"w")], None), (DATE, iter(SSE), None), (iter(DATE), SSE, None),
        (DATE, [("date", "v")], None), (DATE, SSE, bytearray(b"first")),
        (DATE, [(b"date", b"v")] * 64, None), (DATE, [(b"bad name", b"v")], None),
    ]
    for defaults, headers, first in left:
        assert chunkpath.RENDER_HEAD(line, defaults, headers, names, table, b"", first) is None


async def test_every_byte_of_a_value_is_taken_or_refused_as_uvicorn_does(head_path: str) -> None:
    # The values are checked at once, by deleting the bytes uvicorn's pattern matches: each
    # of the 256, alone, amid others and in a later header, as uvicorn's own check has it.
    for byte in range(256):
        for value in (bytes((byte,)), b"a%cz" % byte):
            headers = [*SSE, (b"x-a", b"ok"), (b"x-b", value), (b"x-c", b"\t\x80\xff")]
            messages = [start(headers=headers), part(b"a", False)]
            theirs = _cycle()
            ours = _cycle()
            fast_send(ours[0])
            assert await _run(*ours, messages) == await _run(*theirs, messages), (byte, value)


WITH_FIRST: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "stream": ({}, start()),
    "no-keep-alive": ({"keep_alive": False}, start()),
    "connection-close": ({}, start(headers=[*SSE, (b"connection", b"close")])),
    "content-length": ({}, start(headers=[(b"content-length", b"4")])),
    "no-content": ({}, start(204)),
    "bad-value": ({}, start(headers=[(b"x-b", b"a\nb")])),
    "unknown-status": ({}, start(999)),
}


@pytest.mark.parametrize("case", WITH_FIRST)
async def test_a_first_part_in_the_start_is_the_body_message_it_stands_for(
    case: str, head_path: str
) -> None:
    options, head = WITH_FIRST[case]
    theirs = _cycle(**options)
    ours = _cycle(**options)
    fast_send(ours[0])
    assert ours[0].scope["extensions"][EXTENSION] is True
    rest = [part(b"rest", False)]
    expected = await _run(*theirs, [head, part(b"abcd"), *rest])
    got = await _run(*ours, [{**head, EXTENSION: b"abcd"}, *rest])
    # The same bytes, end and state; one message fewer, so the first error is compared.
    assert (got[0], *got[2:5], got[6]) == (expected[0], *expected[2:5], expected[6])
    assert [o for o in got[5] if o != "ok"][:1] == [o for o in expected[5] if o != "ok"][:1]


async def test_a_streamed_head_and_its_first_part_are_one_write(head_path: str) -> None:
    cycle, transport, _ = _cycle()
    fast_send(cycle)
    await cycle.send({**start(), EXTENSION: b"id: 1\ndata: a\n\n"})  # type: ignore[arg-type]
    assert len(transport.writes) == 1
    assert transport.writes[0].endswith(b"\r\n\r\nf\r\nid: 1\ndata: a\n\n\r\n")


async def _parts(*parts: bytes, fail: bool = False) -> Any:
    for one in parts:
        yield one
    if fail:
        raise ValueError("upstream")


async def _stream(chunks: Any, sent: list[dict[str, Any]]) -> None:
    async def send(message: Any) -> None:
        sent.append(dict(message))

    class Listening:
        listener: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    await stream_body(None, send, 200, [("a", "b")], chunks,  # type: ignore[arg-type]
                      disconnect=Listening(), first_at_hand=True)  # type: ignore[arg-type]


async def test_stream_body_sends_its_first_part_with_the_head() -> None:
    sent: list[dict[str, Any]] = []
    await _stream(_parts(b"one", b"two", LastPart(b"end")), sent)
    assert [m.get(EXTENSION, m.get("body")) for m in sent] == [b"one", b"two", b"end"]
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["headers"] == [(b"a", b"b")]
    assert [m.get("more_body") for m in sent[1:]] == [True, False]


async def test_stream_body_ending_at_once_sends_the_head_then_the_end() -> None:
    for chunks, body in ((_parts(), b""), (_parts(LastPart(b"end")), b"end")):
        sent: list[dict[str, Any]] = []
        await _stream(chunks, sent)
        assert sent[0]["type"] == "http.response.start"
        assert EXTENSION not in sent[0]
        assert sent[1:] == [{"type": "http.response.body", "body": body, "more_body": False}]


async def test_stream_body_whose_first_part_fails_sends_the_head_first() -> None:
    sent: list[dict[str, Any]] = []
    with pytest.raises(ValueError, match="upstream"):
        await _stream(_parts(fail=True), sent)
    assert [m["type"] for m in sent] == ["http.response.start"]  # as without the first part
    assert EXTENSION not in sent[0]


async def test_a_head_with_the_first_part_is_one_write_each(head_path: str) -> None:
    cycle, transport, _ = _cycle()
    fast_send(cycle)
    await cycle.send(start())  # type: ignore[arg-type]
    assert transport.writes == [
        b"HTTP/1.1 200 OK\r\ndate: Mon, 07 Dec 2026 09:00:00 GMT\r\ncontent-type: "
        b"text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    ]


async def test_paused_writes_go_through_uvicorns_send_and_its_wait() -> None:
    cycle, transport, _ = _cycle()
    fast_send(cycle)
    cycle.flow.pause_writing()
    sending = asyncio.ensure_future(cycle.send(start()))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert not sending.done()
    assert transport.writes == []
    cycle.flow.resume_writing()
    await sending
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\n")


async def test_the_routers_streamed_answer_never_falls_back_to_uvicorns_send(
    start_router: RouterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # uvicorn_limits gives each HTTP/1.1 cycle its own send; uvicorn's is what it falls
    # back to, counted here.
    calls: list[str] = []
    sent: list[str] = []
    installed: list[RequestResponseCycle] = []

    def spying(cycle: RequestResponseCycle) -> None:
        uvicorns = cycle.send

        async def counted(message: Any) -> None:
            calls.append(message["type"])
            await uvicorns(message)

        cycle.send = counted  # type: ignore[method-assign]
        installed.append(cycle)
        fast_send(cycle)
        ours = cycle.send

        async def seen(message: Any) -> None:
            sent.append(message["type"] + ("+first" if EXTENSION in message else ""))
            await ours(message)

        cycle.send = seen  # type: ignore[method-assign]

    monkeypatch.setattr(uvicorn_limits, "fast_send", spying)
    # An upstream that writes its head and first event at once, as vLLM and the sim do.
    upstream = await asyncio.start_server(
        lambda r, w: chunk_instructions._upstream(
            r, w, argparse.Namespace(chunks=2, interval_ms=5.0)
        ),
        "127.0.0.1", 0,
    )
    url = f"http://127.0.0.1:{upstream.sockets[0].getsockname()[1]}"
    async with upstream, start_router(
        [url], tls=False
    ) as router, httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            router.base_url + "/v1/chat/completions", headers=auth(),
            json={"model": "test-model", "messages": [{"role": "user", "content": "hi"}],
                  "stream": True, "max_tokens": 5},
        )
    assert response.status_code == 200
    # The head as uvicorn sent it: its date, the SSE headers, the router's, the framing.
    names = [name for name, _ in response.headers.raw]
    assert names == [b"date", b"content-type", b"cache-control", b"x-accel-buffering",
                     b"x-firstbyte-region", b"traceparent", b"x-firstbyte-stream",
                     b"server-timing", b"transfer-encoding"]
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert sse_text(response.content)[0] == " word word", response.content
    assert len(installed) == 1
    assert calls == []
    # The role chunk came with the upstream's head: it went out with ours.
    assert sent[0] == "http.response.start+first"


def test_the_compiled_head_holds_what_it_reads_while_a_lookup_runs_python() -> None:
    """A lookup may run Python (a name's __eq__) that empties the list being read: the
    compiled head reads the list again at each step and holds each pair, as a list's
    iterator does, so it writes the lines it read and never a freed one."""
    assert chunkpath.RENDER_HEAD is not None, "firstbyte.router._chunkpath was not built"
    headers: list[Any] = []

    class Emptying(bytes):
        def __eq__(self, other: object) -> bool:
            headers.clear()
            return bytes.__eq__(self, other)  # type: ignore[operator]

        __hash__ = bytes.__hash__

    names = {Emptying(b"x-a"): b"x-a: ", b"x-b": b"x-b: "}
    headers.extend([(b"x-a", b"1" * 100), (b"x-b", b"2" * 100)])
    table = b"\x00" * 256
    head = chunkpath.RENDER_HEAD(b"S\r\n", [], headers, names, table, b"\r\n", None)
    assert head == b"S\r\nx-a: " + b"1" * 100 + b"\r\n\r\n"
    assert headers == []
