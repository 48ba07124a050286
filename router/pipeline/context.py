"""The request context every pipeline stage reads and extends, and the stage outcomes.

A non-IO stage is a plain function ``(ctx, ...) -> Continue | LocalReply | Fallback``:
- :class:`Continue`: go on to the next stage;
- :class:`LocalReply`: answer the client now (an error, a 429) without going upstream;
- :class:`Fallback`: this stage cannot serve here; a later stage (e.g. the multi-region
  router's peer forwarding) may take over, else it becomes a 503 reply.
Stages are testable without sockets: build a context, call the function, look at the outcome.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import msgspec

from firstbyte.protocol import paths
from firstbyte.protocol.codec import CHAT, Codec
from firstbyte.protocol.openai import ChatCompletionRequest, encode, error_body

from ..chunkpath import HUNDREDTHS_TEXT
from ..streams import owner_of

if TYPE_CHECKING:
    from ..geo import Location
    from ..hosting.prometheus import GapTimer
    from ..observability.access import Usage
    from ..readers import ReadableStream
    from .backend import Backend
    from .region import RegionDecision

__all__ = [
    "CONTINUE",
    "Continue",
    "FailCause",
    "Fallback",
    "LocalReply",
    "Observer",
    "Outcome",
    "RequestContext",
    "Traceparent",
    "error_reply",
    "transport_of",
]


def _no_text(ms: float) -> str | None:
    """None: where the compiled module is not there, ``format(ms, ".2f")`` answers alone."""
    return None


_dur_text: Callable[[float], str | None] = HUNDREDTHS_TEXT or _no_text
"""``format(ms, ".2f")`` for a float where that is plain (see
:data:`firstbyte.router.chunkpath.HUNDREDTHS_TEXT`), else None (its callers then call
``format``)."""


@dataclass(frozen=True, slots=True)
class Continue:
    """Proceed to the next stage."""


CONTINUE = Continue()


@dataclass(frozen=True, slots=True)
class LocalReply:
    """Answer the client directly with this status, JSON body and extra headers."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    outcome: str = "rejected"
    """The ``outcome`` label in the requests metric."""
    code: str = ""
    """The error code in the body (the ``reason`` of a counted rejection)."""


@dataclass(frozen=True, slots=True)
class Fallback:
    """This stage could not serve the request here; ``reason`` says why (for logs/metrics)."""

    reason: str


Outcome = Continue | LocalReply | Fallback


def error_reply(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    *,
    param: str | None = None,
    code: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
    outcome: str = "rejected",
) -> LocalReply:
    """A :class:`LocalReply` carrying OpenAI's error body."""
    body = encode(error_body(message, type, param=param, code=code))
    return LocalReply(status, body, headers, outcome, code or "")


_HEX = frozenset("0123456789abcdef")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


def _nonzero_bits(n: int) -> int:
    bits = random.getrandbits(n)
    while not bits:  # all zeros is W3C's invalid id
        bits = random.getrandbits(n)
    return bits


def new_span_id() -> str:
    """A W3C span id: 64 random bits, not zero. From :mod:`random`, as OpenTelemetry's
    ``RandomIdGenerator`` draws them: an id names a span, it guards nothing, and a system
    call per id (``secrets``) cost ~2% of a streamed request's CPU."""
    # Hex through bytes: a third of f"{bits:016x}"'s instructions, the same 16 digits.
    return _nonzero_bits(64).to_bytes(8, "big").hex()


