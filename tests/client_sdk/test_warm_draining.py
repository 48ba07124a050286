"""The SDK's warm-ups against a draining router (``503 draining``, ``Retry-After: 1``, as its
new streams get): a prompt warm-up is sent once more at once on a new connection (another
process of the region may take it), then the region is set aside, as a stream's refusals set
it, and the warm-up goes to the next region, where the next message now goes; a connection
prewarm's ``/healthz`` refusal is reported as a keep-warm ping's is. Nothing raises for it.
Real routers and sims in this process (two regions), over HTTP/1.1 and HTTP/2."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.resolver import Origin
from firstbyte.client_sdk.transports.base import Refusal
from firstbyte.router.config import parse_config
from firstbyte.router.serve import RouterEndpoints, running_router
from firstbyte.router.sim.server import running_sim
from tests.client_sdk.conftest import ROUTER_KEY
from tests.client_sdk.test_client import MESSAGES


@contextlib.asynccontextmanager
async def _region(tls_files: tuple[str, str, str], name: str) -> AsyncIterator[RouterEndpoints]:
    """A sim and a router of region ``name`` in front of it."""
    _, cert_file, key_file = tls_files
    async with running_sim("instant", seed=7) as sim_url:
        config = parse_config({
            "region": name,
            "upstreams": [{"url": sim_url}],
            "listen": {"host": "127.0.0.1", "port": 0, "certfile": cert_file,
                       "keyfile": key_file},
            "auth": {"api_keys": [ROUTER_KEY]},
            "limits": {"prompt_warm_max_load": 1.0},
        }, "<sdk-test>")  # fmt: skip
        async with running_router(config) as endpoints:
            yield endpoints


def _url(router: RouterEndpoints) -> str:
    return f"https://localhost:{router.port}/v1"


def _count(router: RouterEndpoints, endpoint: str, outcome: str) -> int:
    """Requests of ``endpoint`` the router answered with ``outcome``, whatever the model."""
    requests = router.app.state.metrics.requests
    return sum(n for (e, o, _), n in requests.items() if (e, o) == (endpoint, outcome))


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_prompt_warm_up_refused_draining_goes_to_the_next_region(
    tls_files: tuple[str, str, str], http: str
) -> None:
    async with _region(tls_files, "first") as first, _region(tls_files, "second") as second, \
            AsyncClient({"first": _url(first), "second": _url(second)}, ROUTER_KEY,
                        ca_file=tls_files[0], http=http) as client:  # type: ignore[arg-type]
        first.app.state.start_draining()
        warmed = await client.warm_prompt(model="sim-instant", messages=MESSAGES)
        # Refused twice (the connection that heard it, then a new one), then set aside for
        # the refusal's Retry-After: 1.
        assert _count(first, "warm", "draining") == 2
        assert not client.regions.available("first", time.monotonic())
        assert client.regions.aside_s("first", time.monotonic()) <= 1.0
        assert warmed is not None
        assert warmed.prompt_tokens  # from the second region's backend
        assert _count(second, "warm", "prompt_ok") == 1
        async with client.stream(model="sim-instant", messages=MESSAGES,
                                 max_tokens=3) as stream:
            assert len("".join([d.text async for d in stream]).split()) == 3
        assert stream.timings.region == "second"  # no refused attempt on the first first
        assert _count(first, "chat", "draining") == 0


async def test_a_prompt_warm_up_of_the_only_region_draining_answers_none(
    tls_files: tuple[str, str, str]
) -> None:
    """Best effort, as for a busy region: the message then goes as usual (and gets the
    refusal, and its retries, itself)."""
    async with _region(tls_files, "only") as only, \
            AsyncClient(_url(only), ROUTER_KEY, ca_file=tls_files[0]) as client:
        only.app.state.start_draining()
        assert await client.warm_prompt(model="sim-instant", messages=MESSAGES) is None
        assert _count(only, "warm", "draining") == 2


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_a_connection_prewarm_to_a_draining_router_reports_its_refusal(
    tls_files: tuple[str, str, str], http: str
) -> None:
    """What the client's prewarm of a region (its primary, standby, or a hinted one) reads
    to set that region aside, as a keep-warm ping's refusal does: before, the ``/healthz``
    answers were dropped and the region was taken for warm."""
    async with _region(tls_files, "first") as first, _region(tls_files, "second") as second, \
            AsyncClient({"first": _url(first), "second": _url(second)}, ROUTER_KEY,
                        ca_file=tls_files[0], http=http,  # type: ignore[arg-type]
                        reprobe_interval_s=None) as client:
        heard: list[tuple[Origin, Refusal]] = []
        client.pool.on_refusal = lambda origin, refused: heard.append((origin, refused))
        first.app.state.start_draining()
        origin = client.origins[0]
        refused = await client.pool.prewarm(client.pool.session(origin, http), 1)
        assert refused == Refusal(503, 1.0, draining=True)  # the request refusal's Retry-After
        assert heard == [(origin, refused)]
        assert await client.pool.prewarm(client.pool.session(client.origins[1], http), 1) is None
        assert heard == [(origin, refused)]

