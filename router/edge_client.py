"""``GET /v1/edge/client/NAME.js``: the browser client's ES modules, served as shipped.

The files live with the SDK (``client_sdk/browser/``: they are its browser half and follow
its rules) and are package data of the ``firstbyte`` wheel; the router reads them as data
through the ``firstbyte`` package, importing no SDK code. They are public code: no key, CORS
open to any origin (:mod:`firstbyte.router.cors`), cached for a few minutes and revalidated by
ETag, so a page loads the client with a round trip only after the cache expires.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources

from .asgi import Receive, Scope, Send, header_dict, send_bytes
from .pipeline.context import error_reply

__all__ = ["ClientFile", "client_files", "serve_client_file"]

CACHE_CONTROL = "public, max-age=300"


@dataclass(frozen=True, slots=True)
class ClientFile:
    body: bytes
    etag: str


@cache
def client_files() -> dict[str, ClientFile]:
    """Every ``*.js`` of the browser client by name, read once."""
    folder = resources.files("firstbyte").joinpath("client_sdk", "browser")
    files = {}
    for entry in folder.iterdir():
        if entry.name.endswith(".js") and entry.is_file():
            body = entry.read_bytes()
            files[entry.name] = ClientFile(body, f'"{hashlib.sha256(body).hexdigest()[:32]}"')
    return files


async def serve_client_file(scope: Scope, receive: Receive, send: Send, name: str) -> None:
    """Answer one module (304 when the browser's copy is current), or 404."""
    found = client_files().get(name)
    if found is None:
        outcome = error_reply(404, f"No browser client file {name!r}.")
        await send_bytes(send, 404, outcome.body)
        return
    headers = [("cache-control", CACHE_CONTROL), ("etag", found.etag),
               ("x-content-type-options", "nosniff")]
    if header_dict(scope).get("if-none-match") == found.etag:
        await send({"type": "http.response.start", "status": 304,
                    "headers": [(k.encode(), v.encode()) for k, v in headers]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send_bytes(send, 200, found.body, content_type="text/javascript; charset=utf-8",
                     headers=headers)
