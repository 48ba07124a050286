"""uvicorn's request callbacks as the default server's protocol does them in line
(``uvicorn_limits``, patch ``uvicorn-h1-in-line``): for each request, the same scope, the
same request cycle, the same bytes written and the same connection state as uvicorn's own
``HttpToolsProtocol``. Both protocols are fed the same bytes through a transport that keeps
what is written; the application answers through ``send`` as any would."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from firstbyte.router.hosting.limits import ClientLimits, ConnectionCounter
from firstbyte.router.hosting.uvicorn_limits import guarded_protocols
from tests.router.hosting.transports import KeepingTransport as Transport

DATE = [(b"date", b"Mon, 07 Dec 2026 09:00:00 GMT")]
_CYCLE_FIELDS = (
    "keep_alive", "waiting_for_100_continue", "more_body", "body", "response_started",
    "response_complete", "chunked_encoding", "expected_content_length", "disconnected",
    "access_log", "default_headers",
)


async def _serve(guarded: bool, reads: list[bytes], **config: Any) -> dict[str, Any]:
    """What one protocol does with ``reads``: the scopes its application saw (without the
    router's extensions), the messages it received, its cycles' state, the bytes written."""
    scopes: list[dict[str, Any]] = []
    received: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        scopes.append({k: v for k, v in scope.items() if k != "extensions"})
        message = await receive()
        received.append(message)
        body = b"%s %s %r" % (scope["method"].encode(), scope["raw_path"], message["body"])
        headers = [(b"content-type", b"text/plain"), (b"x-a", b"1")]
        if scope["http_version"] == "1.0":  # the router's 1.0 answers without one differ
            headers.append((b"content-length", b"%d" % len(body)))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await send({"type": "http.response.body", "body": body[5:], "more_body": False})

    cls: Any = HttpToolsProtocol
    if guarded:
        limits = ClientLimits()
        cls = guarded_protocols(limits, ConnectionCounter(limits, 1 << 20))[0]
    uconfig = uvicorn.Config(app, http=cls, lifespan="off", access_log=False, log_config=None,
                             **config)
    uconfig.load()
    state = ServerState()
    state.default_headers = list(DATE)
    protocol = cls(config=uconfig, server_state=state, app_state={"a": 1})
    transport = Transport()
    protocol.connection_made(transport)
    cycles = []
    for data in reads:
        protocol.data_received(data)
        cycles.append(protocol.cycle)
        for _ in range(20):  # the app's task, through its sends
            await asyncio.sleep(0)
    keep_alive = protocol.timeout_keep_alive_task
    try:
        return {
            "scopes": scopes,
            "received": received,
            "cycles": [
                None if c is None else {name: getattr(c, name) for name in _CYCLE_FIELDS}
                for c in cycles
            ],
            "writes": b"".join(transport.writes),
            "closed": transport.closed,
            "reading": transport.reading,
            # The router's is armed from the connection's start, uvicorn's from a response's
            # end: the same once a response is over, unless the connection was closed then.
            "keep_alive_armed": not transport.closed
            and keep_alive is not None
            and not keep_alive.cancelled(),
            "pipeline": len(protocol.pipeline),
            "total_requests": state.total_requests,
        }
    finally:
        protocol.connection_lost(None)


CASES = {
    "post": [b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
             b"\r\ncontent-length: 7\r\n\r\n{\"a\":1}"],
    "quoted path and query": [b"GET /a%20b/c%2Fd?x=1&y=%20 HTTP/1.1\r\nhost: x\r\n\r\n"],
    "the same target twice": [b"GET /v1/models?q=1 HTTP/1.1\r\nhost: x\r\n\r\n"] * 2,
    "http/1.0": [b"GET /v1/models HTTP/1.0\r\nhost: x\r\n\r\n"],
    "connection close": [b"GET /x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"],
    "100-continue": [b"POST /x HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                     b"content-length: 2\r\n\r\n", b"ab"],
    "pipelined": [b"GET /1 HTTP/1.1\r\nhost: x\r\n\r\nGET /2 HTTP/1.1\r\nhost: x\r\n\r\n"],
    "body in parts": [b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 6\r\n\r\nab", b"cdef"],
    "body after its head": [b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n", b"ab"],
    "invalid target": [b"GET http://[::1 HTTP/1.1\r\nhost: x\r\n\r\n"],
    "invalid head": [b"GET /x HTTP/1.1\r\nho st: x\r\n\r\n"],
    "long target": [b"GET /" + b"a" * 300 + b"?b=%20 HTTP/1.1\r\nhost: x\r\n\r\n"],
}


@pytest.mark.parametrize("case", list(CASES))
async def test_the_in_line_callbacks_do_what_uvicorns_do(case: str) -> None:
    ours = await _serve(True, CASES[case])
    uvicorns = await _serve(False, CASES[case])
    if case == "body in parts":
        # Answered before the body's end, then the rest came: the router's protocol serves
        # on with the connection's keep-alive clock running (uvicorn_limits' lingering
        # close); uvicorn's leaves the connection without one.
        assert ours.pop("keep_alive_armed")
        assert not uvicorns.pop("keep_alive_armed")
    assert ours == uvicorns
    assert ours["writes"]


@pytest.mark.parametrize("config", [{"root_path": "/api"}, {"limit_concurrency": 1}])
async def test_the_in_line_callbacks_follow_uvicorns_config(config: dict[str, Any]) -> None:
    reads = [b"GET /v1/a%2Fb?x=1 HTTP/1.1\r\nhost: x\r\n\r\n"]
    ours = await _serve(True, reads, **config)
    assert ours == await _serve(False, reads, **config)
    assert ours["writes"]


def test_made_up_targets_neither_grow_nor_fill_the_parsed_target_table() -> None:
    # Targets come before any key is checked: a client sending made-up ones must not grow
    # the table, nor fill it for good so that the target every request uses is parsed each
    # time from then on (it was: a full table kept no new target).
    from firstbyte.router.hosting import uvicorn_limits as limits

    limits._URLS.clear()
    usual = b"/v1/chat/completions"
    for i in range(3 * limits._MAX_URLS):
        limits._parse_url(b"/x%d?q=%%41" % i)
        assert len(limits._URLS) <= limits._MAX_URLS
    assert limits._parse_url(b"/x1?q=%41") == ("/x1", b"/x1", b"q=%41")
    assert limits._parse_url(usual) == ("/v1/chat/completions", usual, b"")
    assert usual in limits._URLS  # kept, though made-up targets came first
    long = b"/v1/" + b"a" * limits._MAX_URL_BYTES
    assert limits._parse_url(long)[1] == long
    assert long not in limits._URLS


async def test_a_body_come_with_its_head_is_received_without_uvicorns_receive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The cycle's own receive takes a message already here in line; uvicorn's (its event's
    # wait() and clear()) is left for the rest (a wait, 100-continue, a client gone).
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    uvicorns = RequestResponseCycle.receive
    calls: list[str] = []

    async def counted(self: Any) -> Any:
        message = await uvicorns(self)
        calls.append(message["type"])
        return message

    monkeypatch.setattr(RequestResponseCycle, "receive", counted)
    ours = await _serve(True, CASES["post"])
    assert ours["received"] == [
        {"type": "http.request", "body": b'{"a":1}', "more_body": False}
    ]
    assert calls == []
    ours = await _serve(True, CASES["body after its head"])  # its receive waits: uvicorn's
    assert ours["received"] == [{"type": "http.request", "body": b"ab", "more_body": False}]
    assert calls == ["http.request"]


async def test_the_message_event_does_what_asyncios_does() -> None:
    from firstbyte.router.hosting.uvicorn_limits import MessageEvent

    for event in (MessageEvent(), asyncio.Event()):
        seen: list[Any] = [event.is_set()]
        event.set()
        seen += [event.is_set(), await event.wait()]
        event.clear()
        waiters = [asyncio.ensure_future(event.wait()) for _ in range(2)]
        cancelled = asyncio.ensure_future(event.wait())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.sleep(0)
        seen += [event.is_set(), [w.done() for w in waiters], cancelled.cancelled()]
        event.set()
        event.set()
        seen += [await asyncio.gather(*waiters), event.is_set()]
        event.clear()
        seen.append(event.is_set())
        assert seen == [False, True, True, False, [False, False], True, [True, True], True,
                        False]
