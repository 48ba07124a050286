"""Refuse an oversized WebSocket message at its frame header (sans-IO).

hypercorn (0.17, 0.18) counts a message's size only as its payload arrives and, once over
``websocket_max_message_size``, sends 1009 but goes on buffering what the client sends: one
128 MB frame cost 128 MB. :class:`FrameSizeGuard` reads the frame headers of the client's
byte stream (RFC 6455 section 5.2) and says at the header of the frame that would take a
message over the limit; payload bytes are counted and skipped, never kept.
"""

from __future__ import annotations

__all__ = ["FrameSizeGuard"]

_CONTINUATION = 0x0
_FIRST_CONTROL = 0x8


class FrameSizeGuard:
    """Follows the frames of one client-to-server byte stream.

    Data frames (text, binary and their continuations) add up to a message; a frame whose
    header takes the message over ``max_message_bytes`` refuses the stream for good. Control
    frames (at most 125 bytes by the RFC) are left to the WebSocket parser.
    """

    def __init__(self, max_message_bytes: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.refused = False
        self.declared_bytes = 0
        """The refused frame's declared payload length (0 until refused)."""
        self._header = bytearray()
        self._payload_left = 0
        self._message_bytes = 0

    def feed(self, data: bytes) -> bool:
        """Follow ``data`` (any split of the stream); False once a message is over the limit
        (and for everything fed after)."""
        if self.refused:
            return False
        at, end = 0, len(data)
        while at < end:
            if self._payload_left:
                step = min(self._payload_left, end - at)
                self._payload_left -= step
                at += step
                continue
            need = self._header_length()
            take = min(need - len(self._header), end - at)
            self._header += data[at : at + take]
            at += take
            if len(self._header) == self._header_length() and not self._frame_header_done():
                return False
        return True

    def _header_length(self) -> int:
        if len(self._header) < 2:
            return 2
        second = self._header[1]
        short = second & 0x7F
        extended = 2 if short == 126 else 8 if short == 127 else 0
        return 2 + extended + (4 if second & 0x80 else 0)

    def _frame_header_done(self) -> bool:
        header, self._header = bytes(self._header), bytearray()
        short = header[1] & 0x7F
        if short == 126:
            length = int.from_bytes(header[2:4], "big")
        elif short == 127:
            length = int.from_bytes(header[2:10], "big")
        else:
            length = short
        opcode = header[0] & 0x0F
        if opcode < _FIRST_CONTROL:
            if opcode != _CONTINUATION:
                self._message_bytes = 0
            self._message_bytes += length
            if self._message_bytes > self.max_message_bytes:
                self.refused = True
                self.declared_bytes = length
                return False
            if header[0] & 0x80:  # FIN: the message is complete
                self._message_bytes = 0
        self._payload_left = length
        return True
