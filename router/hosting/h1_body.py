"""hypercorn's HTTP/1.1 streamed body chunks, framed directly instead of through h11.

Each ``http.response.body`` message of a streamed response goes, in hypercorn (0.17, 0.18),
through a ``Body`` event, the protocol's event dispatch, an ``h11.Data`` event, h11's state
machine (which does not change state for data) and its chunked writer, before the bytes reach
the connection. For an SSE stream that is every token: measured alone, hypercorn spent about
twice uvicorn's CPU per streamed chunk on this machine, most of it there
(``firstbyte bench router_overhead``).

:func:`frame_h1_bodies_directly` patches ``HTTPStream.app_send`` so that a body chunk of a
response h11 already frames as chunked (our state ``SEND_BODY``, its chunked writer) is
written as ``SIZE\\r\\nDATA\\r\\n``, exactly h11's bytes, through the connection's own send
(its lock, flow control and error handling stay). Everything else (the head, the last chunk,
a response with ``Content-Length``, HTTP/2 and HTTP/3, a HEAD request) takes hypercorn's path
unchanged. :mod:`.patches` checks the shapes of h11 and hypercorn it relies on before
applying it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["frame_h1_bodies_directly"]


def frame_h1_bodies_directly() -> None:
    """Install the patch (once per process, by :mod:`.patches`)."""
    import h11
    from h11._writers import ChunkedWriter
    from hypercorn.events import RawData
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

    original = HTTPStream.app_send
    send_body, response = h11.SEND_BODY, ASGIHTTPState.RESPONSE

    async def app_send(self: Any, message: Any) -> None:
        if (
            message is not None
            and message["type"] == "http.response.body"
            and self.state is response
            and message.get("more_body", False)
        ):
            body = message.get("body", b"")
            protocol = getattr(self.send, "__self__", None)
            if body and type(protocol) is H11Protocol and self.scope["method"] != "HEAD":
                connection = protocol.connection
                if (
                    connection.our_state is send_body
                    and type(connection._writer) is ChunkedWriter
                ):
                    await protocol.send(RawData(data=b"%x\r\n%s\r\n" % (len(body), body)))
                    return
        await original(self, message)

    HTTPStream.app_send = app_send  # type: ignore[method-assign]
