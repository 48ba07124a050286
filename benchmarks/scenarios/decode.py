"""SDK stream decoding throughput: SSE bytes in, typed chunks out, ours against the openai SDK.

A CPU benchmark of parsing, not networking: identical pre-recorded chat-completion SSE bytes (in
the router's format, ``id: N`` + ``data: CHUNK``) are fed in 1 KiB pieces to

- ``firstbyte core``: :class:`client_sdk._core.sse.SSEDecoder` +
  :func:`client_sdk.types.decode_chunk`;
- ``firstbyte sdk``: the SDK's stream-assembly path (``SSEDecoder`` + ``StreamAssembler``, which
  also de-duplicates by sequence number and builds deltas), when it is installed;
- ``openai Stream`` / ``openai AsyncStream``: the official ``openai`` SDK's streaming pipeline,
  a real ``client.chat.completions.create(stream=True)`` whose HTTP response body is those
  bytes from an in-memory transport (one request; its cost is negligible over the events).

Each pipeline runs the same number of times, interleaved, in one process; the best pass counts
(the least disturbed by other work on the machine).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import msgspec

from benchmarks.progress import Progress
from client_sdk._core.sse import DONE, SSEDecoder
from client_sdk.types import decode_chunk

__all__ = ["make_stream", "run"]

PIECE = 1024
_WORDS = (
    " the",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " a",
    " lazy",
    " dog",
    ",",
    ".",
    "\n\n",
    " café",
    " 日本語",
    " **bold**",
    " `code`",
    " 42",
    ' "quoted"',
)


def make_stream(events: int, *, seed: int = 0) -> bytes:
    """A realistic streamed chat completion: a role chunk, ``events`` one-token content
    chunks, a finish chunk, a usage chunk, then ``[DONE]``; every event numbered like the router's.
    """
    rnd = random.Random(seed)
    base: dict[str, Any] = {
        "id": "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG",
        "object": "chat.completion.chunk",
        "created": 1741570283,
        "model": "gpt-4o-mini-2024-07-18",
        "system_fingerprint": "fp_06737a9306",
        "service_tier": "default",
    }

    def choice(delta: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]

    chunks = [base | {"choices": choice({"role": "assistant", "content": "", "refusal": None})}]
    chunks += [base | {"choices": choice({"content": rnd.choice(_WORDS)})} for _ in range(events)]
    chunks.append(base | {"choices": choice({}, "stop")})
    usage = {
        "prompt_tokens": 1200,
        "completion_tokens": events,
        "total_tokens": 1200 + events,
        "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
    }
    chunks.append(base | {"choices": [], "usage": usage})
    out = [b"id: %d\ndata: %s\n\n" % (i, msgspec.json.encode(c)) for i, c in enumerate(chunks, 1)]
    out.append(b"id: %d\ndata: [DONE]\n\n" % (len(chunks) + 1))
    return b"".join(out)


def _pieces(body: bytes) -> list[bytes]:
    return [body[i : i + PIECE] for i in range(0, len(body), PIECE)]


def _ours_core(pieces: list[bytes]) -> int:
    decoder = SSEDecoder()
    n = 0
    for piece in pieces:
        for event in decoder.receive_data(piece):
            if event.data == DONE:
                return n
            decode_chunk(event.data)
            n += 1
    return n


def _ours_sdk_factory() -> Callable[[list[bytes]], int] | None:
    """The SDK's assembly path, if this checkout has it."""
    try:
        module = importlib.import_module("client_sdk._core.stream")
    except ImportError:
        return None
    assembler_type: Any = getattr(module, "StreamAssembler", None)
    if assembler_type is None:
        return None

    def sdk(pieces: list[bytes]) -> int:
        decoder = SSEDecoder()
        assembler = assembler_type()
        n = 0
        for piece in pieces:
            for event in decoder.receive_data(piece):
                seq = int(event.id) if event.id is not None else None
                assembler.receive(seq, event.data)
                if assembler.done:
                    return n
                n += 1
        return n

    return sdk


