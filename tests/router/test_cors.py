"""CORS for listed page origins only, and the browser client's files served without a key."""

from __future__ import annotations

import logging

import httpx
import pytest

from firstbyte.router.config import CorsConfig
from firstbyte.router.cors import CorsPolicy, Preflight, ResponseHeaders
from firstbyte.router.edge_client import client_files
from tests.router.conftest import RouterFactory, auth
from tests.router.upstream import Upstream

APP = "https://app.example"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True}
PREFLIGHT = {"origin": APP, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def policy() -> CorsPolicy:
    return CorsPolicy(CorsConfig(allow_origins=[APP]))


def test_a_listed_origins_preflight_is_answered() -> None:
    answer = policy().decide("OPTIONS", "/v1/chat/completions", PREFLIGHT)
    assert isinstance(answer, Preflight)
    assert answer.status == 204
    headers = dict(answer.headers)
    assert headers["access-control-allow-origin"] == APP
    assert set(headers["access-control-allow-methods"].split(", ")) == {"GET", "POST", "OPTIONS"}
    assert {"authorization", "content-type", "last-event-id"} <= set(
        headers["access-control-allow-headers"].split(", "))
    assert headers["access-control-max-age"] == "600"
    assert "access-control-allow-credentials" not in headers  # tokens, never cookies


def test_unlisted_origins_get_nothing_and_are_logged_once(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    p = policy()
    with caplog.at_level(logging.WARNING, "firstbyte.router.cors"):
        refused = p.decide("OPTIONS", "/v1/chat/completions", {**PREFLIGHT,
                                                               "origin": "https://evil.example"})
        plain = p.decide("POST", "/v1/chat/completions", {"origin": "https://evil.example"})
    assert refused == Preflight(403, (("vary", "Origin"),))
    assert plain is None
    assert [r.getMessage() for r in caplog.records].count(
        "CORS: origin 'https://evil.example' is not in cors.allow_origins; answered without"
        " CORS headers (the browser withholds the response)") == 1
    # Exact matches only: a prefix, another scheme or port is another origin.
    for other in ("https://app.example.evil", "http://app.example", "https://app.example:8443"):
        assert p.decide("GET", "/v1/models", {"origin": other}) is None


def test_same_origin_and_non_browser_requests_need_nothing() -> None:
    p = policy()
    assert p.decide("POST", "/v1/chat/completions", {}) is None
    assert p.decide("POST", "/v1/chat/completions",
                    {"origin": "https://router.example", "host": "router.example"}) is None


def test_without_origin_only_the_client_files_get_cors() -> None:
    """The app asks decide() only of a request with ``Origin`` or to the client's files: every
    other answer is None, whatever the method, path or other headers."""
    p = policy()
    others = ({}, {"access-control-request-method": "POST", "host": "router.example"},
              {k: v for k, v in PREFLIGHT.items() if k != "origin"})
    for method in ("GET", "POST", "OPTIONS", "DELETE"):
        for path in ("/v1/chat/completions", "/v1/models", "/v1/edge/client", "/", "/healthz"):
            for headers in others:
                assert p.decide(method, path, headers) is None, (method, path, headers)
        assert p.decide(method, "/v1/edge/client/firstbyte.js", {}) == ResponseHeaders(
            (("access-control-allow-origin", "*"), ("timing-allow-origin", "*")))


def test_client_files_are_open_to_every_origin() -> None:
    answer = policy().decide("GET", "/v1/edge/client/firstbyte.js", {"origin": "https://x.example"})
    assert answer == ResponseHeaders((("access-control-allow-origin", "*"),
                                      ("timing-allow-origin", "*")))


async def test_live_cors_headers(start_router: RouterFactory, upstream: Upstream) -> None:
    async with start_router([upstream.url], tls=False, cors={"allow_origins": [APP]}) as r, \
            httpx.AsyncClient(base_url=r.base_url) as http:
        pre = await http.options("/v1/chat/completions", headers=PREFLIGHT)
        listed = await http.post("/v1/chat/completions", json=CHAT,
                                 headers={**auth(), "origin": APP})
        unlisted = await http.post("/v1/chat/completions", json=CHAT,
                                   headers={**auth(), "origin": "https://evil.example"})
        refused_pre = await http.options("/v1/chat/completions",
                                         headers={**PREFLIGHT, "origin": "https://evil.example"})
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == APP
    assert listed.status_code == 200
    assert listed.headers["access-control-allow-origin"] == APP
    exposed = set(listed.headers["access-control-expose-headers"].split(", "))
    assert {"x-firstbyte-stream", "x-firstbyte-region", "server-timing"} <= exposed
    assert listed.headers["timing-allow-origin"] == APP
    assert listed.headers["vary"] == "Origin"
    assert unlisted.status_code == 200  # served, but the browser will not hand it to the page
    assert not any(h.startswith("access-control-") or h == "timing-allow-origin"
                   for h in unlisted.headers)
    assert refused_pre.status_code == 403
    assert "access-control-allow-origin" not in refused_pre.headers


async def test_the_client_files_are_served_without_a_key(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    names = set(client_files())
    assert {"firstbyte.js", "sse.js", "stream.js", "timings.js", "protocol.js"} <= names
    async with start_router([upstream.url], tls=False) as r, \
            httpx.AsyncClient(base_url=r.base_url) as http:
        got = await http.get("/v1/edge/client/firstbyte.js",
                             headers={"origin": "https://anyone.example"})
        again = await http.get("/v1/edge/client/firstbyte.js",
                               headers={"if-none-match": got.headers["etag"]})
        missing = await http.get("/v1/edge/client/nope.js")
        escape = await http.get("/v1/edge/client/../config.py")
        post = await http.post("/v1/edge/client/firstbyte.js")
    assert got.status_code == 200
    assert got.headers["content-type"] == "text/javascript; charset=utf-8"
    assert got.headers["cache-control"] == "public, max-age=300"
    assert got.headers["x-content-type-options"] == "nosniff"
    assert got.headers["access-control-allow-origin"] == "*"
    assert got.content == client_files()["firstbyte.js"].body
    assert b"export class Client" in got.content
    assert again.status_code == 304
    assert again.content == b""
    assert missing.status_code == 404
    assert escape.status_code == 404
    assert post.status_code in (404, 405)


@pytest.mark.parametrize(("section", "values", "message"), [
    ("cors", {"allow_origins": ["*"]}, "cors.allow_origins[0]"),
    ("cors", {"allow_origins": ["https://app.example/"]}, "cors.allow_origins[0]"),
    ("auth", {"token_secret": "short"}, "auth.token_secret"),
    ("auth", {"client_token_max_ttl_s": 0}, "auth.client_token_max_ttl_s"),
])
def test_bad_browser_config_is_refused_naming_the_key(
    section: str, values: dict[str, object], message: str
) -> None:
    from firstbyte.router.config import ConfigError
    from tests.router.conftest import router_config

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        router_config(["http://127.0.0.1:1"], None, **{section: values})


def test_a_preflight_allows_the_headers_it_asks_for() -> None:
    """The official SDKs send headers of their own from a page (openai's ``x-stainless-*``,
    anthropic's ``anthropic-version``, ``x-api-key``): a fixed list refused them, and the
    browser never sent the request. A malformed list gets the fixed one."""
    asked = "Authorization, content-type, x-stainless-os, anthropic-version, x-api-key"
    answer = policy().decide("OPTIONS", "/v1/messages",
                             {**PREFLIGHT, "access-control-request-headers": asked})
    assert isinstance(answer, Preflight)
    headers = dict(answer.headers)
    assert headers["access-control-allow-headers"] == (
        "authorization, content-encoding, content-type, last-event-id, traceparent,"
        " x-stainless-os, anthropic-version, x-api-key")
    assert headers["vary"] == "Origin, Access-Control-Request-Headers"
    for bad in ("x-a, bad header", "x-a,,x-b", "x" * 3000):
        answer = policy().decide("OPTIONS", "/v1/messages",
                                 {**PREFLIGHT, "access-control-request-headers": bad})
        assert isinstance(answer, Preflight)
        assert dict(answer.headers)["access-control-allow-headers"] == (
            "authorization, content-encoding, content-type, last-event-id, traceparent")
