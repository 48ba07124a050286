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
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable

from firstbyte.protocol.openai import Message, message_text

__all__ = ["IM_END", "IM_START", "TOKEN_PATTERN", "prompt_tokens", "tokenize"]

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


def prompt_tokens(messages: Iterable[Message]) -> list[int]:
    """Token ids of the chat-templated prompt, including the assistant generation prompt."""
    ids: list[int] = []
    for message in messages:
        ids.append(IM_START)
        ids.append(_ROLE_IDS.get(message.role, 9))
        ids.append(_NEWLINE)
        ids.extend(tokenize(message_text(message)))
        ids.append(IM_END)
        ids.append(_NEWLINE)
    ids.extend((IM_START, _ROLE_IDS["assistant"], _NEWLINE))
    return ids
