"""The soak's hostile and careless clients, each bounded in count and time, loopback only.

Each attack returns a :class:`collections.Counter` of what the router did to it (the class
names say it: ``401``, ``413``, ``closed by router``, ``held until the end``, ``GOAWAY``, ...).
Raw sockets (and the h2 library over a raw TLS socket) are used where a client library would
refuse to misbehave. Nothing here judges the answers: the report shows them. The HTTP/3 and
QUIC clients are in :mod:`._soak_quic`, the phases that change the world (a blackholed sim, a
removed key) in :mod:`._soak_faults`; :data:`ATTACKS` lists them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import hpack
import httpx
import hyperframe.frame
import msgspec

from firstbyte.benchmarks.scenarios._soak_faults import blackholed_backend, revoked_tokens
from firstbyte.benchmarks.scenarios._soak_good import MODEL
from firstbyte.benchmarks.scenarios._soak_quic import h3_early_answer, quic_flood, quic_idle
from firstbyte.benchmarks.scenarios._soak_target import (
    Target,
    bucket,
    many,
    rounds,
    status_class,
)
from firstbyte.protocol import paths

__all__ = ["ATTACKS", "HUGE_HEADS", "Target"]

_CHAT = paths.CHAT_COMPLETIONS


def _chat_body(n: int, max_tokens: int = 16) -> bytes:
    prompt = f"soak hostile request {n}"
    return msgspec.json.encode({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                                "messages": [{"role": "user", "content": prompt}]})


async def _held(target: Target, until: float, head: bytes, drip: bytes | None) -> str:
    """Open a connection, send ``head``, then ``drip`` every second (slowloris) or nothing,
    until ``until``; what the router did: answered (status), closed, or nothing."""
    started = time.monotonic()
    try:
        reader, writer = await target.connect()
    except (OSError, TimeoutError) as exc:
        return f"connect failed: {type(exc).__name__}"
    try:
        if head:
            writer.write(head)
        while time.monotonic() < until:
            try:
                data = await asyncio.wait_for(reader.read(1024), timeout=1.0)
            except TimeoutError:
                if drip:
                    writer.write(drip)
                    await writer.drain()
                continue
            after = time.monotonic() - started
            if data.startswith(b"HTTP/1.1 "):
                return f"answered {data[9:12].decode()} after {bucket(after)}"
            return f"closed by router after {bucket(after)}"
        return "held until the end"
    except OSError:
        return f"closed by router after {bucket(time.monotonic() - started)}"
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def slowloris(target: Target, until: float) -> Counter[str]:
    """Request heads that never end: a header line a second."""
    head = f"POST {_CHAT} HTTP/1.1\r\nHost: {target.host}\r\n".encode()
    return await many(40 * target.scale, lambda: _held(target, until, head, b"X-Wait: 1\r\n"))


async def held_bodies(target: Target, until: float) -> Counter[str]:
    """A complete head announcing a body, no API key, and no body ever."""
    head = (f"POST {_CHAT} HTTP/1.1\r\nHost: {target.host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n").encode()
    return await many(40 * target.scale, lambda: _held(target, until, head, None))


async def idle_connections(target: Target, until: float) -> Counter[str]:
    """TLS handshakes, then silence."""
    return await many(40 * target.scale, lambda: _held(target, until, b"", None))


async def pre_tls_holders(target: Target, until: float) -> Counter[str]:
    """Raw TCP connections from one address that never send a byte (not even a TLS hello)."""

    async def one() -> str:
        started = time.monotonic()
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(target.host, target.port), 10)
        except (OSError, TimeoutError) as exc:
            return f"connect failed: {type(exc).__name__}"
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, until - time.monotonic())):
                    await reader.read(1)
                    return f"closed by router after {bucket(time.monotonic() - started)}"
            return "held until the end"
        except OSError:
            return f"reset by router after {bucket(time.monotonic() - started)}"
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    return await many(50 * target.scale, one)


HUGE_HEADS: dict[str, bytes] = {
    "header line of 2 MiB": (f"POST {_CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ".encode()
                             + b"x" * (2 << 20) + b"\r\nContent-Length: 0\r\n\r\n"),
    "4,000 header lines": (f"POST {_CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\n".encode()
                           + b"".join(b"X-H-%d: v\r\n" % i for i in range(4000))
                           + b"Content-Length: 0\r\n\r\n"),
    "URL of 1 MiB": (b"GET /v1/models?pad=" + b"x" * (1 << 20)
                     + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"),
}
"""Request heads far over any sane bound, without a key: each must be refused by its size."""
HUGE_H2_HEADS: dict[str, list[tuple[str, str]]] = {
    "HTTP/2 header of 2 MiB": [("x-pad", "x" * (2 << 20))],
    "HTTP/2 4,000 headers": [(f"x-h-{i}", "v") for i in range(4000)],
}
"""The same over HTTP/2 (HPACK, CONTINUATION frames), one request a connection."""


async def huge_heads(target: Target, until: float) -> Counter[str]:
    """Each of :data:`HUGE_HEADS` on a new HTTP/1.1 connection, a few rounds."""
    found: Counter[str] = Counter()
    for n in rounds(until):
        if n == 2 * target.scale:
            break
        for name, head in HUGE_HEADS.items():
            found[f"{name}: {await _huge_head(target, head)}"] += 1
        for name, extra in HUGE_H2_HEADS.items():
            found[f"{name}: {await _huge_head_h2(target, extra)}"] += 1
    return found


async def _huge_head(target: Target, head: bytes) -> str:
    """Send ``head`` whole (the router may stop reading it), then what came back in 5 s."""
    try:
        reader, writer = await target.connect()
    except (OSError, TimeoutError) as exc:
        return f"connect failed: {type(exc).__name__}"
    try:
        writer.write(head)
        with contextlib.suppress(OSError, TimeoutError):
            await asyncio.wait_for(writer.drain(), 5)
        async with asyncio.timeout(5):
            data = await reader.read(1024)
        if data.startswith(b"HTTP/1.1 "):
            return f"answered {data[9:12].decode(errors='replace')}"
        return "closed without an answer"
    except TimeoutError:
        return "no answer in 5 s"
    except OSError as exc:
        return f"connection reset: {type(exc).__name__}"
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


async def _huge_head_h2(target: Target, extra: list[tuple[str, str]]) -> str:
    """One HTTP/2 POST whose head carries ``extra``; the status, reset or GOAWAY in 5 s.

    The frames are built here, the header block without Huffman coding: the h2 library
    Huffman-codes every value in pure Python, a minute of CPU for 2 MiB (this event loop
    runs the good clients too)."""
    try:
        reader, writer = await target.connect("h2")
    except (OSError, TimeoutError) as exc:
        return f"connect failed: {type(exc).__name__}"
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "https"),
                                    (":authority", target.host), (":path", _CHAT), *extra],
                                   huffman=False)
    pieces = [block[i:i + _H2_FRAME] for i in range(0, len(block), _H2_FRAME)]
    frames: list[hyperframe.frame.Frame] = [hyperframe.frame.SettingsFrame(0)]
    for i, piece in enumerate(pieces):
        frame = (hyperframe.frame.HeadersFrame(1, data=piece, flags=["END_STREAM"]) if i == 0
                 else hyperframe.frame.ContinuationFrame(1, data=piece))
        if i == len(pieces) - 1:
            frame.flags.add("END_HEADERS")
        frames.append(frame)
    try:
        writer.write(_H2_PREFACE)
        writer.write(b"".join(frame.serialize() for frame in frames))
        async with asyncio.timeout(5):
            return await _h2_answer(reader, writer)
    except TimeoutError:
        return "no answer in 5 s"
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError) as exc:
        return f"connection dropped: {type(exc).__name__}"
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()


_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_FRAME = 16_384
"""SETTINGS_MAX_FRAME_SIZE's initial value: every peer accepts frames this large."""


