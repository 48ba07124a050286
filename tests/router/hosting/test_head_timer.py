"""The HTTP/1.1 head's timer (``client_header_timeout_s``) of the default server's protocol:
armed only for a head that does not come whole in one read, and still in force for a head that
stalls. A real router on loopback, a raw socket, the router's own protocol object."""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

import pytest

from tests.router.conftest import API_KEY, RouterFactory
from tests.router.upstream import Upstream

HEAD = (
    b"GET /v1/models HTTP/1.1\r\nhost: x\r\n"
    b"authorization: Bearer " + API_KEY.encode() + b"\r\n\r\n"
)


def _protocol_of(local: tuple[str, int]) -> Any:
    """The router's protocol object serving the connection whose client end is ``local``."""
    for obj in gc.get_objects():
        if any(c.__name__ == "GuardedHttpToolsProtocol" for c in type(obj).__mro__):
            transport = getattr(obj, "transport", None)
            if transport is not None and transport.get_extra_info("peername") == local:
                return obj
    raise AssertionError("no protocol serves this connection")


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head


async def test_a_head_whole_in_one_read_arms_no_timer_and_a_split_one_does(
    start_router: RouterFactory, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with start_router(
        [upstream.url], tls=False, limits={"client_header_timeout_s": 0.5}
    ) as router:
        host, port = router.base_url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(HEAD)
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            protocol = _protocol_of(writer.get_extra_info("sockname"))
            armed: list[float] = []
            start = type(protocol)._start_head_timer

            def counting(self: Any) -> None:
                if self is protocol:
                    armed.append(time.monotonic())
                start(self)

            monkeypatch.setattr(type(protocol), "_start_head_timer", counting)
            writer.write(HEAD)  # whole: parsed in the read it came in
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            assert armed == []
            writer.write(HEAD[:20])  # the rest a moment later: its clock runs meanwhile
            await asyncio.sleep(0.1)
            assert len(armed) == 1
            writer.write(HEAD[20:])
            assert (await _answer(reader)).startswith(b"HTTP/1.1 200")
            assert len(armed) == 1
            started = time.monotonic()
            writer.write(HEAD[:20])  # and one that stalls is closed at the header timeout
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 408")
            assert time.monotonic() - started >= 0.5 - 0.05  # the loop's timer may fire early
            assert len(armed) == 2
        finally:
            writer.close()
