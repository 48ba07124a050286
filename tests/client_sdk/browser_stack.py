"""The browser client's test world: the sim behind a real router (plain HTTP, or TLS with a
trustme certificate Chromium is told to trust by its key), a page server on another loopback
origin, and headless Chromium on that page with the client's modules imported from the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import trustme

from firstbyte.benchmarks import browser
from firstbyte.benchmarks.browser import Page, open_page
from firstbyte.router.app import RouterApp
from firstbyte.router.config import parse_config
from firstbyte.router.edge_client import client_files
from firstbyte.router.serve import running_router
from firstbyte.router.sim.server import running_sim
from tests.client_sdk.test_client import MESSAGES, reference_text

KEY = "sk-browser-test-0001"
OTHER_KEY = "sk-browser-test-0002"
SECRET = "s" * 40

PAGE = b"""<!DOCTYPE html><meta charset="utf-8"><title>firstbyte browser test</title>
<div id="out"></div>
<script type="module">
const router = new URLSearchParams(location.search).get("modules");
window.fb = await import(router + "/v1/edge/client/firstbyte.js");
window.rules = await import(router + "/v1/edge/client/stream.js");
</script>
"""
READY = """new Promise((resolve) => { const t = () => window.fb && window.rules ? resolve(true)
  : setTimeout(t, 10); t(); })"""


@dataclass
class World:
    router_url: str
    """``http://127.0.0.1:PORT`` (or https), no ``/v1``."""
    router_port: int
    sim_url: str
    page_port: int
    cert_pem: bytes | None = None
    """The router's (and, with TLS, the page server's) certificate."""
    app: RouterApp | None = None
    """The router's app, for a test that changes its state (a drain)."""

    @property
    def page_origin(self) -> str:
        scheme = "https" if self.cert_pem is not None else "http"
        return f"{scheme}://127.0.0.1:{self.page_port}"

    def page_url(self, origin: str | None = None, modules: str | None = None) -> str:
        return f"{origin or self.page_origin}/?modules={modules or self.router_url}"

    async def reference_text(self, max_tokens: int, seed: int = 11) -> str:
        """What the sim answers to this request, asked directly and without streaming."""
        return await reference_text(self, max_tokens, seed)  # type: ignore[arg-type]

    async def mint(self, key: str = KEY, **body: Any) -> str:
        async with httpx.AsyncClient(verify=False) as http:
            response = await http.post(f"{self.router_url}/v1/edge/tokens", json=body,
                                        headers={"authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        token: str = response.json()["token"]
        return token


async def _serve_page(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The page at ``/``; the client's modules too (as the router has them), for a page that
    must not have touched the router before its first stream."""
    with contextlib.suppress(Exception):
        head = await reader.readuntil(b"\r\n\r\n")
        path = head.split(b" ", 2)[1].decode()
        body, ctype = PAGE, b"text/html; charset=utf-8"
        if path.startswith("/v1/edge/client/"):
            body, ctype = client_files()[path.rsplit("/", 1)[1]].body, b"text/javascript"
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def world(tls: trustme.CA | None = None, tls_dir: str = "", upstream: str | None = None,
                **sections: Any) -> AsyncIterator[World]:
    """The sim, the router (CORS for the page's origin) and the page server, running; with
    ``tls`` both serve HTTPS with one certificate of that CA. ``upstream``: the URL of a sim
    already running (a ``firstbyte sim`` process with faults) instead of one started here."""
    listen: dict[str, Any] = {"host": "127.0.0.1", "port": 0}
    cert_pem = None
    page_tls = None
    if tls is not None:
        cert = tls.issue_cert("127.0.0.1", "localhost")
        cert_pem = cert.cert_chain_pems[0].bytes()
        cert.private_key_and_cert_chain_pem.write_to_path(f"{tls_dir}/cert.pem")
        cert.private_key_pem.write_to_path(f"{tls_dir}/key.pem")
        listen.update(certfile=f"{tls_dir}/cert.pem", keyfile=f"{tls_dir}/key.pem", http3=False)
        page_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        page_tls.load_cert_chain(f"{tls_dir}/cert.pem", f"{tls_dir}/key.pem")
    else:
        listen["insecure_plain_http"] = True
    page_server = await asyncio.start_server(_serve_page, "127.0.0.1", 0, ssl=page_tls)
    page_port = page_server.sockets[0].getsockname()[1]
    scheme = "http" if tls is None else "https"
    try:
        async with contextlib.AsyncExitStack() as stack:
            sim_url = upstream or await stack.enter_async_context(
                running_sim("instant", seed=7))
            data: dict[str, Any] = {
                "region": "browser-test",
                "upstreams": [{"url": sim_url}],
                "listen": listen,
                "auth": {"api_keys": [KEY, OTHER_KEY], "token_secret": SECRET},
                "cors": {"allow_origins": [f"{scheme}://127.0.0.1:{page_port}"]},
            }
            for name, values in sections.items():
                data.setdefault(name, {}).update(values)
            async with running_router(parse_config(data, "<browser-test>")) as endpoints:
                yield World(endpoints.base_url, endpoints.port, sim_url, page_port, cert_pem,
                            endpoints.app)
    finally:
        page_server.close()


def spki_flag(w: World) -> str:
    """Chromium's flag trusting the router's certificate (by its key, nothing else)."""
    assert w.cert_pem is not None
    return browser.spki_flag(w.cert_pem)


@contextlib.asynccontextmanager
async def browser_on(w: World, origin: str | None = None, flags: tuple[str, ...] = (),
                     modules: str | None = None) -> AsyncIterator[Page]:
    """Chromium on the test page; the client's modules from the router (or ``modules``)."""
    async with open_page(w.page_url(origin, modules), flags=flags) as page:
        assert await page.evaluate(READY) is True, page.problems()
        yield page


def stream_script(base_url: str, token: str, transport: str, max_tokens: int, *,
                  busy_ms: int = 0, report: bool = False,
                  options: dict[str, Any] | None = None) -> str:
    """A script that streams one completion (the sim, seed 11) into #out and answers what it
    saw; with ``report`` the client reports its timings, sent before the script answers."""
    request = {"model": "sim-instant", "messages": MESSAGES, "max_tokens": max_tokens,
               "seed": 11}
    return browser.stream_script(base_url, token, transport, request, busy_ms=busy_ms,
                                 report=report, options=options)