# A msgspec Struct, not a frozen dataclass: made once or twice a request, and a frozen
# dataclass's __init__ is a Python call setting each field through object.__setattr__.
class Traceparent(msgspec.Struct, frozen=True):
    """A W3C ``traceparent``: the request's trace id and the router's own span id."""

    trace_id: str
    parent_id: str
    flags: str = "01"
    caller_id: str | None = None
    """The caller's span id from its ``traceparent`` (the parent of the router's span)."""

    @classmethod
    def continue_from(cls, header: str | None) -> Traceparent:
        """Join the caller's trace (new span id) or start a new one if absent or malformed."""
        if header:
            parts = header.strip().lower().split("-")
            if (
                len(parts) == 4
                and parts[0] == "00"
                and len(parts[1]) == 32
                and len(parts[3]) == 2
                and _HEX.issuperset(parts[1] + parts[3])  # a set's test: no generator
                and parts[1] != _ZERO_TRACE
            ):
                span = parts[2]
                valid = len(span) == 16 and span != _ZERO_SPAN and _HEX.issuperset(span)
                caller = span if valid else None
                return cls(parts[1], new_span_id(), parts[3], caller)
        # A new trace: its id and the router's span id from one draw, in hex through bytes
        # (some 5k instructions a request less than two draws each formatted); an all-zero
        # id, which W3C forbids (1 in 2**64), is drawn again.
        ids = random.getrandbits(192).to_bytes(24, "big").hex()
        trace_id, span_id = ids[:32], ids[32:]
        if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return cls(_nonzero_bits(128).to_bytes(16, "big").hex(), new_span_id())
        return cls(trace_id, span_id)

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.parent_id}-{self.flags}"

    @property
    def sampled(self) -> bool:
        """The caller's sampling decision (W3C ``sampled`` flag); a new trace is sampled."""
        return bool(int(self.flags, 16) & 1)


FailCause = Literal["refused", "reset", "first_byte_timeout", "5xx"]
"""Why a request leaves its backend before anything reached its client: the connection was
refused (or not accepted in time), closed or reset before any byte of the answer, no byte of
the answer came by the first-byte deadline, or the backend answered 5xx."""


class Observer(Protocol):
    """Per-request hooks the proxy calls while it streams (the multi-region stage's
    ``Observation``): the first token, each later batch of chunks, the first-token deadline
    and its switch, the first-byte deadline, a backend that failed the request before
    anything reached the client (:data:`FailCause`), the end."""

    first_token_deadline_s: float | None
    gaps: GapTimer
    """What :meth:`chunk` ticks; the compiled per-chunk path ticks it in its place."""

    def first_token(self, ctx: RequestContext, ttft_ms: float) -> None: ...
    def chunk(self, ctx: RequestContext, now: float) -> None: ...
    def claim_switch(self, ctx: RequestContext) -> bool: ...
    def switch(self, ctx: RequestContext) -> Backend: ...
    def first_byte_timeout_s(self) -> float | None: ...
    async def fail_over(
        self, ctx: RequestContext, exc: Exception, cause: FailCause = "refused"
    ) -> Backend | None: ...
    def finished(self, ctx: RequestContext, ok: bool) -> None: ...


_T = TypeVar("_T")

_ANONYMOUS = owner_of(None)


