"""The engine's clock: one asyncio task that advances the sans-IO engine in real time.

It calls :meth:`Engine.advance` at each step deadline, wakes the request handlers whose
sequences got tokens, and sleeps until the next deadline (or until a request arrives at an
idle engine). Engine time is the event loop's monotonic clock, so TTFT and inter-token gaps
measured by a client on loopback match the engine's within the loop's timer resolution.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as SequenceOf

from firstbyte.router.sim.engine import Engine, Sequence
from firstbyte.tasks import cancel_and_wait

__all__ = ["EngineDriver"]


class EngineDriver:
    """Runs an :class:`Engine` against the running event loop's clock."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start the step loop on the running loop (idempotent)."""
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    def now(self) -> float:
        loop = self._loop or asyncio.get_running_loop()
        return loop.time()

    def submit(
        self,
        prompt_tokens: SequenceOf[int],
        max_output: int,
        finish_reason: str,
        block_keys: list[bytes] | None = None,
        late_s: float = 0.0,
    ) -> Sequence:
        """Queue a sequence as of ``late_s`` seconds ago (its modelled arrival at the engine);
        raises :class:`firstbyte.router.sim.engine.Overloaded` when full."""
        self.start()
        now = self.now() - late_s
        seq = self.engine.submit(prompt_tokens, max_output, finish_reason, now, block_keys)
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)
        return seq

    def cancel(self, seq: Sequence) -> None:
        self.engine.cancel(seq)
        self._notify(seq)

    async def wait(self, seq: Sequence, seen: int) -> None:
        """Return once ``seq`` has more than ``seen`` tokens, finished, or was cancelled."""
        while seq.generated <= seen and seq.state.value in ("waiting", "running"):
            fut = seq.waiter
            if fut is None or fut.done():
                assert self._loop is not None
                fut = seq.waiter = self._loop.create_future()
            await fut

    @staticmethod
    def _notify(seq: Sequence) -> None:
        fut = seq.waiter
        if fut is not None:
            seq.waiter = None
            if not fut.done():
                fut.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        notify = self._notify
        while True:
            now = loop.time()
            for seq in engine.advance(now):
                if seq.waiter is not None:
                    notify(seq)
            deadline = engine.next_deadline()
            if deadline is None:
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
            elif deadline <= now:
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(deadline - now)
