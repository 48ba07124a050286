"""uvicorn's ASGI ``send`` for an HTTP/1.1 request cycle, with the common case in fewer steps.

uvicorn's ``RequestResponseCycle.send`` was the costliest function of a streamed request
(~590 Python opcodes of ~12,300): for the response head it runs two regular expressions,
a ``lower()`` and three comparisons for every header, the date header included. The
headers of a response are almost always the same few names with new values, so
:func:`fast_send` gives a cycle a ``send`` that:

- builds the head from each name's lower-cased form, learnt once per name (a name is
  learnt only if uvicorn's name check passes and it is none of the names that change the
  framing or the connection: ``content-length``, ``transfer-encoding``, ``connection``),
  and checks all the values against uvicorn's value pattern at once, over their
  concatenation (the pattern matches single characters: it finds one in the concatenation
  exactly when it finds one in a value), by deleting the bytes it matches (learnt once); a
  head of learnt names is written in one C call where the module was built
  (:data:`_RENDER_HEAD`);
- writes a part of a chunked body and ends it as uvicorn's does;
- takes the body's first part in the response start (:data:`EXTENSION`, which the scope's
  extensions list): the head and that part go out in one write, where the head and then
  the part were two (a streamed answer has its first event at hand when its head goes).

Its state changes, its writes and their bytes are uvicorn's (``response_started``,
``waiting_for_100_continue``, ``chunked_encoding``, ``response_complete``, the message
event, the close without keep-alive, ``on_response``), in the same order. Anything else
(a head with one of those names, a name or a value uvicorn would refuse, an unknown
status, the access log on, the writes paused, a client gone, a body not chunked, a message
out of turn) goes to uvicorn's own ``send``, untouched, before anything is changed: its
checks, errors and waits are the ones that apply.

Set on HTTP/1.1 cycles other than ``HEAD`` by :mod:`.uvicorn_limits` (an HTTP/1.0 one gets
:mod:`.http10`'s), before their ``run_asgi`` task runs; :mod:`.patches` checks the shape of
``send`` it reproduces (``uvicorn-h1-send``). The ``send`` refers to its cycle, so the
cycle's attribute is taken back at the response's end (``uvicorn_limits._drop_writer``):
that loop would leave each request's objects to the cyclic GC.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .. import chunkpath

__all__ = ["EXTENSION", "fast_send"]

EXTENSION = "firstbyte.head_body"
"""In the scope's extensions where this ``send`` is the cycle's; in an ``http.response.start``
message, the first part of the body (more parts to follow), written with the head."""

_SPECIAL = frozenset({b"content-length", b"transfer-encoding", b"connection"})
"""Names whose value changes the framing or the connection: uvicorn's ``send`` has them."""
_NAMES: dict[bytes, bytes] = {}
"""Header lines' starts as sent (the name lower-cased, then ``: ``), by the name's bytes the
application gave: checked once."""
_MAX_NAMES = 512
"""Past this many names kept, a new one is checked each time (made-up names cannot grow
the table)..."""
_MAX_NAME_BYTES = 64
"""... and longer names are checked each time, never kept."""
_STATUS_LINE: dict[int, bytes] = {}
"""uvicorn's status lines, by status (bound at the first cycle: this module imports no
library when imported)."""
_REFUSED: bytes = bytes(range(256))
"""The bytes uvicorn's value check refuses (bound with the status lines; until then every
byte). Its pattern is one class of single characters (``HEADER_VALUE_RE``, its source
checked by :mod:`.patches`): a value passes it exactly when deleting these bytes leaves it
whole, which ``bytes.translate`` tells in a C loop of a few instructions a byte, where the
regular expression's search took ~25 (~8k instructions for a streamed answer's head)."""


_REFUSED_TABLE: bytes = b"\x01" * 256
""":data:`_REFUSED` as the compiled :func:`_render` reads it: a byte's entry not zero if
refused."""


def _bind() -> None:
    global _STATUS_LINE, _REFUSED, _REFUSED_TABLE
    from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE, STATUS_LINE

    _REFUSED = bytes(b for b in range(256) if HEADER_VALUE_RE.search(bytes((b,))))
    _REFUSED_TABLE = bytes(1 if b in _REFUSED else 0 for b in range(256))
    _STATUS_LINE = STATUS_LINE


def _learn(name: bytes) -> bytes | None:
    """The start of ``name``'s line (lower-cased, then ``: ``), if uvicorn takes it and it
    changes neither the framing nor the connection; else None (uvicorn's ``send`` then sends
    the head)."""
    from uvicorn.protocols.http.httptools_impl import HEADER_RE

    if type(name) is not bytes or HEADER_RE.search(name):
        return None
    lowered = name.lower()
    if lowered in _SPECIAL:
        return None
    start = lowered + b": "
    if len(_NAMES) < _MAX_NAMES and len(name) <= _MAX_NAME_BYTES:
        _NAMES[name] = start
    return start