async def _h2_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
    """Read frames until stream 1's status, its RST_STREAM or a GOAWAY."""
    block = b""
    while True:
        frame, length = hyperframe.frame.Frame.parse_frame_header(
            memoryview(await reader.readexactly(9)))
        frame.parse_body(memoryview(await reader.readexactly(length)))
        if isinstance(frame, hyperframe.frame.SettingsFrame) and "ACK" not in frame.flags:
            writer.write(hyperframe.frame.SettingsFrame(0, flags=["ACK"]).serialize())
        elif isinstance(frame, hyperframe.frame.GoAwayFrame):
            return f"GOAWAY {_h2_error(frame.error_code)}"
        elif frame.stream_id == 1 and isinstance(frame, hyperframe.frame.RstStreamFrame):
            return f"stream reset {_h2_error(frame.error_code)}"
        elif frame.stream_id == 1 and isinstance(frame, (hyperframe.frame.HeadersFrame,
                                                        hyperframe.frame.ContinuationFrame)):
            block += frame.data
            if "END_HEADERS" in frame.flags:
                status = dict(hpack.Decoder().decode(block, raw=True)).get(b":status", b"?")
                return f"answered {status.decode(errors='replace')}"


def _h2_error(code: int) -> str:
    try:
        return h2.errors.ErrorCodes(code).name
    except ValueError:
        return str(code)


