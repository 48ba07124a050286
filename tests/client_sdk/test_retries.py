"""A request refused before its stream started (429, 503) is sent again after the server's
``Retry-After``, within the retry budget set on the client (``retries``, ``retry_budget_s``);
past the budget the refusal is raised, at once when the wait could not end in a retry. Over
real TLS against the protocol server, whose ``busy-N`` / ``draining-N`` models refuse the
first N requests with ``Retry-After: 1``."""

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
from tests.client_sdk.conftest import API_KEY
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
@pytest.mark.parametrize(("model", "refusal"), [("busy-2", 429), ("draining-2", 503)])
async def test_a_refusal_before_the_stream_is_retried_after_retry_after(
    server: RunningServer, ca_file: str, http: str, model: str, refusal: int
) -> None:
    """Two refusals, then the stream: the caller sees only the whole answer, sent after two
    waits of the server's Retry-After (1 s each: a lower bound on the time taken)."""
    started = time.monotonic()
    async with (
        AsyncClient(server.base_url, API_KEY, ca_file=ca_file, http=http) as client,  # type: ignore[arg-type]
        client.stream(model=model, messages=MESSAGES, max_tokens=6) as stream,
    ):
        text = "".join([delta.text async for delta in stream])
    took_s = time.monotonic() - started
    assert text == expected_text(6)
    assert posts(server) == 3
    assert took_s >= 2.0  # Retry-After honoured: never sooner


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
    """``retry_budget_s`` 0.5 and ``Retry-After: 1``: no wait that could not end in a retry."""
    async with AsyncClient(server.base_url, API_KEY, ca_file=ca_file,
                           retry_budget_s=0.5) as client:
        with pytest.raises(ServiceUnavailableError) as info:
            async with client.stream(model="draining-1", messages=MESSAGES):
                pass
    assert info.value.code == "draining"
    assert posts(server) == 1


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
