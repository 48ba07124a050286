"""``firstbyte probe`` as a user runs it: a subprocess against the real router and sim."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import msgspec
import pytest

from firstbyte.client_sdk.timings import Timings
from tests.client_sdk.conftest import ROUTER_KEY, Stack


async def probe(*args: str, api_key: str | None = ROUTER_KEY) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FIRSTBYTE_API_KEY"}
    if api_key is not None:
        env["FIRSTBYTE_API_KEY"] = api_key
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "firstbyte", "probe", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_probe_prints_the_phases(stack: Stack) -> None:
    code, out, err = await probe(stack.base_url, "--cacert", stack.ca_file)
    assert code == 0, err
    for phase in ("dns", "tcp_connect", "tls_handshake", "request_sent", "first_byte",
                  "first_token", "last_token", "server-timing", "HTTP/2", "cold"):
        assert phase in out, (phase, out)


@pytest.mark.parametrize(("transport", "http"), [("sse", "3"), ("websocket", "1.1"),
                                                 ("longpoll", "2")])
async def test_probe_json_decodes_to_timings(stack: Stack, transport: str, http: str) -> None:
    code, out, err = await probe(stack.base_url, "--cacert", stack.ca_file, "--json",
                                 "--transport", transport, "--http", http)
    assert code == 0, err
    timings = msgspec.json.decode(out, type=Timings)
    assert timings.transport == transport
    assert timings.first_byte_ms is not None
    assert timings.first_token_ms is not None
    assert timings.output_chunks > 0
    assert not timings.warm


async def test_probe_insecure_skips_verification(stack: Stack) -> None:
    code, out, err = await probe(stack.base_url, "--insecure", "--json")
    assert code == 0, err
    assert msgspec.json.decode(out, type=Timings).tls_handshake_ms is not None


async def test_probe_warm_measures_a_prewarmed_connection(stack: Stack) -> None:
    url_without_v1 = stack.base_url.removesuffix("/v1")
    code, out, err = await probe(url_without_v1, "--cacert", stack.ca_file, "--json", "--warm")
    assert code == 0, err
    timings = msgspec.json.decode(out, type=Timings)
    assert timings.warm
    assert (timings.tcp_connect_ms, timings.tls_handshake_ms) == (None, None)


async def test_probe_errors_are_clear_and_without_traceback(stack: Stack) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
        cases = [
            ((f"https://127.0.0.1:{closed}/v1",), ROUTER_KEY, "cannot connect"),
            ((stack.base_url,), ROUTER_KEY, "certificate"),
            ((stack.base_url, "--cacert", stack.ca_file), "sk-wrong-key-000",
             "authentication failed"),
            ((stack.base_url, "--cacert", stack.ca_file), None, "FIRSTBYTE_API_KEY"),
            (("ftp://example/v1",), ROUTER_KEY, "base URL"),
            ((stack.base_url, "--cacert", "/nonexistent.pem"), ROUTER_KEY, "no such file"),
            ((stack.base_url, "--timeout", "-1"), ROUTER_KEY, "--timeout must be > 0"),
            ((stack.base_url, "--max-tokens", "0"), ROUTER_KEY, "--max-tokens must be >= 1"),
        ]
        for args, key, expected in cases:
            code, out, err = await probe(*args, api_key=key)
            assert code == 2, (args, out, err)
            assert err.startswith("firstbyte probe: error: "), err
            assert expected in err, (expected, err)
            assert "Traceback" not in err


async def test_probe_help_lists_the_options() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "firstbyte", "probe", "--help",
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    for option in ("--transport", "--http", "--warm", "--json", "--api-key", "--model",
                   "--cacert", "--insecure"):
        assert option in out.decode()
