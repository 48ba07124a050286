"""What a request gets when the shared state does not answer, or answers that it is full:
``503 state_unavailable``.

Every per-request call into Redis (admission, a stream looked up or read elsewhere, a backend
claimed for a failover) turns a failure of its own (refused connection, timeout after
``state.timeout_s``, no pooled connection free in time, an error reply) into
:class:`StateUnavailable`; the request's stage answers it with :func:`unavailable_reply`
(``Retry-After``, OpenAI's error body) and one log line per ten seconds, never a 500 or a
traceback. Nothing here imports redis-py: placement imports it with or without the extra.
"""

from __future__ import annotations

import logging
import re
import time

from firstbyte.protocol import error_codes

from ..hosting.limits import Throttle
from ..pipeline.context import LocalReply, error_reply

__all__ = ["RETRY_AFTER_S", "StateUnavailable", "unavailable_reply"]

log = logging.getLogger("firstbyte.router.shared")

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a ``state_unavailable`` answer: a restarted Redis is back in about
this long, and the SDK's retry budget covers a few of them."""

_throttle = Throttle(10.0)
_AWAY = "The region's shared state (Redis) is not answering; retry shortly."
_FULL = "The region's shared state (Redis) is full (out of memory); retry shortly."


_OOM = re.compile(r"\bOOM\b")
"""The error code a full Redis or Valkey (``maxmemory`` reached, ``noeviction``) starts its
refusal with (``OOM command not allowed when used memory > 'maxmemory'``), as it appears in
a :class:`StateUnavailable`'s message (``admission: ResponseError: OOM command ...``)."""


class StateUnavailable(Exception):
    """A command to the shared state failed or timed out (the message says which and why)."""

    @property
    def full(self) -> bool:
        """Redis answered, refusing for memory (``OOM``): it is full, not away."""
        return _OOM.search(str(self)) is not None


def unavailable_reply(exc: StateUnavailable) -> LocalReply:
    """The 503 for a request the shared state could not answer, logged (throttled); its
    message says whether Redis does not answer or answers that it is full."""
    more = _throttle.report("state_unavailable", time.monotonic())
    if more is not None:
        log.warning("shared state unavailable, answering 503 state_unavailable: %s%s", exc, more)
    return error_reply(
        503,
        _FULL if exc.full else _AWAY,
        "server_error",
        code=error_codes.STATE_UNAVAILABLE,
        headers=(("retry-after", str(RETRY_AFTER_S)),),
        outcome="state_unavailable",
    )

