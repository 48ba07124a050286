"""The region's state behind one interface (router/regionstate.py): chosen once at start, and
no control flow elsewhere through whether the state is shared."""

from __future__ import annotations

import ast
from pathlib import Path

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.router.config import RouterConfig, parse_config
from firstbyte.router.regionstate import InMemory, InRedis
from firstbyte.router.state import RouterState
from tests.router.redis_fixture import redis_server  # noqa: F401

ROUTER = Path(__file__).resolve().parents[2] / "router"


def _config(redis_url: str | None) -> RouterConfig:
    state = {} if redis_url is None else {"redis_url": redis_url, "key_prefix": "iface:"}
    return parse_config(
        {
            "upstreams": [{"url": "http://127.0.0.1:9/v1"}],
            "auth": {"allow_anonymous": True},
            "listen": {"insecure_plain_http": True},
            "state": state,
        },
        "test",
    )


async def test_in_memory_the_region_is_this_process() -> None:
    state = RouterState(_config(None))
    try:
        assert isinstance(state.region_state, InMemory)
        assert state.routing.claim is None  # the tracker's count is all
        stream = state.new_stream(b"owner")
        assert state.announced(stream) is None  # nothing to wait for: nobody else reads it
        assert await state.find_stream(stream.id, b"owner") is stream
        assert await state.find_stream("unknown", b"owner") is None
        assert not state.region_state.readable_elsewhere
        assert not state.region_state.unreachable  # /healthz never says state_unavailable
    finally:
        await state.aclose()


async def test_with_redis_url_the_state_is_shared_through_redis(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Two processes' states on one Redis: a stream made by one is found by the other."""
    one, other = RouterState(_config(redis_server.url)), RouterState(_config(redis_server.url))
    try:
        assert isinstance(one.region_state, InRedis)
        assert one.shared is not None
        assert one.region_state.shared is one.shared
        assert one.routing.claim == one.shared.admission.claim_backend
        assert one.region_state.readable_elsewhere
        for state in (one, other):
            state.ensure_started()
            await state.region_state.started()
        assert not one.region_state.unreachable
        stream = one.new_stream(b"owner")
        announcing = one.announced(stream)
        assert announcing is not None
        await announcing
        found = await other.find_stream(stream.id, b"owner")
        assert found is not None
        assert found is not stream  # read through Redis, not this process's store
        assert found.id == stream.id
        assert await other.find_stream(stream.id, b"someone else") is None
    finally:
        await one.aclose()
        await other.aclose()


def test_nothing_but_the_region_state_reads_the_shared_parts() -> None:
    """``RouterState.shared`` is read once, in ``RouterState.__init__``, to choose the
    implementation; placement, drain and housekeeping go through ``region_state``."""
    reads: list[str] = []
    for path in sorted(ROUTER.glob("*.py")):
        if path.name == "regionstate.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                allowed.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "shared" and id(node) not in allowed:
                reads.append(f"{path.name}:{node.lineno}")
    assert reads == []
