"""The end of a drain: a connection still open when hypercorn's graceful timeout ends is cut
at once, and its task ends quietly.

At the end of the graceful timeout hypercorn cancels each connection's task. Two things then
go wrong, and both come with kept-alive TLS clients, which every application's connection
pool and every browser has:

- hypercorn's ``TCPServer`` closes the connection and waits for the TLS goodbye. A client
  that reads nothing more never answers the server's ``close_notify``, so the connection
  lives on for the loop's TLS shutdown timeout (30 s); hypercorn's ``_close`` even swallows
  the cancel that comes while it waits, and its task reads on. The router's own deadline
  (:func:`.servers.running`) then cancels hypercorn's ``serve`` in the middle of its clean-up,
  which raises ``InvalidStateError`` out of it (it asks the gathered tasks' future for an
  exception before that future is done).
- A client that holds a kept-alive TLS connection open and never answers the server's
  ``close_notify`` (at a keep-alive timeout, not only in a drain) makes hypercorn's wait end
  in ``TimeoutError: SSL shutdown timed out`` after the loop's 30 s, which ended the
  connection's task with a traceback; the connection is cut instead, quietly.
- Python 3.11 before 3.11.8 (gh-113538): ``asyncio.start_server``'s done-callback calls
  ``task.exception()`` on a cancelled task and logs a traceback: one per connection.

:func:`cut_at_graceful_timeout` makes hypercorn's per-connection server cut the connection
when it closes it from a cancelled task, or when a cancel came while it closed (nothing is
waited for: the timeout that allowed waiting is over), and end that task without the
``CancelledError``: nothing awaits a connection's task but that callback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from typing import Any


def cut_at_graceful_timeout() -> None:
    """Install the connection server described in the module docstring as hypercorn's (a
    subclass of whatever ``hypercorn.asyncio.run.TCPServer`` is now: it wraps the HTTP/1.1
    split, :mod:`.http1_split`)."""
    from hypercorn.asyncio import run

    hypercorn_run: Any = run

    class CuttingTCPServer(hypercorn_run.TCPServer):  # type: ignore[misc]
        writer: Any
        _socket: Any = None
        _was_cut = False

        async def run(self) -> None:
            # Taken now: asyncio's TLS transport, once closed twice, forgets its connection
            # (abort() is then a no-op and get_extra_info fails); its socket still cuts it.
            self._socket = self.writer.get_extra_info("socket")
            try:
                await super().run()
            except asyncio.CancelledError:
                # Cancelled (the graceful timeout is over): cut, and end the task here.
                self._cut()
            except Exception:
                # Once cut, a write to the connection may fail in ways hypercorn does not
                # catch (asyncio's TLS transport, closed twice, raises AttributeError). An
                # error out of any connection task ends hypercorn's whole serve() during a
                # drain: after a cut, it is the cut's echo, not news.
                if not self._was_cut:
                    raise

        async def _close(self) -> None:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                self._cut()  # no TLS goodbye to wait for
            try:
                await super()._close()
            except TimeoutError:
                # The client never answered the TLS goodbye within the loop's shutdown
                # timeout (a kept-alive connection it holds open and no longer reads): the
                # wait is over, so cut it. Raised on, it ended the connection's task with a
                # traceback in the log ("SSL shutdown timed out"), once per such client.
                self._cut()
            if task is not None and task.cancelling():
                self._cut()  # the cancel came while hypercorn waited, and it swallowed it

        def _cut(self) -> None:
            self._was_cut = True
            self.writer.transport.abort()
            fd = self._socket.fileno() if self._socket is not None else -1
            if fd >= 0:  # -1 once the transport has closed it
                # The TCP connection under the TLS layer ends in both directions: the
                # transport sees its end even if abort() found nothing to abort.
                with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as same:
                    same.shutdown(socket.SHUT_RDWR)

    hypercorn_run.TCPServer = CuttingTCPServer
