"""Redis replies (RESP2 and RESP3) parsed from bytes as they arrive: sans-IO.

:class:`.wire.Calls` parses the replies to a batch of admissions in its connection's data
callback, so each caller resumes in the next event-loop turn. redis-py parses them in a task
that reads an ``asyncio.StreamReader``: the data callback wakes that task a turn later, and
the task wakes the caller a turn after that. In a ramp each turn relays every chunk ready
then, a millisecond or more that a stream's start waits.

Replies come as redis-py's own parsers return them with ``disable_decoding``: simple, bulk
and verbatim strings as ``bytes`` (a verbatim string without its format), integers and big
numbers as ``int``, doubles as ``float``, booleans as ``bool``, arrays and sets as ``list``,
maps as ``dict``, a nil or null as ``None``, and an error reply as an exception *value*
(:class:`~redis.exceptions.NoScriptError` for ``NOSCRIPT``, else
:class:`~redis.exceptions.ResponseError`), for the caller to raise. A connection speaks
RESP3 when redis-py asks for it in its ``HELLO`` (redis-py 8's default; 5's is RESP2).
Out-of-band pushes and attributes are skipped: nothing here subscribes or tracks keys.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import InvalidResponse, NoScriptError, ResponseError

__all__ = ["ReplyParser"]

_MORE = object()
"""The buffer ends inside a reply."""


def _error(message: bytes) -> ResponseError:
    text = message.decode(errors="replace")
    code, _, rest = text.partition(" ")
    if code == "NOSCRIPT":  # as redis-py: the script cache lost it, so send its body
        return NoScriptError(rest)
    return ResponseError(text)


def _parse(buffer: bytearray, at: int) -> Any:
    """``(reply, position after it)``, or :data:`_MORE`."""
    end = buffer.find(b"\r\n", at)
    if end < 0:
        return _MORE
    kind = buffer[at]
    line = bytes(buffer[at + 1 : end])
    after = end + 2
    try:
        if kind == 0x3A or kind == 0x28:  # ':' integer, '(' big number
            return int(line), after
        if kind == 0x24 or kind == 0x3D or kind == 0x21:  # '$' bulk, '=' verbatim, '!' error
            size = int(line)
            if size < 0:
                return None, after
            if len(buffer) < after + size + 2:
                return _MORE
            value = bytes(buffer[after : after + size])
            if kind == 0x3D:
                value = value[4:]  # "txt:" or "mkd:", as redis-py drops it
            elif kind == 0x21:
                return _error(value), after + size + 2
            return value, after + size + 2
        if kind in _AGGREGATES:
            count = int(line)
            if count < 0:
                return None, after
            items = []
            for _ in range(count * (2 if kind in _PAIRS else 1)):
                parsed = _parse(buffer, after)
                if parsed is _MORE:
                    return _MORE
                item, after = parsed
                items.append(item)
            if kind == 0x25:  # '%' map
                return dict(zip(items[::2], items[1::2], strict=True)), after
            if kind == 0x3E or kind == 0x7C:  # '>' push, '|' attribute: not a reply
                return _parse(buffer, after)
            return items, after
        if kind == 0x2C:  # ',' double
            return float(line), after
    except ValueError:
        raise InvalidResponse(f"Redis sent a malformed length: {line[:40]!r}") from None
    except TypeError:  # a map keyed by an array
        raise InvalidResponse("Redis sent a map with an unhashable key") from None
    if kind == 0x2B:  # '+' simple string
        return line, after
    if kind == 0x2D:  # '-' error
        return _error(line), after
    if kind == 0x5F:  # '_' null
        return None, after
    if kind == 0x23:  # '#' boolean
        return line == b"t", after
    raise InvalidResponse(f"Redis sent an unknown reply type: {bytes([kind])!r}")


_AGGREGATES = frozenset(b"*~%>|")  # array, set, map, push, attribute
_PAIRS = frozenset(b"%|")  # their elements come in pairs


class ReplyParser:
    """Feed it bytes; it returns each reply once it is whole."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    @property
    def partial(self) -> bool:
        """Bytes of a reply not yet whole are held."""
        return bool(self._buffer)

    def feed(self, data: bytes) -> list[Any]:
        """The replies ``data`` completes, in order; raises
        :class:`~redis.exceptions.InvalidResponse` on bytes that are not RESP."""
        buffer = self._buffer
        buffer += data
        replies: list[Any] = []
        at = 0
        while at < len(buffer):
            parsed = _parse(buffer, at)
            if parsed is _MORE:
                break
            reply, at = parsed
            replies.append(reply)
        del buffer[:at]
        return replies
