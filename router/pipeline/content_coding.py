"""Compressed request bodies: the head's coding judged before the read, the body inflated after.

The one place the router unpacks a body (:mod:`firstbyte.protocol.content_coding` does the
work). :func:`body_coding` runs on the head, after the key is checked and before any body is
read: a coding the router does not take is a 415 carrying ``Accept-Encoding`` (RFC 7694
section 3) and costs no read. :func:`inflate_body` runs on the body as read (the body timeout
and the read's bound of ``max_body_bytes + 1`` covered the compressed bytes) and replaces
``ctx.body`` with the inflated one, bounded by the same limit: everything after it (the size
check, parsing, affinity, the body forwarded upstream with its own ``content-length`` and no
``content-encoding``) sees the inflated body.
"""

from __future__ import annotations

from firstbyte.protocol import error_codes
from firstbyte.protocol.content_coding import (
    ACCEPT_ENCODING,
    ACCEPT_ENCODING_HEADER,
    CONTENT_ENCODING_HEADER,
    QUERY_PARAM,
    Coding,
    CorruptBody,
    InflatedTooLarge,
    UnsupportedCoding,
    inflate,
    requested_coding,
)

from .admit import check_body_size
from .context import CONTINUE, LocalReply, Outcome, RequestContext, error_reply

__all__ = ["ADVERTISED", "body_coding", "inflate_body"]

ADVERTISED = ((ACCEPT_ENCODING_HEADER, ACCEPT_ENCODING),)
"""The response header saying which request codings the router takes."""


def body_coding(ctx: RequestContext, query: dict[str, str]) -> Coding | LocalReply:
    """The coding of the body to come, from ``Content-Encoding`` or (the simple start, whose
    ``text/plain`` body cannot come with that header) ``?encoding=``; a 415 for another."""
    header = ctx.headers.get(CONTENT_ENCODING_HEADER)
    if header is None and QUERY_PARAM not in query:  # nearly every request: one call less
        return Coding.IDENTITY
    try:
        return requested_coding(header, query.get(QUERY_PARAM))
    except UnsupportedCoding:
        return error_reply(
            415,
            f"Unsupported request body coding; send one of: {ACCEPT_ENCODING} (or none).",
            param=CONTENT_ENCODING_HEADER if header is not None else QUERY_PARAM,
            code=error_codes.UNSUPPORTED_CONTENT_ENCODING,
            # Once: an endpoint that advertises on every answer (the warm-up) has it already.
            headers=() if ADVERTISED[0] in ctx.response_headers else ADVERTISED,
        )


def inflate_body(ctx: RequestContext, coding: Coding, max_body_bytes: int) -> Outcome:
    """Replace ``ctx.body`` (as read, in ``coding``) with its inflated bytes: a 413 (as for
    a plain body) when either is over ``max_body_bytes``, a 400 for data that is not
    ``coding``'s."""
    if coding is Coding.IDENTITY:
        return CONTINUE
    too_large = check_body_size(ctx, max_body_bytes)
    if too_large is not CONTINUE:
        return too_large
    try:
        ctx.body = inflate(ctx.body, coding, max_body_bytes)
    except InflatedTooLarge:
        ctx.body = b""  # the partial output goes now, not with the context
        return error_reply(
            413,
            f"Request body larger than {max_body_bytes} bytes once inflated.",
            code=error_codes.REQUEST_TOO_LARGE,
        )
    except CorruptBody as exc:
        return error_reply(
            400,
            f"The request body is not valid {coding.value} data ({exc}).",
            param=CONTENT_ENCODING_HEADER,
            code=error_codes.INVALID_CONTENT_ENCODING,
        )
    return CONTINUE
