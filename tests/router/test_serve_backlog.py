"""``listen.backlog`` reaches the listening socket whichever server runs the router.

hypercorn re-``listen()``s the socket it is given with its own default (100), which 500 clients
connecting at once overflowed; the kernel shows a listening socket's backlog as ``Send-Q``.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest

from .conftest import RouterFactory
from .upstream import Upstream

pytestmark = pytest.mark.asyncio


def listen_backlog(port: int) -> int:
    """The accept queue size of the socket listening on ``port`` (``ss``'s Send-Q)."""
    line = subprocess.run(
        ["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(line[2])


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
async def test_listen_backlog_is_the_configured_one(
    server: str, start_router: RouterFactory, upstream: Upstream
) -> None:
    listen = {"server": server, "backlog": 321}
    async with (
        start_router([upstream.url], tls=False, listen=listen) as router,
        httpx.AsyncClient() as client,
    ):
        # answered: the server has set its listener up (hypercorn re-listens the socket)
        assert (await client.get(router.base_url + "/healthz")).status_code in (200, 503)
        assert listen_backlog(router.port) == 321
