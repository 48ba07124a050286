"""Request bodies from hypothesis, against the router process: never a 5xx, never a
traceback, and the canary streams on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.conftest import auth

from .conftest import RouterStarter, canary_running

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | _json},
    optional={"content": st.text() | _json, "name": _json},
)
_chat = st.fixed_dictionaries(
    {"model": st.text(max_size=20) | _json, "messages": st.lists(_message, max_size=3) | _json},
    optional={
        "stream": st.booleans() | _json,
        "max_tokens": st.integers(-3, 20) | _json.filter(lambda v: not isinstance(v, int)),
        "temperature": _json,
        "tools": _json,
        "response_format": _json,
    },
)

# Valid requests with a fuzzed field or two: these reach the upstream.
_nearly_valid = st.builds(
    lambda content, extra: {
        "model": "test-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        **extra,
    },
    st.text(max_size=50),
    st.dictionaries(
        st.sampled_from(["stream", "temperature", "top_p", "stop", "seed", "user", "n"]),
        st.booleans() | st.integers(-2, 2) | st.floats(-1, 3) | st.text(max_size=5),
        max_size=3,
    ),
)


def _encode(value: Any) -> bytes:
    return json.dumps(value).encode()


BODIES = st.one_of(
    st.binary(max_size=512),
    _json.map(_encode),
    _chat.map(_encode),
    _nearly_valid.map(_encode),
    st.integers(1, 3000).map(lambda depth: b'{"model":' + b"[" * depth + b"]" * depth + b"}"),
)


async def test_fuzzed_bodies_never_5xx(start_router_process: RouterStarter) -> None:
    statuses: dict[int, int] = {}
    async with start_router_process() as router, canary_running(router):

        @settings(
            max_examples=150,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        )
        @given(body=BODIES)
        def check(body: bytes) -> None:
            with httpx.Client(verify=router.client_tls(), timeout=30) as client:
                response = client.post(
                    router.base_url + "/v1/chat/completions", content=body, headers=auth()
                )
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (body[:200], response.text[:200])

        # hypothesis drives a blocking client from a thread while this loop serves the
        # upstream and the canary.
        await asyncio.to_thread(check)
    print("statuses", statuses)
    router.assert_clean_log()
