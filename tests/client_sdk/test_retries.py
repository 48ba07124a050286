"""A request refused before its stream started (429, 503) is sent again after the server's
``Retry-After``, within the retry budget set on the client (``retries``, ``retry_budget_s``);
past the budget the refusal is raised, at once when the wait could not end in a retry. A
``503 draining`` is first sent again at once on a new connection (one of the retries). A
refusing region is set aside for the refusal's ``Retry-After``. Over real TLS against the
protocol server, whose ``busy-N`` / ``draining-N`` models refuse the first N requests with
``Retry-After: 1``."""

from __future__ import annotations

import time

import pytest

from firstbyte.client_sdk._core.retry import RetryBudget
from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import (
    ConfigurationError,
    RateLimitError,
    ServiceUnavailableError,
)
from firstbyte.client_sdk.sync import Client
from firstbyte.router.sim.profiles import get_profile
from tests.client_sdk.conftest import API_KEY, ROUTER_KEY, start_stack
from tests.client_sdk.protocol_server import (
    RunningServer,
    expected_text,
    running_protocol_server,
)
from tests.client_sdk.test_endpoints import saturated_region

MESSAGES = [{"role": "user", "content": "hi"}]


def posts(server: RunningServer) -> int:
    return sum(1 for method, path in server.app.requests
               if (method, path) == ("POST", "/v1/chat/completions"))


@pytest.mark.parametrize("http", ["1.1", "2"])
@pytest.mark.parametrize(("model", "waits"), [("busy-2", 2), ("draining-2", 1)])
async def test_a_refusal_before_the_stream_is_retried_after_retry_after(
    server: RunningServer, ca_file: str, http: str, model: str, waits: int
) -> None:
    """Two refusals, then the stream: the caller sees only the whole answer, sent after a
    wait of the server's Retry-After (1 s each: a lower bound on the time taken) for each
    refusal, but the first ``draining``'s: that one is sent again at once on a new connection
    (a region's other router process would take it; this server is one process)."""
    started = time.monotonic()
    async with (
        AsyncClient(server.base_url, API_KEY, ca_file=ca_file, http=http) as client,  # type: ignore[arg-type]
        client.stream(model=model, messages=MESSAGES, max_tokens=6) as stream,
    ):
        text = "".join([delta.text async for delta in stream])
    took_s = time.monotonic() - started
    assert text == expected_text(6)
    assert posts(server) == 3
    assert took_s >= waits * 1.0  # Retry-After honoured: never sooner


async def test_past_the_retry_count_the_refusal_is_raised(
    server: RunningServer, ca_file: str
) -> None:
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file, retries=1) as client:
        with pytest.raises(RateLimitError) as info:
            async with client.stream(model="busy-5", messages=MESSAGES):
                pass
    assert info.value.retry_after == 1.0
    assert posts(server) == 2  # the request and one retry


async def test_a_retry_after_beyond_the_budget_raises_at_once(
    server: RunningServer, ca_file: str
) -> None:
    """``retry_budget_s`` 0.5 and ``Retry-After: 1``: no wait that could not end in a retry
    (the first ``draining`` is sent again at once, on a new connection: no wait)."""
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file,
                           retry_budget_s=0.5) as client:
        with pytest.raises(ServiceUnavailableError) as info:
            async with client.stream(model="draining-2", messages=MESSAGES):
                pass
    assert info.value.code == "draining"
    assert posts(server) == 2


async def test_retries_zero_turns_retrying_off(server: RunningServer, ca_file: str) -> None:
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file, retries=0) as client:
        with pytest.raises(RateLimitError):
            async with client.stream(model="busy-1", messages=MESSAGES):
                pass
    assert posts(server) == 1


def test_the_sync_client_takes_the_same_options(server: RunningServer, ca_file: str) -> None:
    with (
        Client(server.base_url, API_KEY, ca_file=ca_file, retries=1) as client,
        client.stream(model="busy-1", messages=MESSAGES, max_tokens=4) as stream,
    ):
        text = "".join(delta.text for delta in stream)
    assert text == expected_text(4)
    assert posts(server) == 2


def test_bad_retry_options_are_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match="retries: must be 0 or more"):
        AsyncClient("https://localhost:1/v1", retries=-1)
    with pytest.raises(ConfigurationError, match="retry_budget_s: must be 0 or more"):
        AsyncClient("https://localhost:1/v1", retry_budget_s=-1.0)


def test_the_budget_honours_retry_after_backs_off_and_stops() -> None:
    budget = RetryBudget(retries=3, budget_s=5.0)
    assert budget.delay(None) == 1.0  # no Retry-After: a doubling backoff
    assert budget.delay(None) == 2.0
    assert budget.delay(2.5) is None  # 5.5 s of waiting is past the budget: not spent
    assert budget.delay(1.5) == 1.5
    assert budget.delay(0.0) is None  # three retries used



