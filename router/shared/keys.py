"""The name of every Redis key the router writes, in one place (all under one prefix)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names under ``prefix`` (``state.key_prefix``, e.g. ``firstbyte:``)."""

    prefix: str

    def events(self, stream_id: str) -> str:
        """The Redis Stream of a stream's events (entry id ``SEQ-0``, field ``d``)."""
        return f"{self.prefix}s:{stream_id}"

    def meta(self, stream_id: str) -> str:
        """A hash: ``owner`` (the API key's digest), ``proc`` (the producing process),
        ``ttft`` (upstream time to first token, ms, once known), ``intact`` (removed when an
        event could not be written: Redis full) and ``v`` (2: ``intact`` is kept)."""
        return f"{self.prefix}m:{stream_id}"

    def reader(self, stream_id: str) -> str:
        """Present while a process other than the producer has a reader on the stream."""
        return f"{self.prefix}r:{stream_id}"

    def lease(self, process: str) -> str:
        """A process's lease: present while it runs (``SET PX``, renewed)."""
        return f"{self.prefix}p:{process}"

    def key_slots(self, owner: bytes) -> str:
        """A hash of an API key's completions in flight: process -> count (per-key limits)."""
        return f"{self.prefix}c:{owner.hex()}"

    def key_bucket(self, owner: bytes) -> str:
        """A hash holding an API key's rate bucket: ``tokens`` and ``at`` (ms)."""
        return f"{self.prefix}q:{owner.hex()}"

    def backend_load(self, backend: str) -> str:
        """A hash of a backend's requests in flight: process -> count."""
        return f"{self.prefix}l:{backend}"

    def affinity(self, digest: str) -> str:
        """The backend an affinity key goes to, by the key's digest (``SET PX``)."""
        return f"{self.prefix}a:{digest}"

    def ticket(self, label: bytes) -> str:
        """One QUIC session ticket, by its label (taken once with ``GETDEL``)."""
        return f"{self.prefix}t:{label.hex()}"

    def warm_budget(self, owner: bytes, subject: str) -> str:
        """A sorted set of a key's and user's prompt warm-ups in the last minute (their times
        on Redis's clock); ``subject`` as :mod:`.warm_budget` names it."""
        return f"{self.prefix}w:{owner.hex()}:{subject}"
