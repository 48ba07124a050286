"""firstbyte's edge client SDK: prewarmed connections, one streaming API over SSE, WebSocket
and long-poll on HTTP/1.1, HTTP/2 and HTTP/3, phase timings, resume and regional failover."""

from __future__ import annotations

from typing import TYPE_CHECKING

from firstbyte.client_sdk.budget import BudgetReport, LatencyBudget
from firstbyte.protocol.openai import Message, Usage  # the chat types the client API takes/gives

if TYPE_CHECKING:
    from firstbyte import __version__
    from firstbyte.client_sdk._core.stream import StreamDelta
    from firstbyte.client_sdk.client import AsyncClient
    from firstbyte.client_sdk.client_tokens import (
        ClientToken,
        amint_client_token,
        mint_client_token,
    )
    from firstbyte.client_sdk.errors import (
        APIError,
        AuthenticationError,
        ConfigurationError,
        ConnectError,
        FirstbyteError,
        RateLimitError,
        ServiceUnavailableError,
        StreamBrokenError,
        StreamHistoryTrimmedError,
        StreamLostError,
        StreamStalledError,
        TLSError,
    )
    from firstbyte.client_sdk.sync import Client
    from firstbyte.client_sdk.timings import Timings

__all__ = [
    "APIError",
    "AsyncClient",
    "AuthenticationError",
    "BudgetReport",
    "Client",
    "ClientToken",
    "ConfigurationError",
    "ConnectError",
    "FirstbyteError",
    "LatencyBudget",
    "Message",
    "RateLimitError",
    "ServiceUnavailableError",
    "StreamBrokenError",
    "StreamDelta",
    "StreamHistoryTrimmedError",
    "StreamLostError",
    "StreamStalledError",
    "TLSError",
    "Timings",
    "Usage",
    "__version__",
    "amint_client_token",
    "mint_client_token",
]

# The client pulls in httpx, aioquic and websockets, so it is imported on first use, not with
# the package (``firstbyte.protocol`` holds the wire types the router shares).
_LAZY = {
    "AsyncClient": "firstbyte.client_sdk.client",
    "Client": "firstbyte.client_sdk.sync",
    "ClientToken": "firstbyte.client_sdk.client_tokens",
    "amint_client_token": "firstbyte.client_sdk.client_tokens",
    "mint_client_token": "firstbyte.client_sdk.client_tokens",
    "StreamDelta": "firstbyte.client_sdk._core.stream",
    "Timings": "firstbyte.client_sdk.timings",
    "__version__": "firstbyte",
    **{name: "firstbyte.client_sdk.errors" for name in (
        "APIError", "AuthenticationError", "ConfigurationError", "ConnectError",
        "FirstbyteError", "RateLimitError", "ServiceUnavailableError", "StreamBrokenError",
        "StreamHistoryTrimmedError", "StreamLostError", "StreamStalledError", "TLSError")},
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
