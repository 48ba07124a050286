"""The ``firstbyte.disconnected`` ASGI extension: a future for the client's disconnect.

ASGI says a client left by answering ``receive()`` with ``http.disconnect``, so an
application that must notice it while it waits for something else (the upstream's head, the
next token) keeps a task blocked in ``receive()`` for the whole request, then cancels it.
Where the server offers this extension (``scope["extensions"][EXTENSION]``), the application
gets an ``asyncio.Future`` instead, which the server resolves (result None) when the
request's connection is lost before its response completed. It is never resolved otherwise:
the application cancels it when the request is over, as it would cancel its listener.

Offered on uvicorn's httptools protocol (:mod:`.uvicorn_limits`: the default server's
HTTP/1.1), from its ``connection_lost``, the one place uvicorn itself learns of it. HTTP/2,
HTTP/3 and WebSocket requests do without it and listen through ``receive()``
(:class:`firstbyte.router.asgi.Disconnect`).
"""

from __future__ import annotations

__all__ = ["EXTENSION"]

EXTENSION = "firstbyte.disconnected"
