"""The attacked router runs as its own process (``firstbyte router --config``), so its memory
is measured alone (``/proc/PID/status``) and its log is what an operator would read; the
upstream is the tests' own (``tests/router/upstream.py``), counting what reaches it.

Every attack runs with a :class:`Canary` beside it: a client from another loopback address
(127.0.0.2, so per-address limits on the attacker's 127.0.0.1 do not touch it) streaming
completions back to back, each of which must arrive whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from firstbyte.benchmarks.ports import free_port
from tests.router.conftest import API_KEY, auth
from tests.router.upstream import Upstream, running_upstream

CANARY_ADDRESS = "127.0.0.2"

ON_EACH_SERVER = pytest.mark.parametrize("router_server", ["auto", "hypercorn", "uvicorn"])
"""For attacks on how connections are accepted and counted, which each ``listen.server`` does
its own way (``auto``: hypercorn accepts, then hands HTTP/1.1 to uvicorn's protocol)."""
ON_EACH_PROTOCOL = pytest.mark.parametrize("router_server", ["auto", "hypercorn"])
"""For attacks on HTTP/1.1 and WebSocket protocol code: hypercorn's, or uvicorn's guarded
protocol, which ``auto`` and ``uvicorn`` run alike (the same classes and config). The app's
own checks run once, on the default."""
CANARY_TOKENS = 20

STALLED_TOKENS = 40_000
"""A stream long enough (~7 MB) to fill what the kernel buffers on loopback for a client that
reads nothing (the router's send buffer autotunes up to ``tcp_wmem``'s 4 MiB) and then the
transport's, so the router's writes pause."""

TIMER_SLACK_S = 0.05
"""How early a router's timeout may end a connection: the event loop fires a timer up to
its clock's resolution early (a 1.5 s timeout was seen to hold 1.49995 s)."""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(path: Path, sections: dict[str, Any], upstream_url: str) -> None:
    lines = ['region = "test-1"', "", "[[upstreams]]", f"url = {_toml_value(upstream_url)}"]
    for name, values in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]
    path.write_text("\n".join(lines) + "\n")


