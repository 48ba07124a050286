"""The synchronous API: :class:`Client` runs an :class:`~firstbyte.client_sdk.client.AsyncClient`
on a private event loop thread, and :class:`SyncChatStream` iterates its streams from plain code.

Same arguments, errors and timings as the async API; each call blocks until the loop has done
the work.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from firstbyte.client_sdk._core.stream import StreamDelta
from firstbyte.client_sdk.client import AsyncClient, ChatStream
from firstbyte.client_sdk.timings import Timings
from firstbyte.protocol.openai import Usage
from firstbyte.protocol.prewarm import PromptWarmed

__all__ = ["Client", "SyncChatStream"]

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

        return SyncChatStream(self._runner, self._runner.run(make()))


class SyncChatStream:
    """A :class:`ChatStream` driven from synchronous code."""

    def __init__(self, runner: _LoopThread, stream: ChatStream) -> None:
        self._runner = runner
        self._stream = stream

    def __enter__(self) -> SyncChatStream:
        self._runner.run(self._stream.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self._runner.run(self._stream.aclose())

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        async def step() -> StreamDelta | None:
            try:
                return await self._stream.__anext__()
            except StopAsyncIteration:
                return None

        delta = self._runner.run(step())
        if delta is None:
            raise StopIteration
        return delta

    @property
    def timings(self) -> Timings:
        return self._stream.timings

    @property
    def usage(self) -> Usage | None:
        return self._stream.usage

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def stream_id(self) -> str | None:
        return self._stream.stream_id
