"""The long-poll cursor, sans-IO: which poll to send next, what a batch means, when to back off.

The machine never sleeps or reads a clock; the IO layer asks :meth:`PollCursor.next_poll`
with ``now`` and waits until the returned ``not_before`` before sending it. A batch advances the
cursor to its ``next``; events at or below the cursor are dropped (a retried poll whose first
answer was lost in flight may return them again). Failures back off exponentially, bounded in
count; a successful poll resets the count.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from firstbyte.client_sdk.errors import StreamBrokenError
from firstbyte.protocol import paths
from firstbyte.protocol.poll import PollBatch, PollEvent

__all__ = ["PollCursor", "PollRequest", "decode_batch"]

_batch = msgspec.json.Decoder(PollBatch)


def decode_batch(body: bytes) -> PollBatch:
    """Decode a poll answer; a malformed one raises :class:`StreamBrokenError`."""
    try:
        return _batch.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StreamBrokenError(f"invalid long-poll answer: {exc}") from None


@dataclass(frozen=True, slots=True)
class PollRequest:
    """The next poll, ``GET {path}?after=..&wait=..``, to be sent no earlier than ``not_before``."""

    path: str
    after: int
    wait_s: float
    not_before: float

    @property
    def params(self) -> dict[str, str]:
        return {"after": str(self.after), "wait": f"{self.wait_s:g}"}


class PollCursor:
    """Tracks the position in one stream and the retry state of its polls."""

    def __init__(
        self,
        stream_id: str,
        *,
        after: int = 0,
        wait_s: float = 10.0,
        max_failures: int = 5,
        backoff_s: float = 0.05,
        backoff_max_s: float = 2.0,
    ) -> None:
        self.stream_id = stream_id
        self.after = after
        self.done = False
        self.failures = 0
        self._wait_s = wait_s
        self._max_failures = max_failures
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self._not_before = 0.0

    @property
    def path(self) -> str:
        """The poll path relative to the API base (``https://host/v1`` + this)."""
        return paths.at_base(paths.stream_poll(self.stream_id), "")

    def next_poll(self, now: float) -> PollRequest | None:
        """The poll to send next, or ``None`` once the stream is done."""
        if self.done:
            return None
        return PollRequest(self.path, self.after, self._wait_s, max(now, self._not_before))

    def receive_batch(self, batch: PollBatch, now: float) -> list[PollEvent]:
        """Apply one poll answer; return its events not yet seen, in sequence order."""
        if batch.stream != self.stream_id:
            raise StreamBrokenError(f"poll answer for stream {batch.stream!r}, not ours")
        self.failures = 0
        self._not_before = now
        fresh = sorted((e for e in batch.events if e.seq > self.after), key=lambda e: e.seq)
        if fresh:
            self.after = fresh[-1].seq
        if batch.next > self.after and not fresh:
            raise StreamBrokenError(f"poll answer skips to {batch.next} with no events")
        if batch.done:
            self.done = True
        return fresh

    def receive_failure(self, now: float, reason: str = "poll failed") -> float:
        """Record a failed poll; return the delay before the retry, or raise when out of tries."""
        self.failures += 1
        if self.failures > self._max_failures:
            raise StreamBrokenError(
                f"{reason}; gave up after {self._max_failures} retries at event {self.after}"
            )
        delay = min(self._backoff_s * 2.0 ** (self.failures - 1), self._backoff_max_s)
        self._not_before = now + delay
        return delay
