"""Compressed request bodies, over real sockets: a gzip or deflate body is inflated once, the
backend gets the inflated body (no ``content-encoding``), and a coding the router does not
take, a corrupt body or one inflating past the body limit is refused with its own code."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.client_sdk.client_tokens import amint_client_token
from firstbyte.protocol import error_codes
from firstbyte.router.sim.server import running_sim
from tests.router.conftest import API_KEY, RouterFactory, auth
from tests.router.upstream import Upstream

MODEL = "m"
APP = "https://app.example"
HISTORY = " ".join(f"word{i % 97} about the weather and the sea" for i in range(1500))
"""~60 KB of text: several initial windows' worth, a few thousand tokens."""


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": HISTORY}], **extra}


def _messages() -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": HISTORY}]}


def _deflate(data: bytes) -> bytes:
    return zlib.compress(data)  # RFC 9110's deflate: zlib-wrapped, as browsers send it


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


CODINGS = {"gzip": gzip.compress, "deflate": _deflate}


def _prompt_tokens(sse: str) -> int:
    """The prompt's tokens as the backend counted them (chat's usage chunk, or Messages'
    ``message_start``)."""
    for line in sse.splitlines():
        if not line.startswith("data: {"):
            continue
        event = json.loads(line[6:])
        usage = event.get("usage") or event.get("message", {}).get("usage")
        if usage and usage.get("prompt_tokens"):
            return int(usage["prompt_tokens"])
        if usage and "input_tokens" in usage:  # Anthropic's: those not read from the cache
            return int(usage["input_tokens"] + usage["cache_read_input_tokens"]
                       + usage["cache_creation_input_tokens"])
    raise AssertionError(f"no usage in {sse[-500:]!r}")


async def test_gzip_and_deflate_bodies_reach_the_backend_inflated(
    start_router: RouterFactory,
) -> None:
    """The sim counts the same prompt tokens for a packed body as for the plain one, on chat
    and on Anthropic Messages, and the streams run to their end."""
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            start_router([sim], tls=False) as r, \
            httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
        for path, body in (("/v1/chat/completions", _chat()), ("/v1/messages", _messages())):
            raw = json.dumps(body).encode()
            plain = await http.post(path, content=raw, headers=auth())
            assert plain.status_code == 200, plain.text
            expected = _prompt_tokens(plain.text)
            assert expected > 1000
            packed_bodies = {"raw deflate": ("deflate", _raw_deflate(raw)),
                             "identity": ("identity", raw),
                             **{name: (name, pack(raw)) for name, pack in CODINGS.items()}}
            for label, (coding, packed) in packed_bodies.items():
                answer = await http.post(path, content=packed,
                                         headers={**auth(), "content-encoding": coding})
                assert answer.status_code == 200, (path, label, answer.text)
                assert answer.headers["content-type"].startswith("text/event-stream")
                assert _prompt_tokens(answer.text) == expected, (path, label)
                assert ("[DONE]" in answer.text) or ("message_stop" in answer.text)
            assert len(gzip.compress(raw)) < len(raw) // 3


