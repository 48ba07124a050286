"""A long conversation of real English text, the same on every run: what a chat's history is.

Synthetic filler (``" u001 u002 ..."``) compresses far better than text a user reads, so a
benchmark of request compression needs prose. The prose here is the standard library's own
(``pydoc_data.topics``: the Python reference's topic pages, which every Python install has):
paragraphs of running text, without the code samples, grammar rules and headings. gzip
compresses it about 3.2x, as it does English chat text; the simulated server's tokenizer
(:mod:`firstbyte.router.sim.tokens`) counts it at about 2.9 characters per token.
"""

from __future__ import annotations

import functools
import itertools
import pydoc_data.topics

from firstbyte.protocol.openai import Message
from firstbyte.router.sim.tokens import prompt_tokens, tokenize

__all__ = ["conversation", "count_tokens", "paragraphs"]

MESSAGE_TOKENS = 500
"""About how long each message of :func:`conversation` is (tokens)."""


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """The prose paragraphs of ``pydoc_data.topics``, in topic order, whitespace collapsed."""
    out = []
    for topic in sorted(pydoc_data.topics.topics):
        for block in pydoc_data.topics.topics[topic].split("\n\n"):
            lines = block.strip("\n").splitlines()
            if not lines or block.startswith(" "):  # indented: code, a grammar rule
                continue
            if set(lines[-1]) <= set("*=-~^"):  # a heading and its underline
                continue
            if "::=" in block or ">>>" in block:
                continue
            out.append(" ".join(block.split()))
    return tuple(out)


def count_tokens(messages: list[dict[str, str]]) -> int:
    """The prompt tokens the simulated server counts for ``messages`` (its chat template)."""
    return len(prompt_tokens(Message(role=m["role"], content=m["content"])  # type: ignore[arg-type]
                             for m in messages))


def conversation(topic: str, tokens: int = 8000) -> list[dict[str, str]]:
    """A conversation of prose that the sim counts as ``tokens`` tokens at most (and within a
    word of it): messages of about :data:`MESSAGE_TOKENS`, user and assistant in turn,
    the last the assistant's (the user's next message follows). The first message starts with
    ``topic``, so that each topic's history (its affinity key, every prefix block) is its own."""
    messages: list[dict[str, str]] = []
    parts: list[str] = [topic]
    total = 3 + 5 + len(tokenize(topic))  # the generation prompt, one message's markers
    in_message = len(tokenize(topic))
    for paragraph in itertools.cycle(paragraphs()):  # ends: every paragraph costs tokens
        cost = len(tokenize(" " + paragraph))
        if total + cost > tokens:
            cut = _cut(paragraph, tokens - total)
            if cut:
                parts.append(cut)
            break
        parts.append(paragraph)
        total += cost
        in_message += cost
        if in_message >= MESSAGE_TOKENS and total + 5 < tokens:
            messages.append({"role": "", "content": " ".join(parts)})
            parts, in_message = [], 0
            total += 5
    if parts:
        messages.append({"role": "", "content": " ".join(parts)})
    for back, message in enumerate(reversed(messages)):
        message["role"] = ("assistant", "user")[back % 2]
    return messages


def _cut(paragraph: str, tokens: int) -> str:
    """The words of ``paragraph`` from its start that cost at most ``tokens`` tokens."""
    words = paragraph.split(" ")
    kept: list[str] = []
    used = 0
    for word in words:
        cost = len(tokenize(" " + word))
        if used + cost > tokens:
            break
        kept.append(word)
        used += cost
    return " ".join(kept)
