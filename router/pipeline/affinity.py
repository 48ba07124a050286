"""Choosing a backend inside the region: prefix affinity balanced by load (sans-IO).

The affinity key is the model plus the first ``affinity_chars`` characters of the first
message *after* the shared prefix: leading ``system``/``developer`` messages are skipped
(as is a configured warm prefix at the start of the first remaining message), so a
system prompt shared by every user does not send every user to one backend (the hot spot of
vLLM production-stack issue 957). The user's first message stays the same for every turn of
a conversation, so a conversation keeps landing where its history is cached.

Policy (``prefix``), in order:

1. Imbalance (SGLang router's rule): if, over the available backends,
   ``max_load - min_load > abs_threshold`` AND ``max_load > rel_threshold * min_load``, take
   the least-loaded backend (least in flight, then rendezvous rank, breaks ties).
2. A key seen before (within ``ttl_s``) goes back to its backend while that one is available.
3. A new key goes to the highest weighted-rendezvous-hash backend whose share of live keys
   stays within ``bounded_load_factor`` times its fair share (consistent hashing with
   bounded loads, Mirrokni et al. 2018). The default factor is 1.0: a new key has no cache
   anywhere yet (the shared prefix is warm everywhere), so nothing is lost by placing it
   strictly by balance; 50 users on 4 backends get 13/13/12/12 keys.

``round_robin`` and ``least_loaded`` exist for comparison (the routing benchmark).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import msgspec

from firstbyte.protocol.openai import ChatCompletionRequest, message_text

__all__ = ["AffinityPolicy", "BackendChoice", "affinity_key", "opens_conversation",
           "rendezvous_rank"]


def affinity_key(
    request: ChatCompletionRequest, warm_prefixes: Sequence[str] = (), chars: int = 256
) -> str:
    """The part of the request that should decide its backend (see the module docstring)."""
    messages = request.messages
    i = 0
    while i < len(messages) and messages[i].role in ("system", "developer"):
        i += 1
    if i == len(messages):  # nothing but the shared prompt: key on it
        i = 0
    # Only the first message after the shared prompt: later messages grow turn by turn, and a
    # key that changes between turns would move the conversation away from its cache.
    content = messages[i].content  # message_text inlined for a string (a call a request)
    first = content if type(content) is str else message_text(messages[i])
    if warm_prefixes:  # none (no warmup): no sort, which cost ~1.6k instructions even empty
        for prefix in sorted(warm_prefixes, key=len, reverse=True):
            if prefix and first.startswith(prefix):
                first = first[len(prefix) :]
                break
    return f"{request.model}\x00{messages[i].role}:{first[:chars]}"


def opens_conversation(request: ChatCompletionRequest) -> bool:
    """No answer in it yet (no ``assistant``, ``tool`` or ``function`` message): a
    conversation's first message, whose history no backend can hold a cache of, so no other
    router process can have placed its key already, unless the same first message came
    before (a retry, or users opening alike: a short prompt to compute again)."""
    return not any(m.role in ("assistant", "tool", "function") for m in request.messages)


def _score(key: str, backend: str, weight: float) -> float:
    digest = hashlib.blake2b(f"{key}\x00{backend}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 1) / (2**64 + 1)  # in (0, 1)
    return -weight / math.log(u)  # weighted rendezvous hashing


def rendezvous_rank(key: str, weights: Mapping[str, float]) -> list[str]:
    """Backends from most to least preferred for ``key`` (stable under adding/removing one)."""
    return sorted(weights, key=lambda b: _score(key, b, weights[b]), reverse=True)


# A msgspec Struct, not a frozen dataclass: made once or twice a request, and a frozen
# dataclass's __init__ is a Python call setting each field through object.__setattr__.
class BackendChoice(msgspec.Struct, frozen=True):
    backend: str
    reason: str
    """``affinity``, ``new-key``, ``balance``, ``round-robin`` or ``least-loaded``."""


class AffinityPolicy:
    """Stateful chooser: remembers where each affinity key went (bounded, expiring)."""

    def __init__(
        self,
        weights: Mapping[str, float],
        *,
        policy: str = "prefix",
        abs_threshold: int = 8,
        rel_threshold: float = 1.5,
        bounded_load_factor: float = 1.0,
        ttl_s: float = 600.0,
        max_keys: int = 100_000,
    ) -> None:
        self.weights = dict(weights)
        self.policy = policy
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.bounded_load_factor = bounded_load_factor
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._keys: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._key_counts: dict[str, int] = dict.fromkeys(weights, 0)
        self._rr = itertools.count()

    def key_counts(self) -> dict[str, int]:
        """Live affinity keys per backend."""
        return dict(self._key_counts)

    def _expire(self, now: float) -> None:
        while self._keys:
            key, (backend, seen) = next(iter(self._keys.items()))
            if now - seen <= self.ttl_s and len(self._keys) <= self.max_keys:
                break
            del self._keys[key]
            self._key_counts[backend] -= 1

    def _remember(self, key: str, backend: str, now: float) -> None:
        keys = self._keys
        old = keys.get(key)
        if old is not None and old[0] == backend:  # seen again where it was: counts stay
            keys[key] = (backend, now)
            keys.move_to_end(key)
            return
        old = keys.pop(key, None)
        if old is not None:
            self._key_counts[old[0]] -= 1
        self._keys[key] = (backend, now)
        self._key_counts[backend] = self._key_counts.get(backend, 0) + 1

    def learn(self, key: str, backend: str, now: float) -> None:
        """``key`` went to ``backend`` (decided by another router process of the region)."""
        if backend in self.weights:
            self._expire(now)
            self._remember(key, backend, now)

    def choose(
        self,
        key: str,
        available: Sequence[str],
        loads: Mapping[str, int],
        now: float,
    ) -> BackendChoice | None:
        """Pick a backend among ``available`` (healthy, unsaturated); ``None`` if there is none.

        ``loads`` is each backend's current load (requests in flight or queued); with one
        candidate and ``abs_threshold >= 0`` it is not read (the candidate is picked
        whatever its load, under every policy).
        """
        if not available:
            return None
        if self.policy == "round_robin":
            return BackendChoice(available[next(self._rr) % len(available)], "round-robin")
        if len(available) == 1 and self.policy != "least_loaded" and self.abs_threshold >= 0:
            # One candidate (a model one backend serves, or the only one with room): every
            # rule below picks it (no imbalance within one backend, its bounded load or the
            # fallback takes a new key), so only the reason and the key's memory are left,
            # without the ranks, loads and shares worked out for several (~8k instructions).
            backend = available[0]
            keys = self._keys
            if keys:  # _expire's first test in line: nearly always nothing has expired
                _, seen = next(iter(keys.values()))
                if now - seen > self.ttl_s or len(keys) > self.max_keys:
                    self._expire(now)
            known = keys.get(key)
            if known is not None and known[0] == backend:  # _remember's own first case
                keys[key] = (backend, now)
                keys.move_to_end(key)
                return BackendChoice(backend, "affinity")
            self._remember(key, backend, now)
            return BackendChoice(backend, "new-key")
        # One backend is its own rank: no digest to take (a region of one backend per model).
        rank = (
            list(available) if len(available) == 1
            else rendezvous_rank(key, {b: self.weights.get(b, 1.0) for b in available})
        )
        # Loops, not comprehensions: each comprehension is a Python call, made per request.
        position: dict[str, int] = {}
        for i, b in enumerate(rank):
            position[b] = i

        def least_loaded() -> str:
            return min(available, key=lambda b: (loads.get(b, 0), position[b]))

        if self.policy == "least_loaded":
            return BackendChoice(least_loaded(), "least-loaded")
        self._expire(now)
        high = low = loads.get(available[0], 0)
        for b in available:
            load = loads.get(b, 0)
            if load > high:
                high = load
            elif load < low:
                low = load
        if high - low > self.abs_threshold and high > self.rel_threshold * low:
            return BackendChoice(least_loaded(), "balance")
        known = self._keys.get(key)
        if known is not None and known[0] in position:
            self._remember(key, known[0], now)
            return BackendChoice(known[0], "affinity")
        total_weight = sum(self.weights.get(b, 1.0) for b in available)
        live = sum(self._key_counts.get(b, 0) for b in available) + 1
        for backend in rank:
            share = self.weights.get(backend, 1.0) / total_weight
            cap = math.ceil(self.bounded_load_factor * live * share)
            if self._key_counts.get(backend, 0) + 1 <= cap:
                self._remember(key, backend, now)
                return BackendChoice(backend, "new-key")
        self._remember(key, rank[0], now)
        return BackendChoice(rank[0], "new-key")
