"""The SDK at its edges: each mistake a new user makes gets its own typed error and a message
that names it (docs/sdk-errors.md lists them; ``test_error_table`` checks that list)."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import ConfigurationError, ConnectError, TLSError
from firstbyte.router.sim.server import running_sim
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


@pytest.mark.parametrize(("transport", "http"), [("sse", "1.1"), ("sse", "2"),
                                                 ("longpoll", "1.1"), ("websocket", "1.1")])
async def test_https_to_a_plain_http_port_says_the_port_does_not_speak_tls(
    transport: str, http: str
) -> None:
    # Before: OpenSSL's "[SSL: WRONG_VERSION_NUMBER] wrong version number" and nothing more.
    async with running_sim("instant") as sim_url:
        url = sim_url.replace("http://", "https://") + "/v1"
        async with AsyncClient(url, "test-key", transport=transport, http=http,  # type: ignore[arg-type]
                               retries=0) as client:
            with pytest.raises(TLSError) as info:
                await first_text(client)
    port = sim_url.rsplit(":", 1)[1]
    assert str(info.value) == (
        f"TLS handshake with 127.0.0.1:{port} failed: the server does not speak TLS there"
        " (if it serves plain HTTP, use http:// in the base URL)")


async def test_messages_that_are_no_list_of_messages_say_so() -> None:
    # Before: None raised "'NoneType' object is not iterable"; a string went out cut into
    # characters, for the router to refuse as 'messages[0]: expected object'.
    async with AsyncClient("https://localhost:1/v1", "key") as client:
        for bad, name in ((None, "NoneType"), ("Hi", "str"), ({"role": "user"}, "dict")):
            with pytest.raises(TypeError) as info:
                client.stream(model="m", messages=bad)  # type: ignore[arg-type]
            assert str(info.value) == (
                "messages must be a list of messages ({'role': ..., 'content': ...}), not"
                f" {name}")
            with pytest.raises(TypeError, match=r"^messages must be a list of messages"):
                client.messages.stream(model="m", messages=bad, max_tokens=4)  # type: ignore[arg-type]


def test_a_bad_base_url_names_the_option() -> None:
    with pytest.raises(ConfigurationError, match=r"^base_url: must be a base URL http\(s\)://"):
        AsyncClient("localhost:8080")
    # Pasted from a file or an environment variable with its newline: refused here, not a 404
    # for "/v1\n/chat/completions" at the first request.
    with pytest.raises(ConfigurationError, match=r"^base_url: must be a base URL .*/v1\\n'$"):
        AsyncClient("https://localhost:8443/v1\n")
    for port in ("99999", "abc", "0"):
        url = f"https://localhost:{port}/v1"
        with pytest.raises(ConfigurationError) as info:
            AsyncClient(url)
        assert str(info.value) == f"base_url: the port of {url!r} is not a number from 1 to 65535"
    with pytest.raises(ConfigurationError) as info:
        AsyncClient(None)  # type: ignore[arg-type]
    assert str(info.value) == ("base_url: must be a URL, a list of URLs or a mapping of region"
                               " name to URL, not None")


@pytest.mark.parametrize("base_url", [
    ["https://a.test/v1", "https://a.test/v1"],
    ["https://a.test/v1", "https://a.test/v1/"],
    {"tokyo": "https://a.test/v1", "osaka": "https://a.test:443/v1"},
])
def test_the_same_region_given_twice_is_refused(base_url: list[str] | dict[str, str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        AsyncClient(base_url)
    assert str(info.value) == "base_url: the same URL is given for two regions"


@pytest.mark.parametrize(("option", "value", "wanted"), [
    ("keepalive_interval_s", 0, "a number above 0"),  # would ping back to back
    ("idle_timeout_s", -1, "a number above 0"),  # would stall every stream at once
    ("connect_timeout_s", 0, "a number above 0"),
    ("poll_wait_s", -5, "a number above 0"),  # the router's 400, after the stream was made
    ("reprobe_interval_s", 0, "a number above 0"),
    ("idle_timeout_s", float("nan"), "a number above 0"),
    ("connect_timeout_s", True, "a number above 0"),
    ("max_resumes", -1, "a number of 0 or more"),
    ("stall_retries", -1, "a number of 0 or more"),
    ("resume_backoff_s", -0.5, "a number of 0 or more"),
    ("keepalive_expiry_s", "120", "a number of 0 or more"),
    ("max_connections", 0, "a whole number, 1 or more"),
    ("max_connections", 2.5, "a whole number, 1 or more"),
])
def test_a_timing_option_out_of_range_names_itself(option: str, value: object, wanted: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        AsyncClient("https://a.test/v1", **{option: value})  # type: ignore[arg-type]
    assert str(info.value) == f"{option}: must be {wanted}, not {value!r}"
    AsyncClient("https://a.test/v1", reprobe_interval_s=None, keepalive_expiry_s=0, max_resumes=0)


def _udp_port(*, keep: bool) -> tuple[int, socket.socket | None]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if keep:
        return port, sock  # bound, never read: datagrams vanish, nothing answers
    sock.close()  # nothing bound: the kernel answers ICMP port unreachable
    return port, None


async def test_h3_to_a_port_nothing_listens_on_fails_at_once() -> None:
    port, _ = _udp_port(keep=False)
    start = time.perf_counter()
    async with AsyncClient(f"https://localhost:{port}/v1", http="3",
                           connect_timeout_s=10) as client:
        with pytest.raises(ConnectError) as info:
            await first_text(client)
    elapsed = time.perf_counter() - start
    assert str(info.value) == (f"cannot connect to localhost:{port}: nothing listens on UDP port"
                               f" {port} (ICMP port unreachable)")
    assert elapsed < 5, elapsed  # did not wait out the 10 s connect timeout


async def test_h3_to_a_silent_port_gives_up_after_the_connect_timeout() -> None:
    port, sock = _udp_port(keep=True)
    assert sock is not None
    with sock:
        async with AsyncClient(f"https://localhost:{port}/v1", http="3",
                               connect_timeout_s=0.5) as client:
            # Timed from the request: the client's set-up and close are not what is bounded
            # (with them, the block once took 1.8 s beside the rest of the suite).
            start = time.perf_counter()
            with pytest.raises(ConnectError, match=r"QUIC handshake with .* timed out after 0.5 s"):
                await first_text(client)
            elapsed = time.perf_counter() - start
    # the timeout (less the loop's timer slack), not the timeout and a wait
    assert 0.5 - 0.05 <= elapsed < 2 * 0.5 + 0.5, elapsed


_QUIET_CLIENT = """
import asyncio, gc, socket, sys
from firstbyte.client_sdk.client import AsyncClient

