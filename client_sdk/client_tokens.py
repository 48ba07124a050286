"""Mint a client token for a browser, from the application's backend (docs/browser.md).

A browser must never hold an API key. The backend, which does, asks the router for a
short-lived token (``POST /v1/edge/tokens``) and hands it to the page; the token reads only
its key's streams (only its subject's, when minted for one), counts against its key's limits
and expires in minutes::

    grant = mint_client_token("https://router.example/v1", API_KEY, ttl_s=300,
                              origin="https://app.example", subject=user.id)
    page_config = {"token": grant.token, "expires_at": grant.expires_at}
"""

from __future__ import annotations

import httpx
import msgspec

from firstbyte.client_sdk.errors import ConnectError, api_error_from_response
from firstbyte.client_sdk.trust import Verify, build_ssl_context
from firstbyte.protocol import paths
from firstbyte.protocol.tokens import ClientToken, TokenRequest

__all__ = ["ClientToken", "amint_client_token", "mint_client_token"]

_grant = msgspec.json.Decoder(ClientToken)
TIMEOUT_S = 10.0


def _request(base_url: str, api_key: str, ttl_s: float | None, origin: str | None,
             subject: str | None = None,
             max_streams: int | None = None) -> tuple[str, dict[str, str], bytes]:
    base = httpx.URL(base_url.rstrip("/"))
    url = str(base.copy_with(path=paths.at_base(paths.EDGE_TOKENS, base.path)))
    headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    request = TokenRequest(ttl_s=ttl_s, origin=origin, subject=subject, max_streams=max_streams)
    return url, headers, msgspec.json.encode(request)


def _answer(response: httpx.Response) -> ClientToken:
    if response.status_code != 200:
        raise api_error_from_response(response.status_code, response.content)
    return _grant.decode(response.content)


def mint_client_token(base_url: str, api_key: str, *, ttl_s: float | None = None,
                      origin: str | None = None, subject: str | None = None,
                      max_streams: int | None = None, verify: Verify = True,
                      ca_file: str | None = None) -> ClientToken:
    """A client token for ``api_key`` from the router at ``base_url`` (``https://host/v1``).

    ``ttl_s`` is capped by the router (``auth.client_token_max_ttl_s``); ``origin`` binds the
    token to one page origin; ``subject`` names the end user it is for (up to 128 characters:
    its requests share the key fairly with the other subjects', and it reads only its own
    streams) and ``max_streams`` caps that user's completions in flight. Raises the SDK's
    :class:`~firstbyte.client_sdk.errors.APIError` family for a refusal and
    :class:`~firstbyte.client_sdk.errors.ConnectError` when the router cannot be reached."""
    url, headers, body = _request(base_url, api_key, ttl_s, origin, subject, max_streams)
    context = build_ssl_context(verify, ca_file)
    try:
        with httpx.Client(verify=context, timeout=TIMEOUT_S) as http:
            return _answer(http.post(url, headers=headers, content=body))
    except httpx.TransportError as exc:
        raise ConnectError(f"cannot reach {url}: {exc}") from None


async def amint_client_token(base_url: str, api_key: str, *, ttl_s: float | None = None,
                             origin: str | None = None, subject: str | None = None,
                             max_streams: int | None = None, verify: Verify = True,
                             ca_file: str | None = None) -> ClientToken:
    """:func:`mint_client_token` for asyncio code."""
    url, headers, body = _request(base_url, api_key, ttl_s, origin, subject, max_streams)
    context = build_ssl_context(verify, ca_file)
    try:
        async with httpx.AsyncClient(verify=context, timeout=TIMEOUT_S) as http:
            return _answer(await http.post(url, headers=headers, content=body))
    except httpx.TransportError as exc:
        raise ConnectError(f"cannot reach {url}: {exc}") from None
