"""Fixtures for the SDK's tests: a trustme CA, a real TLS protocol server (h1, h2, h3)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

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
