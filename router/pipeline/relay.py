"""The relay's sans-IO core: one streamed upstream answer in, decisions for the store out.

Like aioquic's ``QuicConnection`` it never touches a socket or a clock. Its inputs are the
upstream's response head (:meth:`Relay.receive_head`), body bytes with their arrival time
(:meth:`Relay.receive_data`; or the events' payloads already cut out of them,
:meth:`Relay.receive_events`), the first-token deadline firing (:meth:`Relay.deadline_fired`),
the body's end (:meth:`Relay.receive_end`) and a transport failure (:meth:`Relay.fail`); each
returns the actions the IO shell (:mod:`firstbyte.router.pipeline.proxy`) carries out:
:class:`Append` events to the stream, :class:`ReleaseHead` (the client's response head may go
out), :class:`FirstToken`, :class:`SwitchBackend` and :class:`Finish`.

The events appended are the upstream's ``data`` payloads as bytes, sliced out of the body
without decoding them: readers frame each one with its ``id:`` for SSE, or pass it on as raw
JSON for long-poll and WebSocket. Framing follows the WHATWG event-stream rules: the common
case (``data: ...`` lines ended by ``\\n\\n``, what vLLM, SGLang and the sim send) is cut
with one ``bytes.find`` per event; an upstream that uses ``\\r`` line ends, a BOM, comments
or several fields in one event is handed to the full :class:`~firstbyte.protocol.sse.SSEDecoder`
from that byte on. Only chunks before the first content are JSON-decoded (to find it), and
an event whose JSON ends with ``}}`` (the usage chunk; an error event) when it closes a read:
a two-byte comparison per read, so the usage is known without decoding the chunks in between.
The usage chunk is dropped when the client did not ask for it (``strip_usage``: the router
asked instead).

The wire format is the request's :class:`~firstbyte.protocol.codec.Codec`: chat and
completions end with ``[DONE]`` (not stored as an event: the store's own ``[DONE]`` follows);
a format of named events (Responses, Anthropic Messages) keeps each event's ``event:`` line
with its data (``event: NAME\\ndata: ...``, sliced out as sent) and ends at its terminal event,
which is stored. Only the named formats look at every event for its end; chat's hot path is
as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.codec import CHAT, NAMED_PREFIX, Codec, named_event
from firstbyte.protocol.openai import encode, error_body
from firstbyte.protocol.sse import DONE, SSEDecoder, SSEEvent, SSEProtocolError

from ..observability.usage import TokenUsage, UsageReader, usage_reader

__all__ = [
    "Action",
    "Append",
    "EventFramer",
    "Finish",
    "FirstToken",
    "Relay",
    "ReleaseHead",
    "SwitchBackend",
    "error_event",
    "has_content",
    "upstream_error_object",
]

DONE_BYTES = DONE.encode()
_CR, _LF = 13, 10
_OPEN_BRACKET, _CLOSE_BRACE = 91, 125
_BOM = b"\xef\xbb\xbf"
"""A byte-order mark, which the event-stream format allows (and skips) at the very start."""
MAX_EVENT_BYTES = 4 << 20
"""An upstream event (or a run of bytes without an event end) larger than this fails the
stream instead of growing the buffer without bound."""


def error_event(message: str, type: str = "server_error", code: str | None = None) -> bytes:
    """An in-stream error payload (OpenAI's error body)."""
    return encode(error_body(message, type, code=code))


class Append(msgspec.Struct, frozen=True):
    """Append these event payloads to the stream, in order."""

    payloads: list[bytes]


# The actions are msgspec Structs, not frozen dataclasses: a few are made per request (one
# Append per relayed chunk on the full path), and a frozen dataclass's ``__init__`` is a
# Python call setting each field through ``object.__setattr__``; a Struct's is C (~3x less).
class ReleaseHead(msgspec.Struct, frozen=True, gc=False):
    """The client's response head may go out: ``status`` (200, or the upstream's refusal
    with its ``body``), ``elapsed_ms`` from the upstream request to its response head."""

    status: int
    body: bytes
    elapsed_ms: float


class FirstToken(msgspec.Struct, frozen=True, gc=False):
    """The first content chunk arrived ``upstream_ttft_ms`` after the upstream request."""

    upstream_ttft_ms: float


class SwitchBackend(msgspec.Struct, frozen=True, gc=False):
    """The first-token deadline passed without content: this upstream may be given up."""


class Finish(msgspec.Struct, frozen=True, gc=False):
    """The stream is over: ``ok`` if it ended with ``[DONE]``; else ``error`` is the error
    event to append first. ``outcome`` is the requests metric's label."""

    ok: bool
    outcome: str
    error: bytes | None = None


Action = Append | ReleaseHead | FirstToken | SwitchBackend | Finish


def has_content(data: bytes) -> bool:
    """Does this chat chunk carry output (text, a tool call, a refusal)?"""
    return CHAT.is_content(data)


def upstream_error_object(body: bytes) -> dict[str, Any] | None:
    """The ``error`` object of an upstream's error body (OpenAI's and Anthropic's both have
    ``{"error": {...}}``), or None for another body (a proxy's HTML page, nothing)."""
    try:
        data: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        error: dict[str, Any] = data["error"]
        return error
    return None


def _as_error_event(
    status: int, body: bytes, codec: Codec = CHAT, after: bytes | None = None
) -> bytes:
    """An upstream error reply as an in-stream error event: its body if it is OpenAI's and
    the format is OpenAI's chat or completions; in a format of named events (Responses,
    Anthropic's Messages), that format's error event carrying the upstream's message (from
    OpenAI's or Anthropic's error body, both ``{"error": {"message": ...}}``), following
    ``after``, the stream's last event."""
    error = upstream_error_object(body)
    if codec.named_events:
        message = error.get("message") if error is not None else None
        if not isinstance(message, str) or not message:
            message = f"Upstream answered {status}."
        return codec.error_event(message, code=f"upstream_{status}", after=after)
    if error is not None:
        return encode({"error": error})
    return error_event(f"Upstream answered {status}.", code=f"upstream_{status}")


class EventFramer:
    """Event-stream bytes in, each event's ``data`` (as bytes) out; any split of the input
    gives the same payloads as :class:`~firstbyte.protocol.sse.SSEDecoder` (encoded).

    ``named``: an event with an ``event:`` name comes out as ``event: NAME\\ndata: DATA``
    (:func:`~firstbyte.protocol.codec.named_event`; the upstream's own bytes when it sent
    exactly that shape)."""

    # Slots: the compiled read path (router/_chunkpath.c) reads ``idle`` at its offset.
    __slots__ = ("_buffer", "_decoder", "_max", "_named", "_started", "idle")

    def __init__(self, named: bool = False, *, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._max = max_event_bytes
        self._named = named
        self._buffer = b""
        self._decoder: SSEDecoder | None = None
        self._started = False
        """Bytes came (here, or cut elsewhere: :meth:`Relay.feed_events`): a BOM is no
        longer the stream's start, where alone it is skipped."""
        self.idle = True
        """At an event boundary on the fast framing: the next read's bytes are cut on their
        own (what :meth:`Relay.feed` checks before cutting one, and the compiled read path
        before it cuts one). The stream's start is one: a read of whole ``data: ...`` events
        starts with no BOM, and any other read comes here, which skips a BOM there."""

    def receive_data(self, data: bytes) -> list[bytes]:
        """Feed bytes; return the payloads of the events they complete, in order."""
        if self._decoder is not None:
            return self._payloads(self._decoder.receive_data(data))
        if not self._buffer:
            # The common read: one whole ``data: ...`` event, its first line end the
            # blank line's. A few C calls instead of the loop below (same payload, same
            # state after). The stream's first read too (its role chunk, as a rule): one
            # that starts with ``data: `` starts with no BOM.
            end = len(data) - 2
            if (
                data.find(b"\n") == end
                and data[end + 1 :] == b"\n"
                and data[:6] == b"data: "
                and _CR not in data
            ):
                self._started = True  # idle already: no buffer, no decoder
                return [data[6:end]]
        buffer = self._buffer + data if self._buffer else data
        if not self._started:
            self._started = True
            if buffer[:1] == _BOM[:1]:  # a BOM, maybe: the full decoder knows what to skip
                return self._fall_back(buffer, at_start=True)
        # Single bytes as ints: ``b"\r" in data`` first tries the bytes as an int and
        # builds (and drops) a TypeError, ~7x the cost of the search itself, per chunk.
        if _CR in data:
            return self._fall_back(buffer)
        payloads: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            block = buffer[start:end]
            if block[:6] == b"data: " and _LF not in block:
                payloads.append(block[6:])
            elif (
                self._named
                and block[:7] == b"event: "
                and block.count(b"\n") == 1
                and block.find(b"\ndata: ") >= 0
            ):
                payloads.append(block)  # ``event: NAME`` and one ``data:`` line, as sent
            elif block:
                # Another shape of event (fields, comments, several data lines): the full
                # decoder from this event on; it sees exactly the bytes not yet consumed.
                return payloads + self._fall_back(buffer[start:])
            start = end + 2
        self._buffer = buffer[start:]
        self.idle = not self._buffer
        if len(self._buffer) > self._max:
            raise SSEProtocolError(f"event larger than {self._max} bytes")
        return payloads

    def _fall_back(self, rest: bytes, *, at_start: bool = False) -> list[bytes]:
        self._buffer = b""
        self.idle = False
        self._decoder = SSEDecoder(max_event_bytes=self._max, max_line_bytes=self._max)
        if not at_start:
            # A blank line first: it dispatches nothing (no event is pending at an event
            # boundary) and takes the decoder past its stream start, where it strips a BOM.
            self._decoder.receive_data(b"\n")
        return self._payloads(self._decoder.receive_data(rest))

    def _payloads(self, events: list[SSEEvent]) -> list[bytes]:
        if not self._named:
            return [e.data.encode() for e in events]
        return [
            e.data.encode() if e.event == "message" else named_event(e.event, e.data.encode())
            for e in events
        ]


class Relay:
    """One streamed request's upstream answer(s), sans IO: see the module docstring.

    ``hold_head``: the client's response head waits for the first content (a first-token
    deadline may still move the request elsewhere, and the head names the region). After a
    switch (:meth:`start` again), the new upstream's events before its first content (its
    role chunk) are dropped when some were appended already: the client has the first's.
    """

    # Slots: the compiled read path (router/_chunkpath.c) reads and writes its fields at
    # their offsets.
    __slots__ = (
        "_appended_full", "_every", "_fast", "_framer", "_head_ms", "_pending", "_sent_at",
        "_skip_preamble", "_status", "appended", "codec", "done", "first_content",
        "full_reads", "head_released", "hold_head", "last_event", "read_usage", "strip_usage",
        "usage",
    )

    def __init__(
        self,
        *,
        hold_head: bool = False,
        codec: Codec = CHAT,
        strip_usage: bool = False,
        read_usage: UsageReader | None = None,
    ) -> None:
        self.hold_head = hold_head
        self.codec = codec
        self._every = codec.named_events
        """Look at every event (for its terminal event), not only until the first content."""
        self.strip_usage = strip_usage
        self.read_usage = read_usage or usage_reader(codec)
        """The format's usage reader: a candidate event (its JSON ends with ``}}``) ->
        (usage, whether the event is nothing but usage), or None."""
        self.usage: TokenUsage | None = None
        """The tokens the upstream reported (its usage chunk or events), once it did."""
        self.appended = 0
        self.last_event: bytes | None = None
        """The last event appended, in a format of named events (None before the first):
        an error the router adds follows it (Responses numbers it next)."""
        self.first_content = False
        self.done = False
        self.head_released = False
        self._framer = EventFramer(codec.named_events)  # positional: no keyword dict
        self._sent_at = 0.0
        self._status = 0
        self._head_ms = 0.0
        self._skip_preamble = False
        self._pending: list[Action] = []
        self.full_reads = 0
        """Reads :meth:`feed` handed to :meth:`receive_data`."""
        self._appended_full = 0
        """Events appended by :meth:`receive_data` (the others were cut by :meth:`feed`)."""
        self._fast = False
        """:meth:`feed` may cut a read itself: past the first content, nothing to drop
        or look at in every event, not done: ``first_content and not (_skip_preamble or
        _every or done)``, set where those change (:meth:`start`, :meth:`_scan`,
        :meth:`_finish`)."""

    def start(self, now: float) -> None:
        """A request to a (new) upstream was sent at ``now``."""
        if self._framer._started:  # the one made with the relay serves its first attempt
            self._framer = EventFramer(self.codec.named_events)
        self._sent_at = now
        self._status = 0
        self._skip_preamble = skip = self.appended > 0
        # The _fast rule (see __init__) here, where skip may change
        self._fast = self.first_content and not (skip or self._every or self.done)

    def receive_head(self, status: int, now: float, body: bytes = b"") -> list[Action]:
        """The upstream's response head; for a status other than 200, with its (bounded) body,
        which ends the stream."""
        self._status = status
        self._head_ms = (now - self._sent_at) * 1000
        if status != 200:
            return self._finish(
                Finish(False, f"upstream_{status}",
                       _as_error_event(status, body, self.codec, self.last_event)),
                ReleaseHead(status, body, self._head_ms),
            )
        if self.hold_head:
            return []
        self.head_released = True  # _release inlined (a call a request)
        return [ReleaseHead(200, b"", self._head_ms)]

    def receive_data(self, data: bytes, now: float) -> list[Action]:
        """Body bytes that arrived at ``now``."""
        if self.done:
            return []
        try:
            payloads = self._framer.receive_data(data)
        except SSEProtocolError as exc:
            return self.fail(type(exc).__name__, now)
        return self.receive_events(payloads, now)

    def receive_events(self, payloads: list[bytes], now: float) -> list[Action]:
        """The events' ``payloads`` that arrived at ``now``, as the framer cuts them out of
        body bytes: :meth:`receive_data` past its framer."""
        if not payloads or self.done:
            return []
        actions: list[Action] = []
        payloads = self._events(payloads, now, actions)
        if payloads:
            actions.insert(0, Append(payloads))
        return actions

    def _events(self, payloads: list[bytes], now: float, actions: list[Action]) -> list[bytes]:
        """What :meth:`receive_events` does with a read's ``payloads`` (some; not done): the
        payloads to append, counted as appended, and its other actions added to
        ``actions`` (inlined in :meth:`feed_events`: keep the two alike)."""
        if not self.first_content or self._skip_preamble or self._every or DONE_BYTES in payloads:
            payloads = self._scan(payloads, now, actions)
        elif payloads[-1][-2:] == b"}}" and self._usage(payloads[-1]):
            payloads = payloads[:-1]
        self.appended += len(payloads)
        return payloads

    def feed(self, data: bytes, now: float) -> list[bytes] | None:
        """:meth:`receive_data` for the hot path: when all the bytes make is events to
        append (the common read of a stream past its first content), their payloads (none
        when no event is complete yet), with no action object made; else None, and
        :meth:`take_actions` returns the actions :meth:`receive_data` would have (an
        :class:`Append` of the payloads among them)."""
        if self._fast and self._framer.idle:
            # One whole ``data: ...`` event, what a streaming server writes per token: the
            # framer's common case without its call (same payload, same state after). The
            # checks are the cheapest CPython has (an int index, not a slice or a method
            # with arguments), as this runs per relayed chunk. Not taken: the payload
            # starts with ``[`` (``[DONE]``) or ends with ``}}`` (usage, an error).
            end = len(data) - 2
            if (
                data.find(b"\n") == end
                and data[-1] == _LF
                and data[:6] == b"data: "
                and _CR not in data
                and data[6] != _OPEN_BRACKET
                and (data[end - 2] != _CLOSE_BRACE or data[end - 1] != _CLOSE_BRACE)
            ):
                self.appended += 1
                return [data[6:end]]
        # receive_data's steps, answered as feed answers (feed_events past the framer).
        if self.done:
            self.full_reads += 1
            return []
        try:
            payloads = self._framer.receive_data(data)
        except SSEProtocolError as exc:
            self.full_reads += 1
            self._pending = self.fail(type(exc).__name__, now)
            return None
        return self.feed_events(payloads, now)

    def feed_events(self, payloads: list[bytes], now: float) -> list[bytes] | None:
        """:meth:`feed` for a read already cut into its events' payloads (the compiled read
        path cuts whole chunks of one-line ``data:`` events, as the framer would at an event
        boundary): the same outcome, from :meth:`receive_events` on. A read cut elsewhere
        also takes the framer past the stream's start (a later BOM is not skipped)."""
        self._framer._started = True
        self.full_reads += 1
        if not payloads or self.done:
            return []
        # receive_events' work, its actions made only when there is more than an append;
        # _events inlined (two calls a request: the role chunk's read, the first content's).
        actions: list[Action] = []
        if not self.first_content or self._skip_preamble or self._every or DONE_BYTES in payloads:
            payloads = self._scan(payloads, now, actions)
        elif payloads[-1][-2:] == b"}}" and self._usage(payloads[-1]):
            payloads = payloads[:-1]
        count = len(payloads)
        self.appended += count
        self._appended_full += count
        if not actions:
            return payloads
        if payloads:
            actions.insert(0, Append(payloads))
        self._pending = actions
        return None

    @property
    def fast_reads(self) -> int:
        """Reads :meth:`feed` cut itself (one event each, so: the events it appended)."""
        return self.appended - self._appended_full

    def take_actions(self) -> list[Action]:
        """The actions of the last :meth:`feed` that returned None."""
        actions, self._pending = self._pending, []
        return actions

    def _scan(self, payloads: list[bytes], now: float, actions: list[Action]) -> list[bytes]:
        """The slow path: find the first content and ``[DONE]``; returns what to append."""
        kept: list[bytes] = []
        codec, every = self.codec, self._every
        for payload in payloads:
            if payload == DONE_BYTES:
                actions.extend(self._finish(Finish(True, "ok")))
                break
            end = None
            if every:
                if payload[:7] != NAMED_PREFIX:
                    # A bare event in a named format is named as the event-stream format
                    # names it (``message``): every stored event of such a stream is named,
                    # which lets readers look at one event per batch to know the framing.
                    payload = named_event(b"message", payload)
                end = codec.end_of(payload)
            if end is not None:  # the format's terminal event: stored, and the stream ends
                if payload[-2:] == b"}}":
                    self._usage(payload)  # Responses: the usage is in response.completed
                kept.append(payload)
                actions.extend(self._finish(Finish(end == "ok", end)))
                break
            if not self.first_content and codec.is_content(payload):
                self.first_content = True
                self._skip_preamble = False
                self._fast = not (every or self.done)  # the _fast rule, here
                actions.append(FirstToken((now - self._sent_at) * 1000))
                if not self.head_released:
                    actions.append(self._release())
            if self._skip_preamble:
                continue
            if payload[-2:] == b"}}" and self._usage(payload):
                continue
            kept.append(payload)
        if every and kept:
            self.last_event = kept[-1]
        return kept

    def _usage(self, payload: bytes) -> bool:
        """Note the usage ``payload`` reports; True if it is to be dropped (a usage-only
        chunk the client did not ask for)."""
        found = self.read_usage(payload)
        if found is None:
            return False
        usage, usage_only = found
        if self.usage is not None:  # Anthropic: input in message_start, output later
            usage = TokenUsage(
                usage.input_tokens if usage.input_tokens is not None else self.usage.input_tokens,
                usage.output_tokens
                if usage.output_tokens is not None
                else self.usage.output_tokens,
            )
        self.usage = usage
        return usage_only and self.strip_usage

    def deadline_fired(self, now: float) -> list[Action]:
        """The first-token deadline passed: switch if no content came yet."""
        if self.first_content or self.done:
            return []
        return [SwitchBackend()]

    def receive_end(self, now: float) -> list[Action]:
        """The upstream's body ended (cleanly or not) before or after ``[DONE]``."""
        if self.done:
            return []
        return self._finish(
            Finish(
                False,
                "upstream_eof",
                self.codec.error_event(
                    "The upstream closed the stream before its end.",
                    code=error_codes.UPSTREAM_EOF,
                    after=self.last_event,
                )
                if self._every
                else error_event(
                    "The upstream closed the stream before [DONE].", code=error_codes.UPSTREAM_EOF
                ),
            )
        )

    def fail(self, reason: str, now: float) -> list[Action]:
        """The upstream request failed (``reason``: the error's name, e.g. ``ReadTimeout``)."""
        if self.done:
            return []
        message = f"Upstream failed: {reason}."
        release = None
        if not self.head_released:
            # The same code as the error event and as a whole request's 502: a client
            # switching on ``code`` saw null here (a stream cut at its first-byte deadline).
            body = error_body(message, "server_error", code=error_codes.UPSTREAM_ERROR)
            release = ReleaseHead(502, encode(body), 0.0)
        return self._finish(
            Finish(
                False,
                "upstream_error",
                self.codec.error_event(
                    message, code=error_codes.UPSTREAM_ERROR, after=self.last_event
                ),
            ),
            release,
        )

    def _release(self, head: ReleaseHead | None = None) -> ReleaseHead:
        self.head_released = True
        return head or ReleaseHead(200, b"", self._head_ms)

    def _finish(self, finish: Finish, head: ReleaseHead | None = None) -> list[Action]:
        self.done = True
        self._fast = False
        actions: list[Action] = []
        if not self.head_released:
            # A 200 head that waited for content the stream never had goes out now.
            actions.append(self._release(head))
        actions.append(finish)
        return actions
