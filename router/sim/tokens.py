"""A deterministic stand-in for a tokenizer and a chat template.

The sim needs token *counts* (prefill cost, usage) and token *identities* (prefix-cache block
hashes) that behave like a real BPE tokenizer's without shipping one. The approximation:

- text is split by :data:`TOKEN_PATTERN`: a run of up to four word characters with an optional
  leading space, a single punctuation or symbol character with an optional leading space, or a
  run of whitespace. English prose comes out at about 4 characters per token, the usual figure
  for GPT-style BPE vocabularies;
- each piece's id is the CRC-32 of its UTF-8 bytes, so the same text always gives the same ids,
  on every run and every machine (no ``PYTHONHASHSEED`` dependence);
- the chat template wraps each message in role markers (``<|im_start|>ROLE`` ... ``<|im_end|>``,
  ChatML style) which are reserved ids below 16, and ends with the assistant generation prompt,
  so message boundaries and roles change the tokens, as they do in a real template.

A long message's ids are remembered (an LRU bounded in tokens, :data:`MEMO_TOKENS`): a
conversation sends its whole history again with every turn, and splitting 8K tokens with the
regex costs this process ~4 ms of Python where a real server's Rust tokenizer takes about one.
What a request's tokenizing *costs* is the profile's to say
(:meth:`firstbyte.router.sim.profiles.Profile.tokenize_s`), not this module's CPU.
"""

from __future__ import annotations

import re
import zlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable

from firstbyte.protocol.openai import Message, message_text

__all__ = ["IM_END", "IM_START", "MEMO_TOKENS", "TOKEN_PATTERN", "prompt_tokens", "tokenize"]

TOKEN_PATTERN = re.compile(r" ?\w{1,4}| ?[^\w\s]|\s+")
"""Pieces: up to 4 word characters, or one symbol, each with an optional leading space; or
whitespace."""

IM_START = 1
IM_END = 2
_ROLE_IDS = {"system": 3, "developer": 4, "user": 5, "assistant": 6, "tool": 7, "function": 8}
_NEWLINE = zlib.crc32(b"\n") | 16  # ids below 16 are reserved for the template's markers


def tokenize(text: str) -> list[int]:
    """Token ids of ``text``: one id per :data:`TOKEN_PATTERN` piece (always >= 16)."""
    return [zlib.crc32(piece.encode()) | 16 for piece in TOKEN_PATTERN.findall(text)]


MEMO_TOKENS = 2_000_000
"""Token ids of long messages remembered at most (4 bytes each, plus the texts)."""
_MEMO_MIN_CHARS = 512
"""Shorter texts are split again each time: cheap, and not worth a slot."""


class _Memo:
    """Ids of recently tokenized long texts, least recently used dropped first."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0
        self._ids: OrderedDict[str, array[int]] = OrderedDict()

    def ids(self, text: str) -> array[int]:
        found = self._ids.get(text)
        if found is not None:
            self._ids.move_to_end(text)
            return found
        ids = array("I", tokenize(text))
        self._ids[text] = ids
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            self.tokens -= len(self._ids.popitem(last=False)[1])
        return ids


_memo = _Memo(MEMO_TOKENS)


def prompt_tokens(messages: Iterable[Message]) -> array[int]:
    """Token ids of the chat-templated prompt, including the assistant generation prompt
    (an unsigned 32-bit array: joining remembered messages is a copy of bytes)."""
    ids = array("I")
    for message in messages:
        ids.append(IM_START)
        ids.append(_ROLE_IDS.get(message.role, 9))
        ids.append(_NEWLINE)
        text = message_text(message)
        ids.extend(_memo.ids(text) if len(text) >= _MEMO_MIN_CHARS else tokenize(text))
        ids.append(IM_END)
        ids.append(_NEWLINE)
    ids.extend((IM_START, _ROLE_IDS["assistant"], _NEWLINE))
    return ids
