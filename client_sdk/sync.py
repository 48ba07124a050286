"""The synchronous API: :class:`Client` runs an :class:`~firstbyte.client_sdk.client.AsyncClient`
on a private event loop thread, and :class:`SyncStream` iterates its streams from plain code
(``client.stream(...)`` for chat; ``client.completions``, ``client.responses``,
``client.messages`` and ``client.embeddings`` as on the async client).

Same arguments, errors and timings as the async API; each call blocks until the loop has done
the work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from firstbyte.client_sdk._core.stream import StreamDelta
from firstbyte.client_sdk.client import AsyncClient, ChatStream, EventStream
from firstbyte.client_sdk.timings import Timings
from firstbyte.protocol import codec
from firstbyte.protocol.openai import Usage
from firstbyte.protocol.prewarm import PromptWarmed

__all__ = ["Client", "SyncChatStream", "SyncStream"]

T = TypeVar("T")


class _LoopThread:
    """A private event loop on a daemon thread, for the synchronous API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="firstbyte-sdk",
                                        daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Client:
    """The synchronous API: same arguments as :class:`AsyncClient`, run on a private loop."""

    def __init__(
        self, base_url: str | Sequence[str] | Mapping[str, str], api_key: str | None = None,
        **kw: Any,
    ) -> None:
        self._runner = _LoopThread()

        async def make() -> AsyncClient:
            return AsyncClient(base_url, api_key, **kw)

        try:
            self._client = self._runner.run(make())
        except BaseException:
            self._runner.stop()
            raise
        self.completions = _SyncCalls(self._runner, self._client.completions)
        self.responses = _SyncCalls(self._runner, self._client.responses)
        self.messages = _SyncCalls(self._runner, self._client.messages)
        self.embeddings = _SyncCalls(self._runner, self._client.embeddings)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._runner.run(self._client.aclose())
        finally:
            self._runner.stop()

    def prewarm(self, connections: int = 1, **prompt: Any) -> PromptWarmed | None:
        """Like :meth:`AsyncClient.prewarm` (``model=``, ``messages=`` warm the prompt too)."""
        return self._runner.run(self._client.prewarm(connections, **prompt))

    def probe_regions(self, samples: int = 3) -> dict[str, float | None]:
        return self._runner.run(self._client.probe_regions(samples))

    def stream(self, **kw: Any) -> SyncChatStream:
        """Like :meth:`AsyncClient.stream`; use as ``with client.stream(...) as s: for d in s``."""
        async def make() -> ChatStream:
            return self._client.stream(**kw)

        return SyncStream(self._runner, self._runner.run(make()))


class _SyncCalls:
    """One of the async client's typed namespaces (``completions``, ``responses``,
    ``messages``, ``embeddings``), blocking: ``stream(...)`` gives a :class:`SyncStream`,
    ``create(...)`` the answer."""

    def __init__(self, runner: _LoopThread, calls: Any) -> None:
        self._runner = runner
        self._calls = calls

    def stream(self, **kw: Any) -> SyncStream[Any]:
        async def make() -> EventStream[Any]:
            stream: EventStream[Any] = self._calls.stream(**kw)
            return stream

        return SyncStream(self._runner, self._runner.run(make()))

    def create(self, **kw: Any) -> Any:
        return self._runner.run(self._calls.create(**kw))


class SyncStream(Generic[T]):
    """A :class:`ChatStream` or :class:`EventStream` driven from synchronous code."""

    def __init__(self, runner: _LoopThread, stream: ChatStream | EventStream[Any]) -> None:
        self._runner = runner
        self._stream = stream
        self._next: Callable[[], Awaitable[T]] = stream.__anext__  # type: ignore[assignment]

    def __enter__(self) -> SyncStream[T]:
        self._runner.run(self._stream.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner.run(self._stream.aclose())

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        async def step() -> T | None:
            try:
                return await self._next()
            except StopAsyncIteration:
                return None

        item = self._runner.run(step())
        if item is None:
            raise StopIteration
        return item

    @property
    def timings(self) -> Timings:
        return self._stream.timings

    @property
    def usage(self) -> Usage | codec.Usage | None:
        """The stream's usage (chat: OpenAI's; other formats: input and output tokens)."""
        return self._stream.usage

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def stream_id(self) -> str | None:
        return self._stream.stream_id


SyncChatStream = SyncStream[StreamDelta]
"""A chat stream driven from synchronous code."""