async def test_a_503_sets_its_region_aside_for_its_retry_after(
    server: RunningServer, ca_file: str
) -> None:
    """A region refusing ``503`` with ``Retry-After: 30`` (its routers' shared state away) is
    set aside for those 30 s, as for a ``429``: not for the growing backoff's 1 s, after which
    requests would go back there to be refused again."""
    async with (
        saturated_region(retry_after=30, status=503, code="state_unavailable") as (
            refusing, lines),
        AsyncClient([refusing, server.base_url], API_KEY, ca_file=ca_file, http="1.1",
                    reprobe_interval_s=None) as client,
    ):
        async with client.stream(model="m", messages=MESSAGES, max_tokens=3) as stream:
            text = "".join([delta.text async for delta in stream])
        assert client.regions.aside_s(refusing, time.monotonic()) > 25
    assert text == expected_text(3)
    assert lines == [b"POST /v1/chat/completions HTTP/1.1"]


async def test_a_503_to_a_create_sets_its_region_aside_for_its_retry_after() -> None:
    async with (
        saturated_region(retry_after=30, status=503, code="state_unavailable") as (
            unavailable, first_lines),
        saturated_region(retry_after=20, status=503, code="draining") as (
            draining, second_lines),
        AsyncClient([unavailable, draining], API_KEY, http="1.1", retries=0,
                    reprobe_interval_s=None) as client,
    ):
        with pytest.raises(ServiceUnavailableError):
            await client.messages.create(model="m", max_tokens=2, messages=MESSAGES)
        now = time.monotonic()
        assert client.regions.aside_s(unavailable, now) > 25
        assert client.regions.aside_s(draining, now) > 15
    assert first_lines == second_lines == [b"POST /v1/messages HTTP/1.1"]


async def test_a_probe_answered_503_sets_the_region_aside_for_its_retry_after(
    tls_files: tuple[str, str, str]
) -> None:
    _, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file) as a, \
            running_protocol_server(cert_file, key_file) as b:
        async with AsyncClient({"a": a.base_url, "b": b.base_url}, "k", ca_file=tls_files[0],
                               reprobe_interval_s=None) as client:
            a.app.health = (503, "30")
            rtts = await client.probe_regions()
            now = time.monotonic()
            assert rtts["a"] is not None  # it answered: refused, not unreachable
            assert client.regions.aside_s("a", now) > 25
            assert client.regions.available("b", now)


STARTS = {("POST", "/v1/chat/completions"), ("POST", "/v1/streams"), ("WS", "/v1/ws")}
"""A stream's first request on each transport (a WebSocket's: its socket's upgrade)."""


def start_connections(server: RunningServer) -> list[tuple[str, int] | None]:
    """The connection (client address and port) each stream start came on, in order."""
    return [peer for request, peer in zip(server.app.requests, server.app.peers, strict=True)
            if request in STARTS]


@pytest.mark.parametrize(("transport", "http"), [
    ("sse", "1.1"), ("sse", "2"), ("sse", "3"), ("longpoll", "1.1"), ("longpoll", "3"),
    ("websocket", "1.1"),
])
async def test_a_draining_refusal_is_sent_again_at_once_on_a_new_connection(
    server: RunningServer, ca_file: str, transport: str, http: str
) -> None:
    """A ``503 draining`` on a kept-alive connection is about the router process behind it:
    the request goes again at once (not after ``Retry-After: 1``) on a new connection, which
    a balancer may give another process of the region; the caller sees the whole answer."""
    async with AsyncClient(
        server.base_url, API_KEY, ca_file=ca_file, transport=transport,  # type: ignore[arg-type]
        http=http,  # type: ignore[arg-type]
    ) as client:
        await client.prewarm()  # the kept-alive connection the refusal comes on
        started = time.monotonic()
        async with client.stream(model="draining-1", messages=MESSAGES, max_tokens=6) as stream:
            text = "".join([delta.text async for delta in stream])
        took_s = time.monotonic() - started
    assert text == expected_text(6)
    assert server.app.refused == {"draining-1": 1}
    refused_on, served_on = start_connections(server)
    assert refused_on != served_on
    assert took_s < 1.0  # the Retry-After (1 s) was not waited for


