"""Model-aware routing over real sockets: a request goes only to a backend serving its model
(configured, or listed by its ``/v1/models``), an unknown model is ``404 model_not_found``
without touching an upstream, ``/v1/models`` lists the region's models, the edge status says
which models it serves with what room, and a region without a model forwards it to the
region that has it."""

from __future__ import annotations

import asyncio

import httpx

from firstbyte.benchmarks.cluster import RegionSpec, running_regions, wait_for_peers
from tests.router.conftest import RouterFactory, auth
from tests.router.upstream import running_upstream


def chat(model: str, text: str = "hi", stream: bool = False) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3,
            "stream": stream}


async def test_requests_go_only_to_backends_listing_their_model(
    start_router: RouterFactory,
) -> None:
    async with (
        running_upstream(models=("model-a",)) as a,
        running_upstream(models=("model-b", "model-b-lora")) as b,
        start_router([a.url, b.url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        for i in range(8):
            for model in ("model-a", "model-b", "model-b-lora"):
                r = await client.post(url, json=chat(model, f"q{i}"), headers=auth())
                assert r.status_code == 200, r.text
        assert len(a.chat_requests) == 8  # every model-a request, and nothing else
        assert len(b.chat_requests) == 16
        # Streamed too.
        r = await client.post(url, json=chat("model-b", "s", stream=True), headers=auth())
        assert r.status_code == 200, r.text
        assert r.text.endswith("data: [DONE]\n\n")
        assert len(b.chat_requests) == 17
        assert len(a.chat_requests) == 8

        # A model nobody serves: 404 model_not_found in OpenAI's shape, upstreams untouched.
        for stream in (False, True):
            r = await client.post(url, json=chat("gpt-nope", stream=stream), headers=auth())
            assert r.status_code == 404, r.text
            assert r.json() == {"error": {
                "message": "The model 'gpt-nope' does not exist in region test-1 or its peers;"
                " GET /v1/models lists the models served.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found",
            }}
        assert len(a.chat_requests) + len(b.chat_requests) == 25

        # /v1/models: the region's models, from the router (not one upstream's list).
        listed = await client.get(router.base_url + "/v1/models", headers=auth())
        assert listed.status_code == 200
        assert [m["id"] for m in listed.json()["data"]] == ["model-a", "model-b", "model-b-lora"]
        assert listed.json()["object"] == "list"

        # The edge status says which models it serves, with each one's room.
        status = (await client.get(router.base_url + "/v1/edge/status", headers=auth())).json()
        rooms = {m["name"]: m for m in status["models"]}
        assert sorted(rooms) == ["model-a", "model-b", "model-b-lora"]
        assert rooms["model-a"]["healthy"] is True
        assert rooms["model-a"]["saturated"] is False
        assert rooms["model-a"]["capacity"] == 1024  # one backend of routing's default cap
        metrics = (await client.get(router.base_url + "/metrics", headers=auth())).text
        first, second = (b.name for b in router.app.state.pool.backends)
        assert f'firstbyte_backend_serves{{backend="{second}",model="model-b-lora"}} 1' in metrics
        assert f'firstbyte_backend_serves{{backend="{first}",model="model-b"}}' not in metrics


async def test_configured_models_win_over_the_backends_list(start_router: RouterFactory) -> None:
    async with (
        running_upstream(models=("model-a", "model-b")) as a,
        running_upstream(models=("model-a", "model-b")) as b,
        start_router([a.url, b.url], tls=False, upstreams=[
            {"url": a.url, "models": ["model-a"]}, {"url": b.url, "models": ["model-b"]},
        ]) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        for i in range(6):
            assert (await client.post(url, json=chat("model-b", f"q{i}"), headers=auth())).status_code == 200
        assert (len(a.chat_requests), len(b.chat_requests)) == (0, 6)


async def test_a_backend_whose_list_is_unknown_takes_only_models_nobody_lists(
    start_router: RouterFactory,
) -> None:
    """Its /v1/models answers 404: it gets no request for a model another backend lists, only
    one nobody is known to serve (which it may serve)."""
    async with (
        running_upstream(models=("model-a",)) as a,
        running_upstream(models=None) as unlisted,
        start_router([a.url, unlisted.url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        for i in range(6):
            r = await client.post(url, json=chat("model-a", f"q{i}"), headers=auth())
            assert r.status_code == 200, r.text
        assert (len(a.chat_requests), len(unlisted.chat_requests)) == (6, 0)
        r = await client.post(url, json=chat("model-z"), headers=auth())
        assert r.status_code == 200, r.text
        assert (len(a.chat_requests), len(unlisted.chat_requests)) == (6, 1)
        listed = await client.get(router.base_url + "/v1/models", headers=auth())
        assert [m["id"] for m in listed.json()["data"]] == ["model-a"]


async def test_a_region_without_the_model_forwards_to_the_region_that_has_it() -> None:
    # Each sim serves only its names (another gets vLLM's 404: a misroute is an error); the
    # routers learn them from the sims' /v1/models.
    specs = [
        RegionSpec("tokyo", 35.68, 139.69, backends=1,
                   sim={"served_model_names": ["model-a", "model-b"]}),
        RegionSpec("frankfurt", 50.11, 8.68, backends=1,
                   sim={"served_model_names": ["model-a"]}),
        RegionSpec("virginia", 39.04, -77.49, backends=1,
                   sim={"served_model_names": ["model-a"]}),
    ]
    async with running_regions(specs) as regions, httpx.AsyncClient(timeout=30) as client:
        await wait_for_peers(regions)
        frankfurt = regions["frankfurt"].url
        url = frankfurt + "/v1/chat/completions"
        for i in range(4):
            r = await client.post(url, json=chat("model-b", f"b{i}"))
            assert r.status_code == 200, r.text
            assert r.headers["x-firstbyte-region"] == "tokyo"
            # Not a hint to move the client: its other models are served here.
            assert "x-firstbyte-better-region" not in r.headers
            r = await client.post(url, json=chat("model-a", f"a{i}"))
            assert r.headers["x-firstbyte-region"] == "frankfurt"
        r = await client.post(url, json=chat("model-b", "s", stream=True))
        assert r.status_code == 200
        assert r.headers["x-firstbyte-region"] == "tokyo"
        assert r.text.rstrip().endswith("data: [DONE]")
        # Nobody has it: 404, from the region asked.
        r = await client.post(url, json=chat("model-c"))
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found"
        # Its /v1/models: its own, or with the peers'.
        own = (await client.get(frankfurt + "/v1/models")).json()
        assert [m["id"] for m in own["data"]] == ["model-a"]
        every = (await client.get(frankfurt + "/v1/models?peers=true")).json()
        assert [m["id"] for m in every["data"]] == ["model-a", "model-b"]
        metrics = (await client.get(frankfurt + "/metrics")).text
        assert 'firstbyte_route_forwards_total{to="tokyo"} 5' in metrics
        assert "firstbyte_route_spills_total" not in metrics or 'reason="saturated"} ' not in metrics


async def test_a_model_whose_regions_are_full_is_429_from_a_region_without_it() -> None:
    """Tokyo's one backend serving model-b is busy (1 slot, a slow first token): frankfurt,
    which does not serve model-b, answers 429 region_saturated with Retry-After, saying why,
    and sends nothing anywhere; model-a is still served at frankfurt."""
    specs = [
        RegionSpec("tokyo", 35.68, 139.69, backends=1, upstream={"max_in_flight": 1},
                   sim={"served_model_names": ["model-b"], "faults": ["delay:ms=3000"]}),
        RegionSpec("frankfurt", 50.11, 8.68, backends=1,
                   sim={"served_model_names": ["model-a"]}),
    ]
    async with running_regions(specs) as regions, httpx.AsyncClient(timeout=30) as client:
        await wait_for_peers(regions)
        tokyo, frankfurt = regions["tokyo"], regions["frankfurt"]
        busy = asyncio.ensure_future(
            client.post(tokyo.url + "/v1/chat/completions", json=chat("model-b", "slow"))
        )
        routing = frankfurt.state.routing

        def b_full_at_tokyo() -> bool:
            status = routing.peer_table.fresh(routing.clock()).get("tokyo")
            return status is not None and any(
                m.name == "model-b" and m.saturated for m in status.models or ()
            )

        async with asyncio.timeout(10):
            while not b_full_at_tokyo():  # noqa: ASYNC110 - the peer poller fills the table
                await asyncio.sleep(0.05)
        before = tokyo.state.routing.tracker.in_flight()
        r = await client.post(frankfurt.url + "/v1/chat/completions", json=chat("model-b"))
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["code"] == "region_saturated"
        assert error["message"].startswith(
            "Region frankfurt does not serve this request's model and the regions serving"
        )
        assert int(r.headers["retry-after"]) >= 1
        assert tokyo.state.routing.tracker.in_flight() == before  # nothing forwarded
        r = await client.post(frankfurt.url + "/v1/chat/completions", json=chat("model-a"))
        assert r.status_code == 200, r.text
        assert r.headers["x-firstbyte-region"] == "frankfurt"
        assert (await busy).status_code == 200
