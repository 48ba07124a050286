"""Naming two common mistakes: an ``http://`` base URL aimed at a port that speaks TLS, and
an ``https://`` one aimed at a port that does not (:func:`tls_failure`).

A TLS server that reads a plaintext request closes the connection (or answers with a TLS
alert), which on its own looks like a connection cut before the response and would be
retried. When that happens on a plain connection, :func:`plaintext_to_tls_port` tries a TLS
handshake on the same address; if one completes, the failure is a configuration mistake and
becomes a :class:`~firstbyte.client_sdk.errors.ConnectError` that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from firstbyte.client_sdk.errors import ConnectError, TLSError
from firstbyte.client_sdk.resolver import Origin

__all__ = ["plaintext_to_tls_port", "tls_failure"]


async def _speaks_tls(address: str, port: int, timeout_s: float) -> bool:
    context = ssl.create_default_context()
    # Only whether TLS is spoken matters here, not whom to trust; nothing is sent.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(address, port, ssl=context)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def plaintext_to_tls_port(
    origin: Origin, address: str, timeout_s: float
) -> ConnectError | None:
    """The error to raise when ``origin`` is ``http://`` and its port speaks TLS, else None."""
    if origin.tls or not await _speaks_tls(address, origin.port, timeout_s):
        return None
    return ConnectError(f"{origin.host}:{origin.port} speaks TLS: use https:// instead of"
                        " http:// in the base URL")


def tls_failure(host: str, port: int, exc: ssl.SSLError) -> TLSError:
    """The error for a failed TLS handshake with ``host:port``. ``WRONG_VERSION_NUMBER``: what
    came back is no TLS record (a plain HTTP server's answer to the ClientHello), so the
    message says that the port does not speak TLS, not only OpenSSL's name for it."""
    if getattr(exc, "reason", None) == "WRONG_VERSION_NUMBER":
        return TLSError(f"TLS handshake with {host}:{port} failed: the server does not speak TLS"
                        " there (if it serves plain HTTP, use http:// in the base URL)")
    return TLSError(f"TLS handshake with {host}:{port} failed: {exc}")
