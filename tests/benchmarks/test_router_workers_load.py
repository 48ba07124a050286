"""``bench router_workers``'s load generator times TTFT at the first content chunk, even when
the role chunk and the first token reach it in one read (the sim sends them in one write),
and never at the role chunk."""

from __future__ import annotations

import asyncio

from firstbyte.benchmarks.scenarios.router_workers import _Load, _stream
from tests.benchmarks.sse_answer import ROLE, TOKEN, answering

HELD_S = 0.6
"""How long the server holds back what it sends second."""


async def _ttft_ms(first: bytes, then: bytes) -> float:
    """TTFT as the load generator times it from a server that answers with ``first`` at
    once and ``then`` (and ``[DONE]``) ``HELD_S`` later."""
    async with answering(first, then, HELD_S) as port:
        load = _Load()
        await asyncio.wait_for(_stream(port, b"{}", load), 10)
    assert load.errors == 0, load.error_kinds
    assert len(load.ttft_ms) == 1
    return load.ttft_ms[0]


async def test_the_first_token_read_with_the_role_chunk_is_the_first_content() -> None:
    ttft_ms = await _ttft_ms(ROLE + TOKEN % b"Hello", TOKEN % b" world")
    assert ttft_ms < HELD_S * 1000  # timed on the first token, not the held-back second


async def test_the_role_chunk_alone_is_not_content() -> None:
    ttft_ms = await _ttft_ms(ROLE, TOKEN % b"Hello")
    assert ttft_ms >= HELD_S * 1000  # no content was sent before it
