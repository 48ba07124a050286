"""``keylog_file``: a capture of the SDK's own requests decrypts in tshark, over QUIC (HTTP/3)
and over TCP TLS (HTTP/2, with the user's own ``SSLContext``), and not without the keys.

tshark comes from Debian (installed here when missing); under ``CI=true`` a failed install
fails the test instead of skipping it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import subprocess
from pathlib import Path

import pytest

from firstbyte.client_sdk.client import AsyncClient, keylog_path
from tests.apt import apt_lock
from tests.client_sdk.conftest import ROUTER_KEY, Stack

MESSAGES = [{"role": "user", "content": "decrypt me"}]

# Frame types as tshark prints them: DATA 0 and HEADERS 1, in HTTP/3 (RFC 9114 section 7.2)
# as in HTTP/2 (RFC 9113 section 6).
DATA, HEADERS = "0", "1"


def _install_tshark() -> str:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "tshark"]
    with apt_lock():
        result = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:  # no package lists yet: fetch them once and try again
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=600)
            result = subprocess.run(install, env=env, capture_output=True, text=True,
                                    timeout=900)
    return (result.stdout + result.stderr)[-800:]


@pytest.fixture(scope="session")
def tshark() -> str:
    path = shutil.which("tshark")
    if path is None:
        output = _install_tshark()
        path = shutil.which("tshark")
        if path is None:
            message = f"tshark is missing and apt-get could not install it:\n{output}"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
    return path


class Capture:
    """``tshark -i lo`` writing the packets of one port (TCP and UDP) to a file, for the
    block's duration."""

    def __init__(self, tshark: str, port: int, path: Path) -> None:
        self.args = [tshark, "-i", "lo", "-f", f"port {port}", "-w", str(path)]
        self.port = port
        self.path = path
        self.process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Capture:
        self.process = await asyncio.create_subprocess_exec(
            *self.args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        await self._until_capturing()
        return self

    async def _until_capturing(self) -> None:
        """tshark says "Capturing on" before its capture really runs, and a capture missing
        the QUIC Initial cannot be decrypted: send junk datagrams (the server drops them)
        until one shows in the file."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            async with asyncio.timeout(30):
                header: int | None = None
                while True:
                    probe.sendto(b"\0", ("127.0.0.1", self.port))
                    await asyncio.sleep(0.05)
                    size = self.path.stat().st_size if self.path.exists() else None
                    if header is None:
                        header = size
                    elif size is not None and size > header:
                        return

    async def __aexit__(self, *exc: object) -> None:
        assert self.process is not None
        await asyncio.sleep(0.3)  # the last packets reach the capture
        self.process.send_signal(signal.SIGINT)
        await asyncio.wait_for(self.process.wait(), 30)


def frame_types(
    tshark: str, capture: Path, keys: Path | None, protocol: str, port: int
) -> list[str]:
    """The ``protocol`` (http3 or http2) frame types tshark can read in ``capture``."""
    field = "http3.frame_type" if protocol == "http3" else "http2.type"
    options = ["-o", f"tls.keylog_file:{keys}"] if keys is not None else []
    if protocol == "http2":  # TLS on a port that is not 443: say so (QUIC is found by itself)
        options += ["-d", f"tcp.port=={port},tls"]
    result = subprocess.run(
        [tshark, "-r", str(capture), *options, "-Y", protocol, "-T", "fields", "-e", field],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [t for line in result.stdout.split() for t in line.split(",") if t]


async def _one_request(client: AsyncClient) -> None:
    async with client.stream(model="sim-instant", messages=MESSAGES, max_tokens=3) as stream:
        chunks = [chunk async for chunk in stream]
    assert len(chunks) >= 3


async def test_an_http3_request_decrypts_with_its_keylog(
    stack: Stack, tshark: str, tmp_path: Path
) -> None:
    keys, capture = tmp_path / "keys.log", tmp_path / "h3.pcapng"
    async with Capture(tshark, stack.port, capture), AsyncClient(
        stack.base_url, ROUTER_KEY, http="3", ca_file=stack.ca_file, keylog_file=str(keys)
    ) as client:
        await _one_request(client)
    secrets = keys.read_text()
    assert "CLIENT_HANDSHAKE_TRAFFIC_SECRET" in secrets
    assert "CLIENT_TRAFFIC_SECRET_0" in secrets
    decrypted = frame_types(tshark, capture, keys, "http3", stack.port)
    assert HEADERS in decrypted  # the request's and the response's HEADERS
    assert DATA in decrypted  # the request body and the streamed events
    assert frame_types(tshark, capture, None, "http3", stack.port) == []  # without the keys: nothing


async def test_an_http2_request_decrypts_with_its_keylog_on_the_users_context(
    stack: Stack, tshark: str, tmp_path: Path
) -> None:
    keys, capture = tmp_path / "keys.log", tmp_path / "h2.pcapng"
    own = ssl.create_default_context(cafile=stack.ca_file)  # the user's context, no keylog
    async with Capture(tshark, stack.port, capture), AsyncClient(
        stack.base_url, ROUTER_KEY, http="2", verify=own, keylog_file=str(keys)
    ) as client:
        await _one_request(client)
    assert "CLIENT_TRAFFIC_SECRET_0" in keys.read_text()
    decrypted = frame_types(tshark, capture, keys, "http2", stack.port)
    assert HEADERS in decrypted
    assert DATA in decrypted
    assert frame_types(tshark, capture, None, "http2", stack.port) == []


def test_the_keylog_file_defaults_to_sslkeylogfile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSLKEYLOGFILE", "/somewhere/keys.log")
    assert keylog_path(None) == "/somewhere/keys.log"
    assert keylog_path("mine.log") == "mine.log"
    assert keylog_path("") is None  # explicitly none, whatever the environment says
    monkeypatch.delenv("SSLKEYLOGFILE")
    assert keylog_path(None) is None
