"""A draining router's answers: ``/healthz``'s 503 has the request refusal's ``Retry-After``;
HTTP/2 connections stay (GOAWAY tells their clients: tests/router/operate/test_drain.py).
Real servers on loopback."""

from __future__ import annotations

import httpx
import pytest

from tests.router.conftest import API_KEY, RouterFactory, client_tls
from tests.router.upstream import Upstream

BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize("server", ["auto", "hypercorn"])
async def test_http2_answers_of_a_draining_router_keep_their_connection(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], server: str
) -> None:
    """No ``connection`` header on HTTP/2 (forbidden there: GOAWAY does its job), and the
    connection carries the next request."""
    async with start_router([upstream.url], listen={"server": server, "http3": False}) as router, \
            httpx.AsyncClient(verify=client_tls(tls_files), http2=True) as http:
        router.app.state.start_draining()
        answers = [
            await http.post(f"{router.base_url}/v1/chat/completions", json=BODY,
                            headers={"authorization": f"Bearer {API_KEY}"}),
            await http.get(f"{router.base_url}/healthz"),
        ]
        addresses = {a.extensions["network_stream"].get_extra_info("client_addr")
                     for a in answers}
    assert len(addresses) == 1  # one connection carried both
    for answer in answers:
        assert (answer.status_code, answer.http_version) == (503, "HTTP/2")
        assert "connection" not in answer.headers
        assert answer.headers["retry-after"] == "1"
