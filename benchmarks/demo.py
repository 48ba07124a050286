"""``firstbyte demo``: for now, one streamed completion from a sim on this machine.

It starts the simulated inference server on loopback (profile ``h100-7b``), streams one chat
completion over HTTP/1.1 with httpx and the SDK's sans-IO SSE decoder, prints the text as it
arrives, then TTFT and E2EL (request start to first / last content chunk, as in
``vllm bench serve``), and exits. The full multi-region demo will replace it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import httpx

from client_sdk._core.sse import DONE, SSEDecoder
from client_sdk.cli import CLIError
from client_sdk.types import decode_chunk
from router.sim.profiles import PROFILES
from router.sim.server import running_sim

__all__ = ["add_arguments", "run"]

PROMPT = "In two sentences: why does a warm connection matter for the first token?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile", default="h100-7b", choices=sorted(PROFILES), help="sim cost profile"
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to stream (default 32)")


def run(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise CLIError("--max-tokens must be >= 1")
    return asyncio.run(_demo(args.profile, args.max_tokens))


async def _demo(profile: str, max_tokens: int) -> int:
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": max_tokens,
        "seed": 1,
    }
    async with running_sim(profile) as url, httpx.AsyncClient() as client:
        print(f"sim ({profile}) on {url}; streaming one completion over HTTP/1.1\n")
        await client.get(f"{url}/health")  # open the connection first: this measures the model
        decoder = SSEDecoder()
        first = last = None
        chunks = 0
        start = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for piece in response.aiter_raw():
                for event in decoder.receive_data(piece):
                    if event.data == DONE:
                        continue
                    chunk = decode_chunk(event.data)
                    content = chunk.choices[0].delta.content if chunk.choices else None
                    if content:
                        last = time.perf_counter() - start
                        first = last if first is None else first
                        chunks += 1
                        sys.stdout.write(content)
                        sys.stdout.flush()
        print("\n")
        if first is None or last is None:
            print("no tokens received", file=sys.stderr)
            return 1
        print(f"TTFT {first * 1000:.1f} ms   E2EL {last * 1000:.1f} ms   tokens {chunks}")
    return 0
