"""The ``model`` label of the request, refusal and TTFT metrics, over real sockets: one series
per model the region serves, and ``model=""`` for whatever is refused before its model is known
or names a model nobody lists, so clients cannot grow the series."""

from __future__ import annotations

import re

import httpx

from tests.router.conftest import RouterFactory, auth
from tests.router.upstream import running_upstream

_MODEL_LABEL = re.compile(r'[{,]model="((?:[^"\\]|\\.)*)"')


def chat(model: str, stream: bool = True) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": stream}


def model_labels(exposition: str, prefix: str) -> set[str]:
    """Every ``model`` label value among the samples of families starting with ``prefix``."""
    return {
        match[1]
        for line in exposition.splitlines()
        if line.startswith(prefix)
        for match in _MODEL_LABEL.finditer(line)
    }


async def test_each_served_model_has_its_series_and_refusals_before_routing_have_none(
    start_router: RouterFactory,
) -> None:
    async with (
        running_upstream(models=("model-a",)) as a,
        running_upstream(models=("model-b",)) as b,
        start_router([a.url, b.url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        for model, times in (("model-a", 2), ("model-b", 1)):
            for _ in range(times):
                r = await client.post(url, json=chat(model), headers=auth())
                assert r.status_code == 200, r.text
        plain = await client.post(url, json=chat("model-b", stream=False), headers=auth())
        assert plain.status_code == 200, plain.text
        # Refused before the model is known: no key, a bad body, a model nobody serves.
        assert (await client.post(url, json=chat("model-a"))).status_code == 401
        bad = await client.post(url, content=b'{"model": "model-a", "messages": 7}',
                                headers={**auth(), "content-type": "application/json"})
        assert bad.status_code == 400, bad.text
        for name in ("gpt-nope-1", "gpt-nope-2"):
            assert (await client.post(url, json=chat(name), headers=auth())).status_code == 404
        text = (await client.get(router.base_url + "/metrics", headers=auth())).text

    requests = "firstbyte_router_requests_total"
    assert f'{requests}{{endpoint="chat",outcome="ok",model="model-a"}} 2' in text
    assert f'{requests}{{endpoint="chat",outcome="ok",model="model-b"}} 2' in text
    assert f'{requests}{{endpoint="chat",outcome="model_not_found",model=""}} 2' in text
    assert re.search(rf'{requests}{{endpoint="chat",outcome="[a-z_]+",model=""}} 1\n', text)
    ttft = "firstbyte_router_ttft_seconds"
    assert f'{ttft}_count{{model="model-a"}} 2' in text
    assert f'{ttft}_count{{model="model-b"}} 1' in text  # the plain one has no first token
    route_ttft = 'firstbyte_route_ttft_seconds_count{region="test-1",transport="sse"'
    assert f'{route_ttft},model="model-a"}} 2' in text
    assert f'{route_ttft},model="model-b"}} 1' in text
    second = router.app.state.pool.backends[1].name
    assert (f'firstbyte_route_requests_total{{region="test-1",backend="{second}",outcome="ok",'
            'model="model-b"} 2') in text
    assert 'firstbyte_route_rejections_total{reason="model_not_found",model=""} 2' in text
    # Only the served models (and "") are label values: the clients' names made no series.
    assert model_labels(text, "firstbyte_route") | model_labels(text, "firstbyte_router") == {
        "", "model-a", "model-b"
    }


async def test_a_model_only_an_unlisted_backend_may_serve_is_not_a_label_value(
    start_router: RouterFactory,
) -> None:
    """A backend whose ``/v1/models`` is unknown takes any model nobody lists: served, but
    counted under ``model=""`` (else every name a client sends would be a new series)."""
    async with (
        running_upstream(models=("model-a",)) as a,
        running_upstream(models=None) as unlisted,
        start_router([a.url, unlisted.url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        for i in range(5):
            r = await client.post(url, json=chat(f"made-up-{i}"), headers=auth())
            assert r.status_code == 200, r.text
        assert len(unlisted.chat_requests) == 5
        assert (await client.post(url, json=chat("model-a"), headers=auth())).status_code == 200
        text = (await client.get(router.base_url + "/metrics", headers=auth())).text
    assert 'firstbyte_router_requests_total{endpoint="chat",outcome="ok",model=""} 5' in text
    assert 'firstbyte_router_ttft_seconds_count{model=""} 5' in text
    assert 'firstbyte_router_ttft_seconds_count{model="model-a"} 1' in text
    assert model_labels(text, "firstbyte_route") == {"", "model-a"}


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} missing"
    return float(match[1])


async def test_the_router_start_time_excludes_the_upstream_own_wait(
    start_router: RouterFactory,
) -> None:
    """``firstbyte_router_start_seconds``: one observation per stream, from its arrival to its
    request written upstream, so an upstream slow to its first token is in TTFT, not in it
    (the figure ``bench router_workers`` compares memory and Redis by)."""
    delay_s = 0.3
    async with (
        running_upstream(delay_s=delay_s) as upstream,
        start_router([upstream.url], tls=False) as router,
        httpx.AsyncClient(timeout=10) as client,
    ):
        url = router.base_url + "/v1/chat/completions"
        for _ in range(3):
            r = await client.post(url, json=chat("sim-llama-7b"), headers=auth())
            assert r.status_code == 200, r.text
        text = (await client.get(router.base_url + "/metrics", headers=auth())).text
    assert "# TYPE firstbyte_router_start_seconds histogram" in text
    assert _sample(text, "firstbyte_router_start_seconds_count") == 3
    start_s = _sample(text, "firstbyte_router_start_seconds_sum")
    ttft_s = sum(float(m) for m in re.findall(
        r'^firstbyte_router_ttft_seconds_sum\{model="[^"]*"\} (\S+)$', text, re.MULTILINE))
    assert start_s > 0
    # Each first token waited delay_s upstream, after the request went out.
    assert start_s <= ttft_s - 3 * delay_s
