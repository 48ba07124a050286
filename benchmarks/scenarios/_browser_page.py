"""The web application of ``firstbyte bench browser``: a page on its own origin beside a region's
router, as a real chat application has it.

It runs in the region's process (:mod:`firstbyte.benchmarks.scenarios._region_runner`
``--page-port``), over TLS with the router's certificate, on another port: another origin, so
the page's requests to the router are cross-origin (CORS, preflights) as in production. It
serves

- ``/`` (``/?warm=1``: with ``<link rel="preconnect">`` to the router): the page, with a client
  token minted for it when it is rendered, as the application's backend would (the browser
  never sees an API key), and the client as ``window.fb``;
- ``/v1/edge/client/NAME.js``: the client's modules, from the page's own origin, so loading
  the page opens no connection to the router (a cold page is cold).

Every answer closes its connection: the page's own loads are not the subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Callable
from urllib.parse import urlsplit

from firstbyte.router.edge_client import client_files

__all__ = ["page_html", "serve_page"]


def page_html(router_url: str, token: str, *, warm: bool) -> bytes:
    """The page for the router at ``router_url`` (``https://host:port/v1``)."""
    parts = urlsplit(router_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    # crossorigin: fetch() to another origin without credentials uses the anonymous pool.
    preconnect = f'<link rel="preconnect" href="{origin}" crossorigin>\n' if warm else ""
    config = json.dumps({"router": router_url, "token": token})
    return f"""<!DOCTYPE html><meta charset="utf-8"><title>firstbyte browser bench</title>
{preconnect}<div id="out"></div>
<script type="module">
window.bench = {config};
window.fb = await import("/v1/edge/client/firstbyte.js");
</script>
""".encode()


async def serve_page(host: str, port: int, tls: ssl.SSLContext, router_url: Callable[[], str],
                     mint: Callable[[], str]) -> asyncio.Server:
    """Start serving the page on ``host:port`` (0: any), for the router at ``router_url()``
    (asked per request: the router starts after the page's port is known, which its CORS
    list names); ``mint()`` gives a fresh client token."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b" ", 2)[1].decode()
            path, _, query = target.partition("?")
            status, ctype = b"200 OK", b"text/html; charset=utf-8"
            if path.startswith("/v1/edge/client/"):
                found = client_files().get(path.rsplit("/", 1)[1])
                body, ctype = (found.body if found else b""), b"text/javascript"
                status = b"200 OK" if found else b"404 Not Found"
            elif path == "/":
                body = page_html(router_url(), mint(), warm="warm=1" in query)
            else:
                status, body = b"404 Not Found", b""
            writer.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype
                         + b"\r\ncache-control: no-store\r\ncontent-length: "
                         + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, host, port, ssl=tls)
