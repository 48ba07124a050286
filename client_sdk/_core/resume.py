"""The resume policy, sans-IO: when a broken stream is resumed, after what delay, when to stop.

A stream breaks when its connection is cut, an event goes missing, or nothing (heartbeats do
not count) arrives for the idle timeout (a stall). Each break costs one resume, up to
``max_resumes``; stalls are also bounded by ``stall_retries``. A stream cut before the router
answered (no stream id yet) is sent again, the first time at once (most likely a kept-alive
connection the server had closed); every other resume waits a doubling backoff, capped at 2 s.
A stall without a stream id while the server still answers (:meth:`ResumePolicy.held`: it holds
the request, e.g. queued or in a long prefill) is waited out, never sent again: a second request
would run the model twice. It counts against ``stall_retries`` like any stall.
The browser client (``client_sdk/browser/stream.js``) implements the same rules and is
tested against the same cases (``tests/client_sdk/stream_rules.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from firstbyte.client_sdk.errors import StreamBrokenError, StreamStalledError

__all__ = ["ResumePolicy", "ResumeStep"]

BACKOFF_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class ResumeStep:
    """Wait ``delay_s``, then send the request again (``resend``) or resume after the last
    delivered event."""

    delay_s: float
    resend: bool


class ResumePolicy:
    def __init__(self, *, max_resumes: int = 5, backoff_s: float = 0.05, stall_retries: int = 1,
                 idle_timeout_s: float = 30.0) -> None:
        self.max_resumes = max_resumes
        self.backoff_s = backoff_s
        self.stall_retries = stall_retries
        self.idle_timeout_s = idle_timeout_s
        self.resumes = 0
        self.stalls = 0

    def broken(self, reason: BaseException | str | None, *, opened: bool, stalled: bool = False,
               last_seq: int = 0) -> ResumeStep:
        """The next step after a break; raises :class:`StreamStalledError` or
        :class:`StreamBrokenError` when out of attempts."""
        if stalled and self._stalled_out():
            raise StreamStalledError(
                f"no event for {self.idle_timeout_s:g} s (heartbeats do not count)"
                f" after event {last_seq}; resumed {self.resumes} times",
                idle_s=self.idle_timeout_s,
            )
        self.resumes += 1
        if self.resumes > self.max_resumes:
            raise StreamBrokenError(
                f"stream broken and {self.max_resumes} resumes failed: {reason}")
        backoff = opened or self.resumes > 1 or stalled
        delay = min(self.backoff_s * 2 ** (self.resumes - 1), BACKOFF_MAX_S) if backoff else 0.0
        return ResumeStep(delay, not opened)

    def held(self, *, last_seq: int = 0) -> None:
        """A stall with no stream id to resume by, while the server still answers, so it holds
        the request: wait on (no resume is spent); raises :class:`StreamStalledError` when out
        of ``stall_retries``."""
        if self._stalled_out():
            raise StreamStalledError(
                f"no event for {self.idle_timeout_s:g} s (heartbeats do not count)"
                f" after event {last_seq}; not sent again: the server still answers, so it"
                " holds the request",
                idle_s=self.idle_timeout_s,
            )

    def _stalled_out(self) -> bool:
        """Count a stall; whether it is one more than ``stall_retries`` allows."""
        self.stalls += 1
        return self.stalls > self.stall_retries
