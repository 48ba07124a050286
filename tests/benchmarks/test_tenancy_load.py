"""The tenancy benchmark's load generator tells a stream that failed before its first token
from one that failed after: the role chunk is not a token."""

from __future__ import annotations

from firstbyte.benchmarks.scenarios._tenancy_load import Tally, stream_once
from tests.benchmarks.sse_answer import ROLE, TOKEN, answering


async def _tokens_before_a_drop(sent: bytes) -> int:
    """Content chunks counted from a stream that sends ``sent`` and closes without [DONE]."""
    async with answering(sent) as port:
        outcome = await stream_once(port, "good", {}, {}, Tally())
    assert outcome.error is not None  # closed before [DONE]
    return outcome.tokens


async def test_a_drop_after_the_role_chunk_alone_is_before_any_token() -> None:
    assert await _tokens_before_a_drop(ROLE) == 0


async def test_content_chunks_are_counted_without_the_role_chunk() -> None:
    assert await _tokens_before_a_drop(ROLE + TOKEN % b"Hello" + TOKEN % b" world") == 2
