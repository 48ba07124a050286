"""A kept-alive client connection is not recycled by the server after 1000 requests
(hypercorn's default), over HTTP/1.1 or HTTP/2: the SDK's prewarmed connection stays warm."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from firstbyte.router.hosting import KEEP_ALIVE_MAX_REQUESTS
from firstbyte.router.serve import RouterEndpoints
from tests.router.conftest import client_tls

REQUESTS = 1005  # past hypercorn's default of 1000


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
async def test_one_connection_carries_more_than_a_thousand_requests(
    router: RouterEndpoints, tls_files: dict[str, str], http2: bool
) -> None:
    assert KEEP_ALIVE_MAX_REQUESTS > REQUESTS
    connects = 0

    async def trace(name: str, info: dict[str, Any]) -> None:
        nonlocal connects
        if name == "connection.connect_tcp.complete":
            connects += 1

    limits = httpx.Limits(max_connections=1)
    async with httpx.AsyncClient(verify=client_tls(tls_files), http2=http2, limits=limits) as c:
        for i in range(REQUESTS):
            response = await c.get(router.base_url + "/healthz", extensions={"trace": trace})
            assert response.status_code == 200
            assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            assert response.headers.get("connection", "").lower() != "close", i
    assert connects == 1
