"""Compressed request bodies from headless Chromium, against the real router and sim: a long
conversation's start (fetch-SSE, long-poll) and its prompt warm-up go gzip-compressed (the
simple start says so with ``?encoding=gzip``, a preflighted one with ``Content-Encoding``), the
router inflates them
(the sim counts every token of the history and streams the same answer as to the plain JSON),
and short bodies, ``compressRequests: false`` and a browser without CompressionStream send
JSON. What the router was sent is read on the wire, from a relay between Chromium and it."""

from __future__ import annotations

import gzip
import json
import re
from typing import Any

import pytest

from firstbyte.benchmarks import browser
from firstbyte.benchmarks.browser import prewarm_script
from firstbyte.benchmarks.scenarios._english import conversation, count_tokens
from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import browser_on, world
from tests.client_sdk.browser_stack import stream_script as short_stream_script
from tests.client_sdk.cutproxy import TcpCutProxy

pytestmark = pytest.mark.usefixtures("chromium")

MODEL = "sim-instant"
HISTORY = conversation("A conversation for the compression test.", 8000)
NEXT = {"role": "user", "content": "And what about the next step?"}
MESSAGES = [*HISTORY, NEXT]
REQUEST = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "seed": 11}


def posts(sent: bytes, path: str) -> list[tuple[str, str, bytes]]:
    """Every HTTP/1.1 ``POST`` to ``path`` (any query) in the bytes a client ``sent``: its
    target, its head (lower case) and its body."""
    out = []
    for match in re.finditer(rb"POST (\S+) HTTP/1.1\r\n", sent):
        target = match.group(1).decode()
        if target.split("?")[0] != path:
            continue
        head_end = sent.index(b"\r\n\r\n", match.end()) + 4
        head = sent[match.end():head_end].decode("latin-1").lower()
        length = re.search(r"content-length: *(\d+)", head)
        assert length is not None, head
        out.append((target, head, sent[head_end:head_end + int(length.group(1))]))
    return out


def sent_json(body: bytes) -> Any:
    """The JSON a request body carries, gzip-compressed or not."""
    return json.loads(gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body)


def stream_script(base: str, token: str, options: dict[str, Any] | None = None) -> str:
    """Stream the long conversation's next message over fetch-SSE with these options."""
    return browser.stream_script(base, token, "sse-fetch", REQUEST, options=options)


async def test_a_long_conversation_goes_gzipped_and_streams_whole() -> None:
    """The history is ~26 KB of JSON, over 10 KiB: the simple start sends it gzipped as
    text/plain with ``?encoding=gzip``, a preflighted start with ``Content-Encoding: gzip``;
    the router inflates both (the sim counts the whole history) and the answer is the one the
    uncompressed request gets."""
    async with world() as w, TcpCutProxy(w.router_port, cut_after=0, cuts=0,
                                         record=True) as relay:
        token = await w.mint()
        base = f"http://127.0.0.1:{relay.port}/v1"
        async with browser_on(w) as page:
            simple = await page.evaluate(stream_script(base, token))
            preflighted = await page.evaluate(stream_script(base, token,
                                                            {"simpleStart": False}))
            plain = await page.evaluate(stream_script(base, token, {"compressRequests": False}))
            polled = await page.evaluate(browser.stream_script(base, token, "longpoll", REQUEST))
            assert page.problems() == []
    starts = posts(bytes(relay.upstream_bytes), "/v1/chat/completions")
    assert len(starts) == 3
    json_bytes = len(starts[2][2])  # compressRequests: false
    assert json_bytes > 20_000  # the history, as JSON: well over the 10 KiB threshold
    # The other transports' start (POST /v1/streams) goes compressed too.
    [(poll_target, _, poll_body)] = posts(bytes(relay.upstream_bytes), "/v1/streams")
    assert "encoding=gzip" in poll_target.split("?")[1].split("&")
    assert poll_body[:2] == b"\x1f\x8b"
    for got in (simple, preflighted, plain, polled):
        assert "error" not in got, got
        assert got["text"] == plain["text"] != ""
        # The sim saw the whole history: the router forwarded the inflated body.
        assert got["usage"]["prompt_tokens"] == count_tokens(MESSAGES)
    (simple_target, simple_head, simple_body), (pre_target, pre_head, pre_body), \
        (plain_target, plain_head, plain_body) = starts
    assert "encoding=gzip" in simple_target.split("?")[1].split("&")
    assert "content-type: text/plain" in simple_head
    assert "content-encoding" not in simple_head  # not safelisted: a simple request has none
    assert "encoding=" not in pre_target
    assert "content-encoding: gzip\r\n" in pre_head
    for body in (simple_body, pre_body):
        assert body[:2] == b"\x1f\x8b"
        assert len(body) < json_bytes / 2  # English prose: ~3x
        assert sent_json(body)["messages"] == MESSAGES
    assert "encoding=" not in plain_target
    assert "content-encoding" not in plain_head
    assert json.loads(plain_body)["messages"] == MESSAGES
    # Timings say what was sent (as the Python SDK's request_bytes).
    for got, body in ((simple, simple_body), (preflighted, pre_body), (plain, plain_body),
                      (polled, poll_body)):
        assert got["timings"]["request_bytes"] == len(body)


async def test_the_prompt_warm_up_goes_gzipped_and_warms_the_whole_history() -> None:
    async with world() as w, TcpCutProxy(w.router_port, cut_after=0, cuts=0,
                                         record=True) as relay:
        token = await w.mint()
        base = f"http://127.0.0.1:{relay.port}/v1"
        async with browser_on(w) as page:
            got = await page.evaluate(prewarm_script(
                base, token, "sse-fetch", prompt={"model": MODEL, "messages": HISTORY}))
            assert page.problems() == []
    assert got["prompt"]["warmed"] is True, got
    assert got["prompt"]["prompt_tokens"] == count_tokens(HISTORY)
    [(target, _head, body)] = posts(bytes(relay.upstream_bytes), "/v1/edge/warm")
    assert "encoding=gzip" in target.split("?")[1].split("&")
    assert body[:2] == b"\x1f\x8b"
    assert sent_json(body) == {"model": MODEL, "messages": HISTORY}


async def test_short_bodies_and_browsers_without_compression_send_json() -> None:
    """A short prompt (under 10 KiB) fits in the first flight as it is; a browser without
    CompressionStream sends the long one as JSON too."""
    async with world() as w, TcpCutProxy(w.router_port, cut_after=0, cuts=0,
                                         record=True) as relay:
        token = await w.mint()
        base = f"http://127.0.0.1:{relay.port}/v1"
        async with browser_on(w) as page:
            short = await page.evaluate(short_stream_script(base, token, "sse-fetch", 5))
            await page.evaluate("delete window.CompressionStream; true")
            long = await page.evaluate(stream_script(base, token))
            assert page.problems() == []
    assert "error" not in short, short
    assert "error" not in long, long
    starts = posts(bytes(relay.upstream_bytes), "/v1/chat/completions")
    assert len(starts) == 2
    for target, head, body in starts:
        assert "encoding=" not in target
        assert "content-encoding" not in head
        json.loads(body)
    assert json.loads(starts[1][2])["messages"] == MESSAGES
