"""The answer of a prompt warm-up, ``POST /v1/edge/warm`` with a chat request
(docs/protocol.md): the backend the conversation's next message will be routed to has
computed its prefix."""

from __future__ import annotations

import msgspec

__all__ = ["PromptWarmed"]


class PromptWarmed(msgspec.Struct, kw_only=True):
    """``{"warmed": true, "prompt_tokens": N, "cached_tokens": M}``: the prompt's tokens and
    those of them the backend already had cached (None where the backend did not say)."""

    warmed: bool = True
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
