"""The SDK at its edges: each mistake a new user makes gets its own typed error and a message
that names it (docs/sdk-errors.md lists them; ``test_error_table`` checks that list)."""

from __future__ import annotations

import ssl
import time
from pathlib import Path
from typing import Any

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import ConfigurationError, ConnectError
from tests.client_sdk.protocol_server import RunningServer, expected_text

MESSAGES = [{"role": "user", "content": "hi"}]


async def first_text(client: AsyncClient, **kw: Any) -> str:
    async with client.stream(model="m", messages=MESSAGES, max_tokens=3, **kw) as stream:
        return "".join([delta.text async for delta in stream])


@pytest.mark.parametrize("option", ["ca_file", "verify"])
def test_a_missing_ca_file_is_a_configuration_error_naming_the_option_and_file(
    tmp_path: Path, option: str
) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ConfigurationError) as info:
        AsyncClient("https://localhost:1/v1", **{option: missing})
    assert str(info.value) == f"{option}: {missing}: no such file"
    assert info.value.option == option
    assert isinstance(info.value, ValueError)


def test_a_ca_file_that_holds_no_certificate_is_a_configuration_error(tmp_path: Path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigurationError, match=r"^ca_file: .*notes\.txt: no PEM certificate"):
        AsyncClient("https://localhost:1/v1", ca_file=str(junk))
    with pytest.raises(ConfigurationError, match="is a directory"):
        AsyncClient("https://localhost:1/v1", ca_file=str(tmp_path))


@pytest.mark.parametrize("http", ["2", "3"])
async def test_verify_given_a_ca_path_trusts_that_ca(server: RunningServer, ca_file: str,
                                                     http: str) -> None:
    # What httpx and requests users type; it used to be truthy, so the system CAs were used.
    async with AsyncClient(server.base_url, "test-key", verify=ca_file, http=http) as client:  # type: ignore[arg-type]
        assert await first_text(client) == expected_text(3)
    async with AsyncClient(server.base_url, "test-key", verify=Path(ca_file)) as client:
        assert await first_text(client) == expected_text(3)


def test_verify_of_another_type_is_refused(ca_file: str) -> None:
    with pytest.raises(TypeError, match="verify must be True, False, a CA file path or an "
                                        r"ssl.SSLContext, not int"):
        AsyncClient("https://localhost:1/v1", verify=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="name two CA files"):
        AsyncClient("https://localhost:1/v1", verify=ca_file, ca_file=ca_file + ".other")
    context = ssl.create_default_context(cafile=ca_file)
    assert AsyncClient("https://localhost:1/v1", verify=context).pool.ssl_context is context


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("longpoll", "1.1"),
                                                 ("websocket", "1.1")])
async def test_plain_http_to_a_tls_port_says_to_use_https(
    server: RunningServer, transport: str, http: str
) -> None:
    url = server.base_url.replace("https://", "http://")
    start = time.perf_counter()
    async with AsyncClient(url, "test-key", transport=transport, http=http) as client:  # type: ignore[arg-type]
        with pytest.raises(ConnectError) as info:
            await first_text(client)
    assert str(info.value) == (f"localhost:{server.port} speaks TLS: use https:// instead of"
                               " http:// in the base URL")
    assert client.pool.ssl_context is not None
    assert not server.app.requests  # the plaintext request never reached the application
    print(f"{transport}: refused in {time.perf_counter() - start:.3f} s")


def test_a_bad_base_url_names_the_option() -> None:
    with pytest.raises(ConfigurationError, match=r"^base_url: must be http\(s\)://"):
        AsyncClient("localhost:8080")
