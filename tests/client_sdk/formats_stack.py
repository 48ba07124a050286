"""The real router in front of the real sim, for the SDK's typed calls.

The sim (``firstbyte sim``, serving :data:`MODEL` only, as vLLM) speaks completions,
Responses, Messages and embeddings in their wire formats; the router serves TLS on an
ephemeral port with HTTP/1.1, HTTP/2 and HTTP/3. :func:`reference` is the sim's own
non-streamed answer to a request (deterministic for a request and the sim's seed): what a
stream through the router must add up to.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec

from firstbyte.protocol.events import CompletionChunk, MessageObject, ResponseObject
from firstbyte.router.config import parse_config
from firstbyte.router.serve import running_router
from firstbyte.router.sim.server import sim_server
from tests.client_sdk.conftest import ROUTER_KEY, Stack

__all__ = ["MODEL", "ROUTER_KEY", "body_for", "reference", "start_formats_stack"]

MODEL = "sim-formats"
PROMPT = "Tell me about latency."


def body_for(fmt: str, words: int) -> dict[str, Any]:
    """The request fields the tests send in ``fmt`` for ``words`` tokens (not streamed)."""
    if fmt == "completions":
        return {"model": MODEL, "prompt": PROMPT, "max_tokens": words}
    if fmt == "responses":
        return {"model": MODEL, "input": PROMPT, "instructions": "Be brief.",
                "max_output_tokens": words}
    return {"model": MODEL, "max_tokens": words, "system": "Be brief.",
            "messages": [{"role": "user", "content": PROMPT}]}


async def reference(stack: Stack, fmt: str, words: int) -> str:
    """The sim's answer to :func:`body_for`, asked directly and without streaming."""
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{stack.sim_url}/v1/{fmt}", json=body_for(fmt, words))
    answer.raise_for_status()
    if fmt == "completions":
        return msgspec.json.decode(answer.content, type=CompletionChunk).text
    if fmt == "responses":
        return msgspec.json.decode(answer.content, type=ResponseObject).output_text
    return msgspec.json.decode(answer.content, type=MessageObject).text


@contextlib.asynccontextmanager
async def start_formats_stack(
    tls_files: tuple[str, str, str], **sim: Any
) -> AsyncIterator[Stack]:
    """Start the sim (``sim``: its :class:`SimConfig` fields) and the router in front of it."""
    ca_file, cert_file, key_file = tls_files
    async with sim_server("instant", seed=7, served_model_names=[MODEL], **sim) as running:
        config = parse_config({
            "region": "sdk-formats",
            "upstreams": [{"url": running.url}],
            "listen": {"host": "127.0.0.1", "port": 0, "certfile": cert_file,
                       "keyfile": key_file},
            "auth": {"api_keys": [ROUTER_KEY]},
        }, "<sdk-formats-test>")
        async with running_router(config) as endpoints:
            yield Stack(f"https://localhost:{endpoints.port}/v1", endpoints.port, running.url,
                        ca_file)
