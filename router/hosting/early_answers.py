"""What a client is told when the server answers before its request's end.

Over HTTP/2 a server may answer a request before reading all of its body: a 401 at the head,
a 413 once the body crossed ``max_body_bytes``, a 431 for a head over its bounds. The
stream then stays open on the client's side, and a client goes on sending a body no one will
read. :func:`reset_h2_streams_answered_early` (a patch of hypercorn's ``H2Protocol``, applied
by :mod:`.patches`) resets such a stream with ``NO_ERROR`` once its
answer is sent, as RFC 9113 section 8.1 provides (Kestrel and hyper's h2 do the same).
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["reset_h2_streams_answered_early"]


def reset_h2_streams_answered_early() -> None:
    """Reset an HTTP/2 stream (NO_ERROR) once its response is complete while its client is
    still sending the request body (a 413 once the body crossed the limit, a 401 at the head).

    hypercorn ends such a stream on its side only; the client goes on sending a body no one
    will read, and until a DATA frame arrives for the forgotten stream (which the
    hardening's ``_close_finished_h2_streams`` resets) it does not learn it may stop; a
    client that sent all its window before the answer never sends one, and waits.
    """
    import h2.errors
    import h2.exceptions
    from h2.stream import StreamState
    from hypercorn.protocol.h2 import H2Protocol

    close_stream = H2Protocol._close_stream

    async def closing(self: Any, stream_id: int) -> None:
        await close_stream(self, stream_id)
        if getattr(self.config, "firstbyte_limits", None) is None:
            return
        stream = self.connection.streams.get(stream_id)
        if stream is not None and stream.state_machine.state is StreamState.HALF_CLOSED_LOCAL:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
                await self._flush()

    H2Protocol._close_stream = closing  # type: ignore[method-assign]
