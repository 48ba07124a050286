"""What a browser's prewarm asks of the router (docs/browser.md, "Prewarm").

``GET /v1/edge/warm`` answers 204 with nothing: no key is checked, no body is read, no
backend or store is touched, so the request a page sends on the user's intent (focus of the
prompt box, a keystroke) and every 20 s while it stays visible costs the router one response
head. Its point is on the client's side: the connection it opens (TCP + TLS, or QUIC once the
page has learnt ``Alt-Svc`` from it) is the one the first message then reuses. The CORS
preflight cache is filled by a plain ``OPTIONS`` to the start URL, which
:class:`~firstbyte.router.cors.CorsPolicy` answers for listed origins without an endpoint.
"""

from __future__ import annotations

from .asgi import Receive, Scope, Send, send_bytes
from .state import RouterState

__all__ = ["edge_warm"]


async def edge_warm(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/edge/warm``: 204, ``Cache-Control: no-store`` (every prewarm must reach the
    router: an answer from a cache would open no connection)."""
    state.metrics.count("warm", "ok")
    await send_bytes(send, 204, b"", content_type="text/plain",
                     headers=(("cache-control", "no-store"),))
