"""Fixtures for the SDK's tests: a trustme CA, a real TLS protocol server (h1, h2, h3)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

from firstbyte.router.app import RouterApp
from firstbyte.router.config import parse_config
from firstbyte.router.serve import running_router
from firstbyte.router.sim.profiles import get_profile
from firstbyte.router.sim.server import running_sim
from tests.client_sdk.protocol_server import RunningServer, running_protocol_server

API_KEY = "test-key"


@pytest.fixture(scope="session")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def tls_files(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    """(ca_file, cert_file, key_file) for ``localhost`` / ``127.0.0.1``."""
    directory = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("localhost", "127.0.0.1", "::1")
    ca_file = str(directory / "ca.pem")
    cert_file = str(directory / "cert.pem")
    key_file = str(directory / "key.pem")
    ca.cert_pem.write_to_path(ca_file)
    cert.cert_chain_pems[0].write_to_path(cert_file)
    for extra in cert.cert_chain_pems[1:]:
        with Path(cert_file).open("ab") as f:
            f.write(extra.bytes())
    cert.private_key_pem.write_to_path(key_file)
    return ca_file, cert_file, key_file


@pytest.fixture
def server(tls_files: tuple[str, str, str]) -> Iterator[RunningServer]:
    _, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file, api_key=API_KEY) as running:
        yield running


@pytest.fixture
def ca_file(tls_files: tuple[str, str, str]) -> str:
    return tls_files[0]


# -- the real stack: simulated inference server behind the real router, over TLS -----------------

ROUTER_KEY = "sk-sdk-test-0001"
OTHER_KEY = "sk-sdk-test-0002"


@dataclass(frozen=True)
class Stack:
    base_url: str
    """``https://localhost:PORT/v1`` (the name, so SNI and certificate checks are real)."""
    port: int
    sim_url: str
    ca_file: str
    app: RouterApp | None = None
    """The router's app (its counts of requests and streams), in-process."""

    def url_via(self, port: int) -> str:
        return f"https://localhost:{port}/v1"


@contextlib.asynccontextmanager
async def start_stack(
    tls_files: tuple[str, str, str],
    *,
    faults: Sequence[str] = (),
    profile: str = "instant",
    heartbeat_s: float = 15.0,
    keep_alive_timeout_s: float = 75.0,
    header_timeout_s: float = 60.0,
    models: Sequence[str] = (),
    limits: Mapping[str, Any] | None = None,
) -> AsyncIterator[Stack]:
    """Start ``firstbyte sim`` and the router in front of it in the running loop; the sim
    serves its profile's model, ``busy`` and ``models``; ``limits`` adds to the router's
    ``[limits]``."""
    ca_file, cert_file, key_file = tls_files
    # "busy": what a client failing over from a saturated protocol server asks for.
    served = [get_profile(profile).model, "busy", *models]
    async with running_sim(
        profile, faults=list(faults), seed=7, served_model_names=served
    ) as sim_url:
        config = parse_config({
            "region": "sdk-test",
            "upstreams": [{"url": sim_url}],
            "listen": {"host": "127.0.0.1", "port": 0, "certfile": cert_file,
                       "keyfile": key_file, "keep_alive_timeout_s": keep_alive_timeout_s},
            "auth": {"api_keys": [ROUTER_KEY, OTHER_KEY]},
            "limits": {"heartbeat_interval_s": heartbeat_s,
                       "client_header_timeout_s": header_timeout_s, **(limits or {})},
        }, "<sdk-test>")
        async with running_router(config) as endpoints:
            yield Stack(f"https://localhost:{endpoints.port}/v1", endpoints.port, sim_url,
                        ca_file, endpoints.app)


@pytest.fixture
async def stack(tls_files: tuple[str, str, str]) -> AsyncIterator[Stack]:
    async with start_stack(tls_files) as running:
        yield running
