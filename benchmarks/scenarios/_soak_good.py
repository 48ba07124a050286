"""The soak's well-behaved clients: the firstbyte SDK (SSE, WebSocket, long-poll; HTTP/1.1 and
HTTP/2) and the official openai SDK, each on its own API key, retrying what failed.

One request is up to :data:`MAX_ATTEMPTS` attempts; each attempt's text is judged against the
sim's deterministic output (:mod:`._soak_integrity`), and the request ends **ok** (first
attempt), **retried_ok**, or **failed** with the class of its last error. Error classes are
``STATUS code`` for HTTP answers (``429 region_saturated``), ``stream code`` for an error
event inside a started stream, or the exception's name for the rest (``connect``,
``JSONDecodeError``, ...). Faults injected into the sims reach clients as upstream errors:
:func:`is_upstream_fault` tells those (relayed faithfully by the router) from the router's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from firstbyte.benchmarks.scenarios._soak_integrity import Expected, Ledger, Verdict, expect
from firstbyte.client_sdk import AsyncClient
from firstbyte.client_sdk import errors as sdk_errors
from firstbyte.protocol import error_codes

__all__ = ["KINDS", "MODEL", "Attempt", "Tally", "good_worker", "is_upstream_fault", "open_kind",
           "request_body", "run_request"]

MODEL = "sim-llama-7b"
MAX_ATTEMPTS = 4
RETRY_BACKOFF_S = 0.5
ATTEMPT_TIMEOUT_S = 30.0
KINDS = ("sdk-sse-h2", "sdk-sse-h1", "sdk-ws-h1", "sdk-longpoll-h2", "openai-sse-h1",
         "openai-sse-h2")
"""Client kind = library, transport and HTTP version to the router."""
_UPSTREAM_CODES = {error_codes.UPSTREAM_ERROR, error_codes.UPSTREAM_EOF}
_UPSTREAM_MESSAGES = ("Upstream failed", "Injected fault", "The upstream")


@dataclass(slots=True)
class Attempt:
    """One try at a stream: what arrived, how it ended."""

    text: str = ""
    finished: bool = False
    error: str | None = None
    """The error class (module docstring), None when the stream ended normally."""
    upstream_fault: bool = False
    ttft_ms: float | None = None
    stream_id: str | None = None
    started: float = field(default_factory=time.perf_counter)

    def receive(self, text: str | None) -> None:
        """Add a delta's text; the first non-empty one sets the time to first token."""
        if text and self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.started) * 1000
        self.text += text or ""


@dataclass(slots=True)
class Tally:
    """Outcomes per client kind: final outcomes of requests and the class of every failed try."""

    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    attempt_errors: dict[str, Counter[str]] = field(default_factory=dict)
    failed_at: list[float] = field(default_factory=list)
    """Monotonic time of every failed try (when its request ended), for the phase table."""
    gave_up_at: list[float] = field(default_factory=list)
    """Monotonic time of every request given up."""
    first_tokens: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time the request ended, ms from its first try's start to its first token)
    of every request that got a token, retries included."""

    def add(self, kind: str, outcome: str, errors: list[str],
            first_token_ms: float | None = None) -> None:
        self.outcomes.setdefault(kind, Counter())[outcome] += 1
        self.attempt_errors.setdefault(kind, Counter()).update(errors)
        now = time.monotonic()
        self.failed_at += [now] * len(errors)
        if outcome.startswith("failed"):
            self.gave_up_at.append(now)
        if first_token_ms is not None:
            self.first_tokens.append((now, first_token_ms))


def first_token_ms(attempts: list[Attempt]) -> float | None:
    """From the first try's start to the last try's first token: what the user waited for a
    token, retries included (None when the last try got none)."""
    last = attempts[-1] if attempts else None
    if last is None or last.ttft_ms is None:
        return None
    return (last.started - attempts[0].started) * 1000 + last.ttft_ms


def is_upstream_fault(status: int | None, code: str | None, message: str) -> bool:
    """An error the router relayed from a failing upstream (a fault the soak injected)."""
    del status  # the router relays upstream failures as 502/503 or in-stream: the body tells
    return code in _UPSTREAM_CODES or message.startswith(_UPSTREAM_MESSAGES)


def request_body(key_label: str, n: int, max_tokens: int) -> dict[str, Any]:
    """A request whose output only this key's ``n``-th request can produce."""
    prompt = f"soak client {key_label}, request {n}: describe the route of a packet."
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "seed": n}


def _classify_sdk(exc: BaseException) -> tuple[str, bool]:
    if isinstance(exc, sdk_errors.APIError):
        where = str(exc.status) if exc.status is not None else "stream"
        return f"{where} {exc.code or exc.type or 'error'}", is_upstream_fault(
            exc.status, exc.code, exc.message)
    return type(exc).__name__, False


def _classify_openai(exc: BaseException) -> tuple[str, bool]:
    import openai

    if isinstance(exc, openai.APIStatusError):
        body = exc.body if isinstance(exc.body, dict) else {}
        code = body.get("code") if isinstance(body.get("code"), str) else None
        return f"{exc.status_code} {code or 'error'}", is_upstream_fault(
            exc.status_code, code, str(body.get("message", "")))
    if isinstance(exc, openai.APIConnectionError):
        return type(exc).__name__, False
    if isinstance(exc, openai.APIError):  # an error event inside the stream
        body = exc.body if isinstance(exc.body, dict) else {}
        code = exc.code or (body.get("code") if isinstance(body.get("code"), str) else None)
        return f"stream {code or 'error'}", is_upstream_fault(None, code, exc.message)
    return type(exc).__name__, False


