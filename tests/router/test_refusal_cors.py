"""Refusals written before the app (a connection over its cap, a head over its bounds, memory
shedding) carry the CORS headers the app's own answers carry, once the request's head is read:
an allowed page reads the status, the ``code`` and ``Retry-After`` (without them it sees a
network error). An origin not allowed, or a router with CORS off, gets none. Real routers on
loopback, httpx (HTTP/1.1, HTTP/2), aioquic (HTTP/3) and a raw socket for the exact bytes."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from firstbyte.router.cors import EXPOSE_HEADERS
from tests.router.conftest import RouterFactory, auth, client_tls
from tests.router.h3client import h3_request
from tests.router.upstream import Upstream

PAGE = "https://page.example"
CORS = {"allow_origins": [PAGE]}
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _cors(headers: httpx.Headers | dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith(("access-control-", "timing-"))}


ALLOWED = {
    "access-control-allow-origin": PAGE,
    "access-control-expose-headers": EXPOSE_HEADERS,
    "timing-allow-origin": PAGE,
}


@pytest.mark.parametrize(
    ("server", "http2"),
    [("auto", False), ("auto", True), ("hypercorn", False), ("hypercorn", True),
     ("uvicorn", False)],
    ids=["auto-h1", "auto-h2", "hypercorn-h1", "hypercorn-h2", "uvicorn-h1"],
)
async def test_a_refused_connection_answers_an_allowed_origin_with_cors(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], server: str,
    http2: bool,
) -> None:
    verify = client_tls(tls_files)
    versions = {"http1": not http2, "http2": http2}
    async with start_router(
        [upstream.url], listen={"server": server, "http3": False}, cors=CORS,
        limits={"hard_max_connections_per_client": 1},
    ) as router, httpx.AsyncClient(verify=verify, timeout=20, **versions) as holder:
        assert (await holder.get(router.base_url + "/healthz")).status_code == 200
        answers = {}
        for origin in (PAGE, "https://evil.example", None):
            headers = {**auth(), **({"origin": origin} if origin else {})}
            async with httpx.AsyncClient(verify=verify, timeout=20, **versions) as client:
                answers[origin] = await client.post(router.base_url + CHAT, json=BODY,
                                                    headers=headers)
    for answer in answers.values():
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "overloaded"
    assert _cors(answers[PAGE].headers) == ALLOWED
    assert answers[PAGE].headers["vary"] == "Origin"
    assert _cors(answers["https://evil.example"].headers) == {}
    assert _cors(answers[None].headers) == {}
    assert upstream.started == 0


async def test_a_refused_connection_gets_no_cors_from_a_router_with_cors_off(
    start_router: RouterFactory, upstream: Upstream,
) -> None:
    async with start_router(
        [upstream.url], tls=False, limits={"hard_max_connections_per_client": 1},
    ) as router, httpx.AsyncClient(timeout=20) as holder:
        assert (await holder.get(router.base_url + "/healthz")).status_code == 200
        async with httpx.AsyncClient(timeout=20) as client:
            refused = await client.get(router.base_url + "/v1/models", headers={"origin": PAGE})
    assert refused.status_code == 503
    assert _cors(refused.headers) == {}


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    return answer


@pytest.mark.parametrize("server", ["auto", "hypercorn", "uvicorn"])
async def test_a_refused_http1_connection_answers_these_exact_bytes(
    start_router: RouterFactory, upstream: Upstream, server: str,
) -> None:
    async with start_router(
        [upstream.url], tls=False, listen={"server": server}, cors=CORS,
        limits={"hard_max_connections_per_client": 1},
    ) as router:
        holder = await asyncio.open_connection("127.0.0.1", router.port)
        await asyncio.sleep(0.1)
        # An Origin header spelt as a client may spell it, after a long line.
        answer = await _raw(router.port, (
            b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nx-pad: " + b"p" * 3000
            + b"\r\nORIGIN:  " + PAGE.encode() + b" \r\n\r\n"))
        holder[1].close()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.split(b"\r\n") == [
        b"HTTP/1.1 503 Service Unavailable",
        b"content-type: application/json",
        b"retry-after: 1",
        b"connection: close",
        b"content-length: %d" % len(body),
        b"access-control-allow-origin: " + PAGE.encode(),
        b"access-control-expose-headers: " + EXPOSE_HEADERS.encode(),
        b"timing-allow-origin: " + PAGE.encode(),
        b"vary: Origin",
    ]
    assert json.loads(body)["error"]["code"] == "overloaded"


async def test_memory_shedding_answers_an_allowed_origin_with_cors(
    start_router: RouterFactory, upstream: Upstream,
) -> None:
    """The 503 of a POST shed for memory (1 MiB: always over, here) is written before the
    app's CORS layer ran: it carries its headers all the same."""
    async with start_router(
        [upstream.url], tls=False, cors=CORS, limits={"max_rss_bytes": 1 << 20},
    ) as router, httpx.AsyncClient(timeout=20) as client:
        answers = {
            origin: await client.post(router.base_url + CHAT, json=BODY,
                                      headers={**auth(), "origin": origin})
            for origin in (PAGE, "https://evil.example")
        }
    for answer in answers.values():
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "overloaded"
        assert answer.headers["retry-after"] == "1"
    assert _cors(answers[PAGE].headers) == ALLOWED
    assert _cors(answers["https://evil.example"].headers) == {}


