"""Client tokens, sans-IO: short-lived, HMAC-signed stand-ins for an API key in a browser.

A token is ``fbt1.<payload>.<signature>`` (URL-safe base64 without padding): the payload
carries the key's owner digest (:func:`firstbyte.router.streams.owner_of`, never the key),
the expiry (seconds since the epoch: tokens are checked on other processes and hosts than the
one that minted them, so a monotonic clock would not do) and, optionally, the one ``Origin``
that may use it; the signature is HMAC-SHA256 over ``fbt1.<payload>`` with the router's
secret. A valid token acts as its key's owner: it reads only that key's streams and counts
against that key's limits. It cannot mint tokens (the endpoint wants the API key itself).

Every router that must accept a token needs the secret that signed it: ``auth.token_secret``
shared by all processes and hosts of a region (and by peers a request may be forwarded to).
Without it each process draws its own at start, and its tokens are valid on it alone.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass

import msgspec

from firstbyte.protocol import error_codes
from firstbyte.protocol.tokens import TOKEN_PREFIX, ClientToken

__all__ = ["TokenClaims", "TokenRefusal", "TokenSigner", "is_client_token"]

_SIGNATURE_BYTES = 32
_MAX_TOKEN_CHARS = 1024


class _Payload(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    o: str  # owner digest, base64url
    e: int  # expiry, whole seconds since the epoch
    n: str  # nonce: two tokens minted in the same second differ
    g: str | None = None  # the Origin it is bound to
    s: str | None = None  # the subject (the app's end user)
    m: int | None = None  # the subject's cap on completions in flight


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """What a valid token says: whose it is, until when, for which page origin, for which
    subject (the app's end user; None: the key as a whole) with which cap on its
    completions in flight."""

    owner: bytes
    expires_at: float
    origin: str | None = None
    subject: str | None = None
    max_streams: int | None = None


@dataclass(frozen=True, slots=True)
class TokenRefusal:
    """Why a token is refused: the error code and a one-line message (never the token)."""

    code: str
    message: str


def is_client_token(credential: str) -> bool:
    """True for something shaped like a client token (an API key never starts with ``fbt1.``)."""
    return credential.startswith(TOKEN_PREFIX)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_decoder = msgspec.json.Decoder(_Payload)
_INVALID = TokenRefusal(error_codes.INVALID_CLIENT_TOKEN, "Invalid client token.")


class TokenSigner:
    """Mints and verifies client tokens with one secret; ``max_ttl_s`` caps every lifetime."""

    def __init__(self, secret: bytes, *, max_ttl_s: float, default_ttl_s: float) -> None:
        self._key = hashlib.sha256(b"firstbyte-client-token\0" + secret).digest()
        self.max_ttl_s = max_ttl_s
        self.default_ttl_s = min(default_ttl_s, max_ttl_s)

    def _sign(self, signed: bytes) -> bytes:
        return hmac.new(self._key, signed, hashlib.sha256).digest()[:_SIGNATURE_BYTES]

    def mint(
        self, owner: bytes, now: float, ttl_s: float | None = None, origin: str | None = None,
        *, subject: str | None = None, max_streams: int | None = None,
    ) -> ClientToken:
        """A token for ``owner`` valid from ``now`` (epoch seconds) for ``ttl_s``, capped.

        The expiry is rounded down to a whole second, so a token never outlives its cap."""
        ttl = min(self.default_ttl_s if ttl_s is None else ttl_s, self.max_ttl_s)
        expires = int(now + ttl)
        payload = _Payload(
            _b64(owner), expires, _b64(secrets.token_bytes(6)), origin, subject, max_streams
        )
        body = TOKEN_PREFIX + _b64(msgspec.json.encode(payload))
        token = f"{body}.{_b64(self._sign(body.encode()))}"
        return ClientToken(token, float(expires))

    def verify(self, token: str, now: float, origin: str | None) -> TokenClaims | TokenRefusal:
        """The token's claims if it is ours, unexpired at ``now`` and, when bound to an origin,
        presented with that ``Origin`` (a request without one does not match)."""
        if len(token) > _MAX_TOKEN_CHARS or not is_client_token(token):
            return _INVALID
        body, dot, signature = token.rpartition(".")
        if not dot:
            return _INVALID
        try:
            given = _unb64(signature)
            if not hmac.compare_digest(given, self._sign(body.encode())):
                return _INVALID
            payload = _decoder.decode(_unb64(body[len(TOKEN_PREFIX) :]))
            owner = _unb64(payload.o)
        except (binascii.Error, ValueError, msgspec.DecodeError):
            return _INVALID
        if now >= payload.e:
            return TokenRefusal(
                error_codes.CLIENT_TOKEN_EXPIRED,
                "Client token expired; ask the application for a new one.",
            )
        if payload.g is not None and payload.g != origin:
            return TokenRefusal(
                error_codes.INVALID_CLIENT_TOKEN, "Client token not valid for this origin."
            )
        return TokenClaims(owner, float(payload.e), payload.g, payload.s, payload.m)
