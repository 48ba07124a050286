"""Bad input gets a 4xx with OpenAI's error body; nothing crashes; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from firstbyte.router.sim.server import running_sim
from tests.router.sim.helpers import MODEL, chat_body, stream_chat

GOOD: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with running_sim("instant", served_model_names=[MODEL]) as base:
        yield base


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "messages": [', None),  # malformed JSON
        (b"[1, 2]", None),  # not an object
        (b"", None),
        (json.dumps({**GOOD, "messages": "hi"}).encode(), "messages"),
        (json.dumps({**GOOD, "messages": []}).encode(), "messages"),
        (json.dumps({**GOOD, "max_tokens": -5}).encode(), "max_tokens"),
        (json.dumps({**GOOD, "max_tokens": "ten"}).encode(), "max_tokens"),
        (json.dumps({**GOOD, "stream": "yes"}).encode(), "stream"),
        (json.dumps({**GOOD, "temperature": 9}).encode(), "temperature"),
        (json.dumps({"messages": GOOD["messages"]}).encode(), "model"),  # model missing
        (
            json.dumps({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}).encode(),
            "messages[0].role",
        ),
    ],
)
async def test_invalid_requests_get_400(url: str, body: bytes, param: str | None) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(
            f"{url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        assert_error(r, 400, param)
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert (await stream_chat(c, url, chat_body("ok", max_tokens=1))).done


async def test_ten_megabyte_body_gets_413(url: str) -> None:
    huge = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * (10 << 20)}]})
    async with httpx.AsyncClient() as c:
        r = await c.post(
            f"{url}/v1/chat/completions",
            content=huge,
            headers={"content-type": "application/json"},
        )
        assert_error(r, 413)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked upload
            for i in range(0, len(huge), 1 << 20):
                yield huge[i : i + (1 << 20)].encode()

        r = await c.post(
            f"{url}/v1/chat/completions",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert_error(r, 413)
        assert (await stream_chat(c, url, chat_body("ok", max_tokens=1))).done


async def test_non_json_content_type_gets_415(url: str) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{url}/v1/chat/completions", data={"model": "m"})  # form-encoded
        assert_error(r, 415)
        r = await c.post(
            f"{url}/v1/chat/completions",
            content=json.dumps(GOOD),
            headers={"content-type": "text/plain"},
        )
        assert_error(r, 415)
        r = await c.post(
            f"{url}/v1/chat/completions",
            content=json.dumps(GOOD),
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert r.status_code == 200


async def test_unknown_route_and_wrong_method(url: str) -> None:
    async with httpx.AsyncClient() as c:
        r = await c.get(f"{url}/v1/nothing-here")
        assert_error(r, 404)
        assert r.json()["error"]["type"] == "not_found_error"
        assert_error(await c.get(f"{url}/v1/chat/completions"), 405)
        assert_error(await c.post(f"{url}/v1/models"), 405)
        assert (await stream_chat(c, url, chat_body("ok", max_tokens=1))).done


async def test_client_gone_before_the_end_frees_the_slot() -> None:
    async with (
        running_sim("h100-7b", served_model_names=[MODEL], max_num_seqs=1) as url,
        httpx.AsyncClient() as c,
    ):
        body = chat_body("long", max_tokens=200)
        async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_raw():
                break  # first bytes, then hang up
        # The sequence was aborted (not run to its end), and the slot serves the next one; the
        # metrics are labelled with the served name, as vLLM's.
        r = await stream_chat(c, url, chat_body("next", max_tokens=2))
        assert r.done
        metrics = (await c.get(f"{url}/metrics")).text
        assert (
            'vllm:request_success_total{model_name="sim",finished_reason="abort"} 1.0'
            in metrics
        )
