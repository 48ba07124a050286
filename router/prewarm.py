"""What a client's prewarm asks of the router (docs/browser.md, "Prewarm").

``GET /v1/edge/warm`` answers 204 with nothing: no key is checked, no body is read, no
backend or store is touched, so the request a page sends on the user's intent (focus of the
prompt box, a keystroke) and every 20 s while it stays visible costs the router one response
head. Its point is on the client's side: the connection it opens (TCP + TLS, or QUIC once the
page has learnt ``Alt-Svc`` from it) is the one the first message then reuses. The CORS
preflight cache is filled by a plain ``OPTIONS`` to the start URL, which
:class:`~firstbyte.router.cors.CorsPolicy` answers for listed origins without an endpoint.

While the router drains (:mod:`~firstbyte.router.drain`) both answer as a new stream is refused
then, with :func:`~firstbyte.router.multiregion.draining_reply` (503 ``draining``,
``Retry-After``): a connection kept warm on a process that refuses the next stream is no warmth,
and the refusal is what tells the client to warm another (a new connection, another process or
region). A prompt warm-up is refused so even when a peer region would take a new stream: its
point is the cache of the backend the conversation's next message goes to, which a client sent
elsewhere by the refusal reaches on its own.

``POST /v1/edge/warm`` with a chat request (the conversation so far) warms the *prompt*: the
request is admitted and placed as a chat completion is (the key's limits, the same prefix
affinity, so the backend chosen is the one the conversation's next message will be routed
to), then sent there with ``max_tokens`` 1 and without streaming, so the backend computes the
prefix's KV cache and keeps it. It is bounded per key and subject
(``limits.prompt_warms_per_min_per_subject``: :class:`WarmBudget` in one process, or the
region's with ``[state] redis_url``, :class:`~.shared.warm_budget.SharedWarmBudget`), its
tokens are counted as any request's (the access log's usage), and it is refused (503
``prompt_warm_busy``) when the region's backends hold more than
``limits.prompt_warm_max_load`` of their slots: a warm-up never takes a slot a real request
needs.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

import msgspec

from firstbyte.protocol import error_codes, paths
from firstbyte.protocol.openai import Usage
from firstbyte.protocol.prewarm import PromptWarmed

from .asgi import Receive, Scope, Send, send_bytes, unless_gone, until_disconnect
from .endpoints import _finish, _query, _read_request_body, new_context, not_found
from .multiregion import draining_reply
from .observability.access import reply_usage
from .pipeline.admit import admit_body, authenticate
from .pipeline.content_coding import ADVERTISED
from .pipeline.context import LocalReply, RequestContext, error_reply
from .pipeline.simple_start import adopt_query_token
from .placement import place, release_key_slot
from .shared.errors import StateUnavailable, unavailable_reply
from .state import CLIENT_GONE, RouterState

__all__ = [
    "Budget", "LocalBudget", "WarmBudget", "edge_warm", "region_busy", "warm_body",
    "warm_prompt",
]

WINDOW_S = 60.0
_MAX_TRACKED = 100_000
"""Keys and subjects whose warm-ups are remembered at once (the oldest forgotten first)."""


class WarmBudget:
    """Prompt warm-ups per (key owner, subject) in a sliding minute; sans-IO, clock passed in.

    Remembers at most ``max_tracked`` pairs (least recently used forgotten first), so an app
    with many end users costs bounded memory."""

    def __init__(self, per_min: int, max_tracked: int = _MAX_TRACKED) -> None:
        self.per_min = per_min
        self.max_tracked = max_tracked
        self._seen: OrderedDict[tuple[bytes, str | None], deque[float]] = OrderedDict()

    def take(self, owner: bytes, subject: str | None, now: float) -> float | None:
        """Count a warm-up at ``now`` and answer None, or answer the seconds until one may go
        (nothing counted)."""
        key = (owner, subject)
        times = self._seen.get(key)
        if times is None:
            times = self._seen[key] = deque()
            while len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        self._seen.move_to_end(key)
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        if len(times) >= self.per_min:
            return times[0] + WINDOW_S - now
        times.append(now)
        return None


class Budget(Protocol):
    """Where warm-ups are counted: this process, or the region (chosen once per router)."""

    async def take(self, owner: bytes, subject: str | None, per_min: int) -> float | None:
        """Count one and answer None, or answer the seconds until one may go."""
        ...


class LocalBudget:
    """:class:`WarmBudget` on the router's clock: one process's minute."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.budget = WarmBudget(0)
        self._clock = clock

    async def take(self, owner: bytes, subject: str | None, per_min: int) -> float | None:
        self.budget.per_min = per_min  # a reload's value
        return self.budget.take(owner, subject, self._clock())


_budgets: weakref.WeakKeyDictionary[RouterState, Budget] = weakref.WeakKeyDictionary()


def _budget(state: RouterState) -> Budget:
    budget = _budgets.get(state)
    if budget is None:
        shared = state.region_state.shared_warm_budget(WINDOW_S)
        budget = _budgets[state] = LocalBudget(state.clock) if shared is None else shared
    return budget