class SDKKind:
    """The firstbyte SDK with one transport and HTTP version."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def attempt(self, body: dict[str, Any]) -> Attempt:
        got = Attempt()
        options = {k: v for k, v in body.items() if k not in ("model", "messages", "max_tokens")}
        try:
            async with self.client.stream(model=body["model"], messages=body["messages"],
                                          max_tokens=body["max_tokens"], **options) as stream:
                got.stream_id = stream.stream_id
                async for delta in stream:
                    got.receive(delta.text)
                got.finished = True
        except (sdk_errors.FirstbyteError, OSError, ValueError) as exc:
            got.error, got.upstream_fault = _classify_sdk(exc)
        return got


class OpenAIKind:
    """The official openai SDK over httpx (HTTP/1.1 or HTTP/2), no retries of its own."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def attempt(self, body: dict[str, Any]) -> Attempt:
        import httpx2
        import openai

        got = Attempt()
        try:
            stream = await self.client.chat.completions.create(stream=True, **body)
            async with stream:
                async for chunk in stream:
                    for choice in chunk.choices:
                        got.receive(choice.delta.content)
            got.finished = True
        except (openai.OpenAIError, json.JSONDecodeError, httpx2.HTTPError, OSError) as exc:
            got.error, got.upstream_fault = _classify_openai(exc)
        return got


@contextlib.asynccontextmanager
async def open_kind(kind: str, base_url: str, key: str, ca_file: str) -> AsyncIterator[Any]:
    """A client of ``kind`` (one of :data:`KINDS`) for ``key``, open for the block."""
    library, transport, http = kind.split("-")
    version: Any = "2" if http == "h2" else "1.1"
    if library == "openai":
        import httpx2  # the openai SDK's own httpx
        import openai

        async with httpx2.AsyncClient(verify=ca_file, http2=version == "2",
                                      timeout=ATTEMPT_TIMEOUT_S) as http_client:
            yield OpenAIKind(openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key,
                                                http_client=http_client, max_retries=0))
        return
    name: Any = {"sse": "sse", "ws": "websocket", "longpoll": "longpoll"}[transport]
    async with AsyncClient(base_url + "/v1", key, transport=name, http=version,
                           ca_file=ca_file, reprobe_interval_s=None) as sdk:
        await sdk.prewarm()
        yield SDKKind(sdk)


async def run_request(client: SDKKind | OpenAIKind, key: str, body: dict[str, Any],
                      ledger: Ledger, label: str) -> tuple[str, list[Attempt]]:
    """Up to :data:`MAX_ATTEMPTS` tries of ``body``; the outcome (``ok``, ``retried_ok``,
    ``failed: CLASS``, ``violation: VERDICT``) and every attempt."""
    expected: Expected = expect(key, body)
    ledger.register(expected)
    attempts: list[Attempt] = []
    for n in range(MAX_ATTEMPTS):
        try:
            got = await asyncio.wait_for(client.attempt(body), ATTEMPT_TIMEOUT_S)
        except TimeoutError:
            got = Attempt(error="attempt_timeout")
        attempts.append(got)
        verdict = ledger.judge(expected, got.text, finished=got.error is None, label=label)
        if verdict.violation:
            return f"violation: {verdict.value}", attempts
        if got.error is None and verdict is Verdict.EXACT:
            return ("ok" if n == 0 else "retried_ok"), attempts
        # 0.5, 1, 2 s, as a client backs off: the tries span a killed sim's downtime
        # (KILL_DOWN_S) and the router's next health scrape. At 0.1, 0.2, 0.4 s all four tries
        # of a request whose prompt is placed on the killed sim could fall inside it, and the
        # canary counted that as a request the router failed (1 CI run in 4).
        await asyncio.sleep(RETRY_BACKOFF_S * 2**n)
    return f"failed: {attempts[-1].error}", attempts


async def good_worker(kind: str, key: str, key_label: str, base_url: str, ca_file: str,
                      until: float, ledger: Ledger, tally: Tally,
                      stream_ids: list[tuple[str, str]], max_tokens: Callable[[int], int]) -> None:
    """Sequential requests of one client kind on ``key`` until the monotonic time ``until``;
    at least one, so every kind is judged: under CI's load on a slow machine the SDK kinds'
    clients, opened and prewarmed, reached ``until`` before their first request and left
    their kinds with no row at all."""
    async with open_kind(kind, base_url, key, ca_file) as client:
        n = 0
        while n == 0 or time.monotonic() < until:
            body = request_body(f"{key_label}/{kind}", n, max_tokens(n))
            outcome, attempts = await run_request(client, key, body, ledger, f"{key_label} {kind}")
            tally.add(kind, outcome, [a.error for a in attempts if a.error],
                      first_token_ms(attempts))
            stream_ids += [(key, a.stream_id) for a in attempts if a.stream_id]
            n += 1
