"""Naming one common mistake: an ``http://`` base URL aimed at a port that speaks TLS.

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

from firstbyte.client_sdk.errors import ConnectError
from firstbyte.client_sdk.resolver import Origin

__all__ = ["plaintext_to_tls_port"]


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