def region_busy(state: RouterState) -> bool:
    """Too busy for a warm-up: no backend with room, or the backends' load past
    ``limits.prompt_warm_max_load`` of their slots with this warm-up counted."""
    tracker = state.routing.tracker
    now = state.routing.clock()
    capacity = tracker.capacity()
    if capacity == 0 or tracker.region_saturated(now):
        return True
    load = sum(tracker.load(name, now) for name in tracker.healthy())
    return load + 1 > state.config.limits.prompt_warm_max_load * capacity


def warm_body(body: bytes) -> bytes:
    """The chat request in ``body`` as a warm-up: one token, not streamed. A body that is not
    a JSON object is returned as it is (admission then answers 400 for it)."""
    try:
        request = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body
    if not isinstance(request, dict):
        return body
    for name in ("stream_options", "max_completion_tokens", "n"):
        request.pop(name, None)
    request.update(max_tokens=1, stream=False)
    return msgspec.json.encode(request)


async def edge_warm(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``GET /v1/edge/warm``: 204, ``Cache-Control: no-store`` (every prewarm must reach the
    router: an answer from a cache would open no connection); while draining, a stream's
    refusal."""
    if state.draining:
        await _finish(state, send, new_context(state, scope), draining_reply(), "warm")
        return
    state.metrics.count("warm", "ok")
    await send_bytes(send, 204, b"", content_type="text/plain",
                     headers=(("cache-control", "no-store"), *ADVERTISED))


def _retry_in(seconds: float) -> tuple[tuple[str, str], ...]:
    return (("retry-after", str(max(1, math.ceil(seconds)))),)


async def _checks(state: RouterState, ctx: RequestContext) -> LocalReply | None:
    """The warm-up's own bounds, after admission and before placement: the region's load,
    then its budget (a busy region refuses without counting against the budget)."""
    if region_busy(state):
        return error_reply(
            503, "The region is too busy to warm a prompt now; send the message itself.",
            "server_error", code=error_codes.PROMPT_WARM_BUSY,
            headers=_retry_in(state.routing.retry_after_s()), outcome="warm_busy")
    per_min = state.config.limits.prompt_warms_per_min_per_subject
    try:
        wait = await _budget(state).take(ctx.owner, ctx.subject, per_min)
    except StateUnavailable as exc:
        return unavailable_reply(exc)
    if wait is not None:
        return error_reply(
            429, f"At most {per_min} prompt warm-ups a minute per user.",
            code=error_codes.PROMPT_WARM_LIMITED, headers=_retry_in(wait),
            outcome="warm_limited")
    return None


async def warm_prompt(state: RouterState, scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/edge/warm``: warm the backend the conversation in the body will be routed to
    with a one-token, non-streamed copy of it; 200 ``{"warmed": true, "prompt_tokens": N,
    "cached_tokens": M}``, or an error naming why not."""
    if state.config.limits.prompt_warms_per_min_per_subject == 0:
        await not_found(scope, send)
        return
    ctx = new_context(state, scope)
    ctx.response_headers.extend(ADVERTISED)  # every answer says what bodies it takes
    query = _query(scope)
    if await _finish(state, send, ctx, adopt_query_token(ctx, query, state.cors), "warm"):
        return
    if await _finish(state, send, ctx, authenticate(ctx, state.api_keys, state.tokens), "warm"):
        return
    if state.draining:  # before the body: nothing of it counts, nor is it read for nothing
        await _finish(state, send, ctx, draining_reply(), "warm")
        return
    if not await _read_request_body(state, receive, send, ctx, query, "warm"):
        return
    limit = state.config.limits.max_body_bytes
    if len(ctx.body) <= limit:
        ctx.body = warm_body(ctx.body)
    if await _finish(state, send, ctx, admit_body(ctx, limit), "warm"):
        return
    refused = await _checks(state, ctx)
    if refused is not None:
        await _finish(state, send, ctx, refused, "warm")
        return
    placed = await place(state, ctx, lambda: until_disconnect(receive))
    if placed is CLIENT_GONE:
        ctx.outcome = "client_gone"
        return
    if await _finish(state, send, ctx, placed, "warm"):
        return
    try:
        with state.limiter.holding(ctx.owner):
            forward = asyncio.ensure_future(
                state.proxy.forward(ctx, "POST", paths.CHAT_COMPLETIONS, ctx.body))
            if not await unless_gone(receive, forward):
                forward.cancel()
                ctx.outcome = "client_gone"
                return
            answer = forward.result()
    finally:
        release_key_slot(ctx)
    ctx.usage = reply_usage(answer.body)
    if answer.status != 200:
        failed = error_reply(502, f"The backend did not take the warm-up ({answer.status}).",
                             "server_error", code=error_codes.UPSTREAM_ERROR,
                             outcome=f"upstream_{answer.status}")
        await _finish(state, send, ctx, failed, "warm")
        return
    ctx.outcome = "ok"
    state.metrics.count("warm", "prompt_ok")
    await send_bytes(send, 200, msgspec.json.encode(_summary(answer.body)),
                     headers=(("cache-control", "no-store"), *ADVERTISED))


class _Reply(msgspec.Struct):
    usage: Usage | None = None


_reply = msgspec.json.Decoder(_Reply)


def _summary(body: bytes) -> PromptWarmed:
    """What the backend's answer says of the prompt's tokens (nothing if it says nothing)."""
    try:
        usage = _reply.decode(body).usage
    except msgspec.DecodeError:
        usage = None
    if usage is None:
        return PromptWarmed()
    return PromptWarmed(prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens)