async def greedy_key(target: Target, until: float) -> Counter[str]:
    """One tenant keeps many long streams open at once on its own key."""
    found: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {target.key}"}
    async with httpx.AsyncClient(verify=target.ca_file, http2=True, timeout=60,
                                 limits=httpx.Limits(max_connections=4)) as client:

        async def loop(i: int) -> None:
            for n in rounds(until):
                try:
                    async with client.stream("POST", target.base_url + _CHAT, headers=headers,
                                             content=_chat_body(i * 100_000 + n, 128)) as reply:
                        await reply.aread()
                        found[status_class(reply.status_code, reply.content)] += 1
                        if reply.status_code == 429:
                            await asyncio.sleep(0.2)
                except httpx.HTTPError as exc:
                    found[type(exc).__name__] += 1

        await asyncio.gather(*(loop(i) for i in range(24 * target.scale)))
    return found


async def bad_requests(target: Target, until: float) -> Counter[str]:
    """Careless clients in a loop: oversized, malformed and deeply nested bodies, bad or no
    keys, reading another key's stream, and a body with both Content-Length and
    Transfer-Encoding (request smuggling)."""
    found: Counter[str] = Counter()
    good = {"Authorization": f"Bearer {target.key}", "Content-Type": "application/json"}
    probes: dict[str, tuple[dict[str, str], bytes]] = {
        "oversized body": (good, b'{"pad": "' + b"x" * (2 << 20) + b'"}'),
        "malformed json": (good, b'{"model": "m", "messages": [}'),
        "json nested 5000 deep": (good, b"[" * 5000 + b"]" * 5000),
        "bad key": ({"Authorization": "Bearer sk-not-a-key-at-all"}, _chat_body(0)),
        "no key": ({}, _chat_body(0)),
    }
    async with (
        httpx.AsyncClient(verify=target.ca_file, http2=True, timeout=30) as client,
        httpx.AsyncClient(verify=target.ca_file, timeout=30) as http1,
    ):
        for _ in rounds(until):
            for name, (headers, body) in probes.items():
                # Over HTTP/2 the router answers 413 and resets the stream as the body crosses
                # the limit; httpx, still sending, cannot read that answer (docs/limits.md):
                # the oversized body goes over HTTP/1.1.
                sender = http1 if name == "oversized body" else client
                try:
                    reply = await sender.post(target.base_url + _CHAT, headers=headers,
                                              content=body)
                    found[f"{name}: {status_class(reply.status_code, reply.content)}"] += 1
                except httpx.HTTPError as exc:
                    found[f"{name}: {type(exc).__name__}"] += 1
            for _key, stream_id in target.stream_ids[-3:]:
                reply = await client.get(f"{target.base_url}/v1/streams/{stream_id}",
                                         headers={"Authorization": f"Bearer {target.key}"})
                verdict = "LEAK" if reply.status_code == 200 else str(reply.status_code)
                found[f"another key's stream: {verdict}"] += 1
            found[f"content-length + transfer-encoding: {await _smuggle(target)}"] += 1
            await asyncio.sleep(0.2)
    return found


