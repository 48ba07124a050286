"""A prefix cache of fixed-size token blocks with chained hashes and LRU eviction.

This follows vLLM's automatic prefix caching: a prompt is cut into blocks of ``block_size``
tokens; block ``i``'s key is a hash of block ``i-1``'s key and block ``i``'s tokens, so a key
identifies the whole prefix up to the end of its block. Only full blocks are cached. A lookup
counts the leading blocks whose keys are present; the cache holds at most ``capacity_blocks``
keys and evicts the least recently used one first. Hits and queries are counted in tokens, as
vLLM's ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` counters are.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BLOCK_SIZE", "PrefixCache", "block_hashes"]

BLOCK_SIZE = 16
"""vLLM's default KV-cache block size, in tokens."""

_TOKEN_BYTES = array("I").itemsize


def block_hashes(tokens: Sequence[int], block_size: int = BLOCK_SIZE) -> list[bytes]:
    """Chained keys of every *full* block of ``tokens`` (a trailing partial block has none)."""
    # One conversion of the whole prompt and byte slices of it: an 8K-token prompt is hashed
    # with every request, and an array per block cost the sim ~40 % more of its own CPU.
    ids = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    data = ids.tobytes()
    step = block_size * _TOKEN_BYTES
    blake2b = hashlib.blake2b
    keys: list[bytes] = []
    parent = b""
    for start in range(0, len(data) - step + 1, step):
        parent = blake2b(parent + data[start : start + step], digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """LRU set of block keys with a capacity; sans-IO, no clock needed."""

    def __init__(self, capacity_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queries_tokens = 0
        """Prompt tokens looked up so far (``vllm:prefix_cache_queries``)."""
        self.hits_tokens = 0
        """Prompt tokens found cached so far (``vllm:prefix_cache_hits``)."""
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def match(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """Tokens of a ``num_tokens``-token prompt covered by cached leading blocks.

        Counts the query and the hit, and refreshes the hit blocks' recency. As in vLLM, at
        least the prompt's last token is always computed, so a fully cached prompt reports
        one block fewer.
        """
        hit = self.cached(keys, num_tokens)
        for key in keys[: hit // self.block_size]:
            self._blocks.move_to_end(key)
        self.queries_tokens += num_tokens
        self.hits_tokens += hit
        return hit

    def cached(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """What :meth:`match` would answer, without counting or refreshing anything."""
        usable = (num_tokens - 1) // self.block_size if num_tokens > 0 else 0
        hit_blocks = 0
        for key in keys[:usable]:
            if key not in self._blocks:
                break
            hit_blocks += 1
        return hit_blocks * self.block_size

    def insert(self, keys: Sequence[bytes]) -> None:
        """Record the blocks of a computed prompt as most recently used, evicting LRU blocks."""
        if self.capacity_blocks == 0:
            return
        blocks = self._blocks
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
                if len(blocks) > self.capacity_blocks:
                    blocks.popitem(last=False)
                    self.evictions += 1
