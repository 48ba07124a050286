"""``--served-model-name``: the sim answers only for the models it serves, as vLLM does."""

from __future__ import annotations

import httpx
import openai
import pytest

from firstbyte.router.sim.server import running_sim, sim_server
from tests.router.sim.helpers import chat_body, metric, stream_chat

# vLLM's body for a model it does not serve (OpenAIServing._check_model, current vLLM).
NOT_FOUND = {
    "error": {
        "message": "The model `other` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
}


async def test_unknown_model_gets_vllms_404_and_costs_nothing() -> None:
    async with sim_server("instant", served_model_names=["a"]) as sim, httpx.AsyncClient() as c:
        for stream in (True, False):
            r = await c.post(
                f"{sim.url}/v1/chat/completions", json=chat_body("hi", model="other", stream=stream)
            )
            assert r.status_code == 404
            assert r.headers["content-type"] == "application/json"
            assert r.json() == NOT_FOUND
        assert sim.engine.prompt_tokens_total == 0  # rejected before the engine saw it
        assert (await stream_chat(c, sim.url, chat_body("hi", model="a", max_tokens=2))).done


async def test_every_served_name_answers_and_responses_carry_the_first() -> None:
    async with (
        sim_server("instant", served_model_names=["big", "big-alias"]) as sim,
        httpx.AsyncClient() as c,
    ):
        for name in ("big", "big-alias"):
            streamed = await stream_chat(c, sim.url, chat_body("hi", model=name, max_tokens=2))
            assert streamed.done
            assert {chunk.model for chunk in streamed.chunks} == {"big"}
            whole = await c.post(
                f"{sim.url}/v1/chat/completions",
                json=chat_body("hi", model=name, stream=False, max_tokens=2),
            )
            assert whole.status_code == 200
            assert whole.json()["model"] == "big"
        metrics = (await c.get(f"{sim.url}/metrics")).text
        assert metric(metrics, 'vllm:generation_tokens_total{model_name="big"}') == 8


async def test_models_lists_every_name_as_vllm_does() -> None:
    async with sim_server("h100-7b", served_model_names=["a", "b"]) as sim, httpx.AsyncClient() as c:
        listed = (await c.get(f"{sim.url}/v1/models")).json()
    assert listed["object"] == "list"
    assert [card["id"] for card in listed["data"]] == ["a", "b"]
    for card in listed["data"]:
        assert card["object"] == "model"
        assert card["owned_by"] == "vllm"
        assert card["root"] == "sim-llama-7b"
        assert card["max_model_len"] == 32768
        assert isinstance(card["created"], int)


async def test_default_is_the_profiles_model_and_max_model_len_is_settable() -> None:
    async with running_sim("instant", max_model_len=4096) as url, httpx.AsyncClient() as c:
        (card,) = (await c.get(f"{url}/v1/models")).json()["data"]
        assert (card["id"], card["max_model_len"]) == ("sim-instant", 4096)
        r = await c.post(f"{url}/v1/chat/completions", json=chat_body("hi", model="m"))
        assert r.status_code == 404


async def test_openai_sdk_sees_not_found_error() -> None:
    async with (
        running_sim("instant", served_model_names=["a"]) as url,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client,
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(
                model="other", messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.status_code == 404
        assert "The model `other` does not exist." in str(caught.value)
        assert [m.id for m in (await client.models.list()).data] == ["a"]
