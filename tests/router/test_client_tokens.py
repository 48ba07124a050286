"""Client tokens: the signer (sans-IO, clock passed in) and the live router's rules — a token
acts as its key's owner (its streams, its limits), expires, cannot mint tokens or read
metrics, and travels outside ``Authorization`` only where a browser needs it."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest

from firstbyte.client_sdk import AsyncClient, mint_client_token
from firstbyte.client_sdk.client_tokens import amint_client_token
from firstbyte.client_sdk.errors import APIError, AuthenticationError
from firstbyte.protocol import error_codes
from firstbyte.router.client_tokens import TokenClaims, TokenRefusal, TokenSigner
from firstbyte.router.observability.logs import key_id, subject_id
from firstbyte.router.pipeline.admit import SUBJECT_HEADER
from firstbyte.router.streams import owner_of
from tests.router.conftest import API_KEY, OTHER_KEY, RouterFactory, auth
from tests.router.logs import CHAT_PATH, access_records
from tests.router.upstream import Upstream

OWNER = owner_of(API_KEY)
SECRET = "t" * 40


def signer(secret: bytes = b"k" * 32, max_ttl_s: float = 900) -> TokenSigner:
    return TokenSigner(secret, max_ttl_s=max_ttl_s, default_ttl_s=300)


def test_a_token_carries_its_subject_and_the_subjects_cap() -> None:
    s = signer()
    grant = s.mint(OWNER, now=1000.0, ttl_s=60, subject="user-42", max_streams=3)
    assert s.verify(grant.token, 1001.0, None) == TokenClaims(OWNER, 1060.0, None, "user-42", 3)
    # The subject is signed: a payload edited to another subject is refused.
    body, _, signature = grant.token.rpartition(".")
    forged = s.mint(OWNER, now=1000.0, ttl_s=60, subject="user-43").token.rpartition(".")[0]
    assert isinstance(s.verify(f"{forged}.{signature}", 1001.0, None), TokenRefusal)
    assert body != forged


async def test_sdk_minted_subject_tokens_read_only_their_own_subjects_streams(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False) as r:
        base = f"{r.base_url}/v1"
        alice = await amint_client_token(base, API_KEY, subject="alice")
        bob = await asyncio.to_thread(mint_client_token, base, API_KEY, subject="bob")
        async with AsyncClient(base, alice.token, http="1.1") as client:
            async with client.stream(model="m", messages=CHAT["messages"]) as stream:
                assert "".join([d.text async for d in stream])
            stream_id = stream.stream_id
        async with httpx.AsyncClient(base_url=r.base_url) as http:
            mine = await http.get(f"/v1/streams/{stream_id}", params={"token": alice.token})
            theirs = await http.get(f"/v1/streams/{stream_id}", params={"token": bob.token})
            polled = await http.get(f"/v1/streams/{stream_id}/poll", headers=auth(bob.token),
                                    params={"wait": "0"})
    assert mine.status_code == 200
    assert (theirs.status_code, polled.status_code) == (404, 404)
    assert theirs.json()["error"]["code"] == error_codes.STREAM_NOT_FOUND


def test_a_token_verifies_until_it_expires() -> None:
    s = signer()
    grant = s.mint(OWNER, now=1000.0, ttl_s=60)
    assert grant.expires_at == 1060.0
    assert s.verify(grant.token, 1059.9, None) == TokenClaims(OWNER, 1060.0)
    refused = s.verify(grant.token, 1060.0, None)
    assert isinstance(refused, TokenRefusal)
    assert refused.code == error_codes.CLIENT_TOKEN_EXPIRED
    assert grant.token not in refused.message


def test_the_lifetime_is_capped_and_defaulted() -> None:
    s = signer(max_ttl_s=120)
    assert s.mint(OWNER, 0.0, ttl_s=86400).expires_at == 120.0
    assert s.mint(OWNER, 0.0).expires_at == 120.0  # default 300 capped too
    assert signer().mint(OWNER, 0.0).expires_at == 300.0


@pytest.mark.parametrize("mangle", [
    lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),  # signature
    lambda t: t.replace("fbt1.", "fbt1.x", 1),  # payload
    lambda t: t.rpartition(".")[0],  # no signature
    lambda t: "fbt1.",
    lambda t: "sk-not-a-token",
    lambda t: t + "x" * 2000,
])
def test_a_forged_or_mangled_token_is_invalid(mangle: object) -> None:
    s = signer()
    token = s.mint(OWNER, 0.0).token
    refused = s.verify(mangle(token), 1.0, None)  # type: ignore[operator]
    assert refused == TokenRefusal(error_codes.INVALID_CLIENT_TOKEN, "Invalid client token.")


def test_another_routers_secret_does_not_verify() -> None:
    token = signer(b"a" * 32).mint(OWNER, 0.0).token
    assert isinstance(signer(b"b" * 32).verify(token, 1.0, None), TokenRefusal)


def test_an_origin_bound_token_needs_that_origin() -> None:
    s = signer()
    token = s.mint(OWNER, 0.0, origin="https://app.example").token
    assert isinstance(s.verify(token, 1.0, "https://app.example"), TokenClaims)
    for origin in ("https://evil.example", None):
        refused = s.verify(token, 1.0, origin)
        assert isinstance(refused, TokenRefusal)
        assert refused.code == error_codes.INVALID_CLIENT_TOKEN


# -- the live router ----------------------------------------------------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


async def test_a_token_streams_and_reads_only_its_keys_streams(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False,
                            auth={"token_secret": SECRET}) as r:
        grant = await amint_client_token(f"{r.base_url}/v1", API_KEY, ttl_s=60)
        assert grant.expires_at - time.time() <= 60
        # The sync helper, in a thread: this loop runs the router.
        other = await asyncio.to_thread(mint_client_token, f"{r.base_url}/v1", OTHER_KEY)
        # The Python SDK takes a token where a key goes (Authorization: Bearer).
        async with AsyncClient(f"{r.base_url}/v1", grant.token, http="1.1") as client:
            async with client.stream(model="m", messages=CHAT["messages"]) as stream:
                text = "".join([d.text async for d in stream])
            assert text
            stream_id = stream.stream_id
        async with httpx.AsyncClient(base_url=r.base_url) as http:
            mine = await http.get(f"/v1/streams/{stream_id}", headers=auth(grant.token))
            key = await http.get(f"/v1/streams/{stream_id}", headers=auth(API_KEY))
            foreign = await http.get(f"/v1/streams/{stream_id}", headers=auth(other.token))
            # EventSource's and a browser's simple requests: the token in the query, on a
            # stream's read and poll only (and the starts, tests/router/test_simple_start.py).
            query = await http.get(f"/v1/streams/{stream_id}", params={"token": grant.token})
            key_in_query = await http.get(f"/v1/streams/{stream_id}", params={"token": API_KEY})
            poll_query = await http.get(f"/v1/streams/{stream_id}/poll",
                                        params={"token": grant.token, "wait": "0"})
            metrics = await http.get("/metrics", headers=auth(grant.token))
    assert (mine.status_code, key.status_code) == (200, 200)
    assert "data: [DONE]" in mine.text
    assert foreign.status_code == 404
    assert foreign.json()["error"]["code"] == error_codes.STREAM_NOT_FOUND
    assert query.status_code == 200
    assert key_in_query.status_code == 401  # an API key never rides in a URL
    assert poll_query.status_code == 200, poll_query.text  # a browser's preflight-free poll
    assert metrics.status_code == 401  # nowhere else


async def test_a_token_cannot_mint_and_an_expired_one_is_refused(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    async with start_router([upstream.url], tls=False) as r:
        base = f"{r.base_url}/v1"
        # Minting with a token is refused as such, not for expiry: that token lives long
        # (a 1 s one expired before the second call on a loaded CI machine).
        minter = await amint_client_token(base, API_KEY, ttl_s=600)
        with pytest.raises(APIError) as info:
            await amint_client_token(base, minter.token)
        assert (info.value.status, info.value.code) == (403, error_codes.API_KEY_REQUIRED)
        with pytest.raises(AuthenticationError):
            await amint_client_token(base, "sk-wrong-key-0000")
        async with httpx.AsyncClient(base_url=r.base_url) as http:
            bad_body = await http.post("/v1/edge/tokens", headers=auth(),
                                       content=b'{"ttl_s": -1}')
            bad_origin = await http.post("/v1/edge/tokens", headers=auth(),
                                         json={"origin": "https://a.example/path"})
            grant = await amint_client_token(base, API_KEY, ttl_s=1)
            await asyncio.sleep(max(0.0, grant.expires_at - time.time()) + 0.05)
            expired = await http.post("/v1/chat/completions", headers=auth(grant.token),
                                      json=CHAT)
    assert bad_body.status_code == 400
    assert bad_origin.status_code == 400
    assert expired.status_code == 401
    body = expired.json()["error"]
    assert body["code"] == error_codes.CLIENT_TOKEN_EXPIRED
    assert grant.token not in json.dumps(body)


async def test_a_token_counts_against_its_keys_rate_limit(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    limits = {"requests_per_s_per_key": 0.01, "request_burst_per_key": 2}
    async with start_router([upstream.url], tls=False, limits=limits) as r:
        token = (await amint_client_token(f"{r.base_url}/v1", API_KEY)).token
        other = (await amint_client_token(f"{r.base_url}/v1", OTHER_KEY)).token
        async with httpx.AsyncClient(base_url=r.base_url) as http:
            codes = [(await http.post("/v1/chat/completions", headers=auth(k), json=CHAT))
                     for k in (API_KEY, token, token, other)]
    assert [c.status_code for c in codes] == [200, 200, 429, 200]
    assert codes[2].json()["error"]["code"] == error_codes.KEY_RATE_LIMITED


async def test_a_websocket_takes_the_token_as_a_subprotocol(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    from websockets.asyncio.client import connect

    async with start_router([upstream.url], tls=False) as r:
        token = (await amint_client_token(f"{r.base_url}/v1", API_KEY)).token
        ws_url = r.base_url.replace("http://", "ws://") + "/v1/ws"
        async with connect(ws_url, subprotocols=[  # type: ignore[list-item]
                "firstbyte.v1", f"firstbyte.token.{token}"]) as ws:
            assert ws.subprotocol == "firstbyte.v1"
            await ws.send(json.dumps({"type": "request", "body": {**CHAT, "stream": True}}))
            kinds = []
            while not kinds or kinds[-1] not in ("done", "error"):
                kinds.append(json.loads(await ws.recv())["type"])
    assert kinds[0] == "start"
    assert kinds[-1] == "done"


async def test_a_token_request_s_access_line_names_its_key_and_subject(
    start_router: RouterFactory, upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator tells which key's browser users made a request: a token's line carries
    the key's ``key_id`` and the subject's ``subject_id``, the digests the key's own request
    for that subject logs; neither the token nor the key is in any line."""
    caplog.set_level(logging.INFO, logger="firstbyte")
    async with start_router([upstream.url], tls=False) as r:
        grant = await amint_client_token(f"{r.base_url}/v1", API_KEY, subject="alice")
        async with httpx.AsyncClient(base_url=r.base_url) as http:
            by_token = await http.post(CHAT_PATH, headers=auth(grant.token), json=CHAT)
            by_key = await http.post(
                CHAT_PATH, headers={**auth(), SUBJECT_HEADER: "alice"}, json=CHAT
            )
    assert (by_token.status_code, by_key.status_code) == (200, 200)
    lines = access_records(caplog, CHAT_PATH)
    assert [(line["key_id"], line.get("subject_id")) for line in lines] == [
        (key_id(API_KEY), subject_id("alice"))
    ] * 2
    logged = "\n".join(f"{r.getMessage()} {getattr(r, 'fields', '')}" for r in caplog.records)
    assert grant.token not in logged
    assert API_KEY not in logged
