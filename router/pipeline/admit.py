"""Admission: who is asking (API key), is the body acceptable (size), what is asked (parse).

Each check is a plain function over the :class:`RequestContext`; :func:`admit_chat` runs them
in order. API keys are compared in constant time against every configured key (no early
exit), and never appear in a reply or a log line.
"""

from __future__ import annotations

import functools
import hmac
import time
from collections.abc import Sequence

from firstbyte.protocol import error_codes
from firstbyte.protocol.anthropic import API_KEY_HEADER
from firstbyte.protocol.openai import RequestValidationError

from ..client_tokens import TokenClaims, TokenRefusal, TokenSigner, is_client_token
from ..observability.logs import key_id
from ..streams import owner_of
from ..tenancy import subject_of
from .context import CONTINUE, Outcome, RequestContext, error_reply

__all__ = [
    "admit_body",
    "admit_chat",
    "adopt_api_key_header",
    "adopt_token",
    "authenticate",
    "check_body_size",
    "name_subject",
    "parse_chat",
]


def _bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def adopt_token(ctx: RequestContext, credential: str | None) -> None:
    """Take a client token that came outside ``Authorization`` (an ``EventSource`` query
    parameter, a WebSocket subprotocol) as if it were the bearer token. Only something shaped
    like a client token is taken: an API key never travels in a URL or a subprotocol."""
    if credential and is_client_token(credential) and "authorization" not in ctx.headers:
        ctx.headers["authorization"] = f"Bearer {credential}"


@functools.lru_cache(maxsize=4)
def _owner_by_key(api_keys: tuple[bytes, ...]) -> dict[bytes, bytes]:
    """Each configured key's owner digest, by the key (computed once per key set: a reload
    makes a new one). A keyed request then takes its owner from here, where working out the
    digest (``owner_of``, a SHA-256) cost it ~6k instructions."""
    return {key: owner_of(key.decode()) for key in api_keys}


@functools.lru_cache(maxsize=4)
def _key_id_by_owner(api_keys: tuple[bytes, ...]) -> dict[bytes, str | None]:
    """Each configured key's ``key_id`` (the access line's digest), by its owner digest
    (computed once per key set: a reload makes a new one). A token carries only its key's
    owner: this is how its request is known to be one of a configured key's, and which."""
    return {owner: key_id(key.decode()) for key, owner in _owner_by_key(api_keys).items()}


_REVOKED = TokenRefusal(
    error_codes.CLIENT_TOKEN_REVOKED,
    "Client token revoked: the API key it was minted for is no longer accepted.",
)


def _by_token(
    ctx: RequestContext, token: str, tokens: TokenSigner, api_keys: Sequence[bytes]
) -> Outcome:
    claims = tokens.verify(token, time.time(), ctx.headers.get("origin"))
    # A token stands for its key only while the key is configured: checked against the
    # running config's keys, so removing a key (a reload) revokes its tokens at once, not at
    # their expiry. The same look-up names the key for the access line. An anonymous router
    # has no keys to check against, nor the key behind a token to name (its line's key_id
    # stays null).
    token_key_id = None
    if isinstance(claims, TokenClaims) and api_keys:
        by_owner = _key_id_by_owner(tuple(api_keys))
        if claims.owner in by_owner:
            token_key_id = by_owner[claims.owner]
        else:
            claims = _REVOKED
    if isinstance(claims, TokenRefusal):
        return error_reply(
            401, claims.message, "authentication_error", code=claims.code, outcome="unauthorized"
        )
    ctx.token_owner = claims.owner  # first: the owner is then the token's, no digest taken
    ctx.token_key_id = token_key_id
    ctx.api_key = None
    ctx.subject = claims.subject
    ctx.subject_max_streams = claims.max_streams
    return CONTINUE


