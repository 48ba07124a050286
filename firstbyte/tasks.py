"""Stopping a background task without swallowing the caller's own cancellation.

The SDK and the router both stop helper tasks (a stream's reader, a poller, a renewer) by
cancelling them and waiting for them to finish. The common spelling::

    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

is wrong when the *waiting* task is cancelled while it waits: the ``CancelledError`` meant for
it is suppressed as if it were the helper's, and it runs on as if never cancelled. In the SDK
that lost an application's cancel of a task reading a stream (about one in three, when the
cancel landed while the stream was being closed), so a loop of requests cancelled from outside
never stopped, and ``asyncio.timeout`` around a stream could fail to fire.
"""

from __future__ import annotations

import asyncio
from typing import Any


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # marks it retrieved: no "exception was never retrieved" log


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and return once it has finished.

    Raises what ``task`` raised other than its cancellation (as ``await task`` would), and the
    caller's own ``CancelledError`` if the caller is cancelled while waiting; in that case
    ``task`` finishes in the background and what it raises is not logged as unretrieved."""
    task.cancel()
    try:
        await asyncio.wait([task])  # returns when task is done; raises only our own cancel
    except asyncio.CancelledError:
        task.add_done_callback(_retrieve)
        raise
    if not task.cancelled() and (exc := task.exception()) is not None:
        raise exc