def _render(
    status_line: bytes, defaults: Any, headers: Any, names: dict[bytes, bytes], refused: bytes,
    tail: bytes, first: Any,
) -> bytes | None:
    """A response head as sent: ``status_line``, a line for each of ``defaults`` (uvicorn's:
    the date) then ``headers``, ``tail``, then ``first`` (if not empty) as a chunk; or None
    where uvicorn's ``send`` must send it (see the module's docstring). ``names``:
    :data:`_NAMES`, which this adds to; ``refused``: unused, as :data:`_RENDER_HEAD` has it
    (the compiled one's table of :data:`_REFUSED`)."""
    parts = [status_line]
    # A loop over both lists, not their concatenation: uvicorn's default headers (the
    # date) come first, as uvicorn sends them.
    for given in (defaults, headers):
        for name, value in given:
            try:  # a subscript, not get(): no call for a name learnt
                start = names[name]
            except KeyError:
                learnt = _learn(name)
                if learnt is None:
                    return None
                start = learnt
            # Three appends, not += of a tuple: no tuple made, and list.append has its own
            # fast step in the interpreter (~200 instructions a header less).
            parts.append(start)
            parts.append(value)
            parts.append(b"\r\n")
    joined = b"".join(parts[2::3])  # the values (each line: its start, value, end)
    if len(joined.translate(None, _REFUSED)) != len(joined):
        return None  # uvicorn refuses the first bad value
    parts.append(tail)
    if first:  # the body's first part, in the same write
        parts.append(b"%x\r\n" % len(first))
        parts.append(first)
        parts.append(b"\r\n")
    return b"".join(parts)


_RENDER_HEAD: Callable[..., bytes | None] = (
    _render if chunkpath.RENDER_HEAD is None else chunkpath.RENDER_HEAD
)
""":func:`_render`, compiled where it was built (``render_head`` in ``router/_chunkpath.c``:
~1.5k instructions where the loop above cost ~16k a streamed answer's head). The compiled one
renders only heads whose every name is learnt and whose pairs are exact tuples of bytes, and
says None for any other, which then goes to :func:`_render`: what it makes of a head is the
same."""

_CHUNKED = b"transfer-encoding: chunked\r\n\r\n"
_CLOSE_CHUNKED = b"connection: close\r\n" + _CHUNKED
_CLOSE = b"connection: close\r\n\r\n"


def fast_send(cycle: Any) -> None:
    """Give uvicorn's HTTP/1.1 request ``cycle`` (not a ``HEAD``) the ``send`` above; must be
    called before its ``run_asgi`` task runs."""
    if cycle.scope["method"] == "HEAD":
        return  # uvicorn's send writes no body for it: nothing to gain
    if not _STATUS_LINE:
        _bind()
    uvicorn_send: Callable[[Any], Awaitable[None]] = cycle.send
    # The closure holds the cycle and uvicorn's send only: each object it holds is one
    # more for the cyclic GC to count while the request lasts.

    async def send(message: Any) -> None:
        if cycle.flow.write_paused or cycle.disconnected:
            await _uvicorns(uvicorn_send, message)  # it waits, or drops the message
            return
        if not cycle.response_started:
            head = None
            if message["type"] == "http.response.start" and not cycle.access_log:
                # try/except, not contextlib.suppress: no context manager made a response
                try:
                    status = message["status"]
                    line = _STATUS_LINE.get(status) if type(status) is int else None
                    if line is not None:  # else uvicorn's send says what is wrong
                        chunked = (cycle.chunked_encoding is None and status != 204
                                   and status != 304)
                        first = message.get(EXTENSION)
                        if chunked:  # the body's first part goes in the same write
                            tail = _CHUNKED if cycle.keep_alive else _CLOSE_CHUNKED
                            with_head = first
                        else:
                            tail = b"\r\n" if cycle.keep_alive else _CLOSE
                            with_head = None
                        given = message.get("headers", ())
                        defaults = cycle.default_headers
                        head = _RENDER_HEAD(line, defaults, given, _NAMES, _REFUSED_TABLE, tail,
                                            with_head)
                        if head is None and _RENDER_HEAD is not _render:  # not one it takes
                            head = _render(line, defaults, given, _NAMES, _REFUSED_TABLE, tail,
                                           with_head)
                except Exception:  # uvicorn raises it, as far into its state as it gets there
                    head = None
            if head is None:
                await _uvicorns(uvicorn_send, message)
                return
            cycle.response_started = True
            cycle.waiting_for_100_continue = False
            if chunked:
                cycle.chunked_encoding = True
            cycle.transport.write(head)
            if first and not chunked:  # as the body message it stands for (uvicorn: no body)
                await uvicorn_send({"type": "http.response.body", "body": first, "more_body": True})
            return
        if (
            cycle.response_complete
            or cycle.chunked_encoding is not True
            or message["type"] != "http.response.body"
        ):
            await uvicorn_send(message)
            return
        body = message.get("body", b"")
        transport = cycle.transport
        if message.get("more_body", False):
            if body:
                transport.write(b"%x\r\n%b\r\n" % (len(body), body))
            else:
                transport.write(b"")  # as uvicorn's: a part without bytes writes none
            return
        if cycle.expected_content_length != 0:
            await uvicorn_send(message)  # it refuses a body shorter than announced
            return
        transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n")
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            transport.close()
        cycle.on_response()

    cycle.send = send
    cycle.scope.setdefault("extensions", {})[EXTENSION] = True


async def _uvicorns(uvicorn_send: Callable[[Any], Awaitable[None]], message: Any) -> None:
    """uvicorn's ``send`` of ``message``; then a response start's first part of the body
    (:data:`EXTENSION`), as the body message it stands for (through uvicorn's ``send`` too:
    the cycle's ``send`` referring to itself would be a loop for the cyclic GC)."""
    await uvicorn_send(message)
    if message.get("type") == "http.response.start":
        first = message.get(EXTENSION)
        if first:
            await uvicorn_send({"type": "http.response.body", "body": first, "more_body": True})