def authenticate(
    ctx: RequestContext, api_keys: Sequence[bytes], tokens: TokenSigner | None = None
) -> Outcome:
    """Accept a request whose bearer token is one of ``api_keys`` (any request if none) or,
    when ``tokens`` is given, a valid client token (it acts as its key's owner)."""
    token = _bearer(ctx.headers)
    if tokens is not None and token is not None and is_client_token(token):
        return _by_token(ctx, token, tokens, api_keys)
    if not api_keys:
        # No token and no key set: setting the key to None would change nothing (the owner
        # stays as it is) but cost the setter's Python call.
        if token is not None or ctx._api_key is not None:
            ctx.api_key = token
        return CONTINUE
    if token is None:
        return error_reply(
            401,
            "Missing API key: send 'Authorization: Bearer KEY' (to /v1/messages, also"
            " 'x-api-key: KEY').",
            "authentication_error",
            code=error_codes.MISSING_API_KEY,
            outcome="unauthorized",
        )
    candidate = token.encode()
    matched = False
    for key in api_keys:
        # Every key is compared, so the time taken does not say which one (or how much) matched.
        matched |= hmac.compare_digest(candidate, key)
    if not matched:
        return error_reply(
            401,
            "Incorrect API key.",
            "authentication_error",
            code=error_codes.INVALID_API_KEY,
            outcome="unauthorized",
        )
    # Looked up only once the comparison above matched: the request holds a configured key,
    # so the lookup says nothing about the keys to a client that does not already hold one.
    ctx.adopt_api_key(token, _owner_by_key(tuple(api_keys))[candidate])
    return CONTINUE


def check_body_size(ctx: RequestContext, max_body_bytes: int) -> Outcome:
    """413 for a body over the limit (the IO layer stops reading at ``max_body_bytes + 1``)."""
    if len(ctx.body) > max_body_bytes:
        return error_reply(
            413,
            f"Request body larger than {max_body_bytes} bytes.",
            code=error_codes.REQUEST_TOO_LARGE,
        )
    return CONTINUE


def parse_chat(ctx: RequestContext, *, force_stream: bool = False) -> Outcome:
    """Decode the body with the request's codec (400 naming the field if invalid)."""
    try:
        request = ctx.codec.decode_request(ctx.body)
    except RequestValidationError as exc:
        return error_reply(400, exc.message, param=exc.param, code=error_codes.INVALID_REQUEST)
    ctx.request = request
    ctx.stream_requested = (request.stream or force_stream) and ctx.codec.streams
    return CONTINUE


def adopt_api_key_header(ctx: RequestContext) -> None:
    """Take the key of a request that sends it as ``x-api-key`` (Anthropic's header)
    as if it came as ``Authorization: Bearer``; a request sending both is judged by the
    bearer one."""
    key = ctx.headers.get(API_KEY_HEADER)
    if key and "authorization" not in ctx.headers:
        ctx.headers["authorization"] = f"Bearer {key.strip()}"


SUBJECT_HEADER = "x-firstbyte-subject"
"""A server-side request names the end user it is for (as the body's ``user`` does)."""


def name_subject(ctx: RequestContext) -> None:
    """Set ``ctx.subject`` for a request by API key: the ``x-firstbyte-subject`` header, else
    the body's ``safety_identifier``, else its ``user`` (OpenAI's end-user fields). A client
    token's subject is the one its app minted it for and nothing in the request changes it."""
    if ctx._token_owner is not None:  # by_client_token, not through the property (a call)
        return
    name = ctx.headers.get(SUBJECT_HEADER)
    request = ctx.request
    if not name and request is not None:
        name = request.safety_identifier or request.user
    ctx.subject = subject_of(name) if name else None  # none named: no call


def admit_body(ctx: RequestContext, max_body_bytes: int, *, force_stream: bool = False) -> Outcome:
    """Run the body limit and parsing on an authenticated request; stamp ``ctx.admitted_at``."""
    if len(ctx.body) > max_body_bytes:  # check_body_size's test: a call only to refuse
        return check_body_size(ctx, max_body_bytes)
    outcome = parse_chat(ctx, force_stream=force_stream)
    if outcome is CONTINUE:
        name_subject(ctx)
        ctx.admitted_at = time.perf_counter()
    return outcome


def admit_chat(
    ctx: RequestContext,
    api_keys: Sequence[bytes],
    max_body_bytes: int,
    *,
    force_stream: bool = False,
    tokens: TokenSigner | None = None,
) -> Outcome:
    """Run authentication, then :func:`admit_body`."""
    outcome = authenticate(ctx, api_keys, tokens)
    if outcome is not CONTINUE:
        return outcome
    return admit_body(ctx, max_body_bytes, force_stream=force_stream)
