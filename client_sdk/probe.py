"""``firstbyte probe URL``: the phase breakdown of one streamed request, like ``curl -w``.

It sends one small streamed chat completion with the SDK and prints where the time went:
DNS, TCP, TLS or QUIC handshake, pool wait, request sent, first byte, first and last token,
inter-token gaps and the router's ``Server-Timing`` split. ``--warm`` prewarms a connection
first, so the figures are those of a kept-warm client. ``--json`` prints the
:class:`~firstbyte.client_sdk.timings.Timings` record as JSON. Without ``--model`` it asks
for the first model the server lists (``GET /v1/models``, on a connection of its own, so the
probed request still opens a cold one): a vLLM-like server refuses a name it does not serve.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Awaitable
from typing import Any

import msgspec

from firstbyte.cli import CLIError
from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import (
    APIError,
    AuthenticationError,
    ConnectError,
    FirstbyteError,
    TLSError,
)
from firstbyte.client_sdk.resolver import Origin
from firstbyte.client_sdk.timings import Timings
from firstbyte.protocol import paths
from firstbyte.protocol.openai import ModelList

__all__ = ["add_arguments", "format_timings", "probe", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", metavar="URL",
                        help="the API base URL, e.g. https://eu.example.com/v1 (/v1 is added if"
                             " the URL has no path)")
    parser.add_argument("--transport", choices=["sse", "websocket", "longpoll"], default="sse",
                        help="how to stream (default sse)")
    parser.add_argument("--http", choices=["1.1", "2", "3"], default=None,
                        help="HTTP version (default 2; 1.1 for websocket and http:// URLs)")
    parser.add_argument("--warm", action="store_true",
                        help="prewarm a connection first, then measure the request on it")
    parser.add_argument("--json", action="store_true", help="print the Timings record as JSON")
    parser.add_argument("--api-key", default=None,
                        help="API key (default: the FIRSTBYTE_API_KEY environment variable)")
    parser.add_argument("--model", default=None,
                        help="model name to request (default: the first the server lists at"
                             " /v1/models, else 'default')")
    parser.add_argument("--prompt", default="Say hello.",
                        help="the user message (default 'Say hello.')")
    parser.add_argument("--max-tokens", type=int, default=16, metavar="N",
                        help="tokens to ask for (default 16)")
    parser.add_argument("--cacert", default=None, metavar="FILE",
                        help="CA certificate (PEM) to verify the server with")
    parser.add_argument("--insecure", action="store_true",
                        help="do not verify the server's certificate")
    parser.add_argument("--timeout", type=float, default=30.0, metavar="S",
                        help="give up after S seconds (connect, and idle between events;"
                             " default 30)")


async def probe(
    url: str,
    *,
    transport: str = "sse",
    http: str | None = None,
    warm: bool = False,
    api_key: str | None = None,
    model: str | None = None,
    prompt: str = "Say hello.",
    max_tokens: int = 16,
    ca_file: str | None = None,
    insecure: bool = False,
    timeout_s: float = 30.0,
) -> Timings:
    """Stream one request and return its timings (raises the SDK's typed errors)."""
    options: dict[str, Any] = {
        "transport": transport, "http": http, "verify": not insecure, "ca_file": ca_file,
        "idle_timeout_s": timeout_s, "connect_timeout_s": timeout_s, "max_resumes": 0,
        "stall_retries": 0,
    }
    if model is None:
        async with AsyncClient(url, api_key, **options) as lookup:
            model = await first_model(lookup) or "default"
    async with AsyncClient(url, api_key, **options) as client:
        if warm:
            await client.prewarm()
        async with client.stream(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            on_first_token=lambda delta: None,
        ) as stream:
            async for _ in stream:
                pass
        return stream.timings


async def first_model(client: AsyncClient) -> str | None:
    """The first model ``GET /v1/models`` lists, None when the server lists none (or has no
    such path, or answers what is not a model list)."""
    origin = client.origin
    session = client.pool.session(origin, "1.1" if client.transport == "websocket"
                                  else client.http)
    async with session.request("GET", paths.at_base(paths.MODELS, origin.prefix),
                               headers=client.headers, body=None, recorder=None) as response:
        raw = await response.read()
    if response.status != 200:
        return None
    try:
        models = msgspec.json.decode(raw, type=ModelList).data
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return models[0].id if models else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:9.2f} ms"


