"""SIGTERM drains a real router process: unhealthy at once, new work refused with 503 and
``Retry-After``, the stream in flight finishes whole and then its HTTP/2 connection gets GOAWAY (or, past
``listen.drain_timeout_s``, ends with a ``draining`` error event), exit 0."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from firstbyte.protocol import error_codes
from tests.router.attacks.conftest import RouterStarter, chat_body
from tests.router.conftest import API_KEY, auth
from tests.router.h3client import H3Response, h3_request
from tests.router.upstream import Upstream

from .conftest import H2Session, content_of

pytestmark = pytest.mark.slow

H3_GRACEFUL_LAST_STREAM = (1 << 62) - 4


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


async def _exit_code(router: object, timeout_s: float) -> int:
    proc = router.proc  # type: ignore[attr-defined]
    code: int = await asyncio.to_thread(proc.wait, timeout_s)
    return code


async def test_sigterm_refuses_new_work_sends_goaway_and_finishes_the_stream(
    start_router_process: RouterStarter, upstream: Upstream
) -> None:
    upstream.delay_s = 0.02
    tokens = 100  # ~2 s of stream
    async with start_router_process(listen={"drain_timeout_s": 20.0}) as router:
        session = await H2Session.open(router)
        stream = await session.request(chat_body(tokens), API_KEY)
        await session.read(lambda: b"w3" in stream.body)
        router.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(verify=router.client_tls()) as fresh:
            health = await fresh.get(router.base_url + "/healthz")
            refused = await fresh.post(
                router.base_url + "/v1/chat/completions", json=chat_body(5), headers=auth()
            )
        assert (health.status_code, health.text.strip()) == (503, error_codes.DRAINING)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == error_codes.DRAINING
        assert int(refused.headers["retry-after"]) >= 1
        await session.read(lambda: stream.ended)
        text, errors, done = content_of(stream.body)
        assert (stream.status, errors, done) == (200, [], True)
        assert text == _words(tokens)
        await session.read(lambda: session.goaway is not None, timeout_s=10)
        assert session.goaway is not None, "no GOAWAY on the HTTP/2 connection"
        assert (session.goaway.error_code, session.goaway.last_stream_id) == (0, stream.stream_id)
        assert await _exit_code(router, 15) == 0
    assert upstream.completed >= 1
    assert upstream.cancelled == 0
    # One streamed request: one request answered, one stream produced (their sum was 2).
    assert ("draining: no new work; 1 requests being answered and 1 streams being produced"
            in router.log())
    router.assert_clean_log()


async def test_http3_gets_goaway_at_once_and_its_stream_finishes(
    start_router_process: RouterStarter, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    upstream.delay_s = 0.02
    tokens = 100
    async with start_router_process(listen={"http3": True}) as router:
        signalled = False

        def drain_after_a_few_tokens(response: H3Response) -> None:
            nonlocal signalled
            if not signalled and b"w3" in response.body:
                signalled = True
                router.proc.send_signal(signal.SIGTERM)

        response = await h3_request(
            router.port, "POST", "/v1/chat/completions", cafile=tls_files["cafile"],
            headers={**auth(), "content-type": "application/json"},
            body=json.dumps(chat_body(tokens)).encode(), on_data=drain_after_a_few_tokens,
        )  # fmt: skip
        assert signalled
        text, errors, done = content_of(response.body)
        assert (response.status, errors, done, text) == (200, [], True, _words(tokens))
        assert response.goaway_id() == H3_GRACEFUL_LAST_STREAM
        assert await _exit_code(router, 15) == 0


async def test_connections_their_clients_closed_are_not_told_nor_counted(
    start_router_process: RouterStarter, upstream: Upstream, tls_files: dict[str, str]
) -> None:
    """hypercorn's closed HTTP/2 and HTTP/3 connections linger in the registry until the
    cyclic GC runs; the drain skips them: no GOAWAY written to a closed TLS transport
    (asyncio's "SSL connection is closed" warning), and the count in its log line is the
    connections told."""
    async with start_router_process(listen={"http3": True}) as router:
        for _ in range(6):
            async with httpx.AsyncClient(http2=True, verify=router.client_tls()) as gone:
                answer = await gone.get(router.base_url + "/healthz")
                assert (answer.http_version, answer.status_code) == ("HTTP/2", 200)
        for _ in range(3):  # each closes its QUIC connection once answered
            response = await h3_request(
                router.port, "POST", "/v1/chat/completions", cafile=tls_files["cafile"],
                headers={**auth(), "content-type": "application/json"},
                body=json.dumps(chat_body(2)).encode(),
            )
            assert response.status == 200
        session = await H2Session.open(router)  # stays open, idle after its stream
        stream = await session.request(chat_body(2), API_KEY)
        await session.read(lambda: stream.ended)
        await asyncio.sleep(1.0)  # the router reads the nine closes (a few ms on loopback)
        router.proc.send_signal(signal.SIGTERM)
        await session.read(lambda: session.goaway is not None, timeout_s=10)
        assert session.goaway is not None
        assert await _exit_code(router, 15) == 0
    log = router.log()
    assert "GOAWAY sent on 1 HTTP/2 and HTTP/3 connections" in log, log[-3000:]
    assert "SSL connection is closed" not in log
    router.assert_clean_log()


@pytest.mark.parametrize("hurried", [False, True])
async def test_past_the_drain_timeout_the_stream_ends_with_a_draining_error(
    start_router_process: RouterStarter, upstream: Upstream, hurried: bool
) -> None:
    """``hurried``: an operator who sends the signal again (Ctrl-C twice) does not wait out
    the drain's timeout (60 s here): the stream left ends as at the timeout."""
    upstream.delay_s = 0.05
    timeout_s = 60.0 if hurried else 1.0
    async with start_router_process(listen={"drain_timeout_s": timeout_s}) as router:
        session = await H2Session.open(router)
        stream = await session.request(chat_body(2000), API_KEY)  # ~100 s
        await session.read(lambda: b"w2" in stream.body)
        router.proc.send_signal(signal.SIGTERM)
        if hurried:
            deadline = time.monotonic() + 10
            while "draining: no new work" not in router.log():
                assert time.monotonic() < deadline, router.log()[-3000:]
                await asyncio.sleep(0.05)
            router.proc.send_signal(signal.SIGTERM)
        await session.read(lambda: stream.ended, timeout_s=15)
        text, errors, _ = content_of(stream.body)
        assert [e["code"] for e in errors] == [error_codes.DRAINING]
        assert text.startswith(_words(3))
        assert len(text) < len(_words(2000))
        assert await _exit_code(router, 15) == 0
    why = "cut short by a second signal" if hurried else "timed out after 1 s"
    assert (f"drain {why}: 1 unfinished streams end with a 'draining' error event"
            in router.log())
    router.assert_clean_log()


async def test_drain_grace_keeps_answering_503_while_idle(
    start_router_process: RouterStarter, upstream: Upstream
) -> None:
    async with start_router_process(listen={"drain_grace_s": 1.5}) as router:
        router.proc.send_signal(signal.SIGTERM)
        async with httpx.AsyncClient(verify=router.client_tls()) as fresh:
            await asyncio.sleep(1.0)  # nothing in flight, yet still listening
            health = await fresh.get(router.base_url + "/healthz")
        assert health.status_code == 503
        assert await _exit_code(router, 15) == 0
