"""A draining router refuses warm-ups as it refuses a new stream: ``GET /v1/edge/warm`` (the
keyless prewarm of a page or an SDK) and ``POST /v1/edge/warm`` (a prompt warm-up) answer 503
``draining`` with ``Retry-After``, the stream refusal's own answer (CORS headers for an
allowed page included), while a stream started before the drain runs to its end. A 204 there
told a client its connection was warm on a process that refuses its next stream. A real
router on loopback over HTTP/1.1 and HTTP/2 (httpx)."""

from __future__ import annotations

import httpx
import pytest

from firstbyte.protocol import error_codes
from firstbyte.router.cors import EXPOSE_HEADERS
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.upstream import Upstream

PAGE = "https://page.example"
BODY = {"model": "test-model", "messages": [{"role": "user", "content": "hi"}]}
ALLOWED = {
    "access-control-allow-origin": PAGE,
    "access-control-expose-headers": EXPOSE_HEADERS,
    "timing-allow-origin": PAGE,
}
VARYING = {"date", "traceparent", "content-length"}
"""Headers whose values differ between two answers alike (the trace, the message's length)."""


def _shape(response: httpx.Response) -> tuple[int, str | None, str | None, dict[str, str]]:
    """What a refusal says: status, error code and type, and its headers but the varying."""
    error = response.json()["error"]
    headers = {k: v for k, v in response.headers.items() if k not in VARYING}
    return response.status_code, error["code"], error["type"], headers


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
async def test_a_draining_router_refuses_warm_ups_as_it_refuses_a_stream(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], http2: bool
) -> None:
    upstream.delay_s = 0.02
    tokens = 40
    page = {"origin": PAGE}
    async with start_router([upstream.url], cors={"allow_origins": [PAGE]},
                            listen={"http3": False}) as router, \
            httpx.AsyncClient(verify=client_tls(tls_files), http2=http2, timeout=30) as http:
        warm = await http.get(f"{router.base_url}/v1/edge/warm", headers=page)
        assert warm.status_code == 204  # not draining yet
        body = {**BODY, "max_tokens": tokens, "stream": True}
        async with http.stream("POST", f"{router.base_url}/v1/chat/completions", json=body,
                               headers=auth()) as running:
            seen = b""
            chunks = running.aiter_raw()
            while b"w1" not in seen:
                seen += await anext(chunks)
            router.app.state.start_draining()
            # On fresh connections: on HTTP/1.1 the stream holds the client's one, and a
            # draining router's HTTP/2 connection takes no new stream once it is idle.
            async with httpx.AsyncClient(verify=client_tls(tls_files), http2=http2) as fresh:
                stream = await fresh.post(f"{router.base_url}/v1/chat/completions",
                                          json=body, headers={**auth(), **page})
                warm = await fresh.get(f"{router.base_url}/v1/edge/warm", headers=page)
                prompt = await fresh.post(f"{router.base_url}/v1/edge/warm", json=BODY,
                                          headers={**auth(), **page})
            async for chunk in chunks:
                seen += chunk
        assert running.status_code == 200
    assert b"data: [DONE]" in seen  # the stream of before the drain ran to its end
    assert b"w%d" % (tokens - 1) in seen
    refused = _shape(stream)
    assert refused[:2] == (503, error_codes.DRAINING)
    assert refused[3]["retry-after"] == "1"
    assert {k: refused[3][k] for k in ALLOWED} == ALLOWED  # a page reads it
    assert _shape(warm) == refused
    # Every answer of the prompt warm-up says what request bodies it takes (ADVERTISED).
    status, code, kind, headers = _shape(prompt)
    assert headers.pop("accept-encoding") == "gzip, deflate"
    assert (status, code, kind, headers) == refused
    assert warm.json() == stream.json()
    assert upstream.started == 1  # neither warm-up reached a backend


async def test_a_draining_routers_refusals_spend_no_prompt_warm_up(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    """The refusal comes before the user's warm-ups a minute are counted: with one a minute,
    every warm-up a client sends again to the draining process is told ``draining`` (not
    ``prompt_warm_limited`` from the second on, a limit it never used)."""
    async with start_router([upstream.url], tls=False,
                            limits={"prompt_warms_per_min_per_subject": 1}) as router, \
            httpx.AsyncClient() as http:
        router.app.state.start_draining()
        refused = [await http.post(f"{router.base_url}/v1/edge/warm", json=BODY,
                                   headers=auth()) for _ in range(3)]
    assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [
        (503, error_codes.DRAINING)] * 3
    assert upstream.started == 0