def _openai_factories(pieces: list[bytes]) -> tuple[Callable[[], int], Callable[[], int]]:
    import httpx2
    import openai

    def handler(request: httpx2.Request) -> httpx2.Response:
        class Body(httpx2.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                yield from pieces

        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=Body())

    async def async_handler(request: httpx2.Request) -> httpx2.Response:
        class Body(httpx2.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                for piece in pieces:
                    yield piece

        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=Body())

    base_url = "http://decode-bench.invalid/v1"  # never resolved: the transport is in memory
    sync_client = openai.OpenAI(
        api_key="bench",
        base_url=base_url,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    async_client = openai.AsyncOpenAI(
        api_key="bench",
        base_url=base_url,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(async_handler)),
    )
    messages: Any = [{"role": "user", "content": "hi"}]

    def sync_stream() -> int:
        stream = sync_client.chat.completions.create(model="m", messages=messages, stream=True)
        return sum(1 for _ in stream)

    def async_stream() -> int:
        async def go() -> int:
            stream = await async_client.chat.completions.create(
                model="m", messages=messages, stream=True
            )
            n = 0
            async for _ in stream:
                n += 1
            return n

        return asyncio.run(go())

    return sync_stream, async_stream


def _timed(fn: Callable[[], int]) -> tuple[int, float]:
    gc.collect()
    start = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - start


def run(quick: bool) -> dict[str, Any]:
    """Measure every pipeline on the same bytes; report events/s and ours/openai ratios."""
    events = 5_000 if quick else 20_000
    passes = 2 if quick else 3
    body = make_stream(events)
    pieces = _pieces(body)
    sync_stream, async_stream = _openai_factories(pieces)
    pipelines: dict[str, Callable[[], int]] = {"firstbyte core": lambda: _ours_core(pieces)}
    sdk = _ours_sdk_factory()
    if sdk is not None:
        pipelines["firstbyte sdk"] = lambda: sdk(pieces)
    pipelines["openai Stream"] = sync_stream
    pipelines["openai AsyncStream"] = async_stream
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    with Progress(passes * len(pipelines), "decode") as bar:
        for _ in range(passes):
            for name, fn in pipelines.items():
                n, seconds = _timed(fn)
                counts[name] = n
                best[name] = min(best.get(name, float("inf")), seconds)
                bar.advance()
    expected = events + 3  # role chunk + content chunks + finish chunk + usage chunk
    runs = [
        {
            "label": name,
            "events": counts[name],
            "events_ok": counts[name] == expected,
            "seconds": best[name],
            "events_per_s": counts[name] / best[name],
            "mb_per_s": len(body) / best[name] / 1e6,
        }
        for name in pipelines
    ]
    rate = {name: counts[name] / best[name] for name in pipelines}
    summary: dict[str, Any] = {
        "events": expected,
        "bytes": len(body),
        "core_events_per_s": rate["firstbyte core"],
        "openai_events_per_s": rate["openai Stream"],
        "core_vs_openai_ratio": rate["firstbyte core"] / rate["openai Stream"],
        "core_vs_openai_async_ratio": rate["firstbyte core"] / rate["openai AsyncStream"],
    }
    if "firstbyte sdk" in rate:
        summary["sdk_events_per_s"] = rate["firstbyte sdk"]
        summary["sdk_vs_openai_ratio"] = rate["firstbyte sdk"] / rate["openai Stream"]
    summary["target_ratio"] = 10.0
    return {
        "scenario": "decode",
        "description": (
            f"SSE bytes to typed chat-completion chunks: {expected} events ({len(body):,} bytes) "
            f"fed in {PIECE}-byte pieces, best of {passes} interleaved passes per pipeline, "
            "one process. CPU only: no sockets."
        ),
        "summary": summary,
        "runs": runs,
        "notes": [
            "events/s = typed chunk objects delivered per second of wall time",
            "openai pipelines run a real chat.completions.create(stream=True) over an "
            "in-memory httpx2 transport, so their numbers include one request's setup",
        ],
    }
