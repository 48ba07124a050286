"""Client tokens: what a browser holds instead of an API key (docs/browser.md).

The application's backend sends ``POST /v1/edge/tokens`` with its API key and a
:class:`TokenRequest`; the router answers a :class:`ClientToken`. The token is opaque to
clients: send it as ``Authorization: Bearer TOKEN`` wherever an API key goes, as the
``?token=`` query parameter of ``GET /v1/streams/{id}`` (``EventSource`` cannot set headers),
or as the WebSocket subprotocol ``firstbyte.token.TOKEN`` next to
:data:`~firstbyte.protocol.ws.SUBPROTOCOL` (a browser's ``WebSocket`` cannot set headers
either, and a subprotocol stays out of URLs and the access logs that record them).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["MAX_SUBJECT_CHARS", "QUERY_PARAM", "TOKEN_PREFIX", "ClientToken", "TokenRequest"]

MAX_SUBJECT_CHARS = 128
"""The longest subject a token may carry (the router keeps a count per subject)."""

TOKEN_PREFIX = "fbt1."
"""Every client token starts with it (version 1): a router tells a token from an API key."""

QUERY_PARAM = "token"
"""``GET /v1/streams/{id}?token=TOKEN``: the only place a token may travel in a URL."""


class TokenRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/edge/tokens`` body: the lifetime wanted (capped by the router's
    ``auth.client_token_max_ttl_s``) and, optionally, the one page ``Origin`` that may use it,
    the *subject* it is for (the app's end-user id: its requests share the key's capacity
    fairly with the other subjects', and it reads only its own streams) and that subject's
    cap on completions in flight."""

    ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    origin: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    subject: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_SUBJECT_CHARS)] | None = (
        None
    )
    max_streams: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ClientToken(msgspec.Struct):
    """``POST /v1/edge/tokens`` answer: the token and when it expires (seconds since the epoch)."""

    token: str
    expires_at: float
