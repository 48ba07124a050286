"""Fixtures for the router tests: a trustme CA and server certificate, a test upstream,
and a factory that starts routers on ephemeral ports (TLS by default)."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trustme

from firstbyte.router.config import RouterConfig, parse_config
from firstbyte.router.serve import RouterEndpoints, running_router
from tests.router.upstream import Upstream, running_upstream

API_KEY = "sk-test-key-0001"
OTHER_KEY = "sk-test-key-0002"


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def tls_files(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    certfile, keyfile, cafile = directory / "cert.pem", directory / "key.pem", directory / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    ca.cert_pem.write_to_path(str(cafile))
    return {"certfile": str(certfile), "keyfile": str(keyfile), "cafile": str(cafile)}


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with running_upstream() as up:
        yield up


def router_config(
    upstream_urls: list[str], tls: dict[str, str] | None, **overrides: Any
) -> RouterConfig:
    data: dict[str, Any] = {
        "region": "test-1",
        "upstreams": [{"url": u} for u in upstream_urls],
        "listen": {"port": 0, "host": "127.0.0.1"},
        "auth": {"api_keys": [API_KEY, OTHER_KEY]},
        "streams": {"resume_grace_s": 30.0},
    }
    if tls is not None:
        data["listen"].update(certfile=tls["certfile"], keyfile=tls["keyfile"])
    else:
        data["listen"]["insecure_plain_http"] = True
    for section, values in overrides.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return parse_config(msgspec.to_builtins(data), "<test>")


RouterFactory = Callable[..., contextlib.AbstractAsyncContextManager[RouterEndpoints]]


@pytest.fixture
def start_router(tls_files: dict[str, str]) -> RouterFactory:
    """``async with start_router(upstream_urls, tls=True, **overrides) as endpoints: ...``"""

    @contextlib.asynccontextmanager
    async def start(
        urls: list[str], *, tls: bool = True, **overrides: Any
    ) -> AsyncIterator[RouterEndpoints]:
        config = router_config(urls, tls_files if tls else None, **overrides)
        async with running_router(config) as endpoints:
            yield endpoints

    return start


@pytest.fixture
async def router(start_router: RouterFactory, upstream: Upstream) -> AsyncIterator[RouterEndpoints]:
    async with start_router([upstream.url]) as endpoints:
        yield endpoints


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def cafile_path(tls_files: dict[str, str]) -> Path:
    return Path(tls_files["cafile"])


def client_tls(tls_files: dict[str, str]) -> ssl.SSLContext:
    """A client TLS context trusting the test CA."""
    return ssl.create_default_context(cafile=tls_files["cafile"])
