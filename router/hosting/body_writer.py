"""The ``firstbyte.body_writer`` ASGI extension: write a streamed body's part from a callback.

ASGI's ``send`` is a coroutine: a part of a streamed body goes out from a task, so relaying
one upstream chunk to its reader meant waking the reader's task (a future, a task step, an
async generator or two, ``send``) for one ``transport.write``. Where the server offers this
extension (``scope["extensions"][EXTENSION]``), the application gets a plain function
``write(body) -> bool`` instead, callable from any callback of the event loop once the
response head has gone out through ``send``:

- it writes ``body`` as the next part of the body, framed as ``send`` frames it (a chunk of
  HTTP/1.1 chunked encoding), and returns True; or
- it writes nothing and returns False when ``send`` could not write at once: the transport's
  buffer is over its high-water mark (the reader is behind: ``send`` would wait for it to
  drain), the client is gone, the body is not chunked (a ``HEAD``, a ``content-length``)
  or already complete. The caller then goes back to ``send``, which waits as it always does.

The application must not call it while one of its ``send`` calls is in progress, and ends the
body with ``send`` (``more_body`` false), so the server's own end of response bookkeeping
(keep-alive, the next request) runs as always.

Offered on uvicorn's httptools protocol (:func:`uvicorn_writer`, used by
:mod:`.uvicorn_limits`: the default server's HTTP/1.1) to HTTP/1.1 requests (an HTTP/1.0
one's body has no chunks: :mod:`.http10`), which this reads the state of: the
request cycle's ``transport``, ``flow.write_paused``, ``disconnected``, ``chunked_encoding``
and ``response_complete``. :func:`uvicorn_shape_ok` checks those are there before it is
offered: with another uvicorn the extension is simply absent and bodies go through ``send``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["EXTENSION", "uvicorn_shape_ok", "uvicorn_writer"]

EXTENSION = "firstbyte.body_writer"

log = logging.getLogger("firstbyte.router.hosting")

_CYCLE_FIELDS = ("transport", "flow", "disconnected", "chunked_encoding", "response_complete")
_shape: bool | None = None


def uvicorn_shape_ok(cycle: Any) -> bool:
    """Does uvicorn's request cycle hold what the writer reads? Checked once (logged if not)."""
    global _shape
    if _shape is None:
        _shape = all(hasattr(cycle, name) for name in _CYCLE_FIELDS) and hasattr(
            cycle.flow, "write_paused"
        )
        if not _shape:
            import uvicorn

            log.warning(
                "uvicorn %s's request cycle is not the shape %s reads; streamed bodies go"
                " through ASGI send only",
                uvicorn.__version__,
                EXTENSION,
            )
    return _shape


def uvicorn_writer(cycle: Any) -> Callable[[bytes], bool]:
    """The extension's ``write`` for one uvicorn (httptools) request cycle."""
    transport = cycle.transport
    flow = cycle.flow

    def write(body: bytes) -> bool:
        if not body:
            return True  # an empty chunk would end the body
        if (
            flow.write_paused
            or cycle.disconnected
            or cycle.chunked_encoding is not True
            or cycle.response_complete
            or transport.is_closing()
        ):
            return False
        try:
            transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        except Exception:  # whatever a dying transport raises: its reader's send will say
            return False  # this runs in the upstream's callback: its stream must go on
        return True

    # The compiled writer (firstbyte.router.chunkpath.SSE_WRITER) reads the same state and
    # frames the same chunk: it finds the cycle here.
    write.cycle = cycle  # type: ignore[attr-defined]
    return write