async def test_the_backend_never_sees_the_coding(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    raw = json.dumps(_chat(stream=False)).encode()
    async with start_router([upstream.url], tls=False) as r, \
            httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
        answer = await http.post("/v1/chat/completions", content=gzip.compress(raw),
                                 headers={**auth(), "content-encoding": "gzip",
                                          "content-type": "application/json"})
    assert answer.status_code == 200, answer.text
    assert upstream.chat_requests == [HISTORY]
    [headers] = upstream.chat_headers
    assert "content-encoding" not in headers
    assert int(headers["content-length"]) >= len(HISTORY)  # the inflated body's


async def test_refusals_name_their_cause_before_the_backend(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    raw = json.dumps(_chat()).encode()
    packed = gzip.compress(raw)
    async with start_router([upstream.url], tls=False, cors={"allow_origins": [APP]},
                            limits={"max_body_bytes": 64 * 1024}) as r, \
            httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
        answers = {
            coding: await http.post("/v1/chat/completions", content=packed,
                                    headers={**auth(), "content-encoding": coding,
                                             "origin": APP})
            for coding in ("br", "zstd", "gzip, gzip", "gzip, br")
        }
        corrupt = await http.post(
            "/v1/chat/completions", content=packed[:10] + b"\xff" * 40 + packed[50:],
            headers={**auth(), "content-encoding": "gzip"})
        truncated = await http.post("/v1/chat/completions", content=packed[: len(packed) // 2],
                                    headers={**auth(), "content-encoding": "gzip"})
        not_gzip = await http.post("/v1/chat/completions", content=raw,
                                   headers={**auth(), "content-encoding": "gzip"})
        trailing = await http.post("/v1/chat/completions", content=_deflate(raw) + b"junk",
                                   headers={**auth(), "content-encoding": "deflate"})
        # 100 KB inflated, under the limit packed: the inflated body is what the limit bounds.
        big = gzip.compress(json.dumps(_chat(pad="x" * 100_000)).encode())
        assert len(big) < 64 * 1024
        too_large = await http.post("/v1/chat/completions", content=big,
                                    headers={**auth(), "content-encoding": "gzip"})
        unauthenticated = await http.post("/v1/chat/completions", content=packed,
                                          headers={"content-encoding": "br"})
    for coding, answer in answers.items():
        assert answer.status_code == 415, (coding, answer.text)
        assert answer.json()["error"]["code"] == error_codes.UNSUPPORTED_CONTENT_ENCODING
        assert answer.json()["error"]["param"] == "content-encoding"
        assert answer.headers["accept-encoding"] == "gzip, deflate"
        assert "accept-encoding" in answer.headers["access-control-expose-headers"]
    for answer in (corrupt, truncated, not_gzip, trailing):
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == error_codes.INVALID_CONTENT_ENCODING
    assert too_large.status_code == 413, too_large.text
    assert too_large.json()["error"]["code"] == error_codes.REQUEST_TOO_LARGE
    assert unauthenticated.status_code == 401  # the key first, on the head
    assert upstream.chat_requests == []


async def test_the_simple_start_says_its_coding_in_the_url(
    start_router: RouterFactory, upstream: Upstream
) -> None:
    """A ``text/plain`` start cannot send ``Content-Encoding``; ``?encoding=gzip`` stands for
    it, with the client token in the URL as before, and changes nothing of its checks."""
    simple = {"content-type": "text/plain;charset=UTF-8", "origin": APP}
    packed = gzip.compress(json.dumps(_chat()).encode())
    async with start_router([upstream.url], tls=False, cors={"allow_origins": [APP]}) as r, \
            httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
        token = (await amint_client_token(f"{r.base_url}/v1", API_KEY)).token
        started = await http.post("/v1/chat/completions", content=packed, headers=simple,
                                  params={"token": token, "encoding": "gzip"})
        anonymous = await http.post("/v1/chat/completions", content=packed, headers=simple,
                                    params={"encoding": "gzip"})
        brotli = await http.post("/v1/chat/completions", content=packed, headers=simple,
                                 params={"token": token, "encoding": "br"})
    assert started.status_code == 200, started.text
    assert "[DONE]" in started.text
    assert upstream.chat_requests == [HISTORY]
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == error_codes.MISSING_API_KEY
    assert brotli.status_code == 415
    assert brotli.json()["error"]["param"] == "encoding"


async def test_the_warm_ups_advertise_and_take_compressed_bodies(
    start_router: RouterFactory,
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": HISTORY}]}
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            start_router([sim], tls=False, cors={"allow_origins": [APP]}) as r, \
            httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
        warm = await http.get("/v1/edge/warm", headers={"origin": APP})
        health = await http.get("/healthz")  # what the SDKs' prewarm asks
        warmed = await http.post("/v1/edge/warm", content=gzip.compress(json.dumps(chat).encode()),
                                 headers={**auth(), "content-encoding": "gzip", "origin": APP})
        refused = await http.post("/v1/edge/warm", content=b"x" * 100,
                                  headers={**auth(), "content-encoding": "zstd"})
        preflight = await http.options("/v1/chat/completions", headers={
            "origin": APP, "access-control-request-method": "POST",
            "access-control-request-headers": "content-encoding"})
    for answer in (warm, warmed, refused, health):
        assert answer.headers.get_list("accept-encoding") == ["gzip, deflate"], answer.headers
    assert "accept-encoding" in warm.headers["access-control-expose-headers"]
    assert warmed.status_code == 200, warmed.text
    assert warmed.json()["prompt_tokens"] > 1000
    assert refused.status_code == 415
    assert "content-encoding" in preflight.headers["access-control-allow-headers"]


async def test_curl_sends_a_gzipped_file(
    start_router: RouterFactory, upstream: Upstream, tmp_path: Path
) -> None:
    body = tmp_path / "chat.json.gz"
    body.write_bytes(gzip.compress(json.dumps(_chat(stream=False)).encode()))
    async with start_router([upstream.url], tls=False) as r:
        curl = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--max-time", "30", "-o", "-", "-w", "\n%{http_code}",
            "-H", f"Authorization: Bearer {API_KEY}", "-H", "Content-Type: application/json",
            "-H", "Content-Encoding: gzip", "--data-binary", f"@{body}",
            f"{r.base_url}/v1/chat/completions",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(curl.communicate(), 40)
        finally:
            if curl.returncode is None:
                curl.kill()
                await curl.wait()
    text, _, status = out.decode().rpartition("\n")
    assert status == "200", (text, err)
    assert json.loads(text)["choices"][0]["message"]["content"]
    assert upstream.chat_requests == [HISTORY]


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
async def test_every_inference_endpoint_takes_a_compressed_body(
    start_router: RouterFactory, coding: str
) -> None:
    bodies = {
        "/v1/completions": {"model": MODEL, "prompt": HISTORY, "max_tokens": 2},
        "/v1/responses": {"model": MODEL, "input": HISTORY, "max_output_tokens": 2},
        "/v1/embeddings": {"model": MODEL, "input": HISTORY},
    }
    async with running_sim("instant", served_model_names=[MODEL]) as sim, \
            start_router([sim], tls=False) as r, \
            httpx.AsyncClient(base_url=r.base_url, timeout=30) as http:
        for path, body in bodies.items():
            answer = await http.post(path, content=CODINGS[coding](json.dumps(body).encode()),
                                     headers={**auth(), "content-encoding": coding})
            assert answer.status_code == 200, (path, answer.text)
