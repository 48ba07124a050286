"""Attacks again, on a router process that runs without the library patch that defends
against each (``router/hosting/patches.py``, ``patches.applied_except``): the attack gets
through, which is the library's bug as docs/libraries.md reports it. The same tests with every
patch pass in their own modules, so each of these patches is what its test measures. When a
library fixes the bug, its case here fails: the patch can go.

Not here: patches whose attack gets through only sometimes without them (the HTTP/2 answers
before a body's end, where another patch or the client's timing often hides the bug)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from tests.router.attacks import test_heads as heads
from tests.router.attacks import test_http1 as http1
from tests.router.attacks import test_http2 as http2
from tests.router.attacks import test_http3 as http3
from tests.router.attacks import test_websocket as websocket
from tests.router.attacks.conftest import RouterProcess, RouterStarter
from tests.router.upstream import Upstream

Attack = Callable[..., Awaitable[None]]

CASES: list[tuple[str, str, Attack, dict[str, Any]]] = [
    ("h11-ambiguous-framing", "hypercorn",
     http1.test_content_length_with_transfer_encoding_is_refused_and_closed, {}),
    ("h11-head-timeout", "hypercorn", http1.test_slowloris_head_is_cut_at_the_header_timeout, {}),
    ("h2-header-block-timeout", "auto",
     http2.test_an_unfinished_header_block_is_cut_at_the_header_timeout,
     {"drip": http2.unfinished_block, "beside_a_stream": False}),
    ("h11-head-bounds", "hypercorn", heads.test_http1_head_over_a_bound_is_refused_and_closed,
     dict(zip(("head", "status", "code"), heads.HEADS[0].values, strict=True))),
    ("h3-late-data", "auto", http3.test_early_answer_leaves_http3_serving, {}),
    ("websocket-frame-bounds", "hypercorn", websocket.test_oversized_frame_closed_at_its_header,
     {}),
    ("h2-h3-decoded-head-bounds", "auto", heads.test_http2_head_over_a_bound_is_refused_on_its_stream,
     {"path": "/v1/models", "extra": [(f"x-{i}", "v") for i in range(101)], "status": 431,
      "code": "too_many_headers"}),
    ("quic-connection-guard", "auto", http3.test_connection_that_only_pings_is_closed, {}),
    ("count-at-accept", "hypercorn",
     http1.test_sockets_silent_before_tls_count_and_put_their_address_under_the_cap, {}),
    ("h2-goaway-at-idle-close", "auto",
     http2.test_an_idle_connection_gets_goaway_with_its_last_stream_before_the_close,
     {"requests": 1}),
    ("h2-stream-send-timeout", "auto",
     http2.test_a_stream_whose_window_stays_shut_is_reset_and_its_slot_freed,
     {"zero_window": False}),
]


WAIT_FOR_A_CLOSE_S = 8.0
"""How long an attack waits here for the close its patch makes (at a 2 s timeout, or at
once): four times the timeout. With the patch the attack's own module waits up to 20-30 s, for a
loaded machine; without it the close never comes and the attack waits the whole bound, so a
shorter one here keeps these cases from spending ~50 s of the suite on waiting."""


@pytest.fixture
def start_router_process(start_router_process: RouterStarter) -> RouterStarter:
    """The harness's starter, whose router is killed at the block's end: an attack that got
    through may leave a stream the router cannot end (a shut window that nothing times out),
    and a SIGTERM then waits for it through the drain (30 s) and hypercorn's graceful
    timeout, past the harness's 10 s wait for a stop. Its stop is no part of what is shown."""

    @contextlib.asynccontextmanager
    async def start(*args: Any, **sections: dict[str, Any]) -> AsyncIterator[RouterProcess]:
        async with start_router_process(*args, **sections) as router:
            try:
                yield router
            finally:
                router.proc.kill()

    return start


@pytest.mark.parametrize(
    ("without_patches", "router_server", "attack", "arguments"),
    [((name,), server, attack, arguments) for name, server, attack, arguments in CASES],
    ids=[name for name, *_ in CASES],
)
async def test_without_its_patch_the_attack_gets_through(
    start_router_process: RouterStarter,
    without_patches: tuple[str, ...],
    router_server: str,
    attack: Attack,
    arguments: dict[str, Any],
    upstream: Upstream,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(http1, "CLOSED_WITHIN_S", WAIT_FOR_A_CLOSE_S)
    monkeypatch.setattr(http3, "CLOSED_WITHIN_S", WAIT_FOR_A_CLOSE_S)
    monkeypatch.setattr(http2, "CLOSED_WITHIN_S", WAIT_FOR_A_CLOSE_S)
    if "upstream" in inspect.signature(attack).parameters:
        arguments = {**arguments, "upstream": upstream}
    with pytest.raises((AssertionError, TimeoutError, OSError, httpx.HTTPError)) as failed:
        await attack(start_router_process, **arguments)
    assert "router exited" not in str(failed.value)  # it ran, and the attack got through
