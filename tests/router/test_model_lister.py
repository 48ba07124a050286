"""The model lister against a real socket: a kept-alive connection the backend closes as the
next list is asked on it (uvicorn's and vLLM's keep-alive is 5 s, the router's pool keeps
connections longer) is asked again at once, not logged as a backend that cannot list."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from firstbyte.router.models import ModelLister, ModelMap

_LIST = b'{"object":"list","data":[{"id":"m","object":"model"}]}'


async def test_a_list_asked_on_a_connection_the_backend_closed_is_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(_LIST), _LIST))
        await writer.drain()
        # Kept alive, as far as the client knows; the next request on it is read and then
        # the connection closes unanswered: a keep-alive timeout met in flight.
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    models = ModelMap({"b": []})
    async with server, httpx.AsyncClient() as client:
        lister = ModelLister(models, client, {"b": f"http://127.0.0.1:{port}"})
        with caplog.at_level(logging.WARNING, "firstbyte.router"):
            await lister.list_once("b")
            await lister.list_once("b")  # on the kept connection, which closes unanswered
    assert models.of("b") == {"m"}
    assert connections == 2  # asked again on a new one
    assert not [r for r in caplog.records if "could not be read" in r.getMessage()]
