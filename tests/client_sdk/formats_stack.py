"""The real router in front of an upstream speaking every format, for the SDK's typed calls.

The upstream is :mod:`tests.router.formats_upstream` (completions, Responses, Messages,
embeddings, as vLLM sends them; ``max_tokens`` words ``w0 w1 ...``), on loopback; the router
serves TLS on an ephemeral port with HTTP/1.1, HTTP/2 and HTTP/3.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from firstbyte.router.config import parse_config
from firstbyte.router.serve import running_router
from tests.client_sdk.conftest import ROUTER_KEY, Stack
from tests.router.formats_upstream import MODEL, FormatsUpstream, running_formats_upstream

__all__ = ["MODEL", "ROUTER_KEY", "expected_text", "start_formats_stack"]


def expected_text(words: int) -> str:
    """The upstream's answer to a request for ``words`` tokens."""
    return " ".join(f"w{i}" for i in range(words))


@contextlib.asynccontextmanager
async def start_formats_stack(
    tls_files: tuple[str, str, str], **upstream: Any
) -> AsyncIterator[tuple[Stack, FormatsUpstream]]:
    """Start the formats upstream (``upstream`` its options) and the router in front of it."""
    ca_file, cert_file, key_file = tls_files
    async with running_formats_upstream(**upstream) as up:
        config = parse_config({
            "region": "sdk-formats",
            "upstreams": [{"url": up.url}],
            "listen": {"host": "127.0.0.1", "port": 0, "certfile": cert_file,
                       "keyfile": key_file},
            "auth": {"api_keys": [ROUTER_KEY]},
        }, "<sdk-formats-test>")
        async with running_router(config) as endpoints:
            yield Stack(f"https://localhost:{endpoints.port}/v1", endpoints.port, up.url,
                        ca_file), up