class _Credential(Generic[_T]):
    """:attr:`RequestContext.api_key` and :attr:`RequestContext.token_owner`: setting either
    works out the request's :attr:`~RequestContext.owner` again, a plain attribute then.
    A property, it was a Python call at each of the six to eight times a request asks."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name  # where the value is: a field of the context

    def __get__(self, ctx: object, objtype: type | None = None) -> _T | None:
        return None if ctx is None else getattr(ctx, self.name)

    def __set__(self, ctx: RequestContext, value: _T | None) -> None:
        setattr(ctx, self.name, value)
        token_owner, key = ctx._token_owner, ctx._api_key
        # No key (an anonymous router's request without one): the one owner of them all,
        # known, where a digest costs ~6k instructions.
        ctx.owner = (
            token_owner if token_owner is not None else owner_of(key) if key else _ANONYMOUS
        )


def transport_of(ctx: RequestContext) -> str:
    """:attr:`RequestContext.transport`, as a function: a property is a Python call made from
    C, dearer than a plain call (its once-a-request reader calls this)."""
    path = ctx.path
    if path == paths.WEBSOCKET:
        return "websocket"
    if path == paths.STREAMS:
        return "longpoll"
    return "sse" if ctx.stream_requested else "json"


# Slots: its ~40 fields set a request in a quarter less of the instructions, and read faster.
@dataclass(eq=False, slots=True)
class RequestContext:
    """What the pipeline knows about one request; stages fill it in, in order.

    Times are ``time.perf_counter()`` seconds: ``received_at`` when the request arrived,
    ``admitted_at`` after admission, ``routed_at`` after the backend was chosen.
    """

    method: str
    path: str
    # The key (in ``headers`` and ``api_key``) and the prompt stay out of the repr, which an
    # error report or a debug log line may print.
    headers: dict[str, str] = field(repr=False)
    """Lower-cased header names; the last value wins."""
    body: bytes = field(default=b"", repr=False)
    client: tuple[str, int] | None = None
    http_version: str = "1.1"
    received_at: float = field(default_factory=time.perf_counter)
    # The credential: not fields (not in the constructor or the repr), each None until
    # admission sets it; setting one sets ``owner``.
    api_key = _Credential[str]()
    """The API key the request came with (None: none, or a client token)."""
    token_owner = _Credential[bytes]()
    """Set when a client token authenticated the request: its key's owner digest
    (``api_key`` is then None: the router never sees the key behind a token)."""
    _api_key: str | None = field(default=None, init=False, repr=False)
    _token_owner: bytes | None = field(default=None, init=False, repr=False)
    token_key_id: str | None = field(init=False, repr=False)
    """The access line's ``key_id`` of a client token's key (None on a router without keys),
    set with :attr:`token_owner` and only then: a slot with no default, so building the
    context of a request without a token costs nothing more; read it only where
    :attr:`by_client_token`."""
    owner: bytes = field(default=_ANONYMOUS, init=False, repr=False)
    """Whose request this is (:func:`~firstbyte.router.streams.owner_of` the key): the
    owner of its streams and the subject of the per-key limits, for a key or its token.
    Set by setting ``api_key`` or ``token_owner``; before either, no key's."""
    subject: str | None = field(default=None, repr=False)
    """Who the key's request is for (an app's end user, bounded in size): a client token's
    subject, else the ``x-firstbyte-subject`` header, ``safety_identifier`` or ``user`` of the
    body (:func:`firstbyte.router.pipeline.admit.name_subject`); None: the key itself.
    Subjects of a key share its fair share; a token's subject reads only its own streams."""
    subject_max_streams: int | None = field(default=None, repr=False)
    """The subject's own cap on completions in flight, from its client token."""
    codec: Codec = CHAT
    """The request's wire format (its endpoint): how its body and events are read."""
    request: ChatCompletionRequest | None = field(default=None, repr=False)
    """What routing reads of the body (for a format other than chat, its view as a chat
    request: :meth:`~firstbyte.protocol.codec.Codec.decode_request`)."""
    stream_requested: bool = False
    traceparent: Traceparent = field(default_factory=lambda: Traceparent.continue_from(None))
    backend: Any = None
    """The chosen upstream (a ``router.pipeline.backend.Backend``)."""
    region: str = ""
    admitted_at: float | None = None
    routed_at: float | None = None
    # What the routing stages found, for the proxy and the response (typed, not a dict).
    location: Location | None = field(default=None, repr=False)
    """Where the client is (GeoIP), when known."""
    region_decision: RegionDecision | None = field(default=None, repr=False)
    observer: Observer | None = field(default=None, repr=False)
    """The routing stage's hooks for this request (first token, deadline switch, end)."""
    upstream_headers: dict[str, str] = field(default_factory=dict, repr=False)
    """Extra headers for the upstream request (to a peer region: its key, ours forwarded)."""
    response_headers: list[tuple[str, str]] = field(default_factory=list, repr=False)
    """Extra headers for the client's response (e.g. ``x-firstbyte-better-region``)."""
    placed_at: float | None = field(default=None, repr=False)
    """The router state's clock (not ``perf_counter``) when the request was placed and held
    for its key: its stream starts at that moment too (no await comes between)."""
    release_key_slot: Callable[[], object] | None = field(default=None, repr=False)
    """Gives back the slot the request holds of its API key's limit region-wide (shared
    state; :mod:`firstbyte.router.placement`): when the stream finishes, or the reply is out."""
    upstream_sent_at: float | None = None
    """When the (last) upstream request was sent; a first-token switch resets it."""
    first_token_at: float | None = None
    """When the first content chunk arrived from upstream."""
    outcome: str = ""
    """How the request ended, as the requests metric labels it (``ok``, ``rejected``, ...)."""
    error_code: str | None = None
    """The code of the router's own refusal (``key_rate_limited``, ...), for the access line."""
    route_reason: str = ""
    """Why routing answered 429 itself (a key of ``multiregion.REJECTION_REASONS``)."""
    upstream_error: str = ""
    """The last failure of its upstream requests, for the access line only (the client gets
    its own message): the connection's error with its text (``ReadTimeout: ...``) or the
    failing status (``UpstreamStatusError: HTTP 503``), kept when the request then failed
    over and was served.
    Never the upstream's own error text, which may echo the prompt."""
    model_label: str = ""
    """The ``model`` label of this request's metrics: its model once routing found a local
    backend or a peer listing it (:meth:`~firstbyte.router.pipeline.chooser.RouteChooser.
    model_label`), else empty: refused before its model was known, or a model nobody lists
    (so the label's values are bounded by the lists, whatever clients send)."""
    stream: ReadableStream | None = field(default=None, repr=False)
    """The stream this request started (a :class:`~firstbyte.router.streams.Stream` of this
    process) or reads (perhaps another process's, through Redis): for the access log."""
    usage: Usage | None = None
    """A non-streamed completion's usage (a stream's is read from the stream at its end)."""

    def adopt_api_key(self, key: str, owner: bytes) -> None:
        """Set :attr:`api_key` to ``key`` as setting it does, with its owner digest
        (:func:`~firstbyte.router.streams.owner_of` ``key``) already known: a configured key's,
        worked out once, not a SHA-256 a request."""
        self._api_key = key
        if self._token_owner is None:  # a token's owner stays the owner, as in _Credential
            self.owner = owner if key else _ANONYMOUS

    @property
    def transport(self) -> str:
        """How the client reads the answer, as metrics label it: ``websocket``, ``longpoll``
        (``POST /v1/streams``), ``sse`` (a streamed chat completion) or ``json``
        (:func:`transport_of`)."""
        return transport_of(self)

    @property
    def reader_subject(self) -> str | None:
        """The one subject whose streams this request may read: a client token's (None: an
        API key, or a token minted without a subject, reads every stream of its key)."""
        return self.subject if self.by_client_token else None

    @property
    def by_client_token(self) -> bool:
        return self._token_owner is not None  # not through the descriptor: a call less

    def server_timing(self, **more_ms: float) -> str:
        """``Server-Timing`` for what is known now: queue, route, then ``more_ms`` entries."""
        # Once a request, on every answer: queue and route in one f-string, no list joined.
        admitted_at = self.admitted_at
        if admitted_at is None:
            text = ""
        else:
            # Each duration as f"{ms:.2f}" writes it, in one C call where the compiled
            # module can (_dur_text): float.__format__'s decimal conversion was ~1.4k
            # instructions a duration, three a streamed request.
            queue_ms = (admitted_at - self.received_at) * 1000
            queue = _dur_text(queue_ms) or format(queue_ms, ".2f")
            routed_at = self.routed_at
            if routed_at is None:
                text = f"queue;dur={queue}"
            else:
                route_ms = (routed_at - admitted_at) * 1000
                route = _dur_text(route_ms) or format(route_ms, ".2f")
                text = f"queue;dur={queue}, route;dur={route}"
        for name, ms in more_ms.items():  # a loop: a generator is a call and a step each
            entry = f"{name.replace('_', '-')};dur={_dur_text(ms) or format(ms, '.2f')}"
            text = f"{text}, {entry}" if text else entry
        return text

    def server_timing_upstream_headers(self, ms: float) -> str:
        """``server_timing(upstream_headers=ms)``, a streamed request's head (once a
        stream), without the keywords' dict, its loop and the name's replace."""
        admitted_at = self.admitted_at
        if admitted_at is None:
            return f"upstream-headers;dur={ms:.2f}"
        queue_ms = (admitted_at - self.received_at) * 1000
        routed_at = self.routed_at
        if routed_at is None:
            return f"queue;dur={queue_ms:.2f}, upstream-headers;dur={ms:.2f}"
        return (f"queue;dur={queue_ms:.2f}, route;dur={(routed_at - admitted_at) * 1000:.2f},"
                f" upstream-headers;dur={ms:.2f}")