HEADS = [
    pytest.param("/v1/models?" + "a" * 9000, {}, 414, "request_line_too_long", id="414"),
    pytest.param("/v1/models", {f"x-{i}": "v" for i in range(101)}, 431, "too_many_headers",
                 id="431"),
]


@pytest.mark.parametrize(("path", "extra", "status", "code"), HEADS)
async def test_an_http2_head_over_a_bound_answers_an_allowed_origin_with_cors(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str], path: str,
    extra: dict[str, str], status: int, code: str,
) -> None:
    async with start_router([upstream.url], cors=CORS, listen={"http3": False}) as router, \
            httpx.AsyncClient(verify=client_tls(tls_files), http2=True, http1=False,
                              timeout=20) as client:
        answers = {
            origin: await client.get(router.base_url + path,
                                     headers={**extra, "origin": origin})
            for origin in (PAGE, "https://evil.example")
        }
    for answer in answers.values():
        assert (answer.http_version, answer.status_code) == ("HTTP/2", status), answer.text
        assert answer.json()["error"]["code"] == code
    assert _cors(answers[PAGE].headers) == ALLOWED
    assert _cors(answers["https://evil.example"].headers) == {}


async def test_an_http3_head_over_a_bound_answers_an_allowed_origin_with_cors(
    start_router: RouterFactory, upstream: Upstream, tls_files: dict[str, str],
) -> None:
    async with start_router([upstream.url], cors=CORS, listen={"http3": True}) as router:
        answer = await h3_request(
            router.port, "GET", "/v1/models", cafile=tls_files["cafile"],
            headers={"origin": PAGE, **{f"x-{i}": "v" for i in range(101)}},
        )
    assert answer.status == 431, answer
    assert _cors(answer.headers) == ALLOWED


def test_the_refusal_headers_come_only_for_one_allowed_origin() -> None:
    """Sans-IO: what the hosting layer adds, from a raw HTTP/1.1 head or decoded fields."""
    from firstbyte.router.config import CorsConfig
    from firstbyte.router.cors import CorsPolicy
    from firstbyte.router.hosting.refusal_cors import cors_fields, h1_cors_lines

    policy = CorsPolicy(CorsConfig(allow_origins=[PAGE]))
    cors = policy.refusal_headers
    head = b"GET / HTTP/1.1\r\nHost: r.example\r\n%s\r\nbody: origin: x\r\n"
    allowed = b"Origin: " + PAGE.encode() + b"\r\n"
    lines = h1_cors_lines(cors, head % allowed)
    assert lines.startswith(b"access-control-allow-origin: " + PAGE.encode() + b"\r\n")
    assert lines.endswith(b"vary: Origin\r\n")
    for other in (b"Origin: https://evil.example\r\n",
                  b"Origin: " + PAGE.encode() + b"\r\norigin: " + PAGE.encode() + b"\r\n",
                  b"x-origin: " + PAGE.encode() + b"\r\n", b"", b"Origin: null\r\n"):
        assert h1_cors_lines(cors, head % other) == b"", other
    assert h1_cors_lines(None, head % allowed) == b""
    # Only the head counts: an Origin line after its blank line is body.
    assert h1_cors_lines(cors, b"GET / HTTP/1.1\r\n\r\norigin: " + PAGE.encode()) == b""
    # A page the router serves itself needs none.
    assert h1_cors_lines(cors, b"GET / HTTP/1.1\r\nhost: r.example\r\norigin: https://r.example"
                                b"\r\n\r\n") == b""
    fields = [(b":authority", b"r.example"), (b"origin", PAGE.encode())]
    assert dict(cors_fields(cors, fields))[b"access-control-allow-origin"] == PAGE.encode()
    assert cors_fields(cors, [*fields, (b"origin", PAGE.encode())]) == []
    assert cors_fields(CorsPolicy(CorsConfig()).refusal_headers, fields) == []