@dataclass
class RouterProcess:
    """A running ``firstbyte router`` and what it logged."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    cafile: str

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def logged(self, text: str, timeout_s: float) -> None:
        """Wait until the log has ``text`` (``TimeoutError`` after ``timeout_s``)."""
        async with asyncio.timeout(timeout_s):
            while text not in self.log():  # noqa: ASYNC110 (a file to poll, no event to wait on)
                await asyncio.sleep(0.2)

    def assert_clean_log(self) -> None:
        """No traceback and no exception name: every client mistake is one plain line."""
        text = self.log()
        for marker in ("Traceback", "KeyError", "RecursionError", "Error in ASGI"):
            assert marker not in text, text[-4000:]

    def client_tls(self, alpn: list[str] | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.cafile)
        if alpn:
            context.set_alpn_protocols(alpn)
        return context


RouterStarter = Callable[..., contextlib.AbstractAsyncContextManager[RouterProcess]]


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with running_upstream() as up:
        up.delay_s = 0.01
        yield up


@pytest.fixture
def router_server() -> str:
    """The router's ``listen.server`` (its default); a module parametrizes it to run on each
    server."""
    return "auto"


@pytest.fixture
def without_patches() -> tuple[str, ...]:
    """Library patches the router process runs without (``router/hosting/patches.py``);
    ``test_without_patches.py`` parametrizes it to show what each patch defends."""
    return ()


@pytest.fixture
def start_router_process(
    tls_files: dict[str, str],
    tmp_path: Path,
    upstream: Upstream,
    router_server: str,
    without_patches: tuple[str, ...],
) -> RouterStarter:
    """``async with start_router_process(limits={...}, nofile=N) as router: ...`` on
    ``router_server``."""

    @contextlib.asynccontextmanager
    async def start(nofile: int | None = None, **sections: dict[str, Any]) -> AsyncIterator[
        RouterProcess
    ]:
        sections["listen"] = {"server": router_server} | sections.get("listen", {})
        for attempt in range(3):
            # free_port() lets the port go before the router binds it: another process (an
            # outgoing connection's ephemeral port, another test worker) may take it in
            # between, and the router then exits saying so. A new port, not a failure.
            port = free_port()
            path = tmp_path / f"router-{port}.toml"
            write_config(path, router_sections(port, tls_files, **sections), upstream.url)
            log_path = tmp_path / f"router-{port}.log"
            proc = _spawn(path, log_path, nofile, without_patches)
            router = RouterProcess(proc, port, log_path, tls_files["cafile"])
            try:
                await _until_healthy(router)
                break
            except AssertionError:
                _stop(proc)
                if attempt == 2 or "Address already in use" not in router.log():
                    raise
        try:
            yield router
        finally:
            await asyncio.to_thread(_stop, proc)

    return start


def router_sections(
    port: int, tls_files: dict[str, str], **sections: dict[str, Any]
) -> dict[str, Any]:
    """The harness's config tables (TLS on ``port``, one API key), ``sections`` over them."""
    config: dict[str, Any] = {
        "listen": {
            "host": "127.0.0.1",
            "port": port,
            "certfile": tls_files["certfile"],
            "keyfile": tls_files["keyfile"],
            "http3": False,
        },
        "auth": {"api_keys": [API_KEY]},
        "streams": {"resume_grace_s": 1.0},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


_WITHOUT_PATCHES = """
import logging, os, sys
from firstbyte.router.hosting import patches
cut = sys.argv.index("--")
held = patches.applied_except(*sys.argv[1:cut])  # held: for the life of the process
held.__enter__()
from firstbyte.cli import main
code = main(sys.argv[cut + 1:])
logging.shutdown()
os._exit(code)  # not through the block's exit: it would put the patches back at shutdown
"""


def _spawn(
    config: Path, log_path: Path, nofile: int | None, without: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """``firstbyte router --config CONFIG -v``, its output in ``log_path``, with at most
    ``nofile`` descriptors if given, and without the library patches ``without``."""

    def limit_files() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])}
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [
                sys.executable,
                *(["-c", _WITHOUT_PATCHES, *without, "--"] if without else ["-m", "firstbyte"]),
                "router", "--config", str(config), "-v",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=limit_files,
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _until_healthy(router: RouterProcess) -> None:
    deadline = time.monotonic() + 60  # a router starting on a busy 2-core machine
    async with httpx.AsyncClient(verify=router.client_tls()) as client:
        while True:
            if router.proc.poll() is not None:
                raise AssertionError(f"router exited: {router.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(router.base_url + "/healthz")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"router not healthy: {router.log()}")
            await asyncio.sleep(0.1)


def chat_body(max_tokens: int = CANARY_TOKENS, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "test-model",
        "messages": [{"role": "user", "content": "canary"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@dataclass
class Canary:
    """Streams completions back to back from 127.0.0.2 over one kept-alive connection."""

    router: RouterProcess
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    """Set whenever a stream ends (whole or not)."""
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        expected = " ".join(f"w{i}" for i in range(CANARY_TOKENS))
        transport = httpx.AsyncHTTPTransport(
            verify=self.router.client_tls(), local_address=CANARY_ADDRESS
        )
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            while not self._stop.is_set():
                await self._one(client, expected)
                self.progress.set()

    async def _one(self, client: httpx.AsyncClient, expected: str) -> None:
        text = ""
        try:
            async with client.stream(
                "POST",
                self.router.base_url + "/v1/chat/completions",
                json=chat_body(),
                headers=auth(),
            ) as response:
                if response.status_code != 200:
                    self.failures.append(f"status {response.status_code}")
                    return
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        text += _content(line)
        except httpx.HTTPError as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")
            return
        if text != expected:
            self.failures.append(f"got {text!r}")
        else:
            self.completed += 1

    def stop(self) -> None:
        self._stop.set()


async def _next_stream(canary: Canary) -> None:
    canary.progress.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(canary.progress.wait(), 20)


def _content(line: str) -> str:
    import json

    chunk = json.loads(line[len("data: ") :])
    choices = chunk.get("choices") or [{}]
    return str(choices[0].get("delta", {}).get("content") or "")


def sse_text(body: bytes) -> str:
    """The completion text of a streamed chat answer's SSE body (its deltas joined)."""
    return "".join(
        _content(line) for line in body.decode().splitlines() if line.startswith("data: {")
    )


def words(n: int) -> str:
    """What the tests' upstream streams for ``max_tokens = n``."""
    return " ".join(f"w{i}" for i in range(n))


@contextlib.asynccontextmanager
async def canary_running(router: RouterProcess) -> AsyncIterator[Canary]:
    """A canary for the duration of the block; on exit it must have completed streams,
    all of them whole, before and during the attack."""
    canary = Canary(router)
    task = asyncio.create_task(canary.run())
    # One whole stream before the attack starts: the canary's connection is established.
    await _next_stream(canary)
    before = canary.completed
    try:
        yield canary
    finally:
        # At least one more stream, started while the attack held what it held.
        await _next_stream(canary)
        canary.stop()
        await asyncio.wait_for(task, 30)
    assert canary.failures == [], canary.failures
    assert canary.completed > before


async def open_tls(
    router: RouterProcess, *, alpn: list[str] | None = None, local: str = "127.0.0.1"
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(
        "127.0.0.1",
        router.port,
        ssl=router.client_tls(alpn or ["http/1.1"]),
        server_hostname="127.0.0.1",
        local_addr=(local, 0),
    )


async def open_tls_small_window(
    router: RouterProcess, alpn: list[str]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TLS connection whose socket receives into 4 KiB: once its client stops reading,
    the router's writes back up at once."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", router.port))
    return await asyncio.open_connection(
        sock=sock, ssl=router.client_tls(alpn), server_hostname="127.0.0.1"
    )


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes (``TimeoutError`` if it does not)."""
    data = b""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                chunk = await reader.read(65536)
            except (ConnectionError, ssl.SSLError):
                return data
            if not chunk:
                return data
            data += chunk
