"""The HTTP/3 server of a router on real sockets: if its task ends, the end is logged at once,
``Alt-Svc`` and ``/healthz`` stop promising HTTP/3, and it is restarted."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import httpx
import pytest

from firstbyte.router.hosting.quic import Http3Status
from tests.router.conftest import RouterFactory, client_tls
from tests.router.h3client import h3_request
from tests.router.upstream import Upstream

CRASH = b"crash the QUIC server"


async def _until(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_quic_server_end_is_logged_unadvertised_and_restarted(
    start_router: RouterFactory,
    upstream: Upstream,
    tls_files: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    delay_s = 5.0
    monkeypatch.setattr(Http3Status, "first_restart_delay_s", delay_s)
    async with start_router([upstream.url]) as router:
        assert router.h3_port is not None
        status = router.http3
        assert status is not None
        cafile = tls_files["cafile"]
        advertised = f'h3=":{router.h3_port}"; ma=86400'
        assert (await h3_request(router.h3_port, "GET", "/healthz", cafile=cafile)).status == 200
        clients = [
            httpx.AsyncClient(verify=client_tls(tls_files), http2=http2) for http2 in (False, True)
        ]
        try:
            for client in clients:
                health = await client.get(router.base_url + "/healthz")
                assert (health.text, health.headers.get("alt-svc")) == ("ok\n", advertised)

            # Force the task to end: the QUIC protocol raises on one datagram.
            from hypercorn.protocol import quic

            handle = quic.QuicProtocol.handle

            async def crashing(self: Any, event: Any) -> None:
                if getattr(event, "data", b"") == CRASH:
                    raise RuntimeError("forced")
                await handle(self, event)

            monkeypatch.setattr(quic.QuicProtocol, "handle", crashing)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                udp.sendto(CRASH, ("127.0.0.1", router.h3_port))
            crashed = time.monotonic()
            await _until(lambda: not status.up, 5.0)
            # The router's own lines. Not asyncio's "exception was never retrieved" for a
            # gather the crash cancelled, which hypercorn at the lowest supported version
            # leaves behind; it is written when the garbage collector frees it, so it lands
            # in this window or not.
            errors = [r for r in caplog.records
                      if r.levelno == logging.ERROR and r.name.startswith("firstbyte")]
            assert [r.getMessage() for r in errors] == [
                f"HTTP/3 server stopped on RuntimeError: forced at {__name__.rsplit('.')[-1]}.py"
                f":{crashing.__code__.co_firstlineno + 2}; not advertised, restarting in 5 s"
            ]
            assert errors[0].exc_info is None  # one line, no traceback
            for client in clients:
                health = await client.get(router.base_url + "/healthz")
                assert health.status_code == 200
                assert (health.text, health.headers.get("alt-svc")) == ("ok; HTTP/3 down\n", None)
            monkeypatch.setattr(quic.QuicProtocol, "handle", handle)

            await _until(lambda: status.up, delay_s + 30)
            assert time.monotonic() - crashed >= delay_s - 0.1
            response = await h3_request(router.h3_port, "GET", "/healthz", cafile=cafile)
            assert (response.status, response.body) == (200, b"ok\n")
            for client in clients:
                health = await client.get(router.base_url + "/healthz")
                assert (health.text, health.headers.get("alt-svc")) == ("ok\n", advertised)
        finally:
            for client in clients:
                await client.aclose()
