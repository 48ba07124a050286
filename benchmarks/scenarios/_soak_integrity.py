"""The soak's integrity judge (sans-IO): was every token of every key delivered exactly once, to
that key only?

The sim's output is a pure function of the request (:func:`firstbyte.router.sim.output.
plan_completion`): every sim of the soak runs with the same seed, so whichever backend served a
stream, and however often the stream was resumed, its text is known before it is sent. Each
request's prompt names its key and a counter, so no two requests share an output.

A received text is compared with the expected one word by word:

- equal: **exact**;
- a prefix of it, on an attempt that ended in an error: **partial** (fine: nothing wrong was
  shown, the client retried);
- otherwise at the first differing word: the next words found *earlier* in the expected text
  are **repeated** tokens, found *later* are **lost** tokens, found in another key's expected
  output are a **cross-key** leak; anything else is **corrupt**; a text that stops short of the
  expected one although the stream said it was finished is **lost**.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

import msgspec

from firstbyte.protocol.openai import decode_request
from firstbyte.router.sim.output import plan_completion

__all__ = ["SIM_SEED", "Expected", "Ledger", "Verdict", "expect"]

SIM_SEED = 0
"""``--seed`` of every sim of the soak: the same request gives the same text on any of them."""
NGRAM = 6
"""Words in a row that identify a key's output: the vocabulary has ~130 words, so a 6-word run
repeats by chance about once in 5e12 draws."""
FAILURES = ("lost", "repeated", "cross_key", "corrupt")


class Verdict(Enum):
    EXACT = "exact"
    PARTIAL = "partial"
    LOST = "lost"
    REPEATED = "repeated"
    CROSS_KEY = "cross_key"
    CORRUPT = "corrupt"

    @property
    def violation(self) -> bool:
        return self.value in FAILURES


class Expected(msgspec.Struct, frozen=True):
    """What one request must receive."""

    key: str
    words: tuple[str, ...]
    finish_reason: str

    @property
    def text(self) -> str:
        return " ".join(self.words)


def expect(key: str, body: dict[str, Any]) -> Expected:
    """The text the sim produces for ``body`` (a chat completions request), sent with ``key``."""
    completion = plan_completion(decode_request(msgspec.json.encode(body)), SIM_SEED)
    return Expected(key, completion.words, completion.finish_reason)


class Ledger:
    """Every expected output of the run, indexed by its word n-grams, and the verdicts."""

    def __init__(self) -> None:
        self._owners: dict[tuple[str, ...], set[str]] = {}
        self.counts: dict[str, int] = {verdict.value: 0 for verdict in Verdict}
        self.examples: list[str] = []

    def register(self, expected: Expected) -> None:
        """Index ``expected`` (call before the request is sent, so a leak into a stream that
        started earlier is still recognised)."""
        words = expected.words
        for i in range(len(words) - NGRAM + 1):
            self._owners.setdefault(words[i : i + NGRAM], set()).add(expected.key)

    def judge(self, expected: Expected, received: str, *, finished: bool, label: str) -> Verdict:
        """Classify ``received`` against ``expected`` (see the module docstring) and count it;
        ``finished``: the stream ended normally (not with an error)."""
        verdict = self._classify(expected, received.split(), finished)
        self.counts[verdict.value] += 1
        if verdict.violation and len(self.examples) < 10:
            self.examples.append(
                f"{label}: {verdict.value}: expected {expected.text[:120]!r}, "
                f"got {received[:120]!r}"
            )
        return verdict

    def _classify(self, expected: Expected, got: Sequence[str], finished: bool) -> Verdict:
        want = expected.words
        if tuple(got) == want:
            return Verdict.EXACT
        d = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
        if d is None:  # one is a prefix of the other
            if len(got) < len(want):
                return Verdict.LOST if finished else Verdict.PARTIAL
            return Verdict.REPEATED  # the whole text, then more of it
        if self._foreign(expected.key, got, d):
            return Verdict.CROSS_KEY
        window = tuple(got[d : d + 3])
        for start in range(len(want) - len(window) + 1):
            if want[start : start + len(window)] == window:
                return Verdict.REPEATED if start < d else Verdict.LOST
        return Verdict.CORRUPT

    def _foreign(self, key: str, got: Sequence[str], start: int) -> bool:
        """Does a run of :data:`NGRAM` words from ``start`` on belong to another key only?"""
        for i in range(max(0, start - NGRAM + 1), len(got) - NGRAM + 1):
            owners = self._owners.get(tuple(got[i : i + NGRAM]))
            if owners and key not in owners:
                return True
        return False

    @property
    def violations(self) -> int:
        return sum(self.counts[name] for name in FAILURES)