def format_timings(t: Timings, url: str) -> str:
    """The human-readable phase table ``firstbyte probe`` prints."""
    conn = "warm (reused connection)" if t.warm else "cold (new connection)"
    lines = [f"{url}", f"  {t.transport} over {t.http_version or '?'}, {conn}"
             + (", 0-RTT" if t.zero_rtt else "")]
    rows: list[tuple[str, float | None]] = [
        ("dns", t.dns_ms), ("tcp_connect", t.tcp_connect_ms),
        ("tls_handshake", t.tls_handshake_ms), ("quic_handshake", t.quic_handshake_ms),
        ("ws_upgrade", t.ws_upgrade_ms), ("pool_wait", t.pool_wait_ms),
    ]
    lines.append("  connection phases (durations):")
    lines.extend(f"    {name:<16}{_ms(value)}" for name, value in rows if value is not None)
    if all(value is None for _, value in rows):
        lines.append("    (none: the connection was already open)")
    lines.append("  since request start (offsets):")
    for name, value in [("request_sent", t.request_sent_ms), ("first_byte", t.first_byte_ms),
                        ("first_token", t.first_token_ms), ("render", t.render_ms),
                        ("last_token", t.last_token_ms)]:
        lines.append(f"    {name:<16}{_ms(value)}")
    gaps = t.inter_token_ms
    lines.append(f"  tokens           {t.output_chunks}")
    if gaps:
        ordered = sorted(gaps)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        lines.append(f"  inter-token      p50 {statistics.median(gaps):.2f} ms, p90 {p90:.2f} ms,"
                     f" max {ordered[-1]:.2f} ms")
    if t.server_timing:
        split = ", ".join(f"{k} {v:g} ms" for k, v in t.server_timing.items())
        lines.append(f"  server-timing    {split}")
    if t.region is not None:
        lines.append(f"  region           {t.region}")
    if t.stream_id is not None:
        lines.append(f"  stream           {t.stream_id}")
    return "\n".join(lines)


def _normalise_url(url: str) -> str:
    try:
        origin = Origin.parse(url)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    return url if origin.prefix else url.rstrip("/") + "/v1"


async def _within(timeout_s: float, work: Awaitable[Timings]) -> Timings:
    async with asyncio.timeout(timeout_s):
        return await work


def run(args: argparse.Namespace) -> int:
    url = _normalise_url(args.url)
    api_key = args.api_key or os.environ.get("FIRSTBYTE_API_KEY")
    if args.cacert is not None and not os.path.isfile(args.cacert):
        raise CLIError(f"--cacert {args.cacert}: no such file")
    if not args.timeout > 0:
        raise CLIError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        timings = asyncio.run(_within(args.timeout * 2, probe(
            url, transport=args.transport, http=args.http, warm=args.warm, api_key=api_key,
            model=args.model, prompt=args.prompt, max_tokens=args.max_tokens,
            ca_file=args.cacert, insecure=args.insecure, timeout_s=args.timeout,
        )))
    except TLSError as exc:
        raise CLIError(f"{exc} (use --cacert FILE for a private CA, or --insecure)") from None
    except ConnectError as exc:
        raise CLIError(str(exc)) from None
    except AuthenticationError as exc:
        message = exc.message.rstrip(" .;")  # the router's ends with a full stop
        raise CLIError(f"authentication failed ({exc.status or 'ws'}): {message};"
                       " pass --api-key or set FIRSTBYTE_API_KEY") from None
    except APIError as exc:
        raise CLIError(f"the server answered {exc}") from None
    except FirstbyteError as exc:
        raise CLIError(str(exc)) from None
    except TimeoutError:
        raise CLIError(f"no answer within {args.timeout * 2:g} s") from None
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.json:
        sys.stdout.write(msgspec.json.encode(timings).decode() + "\n")
    else:
        print(format_timings(timings, url))
    return 0