async def _smuggle(target: Target) -> str:
    """RFC 9112 6.1: a request with both framing headers must be refused or its connection
    closed; a second answer means the bytes after the chunked body ran as a request."""
    inner = f"GET /healthz HTTP/1.1\r\nHost: {target.host}\r\n\r\n"
    head = (f"POST {_CHAT} HTTP/1.1\r\nHost: {target.host}\r\nAuthorization: Bearer {target.key}"
            "\r\nContent-Type: application/json\r\nContent-Length: 5\r\n"
            "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + inner)
    try:
        reader, writer = await target.connect()
    except (OSError, TimeoutError) as exc:
        return f"connect failed: {type(exc).__name__}"
    data = b""
    try:
        writer.write(head.encode())
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(2.0):
                while chunk := await reader.read(65536):
                    data += chunk
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    answers = data.count(b"HTTP/1.1 ")
    first = data[9:12].decode(errors="replace") if answers else "none"
    return f"{first}, smuggled request answered" if answers > 1 else f"{first} then closed"


async def rapid_reset(target: Target, until: float) -> Counter[str]:
    """HTTP/2 rapid reset (CVE-2023-44487): chat requests opened and cancelled at once, in
    bursts, over raw TLS with the h2 library."""
    found: Counter[str] = Counter()
    for n in rounds(until):
        found.update(await _reset_burst(target, 400 * target.scale, n))
    return found


async def _reset_burst(target: Target, streams: int, burst: int) -> Counter[str]:
    found: Counter[str] = Counter()
    try:
        reader, writer = await target.connect("h2")
    except (OSError, TimeoutError) as exc:
        return Counter({f"connect failed: {type(exc).__name__}": 1})
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    # A window the router cannot exhaust: what it sends on reset streams is its business.
    conn.increment_flow_control_window(2**31 - 1 - 65_535)
    headers = [(":method", "POST"), (":scheme", "https"), (":authority", target.host),
               (":path", _CHAT), ("authorization", f"Bearer {target.key}"),
               ("content-type", "application/json")]
    sent = 0
    try:
        for i in range(streams):
            stream_id = conn.get_next_available_stream_id()
            conn.send_headers(stream_id, headers)
            conn.send_data(stream_id, _chat_body(burst * 1_000_000 + i), end_stream=True)
            conn.reset_stream(stream_id)
            sent += 1
            if i % 50 == 49:
                writer.write(conn.data_to_send())
                await writer.drain()
        writer.write(conn.data_to_send())
        await writer.drain()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                while data := await reader.read(65536):
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.ConnectionTerminated):
                            found[f"GOAWAY {event.error_code!s}"] += 1
                    writer.write(conn.data_to_send())
        found["connection closed by router" if reader.at_eof() else "connection left open"] += 1
    except (OSError, ssl.SSLError, h2.exceptions.ProtocolError) as exc:
        found[f"connection dropped: {type(exc).__name__}"] += 1
    finally:
        found["streams opened and reset"] += sent
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    return found


async def websocket_oversized(target: Target, until: float) -> Counter[str]:
    """WebSocket frames far over the router's message limit, one per connection."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    found: Counter[str] = Counter()
    frame = "x" * ((4 << 20) * target.scale)
    url = f"wss://{target.host}:{target.port}{paths.WEBSOCKET}"
    for sent in rounds(until):
        if sent == 4 * target.scale:
            break
        try:
            async with connect(url, ssl=target.tls("http/1.1"), max_size=None,
                               additional_headers={"Authorization": f"Bearer {target.key}"},
                               open_timeout=10, close_timeout=5) as ws:
                await ws.send(frame)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5):
                        await ws.recv()
                found["no close after the frame"] += 1
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd is not None else "none"
            found[f"closed {code}"] += 1
        except (InvalidStatus, OSError, TimeoutError) as exc:
            found[type(exc).__name__] += 1
    return found


ATTACKS: dict[str, Callable[[Target, float], Awaitable[Counter[str]]]] = {
    "slowloris": slowloris,
    "held_bodies": held_bodies,
    "idle_connections": idle_connections,
    "pre_tls_holders": pre_tls_holders,
    "huge_heads": huge_heads,
    "h3_early_answer": h3_early_answer,
    "quic_idle": quic_idle,
    "quic_flood": quic_flood,
    "blackholed_backend": blackholed_backend,
    "revoked_tokens": revoked_tokens,
    "greedy_key": greedy_key,
    "bad_requests": bad_requests,
    "rapid_reset": rapid_reset,
    "websocket_oversized": websocket_oversized,
}
"""Every hostile client kind, by the name the report uses."""