async def attempt(url, **kw):
    async with AsyncClient(url, "test-key", http="3", **kw) as client:
        try:
            async with client.stream(model="m", messages=[{"role": "user", "content": "x"}]):
                pass
        except Exception as exc:
            print(type(exc).__name__)

async def main(port):
    await attempt(f"https://localhost:{port}/v1", connect_timeout_s=5)  # CA not trusted
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    await attempt(f"https://localhost:{silent.getsockname()[1]}/v1", connect_timeout_s=0.3)
    port = silent.getsockname()[1]
    silent.close()
    await attempt(f"https://localhost:{port}/v1")
    gc.collect()
    await asyncio.sleep(0.3)
    gc.collect()

asyncio.run(main(int(sys.argv[1])))
gc.collect()
"""


def test_h3_failures_print_nothing(server: RunningServer) -> None:
    # A plain process, as an application is: no logging configured (pytest's own log capture
    # would hide aioquic's and asyncio's last-resort printing).
    done = subprocess.run([sys.executable, "-c", _QUIET_CLIENT, str(server.port)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.split() == ["TLSError", "ConnectError", "ConnectError"], done.stderr
    assert done.stderr == ""


@pytest.mark.parametrize(("transport", "http"), [("websocket", "1.1"), ("sse", "1.1")])
async def test_prewarm_while_a_stream_runs_opens_no_second_connection(
    server: RunningServer, ca_file: str, transport: str, http: str
) -> None:
    # What a periodic re-probe does to the primary: it used to count idle connections only,
    # so a stream in flight at that moment cost a new handshake (a flaky re-probe test).
    def opened() -> int:
        if transport == "websocket":
            return server.app.requests.count(("WS", "/v1/ws"))
        session = client.pool.session(client.origin, "1.1")
        return len(session._client._transport._pool.connections)  # type: ignore[attr-defined]

    async with AsyncClient(server.base_url, "test-key", transport=transport, http=http,  # type: ignore[arg-type]
                           ca_file=ca_file) as client:
        await client.prewarm()
        assert opened() == 1
        async with client.stream(model="m", messages=MESSAGES, max_tokens=9) as stream:
            async for _ in stream:
                await client.prewarm()  # the only connection is busy with this stream
                assert opened() == 1
        assert stream.text == expected_text(9)
        assert await first_text(client) == expected_text(3)
        assert opened() == 1


_IMPORTS_AT = """
import sys
from firstbyte.client_sdk.client import AsyncClient
before = "aioquic" in sys.modules
AsyncClient("https://localhost:1/v1", http=sys.argv[1])
print(before, "aioquic" in sys.modules)
"""


@pytest.mark.parametrize(("http", "loaded"), [("3", "True"), ("2", "False")])
def test_aioquic_loads_when_an_h3_client_is_built_not_in_its_first_request(
    http: str, loaded: str
) -> None:
    """Loading aioquic takes ~70 ms: inside the first request it would sit in no phase of its
    timings (the clock has started, no connection phase has). HTTP/2 clients never load it."""
    done = subprocess.run([sys.executable, "-c", _IMPORTS_AT, http], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split() == ["False", loaded], done.stdout + done.stderr
