"""Requests within their fair share waiting for a slot of a full region, one queue per flow
(sans-IO).

When every backend is at its limit, a request of a flow (an API key, then a subject of that
key) below its fair share (:mod:`firstbyte.router.fair_share`) neither goes past a backend's
limit nor is refused: it waits here. A slot that frees goes to a waiter before any new
arrival (:attr:`FairQueue.handed` counts slots given to waiters that have not taken them yet),
and to the waiter of the flow furthest below its share: the key with the fewest requests in
flight per unit of weight, then, inside it, the subject with the fewest in flight; first come,
first served inside a flow and between equals. A flow waiting is below its share, so the lowest
usage by weight is the furthest below the fair level (:func:`~firstbyte.router.fair_share.
water_fill` gives every unmet flow ``level * weight``).

This module holds who waits and in what order, nothing else: the counts that make a flow's
demand (:meth:`~firstbyte.router.fair_share.FairShare.wait`), the deadline and the wakeup are
the caller's (:mod:`firstbyte.router.state`, ``routing.max_fair_wait_ms``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["FairQueue", "Waiter"]

T = TypeVar("T")


@dataclass(eq=False, slots=True)
class Waiter(Generic[T]):
    """One waiting request: its flow, what wakes it (``item``) and its place in arrival order."""

    key: bytes
    subject: str
    item: T
    seq: int
    queued: bool = True
    """Still in the queue (not handed a slot, not removed)."""


class FairQueue(Generic[T]):
    """Waiting requests by key and subject; the next one to hand a freed slot."""

    def __init__(self) -> None:
        self._keys: dict[bytes, dict[str, deque[Waiter[T]]]] = {}
        self.waiting = 0
        """How many wait (``len()``): an attribute, read where a request ends or arrives
        (``__len__``, a Python method, is a call from C there)."""
        self._seq = 0
        self.handed = 0
        """Slots handed to waiters that have not taken them yet (:meth:`taken`): new
        arrivals leave them alone."""

    def __len__(self) -> int:
        return self.waiting

    def busy(self) -> bool:
        """Whether anyone waits or holds a handed slot: a new arrival does not jump them."""
        return bool(self.waiting or self.handed)

    def push(self, key: bytes, subject: str, item: T) -> Waiter[T]:
        """Queue a request of ``key``/``subject`` behind that flow's others."""
        self._seq += 1
        waiter = Waiter(key, subject, item, self._seq)
        self._keys.setdefault(key, {}).setdefault(subject, deque()).append(waiter)
        self.waiting += 1
        return waiter

    def remove(self, waiter: Waiter[T]) -> bool:
        """Take ``waiter`` out (it gave up); False if it was not queued any more."""
        if not waiter.queued:
            return False
        subjects = self._keys[waiter.key]
        flow = subjects[waiter.subject]
        flow.remove(waiter)
        self._drop(waiter, subjects, flow)
        return True

    def pop(
        self,
        key_usage: Callable[[bytes], float],
        subject_usage: Callable[[bytes, str], float],
    ) -> Waiter[T] | None:
        """Hand a freed slot: the first waiter of the key with the lowest ``key_usage`` (its
        requests in flight per unit of weight), then of that key's subject with the lowest
        ``subject_usage``; the longest waiting between equals. None if nobody waits. The slot
        counts in :attr:`handed` until :meth:`taken`."""
        if not self.waiting:
            return None
        key = min(self._keys, key=lambda k: (key_usage(k), self._first(k)))
        subjects = self._keys[key]
        subject = min(subjects, key=lambda s: (subject_usage(key, s), subjects[s][0].seq))
        flow = subjects[subject]
        waiter = flow.popleft()
        self._drop(waiter, subjects, flow)
        self.handed += 1
        return waiter

    def taken(self) -> None:
        """A handed slot was taken (or given back) by its waiter."""
        self.handed = max(0, self.handed - 1)

    def _first(self, key: bytes) -> int:
        return min(flow[0].seq for flow in self._keys[key].values())

    def _drop(
        self, waiter: Waiter[T], subjects: dict[str, deque[Waiter[T]]], flow: deque[Waiter[T]]
    ) -> None:
        waiter.queued = False
        self.waiting -= 1
        if not flow:
            del subjects[waiter.subject]
            if not subjects:
                del self._keys[waiter.key]
