"""The preflight-free start: a browser's stream start that is a CORS *simple request*.

A cross-origin ``fetch`` with an ``Authorization`` header or ``Content-Type:
application/json`` is preflighted: one more round trip (``OPTIONS``) before a cold page's
first message is even sent. A ``POST`` with ``Content-Type: text/plain`` and no custom header
is not; the browser client then sends the client token as ``?token=`` and the JSON body as
text (the router parses the body whatever its declared type). From there the request is an
ordinary start: :func:`adopt_query_token` only moves the token into place, and admission,
the token's origin binding, the key's and subject's limits, the body limit and the timeouts
all run as for any start.

Why that is safe (docs/browser.md, "No preflight on the critical path"): a page on any origin
could always *send* such a request (a form can), so a preflight never protected anything but
the sender's side effects, and those are what is checked here:

- only a client token is taken from the URL, never an API key (an API key in a URL leaks
  into logs and history; it is refused with ``invalid_client_token``);
- the browser sets ``Origin`` on a cross-origin ``POST`` and a page cannot forge it: a token
  bound to an origin works from that origin only, and a request from an origin that is not in
  ``cors.allow_origins`` is refused (403 ``origin_not_allowed``) before anything is spent, as
  its preflight would have been;
- the answer is readable only by a listed origin (``Access-Control-Allow-Origin``), and no
  cookie or ambient credential is involved: without the token a request is a 401.
"""

from __future__ import annotations

from firstbyte.protocol import error_codes
from firstbyte.protocol.tokens import QUERY_PARAM

from ..client_tokens import is_client_token
from ..cors import CorsPolicy
from .admit import adopt_token
from .context import CONTINUE, Outcome, RequestContext, error_reply

__all__ = ["adopt_query_token"]


def adopt_query_token(ctx: RequestContext, query: dict[str, str], cors: CorsPolicy) -> Outcome:
    """Take a stream start's ``?token=`` as its bearer token, or refuse the request.

    Nothing to do without the parameter, or when ``Authorization`` is sent (it wins). An API
    key in the URL is a 401; a page whose origin may not call the router, a 403."""
    credential = query.get(QUERY_PARAM)
    if credential is None or "authorization" in ctx.headers:
        return CONTINUE
    if not is_client_token(credential):
        return error_reply(
            401,
            f"Only a client token may travel in the URL (?{QUERY_PARAM}=); an API key goes"
            " in 'Authorization: Bearer KEY'.",
            "authentication_error",
            param=QUERY_PARAM,
            code=error_codes.INVALID_CLIENT_TOKEN,
            outcome="unauthorized",
        )
    origin = ctx.headers.get("origin")
    if origin is not None and not cors.allows(origin, ctx.headers):
        return error_reply(
            403,
            "This page's origin may not call the router (it is not in cors.allow_origins).",
            "permission_error",
            code=error_codes.ORIGIN_NOT_ALLOWED,
            outcome="forbidden",
        )
    adopt_token(ctx, credential)
    return CONTINUE