async def test_the_new_connection_after_draining_is_one_of_the_retries(
    server: RunningServer, ca_file: str
) -> None:
    """``retries=1``: the draining refusal's new connection is the one retry, so the second
    refusal is raised, at once; ``retries=0``: the first is, and nothing is sent again."""
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file, retries=1) as client:
        await client.prewarm()
        started = time.monotonic()
        with pytest.raises(ServiceUnavailableError) as info:
            async with client.stream(model="draining-2", messages=MESSAGES):
                pass
        took_s = time.monotonic() - started
    assert info.value.code == "draining"
    assert server.app.refused == {"draining-2": 2}
    first, second = start_connections(server)
    assert first != second
    assert took_s < 1.0
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file, retries=0) as client:
        with pytest.raises(ServiceUnavailableError):
            async with client.stream(model="draining-1", messages=MESSAGES):
                pass
    assert server.app.refused == {"draining-2": 2, "draining-1": 1}
    assert len(start_connections(server)) == 3


async def test_a_websocket_refusal_waits_the_routers_retry_after(
    server: RunningServer, ca_file: str
) -> None:
    """A WebSocket ``error`` message's ``retry_after`` (30 s here) is used as an SSE answer's
    ``Retry-After`` is: the region is set aside for it, and a wait past ``retry_budget_s``
    (5 s) raises the refusal at once with the figure, where the default backoff (1 s) would
    have sent the request again and been served."""
    server.app.refusal_retry_after = 30
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file,
                           transport="websocket", reprobe_interval_s=None) as client:
        with pytest.raises(RateLimitError) as info:
            async with client.stream(model="busy-1", messages=MESSAGES):
                pass
        assert client.regions.aside_s(client.regions.regions[0].name, time.monotonic()) > 25
    assert info.value.retry_after == 30.0
    assert info.value.status == 429
    assert server.app.refused == {"busy-1": 1}  # never sent again


async def test_an_older_routers_websocket_refusal_backs_off_from_the_default(
    server: RunningServer, ca_file: str
) -> None:
    """No ``retry_after`` in the message (a router from before it): the default backoff, 1 s
    and within the budget, so the request is sent again and served."""
    server.app.refusal_retry_after = 30  # over HTTP only: the socket does not say it
    server.app.ws_retry_after = False
    async with (
        AsyncClient(server.base_url, API_KEY, ca_file=ca_file, transport="websocket",
                    reprobe_interval_s=None) as client,
        client.stream(model="busy-1", messages=MESSAGES, max_tokens=4) as stream,
    ):
        text = "".join([delta.text async for delta in stream])
    assert text == expected_text(4)
    assert server.app.refused == {"busy-1": 1}


async def test_the_routers_rate_limit_over_websocket_is_waited_for_not_backed_off(
    tls_files: tuple[str, str, str]
) -> None:
    """The real router, its key's bucket holding one request a 100 s: the second stream's
    refusal over WebSocket says ~100 s, as SSE's ``Retry-After`` would, so it is raised at
    once with that figure (past the 5 s budget) and the region set aside for it, instead of
    two retries after the 1 s and 2 s backoff."""
    limits = {"requests_per_s_per_key": 0.01, "request_burst_per_key": 1}
    async with (
        start_stack(tls_files, limits=limits) as stack,
        AsyncClient(stack.base_url, ROUTER_KEY, ca_file=stack.ca_file, transport="websocket",
                    reprobe_interval_s=None) as client,
    ):
        model = get_profile("instant").model
        async with client.stream(model=model, messages=MESSAGES, max_tokens=2) as stream:
            assert [delta async for delta in stream]
        with pytest.raises(RateLimitError) as info:
            async with client.stream(model=model, messages=MESSAGES, max_tokens=2):
                pass
        aside_s = client.regions.aside_s(client.regions.regions[0].name, time.monotonic())
    assert info.value.code == "key_rate_limited"
    assert info.value.retry_after is not None
    assert info.value.retry_after > 90
    assert aside_s > 80


async def test_a_refused_websocket_upgrade_waits_its_retry_after() -> None:
    """The upgrade itself answered ``503`` with ``Retry-After: 30`` (a front, or the router's
    hosting layer refusing a connection over its cap, answers the upgrade's request as any
    other): the error has the figure, the region is set aside for it and, past the budget, it
    is raised at once instead of the upgrade being sent again after the 1 s backoff."""
    async with (
        saturated_region(retry_after=30, status=503, code="overloaded") as (refusing, lines),
        AsyncClient(refusing, API_KEY, transport="websocket",
                    reprobe_interval_s=None) as client,
    ):
        with pytest.raises(ServiceUnavailableError) as info:
            async with client.stream(model="m", messages=MESSAGES):
                pass
        assert client.regions.aside_s(client.regions.regions[0].name, time.monotonic()) > 25
    assert (info.value.status, info.value.code, info.value.retry_after) == (
        503, "overloaded", 30.0)
    assert lines == [b"GET /v1/ws HTTP/1.1"]
