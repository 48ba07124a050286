"""The preflight-free start and the prewarm's requests, over real sockets: a stream started
by a CORS simple request (``text/plain`` body, the client token in ``?token=``) gets every
check a normal start gets; an API key or an unlisted origin is refused before the upstream
is asked; ``GET /v1/edge/warm`` and a plain ``OPTIONS`` cost no endpoint."""

from __future__ import annotations

import json

import httpx

from firstbyte.client_sdk.client_tokens import amint_client_token
from firstbyte.protocol import error_codes
from tests.router.conftest import API_KEY, RouterFactory
from tests.router.upstream import Upstream

APP = "https://app.example"
OTHER_APP = "https://other.example"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True}
SIMPLE = {"content-type": "text/plain;charset=UTF-8", "origin": APP}
CORS = {"allow_origins": [APP, OTHER_APP]}


async def test_a_simple_request_starts_a_stream_with_a_client_token(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False, cors=CORS) as r, \
            httpx.AsyncClient(base_url=r.base_url) as http:
        token = (await amint_client_token(f"{r.base_url}/v1", API_KEY)).token
        sse = await http.post("/v1/chat/completions", params={"token": token},
                              content=json.dumps(CHAT), headers=SIMPLE)
        polled = await http.post("/v1/streams", params={"token": token, "wait": "5"},
                                 content=json.dumps(CHAT), headers=SIMPLE)
    assert sse.status_code == 200, sse.text
    assert sse.headers["content-type"].startswith("text/event-stream")
    assert sse.headers["access-control-allow-origin"] == APP  # readable by the page
    assert "[DONE]" in sse.text
    assert polled.status_code == 201, polled.text
    assert polled.json()["stream"]
    assert len(upstream.chat_requests) == 2


async def test_the_url_takes_no_api_key_and_no_unlisted_origin(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False, cors=CORS,
                            limits={"max_body_bytes": 4096}) as r, \
            httpx.AsyncClient(base_url=r.base_url) as http:
        token = (await amint_client_token(f"{r.base_url}/v1", API_KEY)).token
        bound = (await amint_client_token(f"{r.base_url}/v1", API_KEY, origin=APP)).token
        key = await http.post("/v1/chat/completions", params={"token": API_KEY},
                              content=json.dumps(CHAT), headers=SIMPLE)
        evil = await http.post("/v1/chat/completions", params={"token": token},
                               content=json.dumps(CHAT),
                               headers={**SIMPLE, "origin": "https://evil.example"})
        elsewhere = await http.post("/v1/chat/completions", params={"token": bound},
                                    content=json.dumps(CHAT),
                                    headers={**SIMPLE, "origin": OTHER_APP})
        big = await http.post("/v1/chat/completions", params={"token": token},
                              content=json.dumps({**CHAT, "pad": "x" * 5000}), headers=SIMPLE)
    _assert_token_checks(key, evil, elsewhere)
    assert big.status_code == 413  # the body limit of every start
    assert upstream.chat_requests == []  # nothing refused reached the backend


async def test_prewarm_requests_answer_without_an_endpoint(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False, cors=CORS) as r, \
            httpx.AsyncClient(base_url=r.base_url) as http:
        warm = await http.get("/v1/edge/warm", headers={"origin": APP})
        anonymous = await http.get("/v1/edge/warm")
        plain_options = await http.options("/v1/chat/completions", headers={"origin": APP})
    assert warm.status_code == 204
    assert warm.content == b""
    assert warm.headers["cache-control"] == "no-store"
    assert warm.headers["access-control-allow-origin"] == APP
    assert anonymous.status_code == 204
    assert plain_options.status_code == 204
    assert plain_options.headers["access-control-allow-origin"] == APP
    assert plain_options.headers["access-control-max-age"] == "600"
    assert upstream.chat_requests == []


async def test_a_long_poll_polls_with_the_token_in_the_url_on_the_starts_terms(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    """``GET /v1/streams/{id}/poll?token=``: a simple request as the start is (no header);
    an API key in the URL, an unlisted origin, the token's origin binding and another user's
    token are refused as a normal poll's credentials would be, and never reveal the stream."""
    async with start_router([upstream.url], tls=False, cors=CORS) as r, \
            httpx.AsyncClient(base_url=r.base_url) as http:
        token = (await amint_client_token(f"{r.base_url}/v1", API_KEY, origin=APP,
                                          subject="ann")).token
        other = (await amint_client_token(f"{r.base_url}/v1", API_KEY, subject="bob")).token
        started = await http.post("/v1/streams", params={"token": token, "wait": "0"},
                                  content=json.dumps(CHAT), headers=SIMPLE)
        assert started.status_code == 201, started.text
        path = f"/v1/streams/{started.json()['stream']}/poll"
        page = {"origin": APP}  # a simple GET: no content-type, no Authorization
        polled = await http.get(path, params={"token": token, "after": "0", "wait": "5"},
                                headers=page)
        key = await http.get(path, params={"token": API_KEY, "after": "0", "wait": "0"},
                             headers=page)
        evil = await http.get(path, params={"token": token, "after": "0", "wait": "0"},
                              headers={"origin": "https://evil.example"})
        elsewhere = await http.get(path, params={"token": token, "after": "0", "wait": "0"},
                                   headers={"origin": OTHER_APP})
        not_hers = await http.get(path, params={"token": other, "after": "0", "wait": "0"},
                                  headers=page)
        bad_after = await http.get(path, params={"token": token, "after": "x", "wait": "0"},
                                   headers=page)
    assert polled.status_code == 200, polled.text
    assert polled.headers["access-control-allow-origin"] == APP  # readable by the page
    assert polled.json()["events"], polled.text
    _assert_token_checks(key, evil, elsewhere)
    assert not_hers.status_code == 404
    assert not_hers.json()["error"]["code"] == error_codes.STREAM_NOT_FOUND
    assert bad_after.status_code == 400
    assert len(upstream.chat_requests) == 1


def _assert_token_checks(key: httpx.Response, evil: httpx.Response, elsewhere: httpx.Response) -> None:
    """What a simple request gets with an API key in the URL (401, the key not echoed), from an
    origin not listed (403), and with a token bound to another origin (401)."""
    assert key.status_code == 401
    assert key.json()["error"]["code"] == error_codes.INVALID_CLIENT_TOKEN
    assert API_KEY not in key.text
    assert evil.status_code == 403
    assert evil.json()["error"]["code"] == error_codes.ORIGIN_NOT_ALLOWED
    assert elsewhere.status_code == 401  # the token's origin binding holds
