"""Server-sent events, sans-IO: a decoder that takes bytes and yields events, and an encoder.

The decoder follows the WHATWG event-stream parsing rules (``\\r\\n``, ``\\r`` and ``\\n`` line
ends, a leading BOM, comments, ``id`` without NUL, ``retry``), is indifferent to how the byte
stream is split into pieces, and bounds memory: a line or an event longer than its limit
raises :class:`SSEProtocolError` instead of growing without end.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DONE",
    "HEARTBEAT",
    "SSEDecoder",
    "SSEEvent",
    "SSEProtocolError",
    "encode_comment",
    "encode_event",
]

DONE = "[DONE]"
"""The payload OpenAI sends as the last event of a chat completion stream."""

_BOM = b"\xef\xbb\xbf"


class SSEProtocolError(ValueError):
    """The byte stream is not a valid or acceptable event stream (e.g. a line over the limit)."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event. ``id`` is the stream's last event id at dispatch time."""

    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    """Incremental event-stream decoder: ``receive_data(bytes) -> list[SSEEvent]``."""

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20) -> None:
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes
        self._buffer = b""
        self._started = False
        self._skip_lf = False
        self._data: list[str] = []
        self._data_size = 0
        self._event_type = ""
        self._retry: int | None = None
        self.last_event_id: str | None = None
        """The ``id`` last set by the stream; what a reconnect sends as ``Last-Event-ID``."""

    def receive_data(self, data: bytes) -> list[SSEEvent]:
        """Feed bytes; return the events completed by them, in order."""
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buffer = self._buffer + data if self._buffer else data
        if not self._started:
            if len(buffer) < len(_BOM) and _BOM.startswith(buffer):
                self._buffer = buffer
                return []
            self._started = True
            if buffer.startswith(_BOM):
                buffer = buffer[len(_BOM) :]
        lines = buffer.splitlines(keepends=True)
        events: list[SSEEvent] = []
        rest = b""
        if lines and not lines[-1].endswith((b"\n", b"\r")):
            rest = lines.pop()
            if len(rest) > self._max_line:
                raise SSEProtocolError(f"event-stream line longer than {self._max_line} bytes")
        if lines and lines[-1].endswith(b"\r"):
            # A CR at the very end may be the first half of a CRLF split across pieces.
            self._skip_lf = not rest
        self._buffer = rest
        for raw in lines:
            line = raw.rstrip(b"\r\n")
            if len(line) > self._max_line:
                raise SSEProtocolError(f"event-stream line longer than {self._max_line} bytes")
            if not line:
                event = self._dispatch()
                if event is not None:
                    events.append(event)
                continue
            self._field(line)
        return events

    def _field(self, line: bytes) -> None:
        if line[:1] == b":":
            return
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data_size += len(value) + 1
            if self._data_size > self._max_event:
                raise SSEProtocolError(f"event larger than {self._max_event} bytes")
            self._data.append(value.decode("utf-8", "replace"))
        elif name == b"id":
            if b"\0" not in value:
                self.last_event_id = value.decode("utf-8", "replace")
        elif name == b"event":
            self._event_type = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():
            self._retry = int(value)

    def _dispatch(self) -> SSEEvent | None:
        data, event_type, retry = self._data, self._event_type, self._retry
        self._data, self._data_size, self._event_type, self._retry = [], 0, "", None
        if not data:
            return None
        return SSEEvent(
            data="\n".join(data),
            event=event_type or "message",
            id=self.last_event_id,
            retry=retry,
        )


def encode_event(
    data: str | bytes, *, id: str | int | None = None, event: str | None = None
) -> bytes:
    """Frame one event. Multi-line data becomes several ``data:`` lines, as the spec requires."""
    payload = data.encode() if isinstance(data, str) else data
    parts: list[bytes] = []
    if event is not None:
        parts.append(b"event: " + event.encode() + b"\n")
    if id is not None:
        parts.append(b"id: " + str(id).encode() + b"\n")
    if b"\n" in payload or b"\r" in payload:
        lines = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        parts.extend(b"data: " + line + b"\n" for line in lines)
    else:
        parts.append(b"data: " + payload + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


def encode_comment(text: str = "") -> bytes:
    """One comment line, which every conforming decoder ignores.

    It is deliberately *not* followed by a blank line: a blank line dispatches an event, and
    decoders differ on what an event with no data is. The WHATWG rules drop it, but the
    official ``openai`` SDK's decoder (and others built the same way) dispatches an empty
    event once the stream has set an ``id`` and then fails to parse it as JSON. A lone
    comment line just joins the lines of the next real event, which stays well-formed.
    """
    if "\n" in text or "\r" in text:
        raise ValueError("an SSE comment is one line: no CR or LF in its text")
    return b": " + text.encode() + b"\n"


HEARTBEAT = encode_comment("ping")
"""What a server sends on an idle event stream (``: ping`` and one LF, see
:func:`encode_comment`): bytes that keep proxies and idle timers from closing the connection
and that no SSE client turns into an event."""
