"""The browser client's other formats (completions, Responses, Messages) in headless Chromium,
against the real router and sim: ``client.streamEvents(format, request)`` over each transport
puts the sim's text in the DOM exactly, every event once and in order, and a cut mid-stream
costs a resume and loses and repeats nothing.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest

from firstbyte.protocol.events import CompletionChunk, MessageObject, ResponseObject
from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import World, browser_on, world
from tests.client_sdk.cutproxy import TcpCutProxy
from tests.client_sdk.test_resume import CUT_AFTER, TOKENS

pytestmark = pytest.mark.usefixtures("chromium")

MODEL = "sim-instant"
FORMATS = ["completions", "responses", "messages"]


def request_for(fmt: str, words: int) -> dict[str, Any]:
    if fmt == "completions":
        return {"model": MODEL, "prompt": "Tell me about latency.", "max_tokens": words}
    if fmt == "responses":
        return {"model": MODEL, "input": "Tell me about latency.", "max_output_tokens": words}
    return {"model": MODEL, "max_tokens": words,
            "messages": [{"role": "user", "content": "Tell me about latency."}]}


async def reference(w: World, fmt: str, words: int) -> str:
    """The sim's own non-streamed answer to the same request."""
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{w.sim_url}/v1/{fmt}", json=request_for(fmt, words))
    answer.raise_for_status()
    kind = {"completions": CompletionChunk, "responses": ResponseObject,
            "messages": MessageObject}[fmt]
    whole = msgspec.json.decode(answer.content, type=kind)
    return whole.output_text if isinstance(whole, ResponseObject) else whole.text


def events_script(base_url: str, token: str, transport: str, fmt: str, words: int) -> str:
    """Stream one request of ``fmt`` into #out; answer the text, the DOM's text, the events'
    types and sequence numbers, usage and timings (or the error)."""
    options = {"baseUrl": base_url, "token": token, "transport": transport, "idleTimeoutS": 10}
    return f"""(async () => {{
  const out = document.getElementById("out");
  out.textContent = "";
  const client = new fb.Client({json.dumps(options)});
  const stream = client.streamEvents({json.dumps(fmt)}, {json.dumps(request_for(fmt, words))},
                                     {{ into: out }});
  const types = [], seqs = [];
  try {{
    for await (const item of stream) {{ types.push(item.type); seqs.push(item.seq); }}
  }} catch (err) {{
    return {{ error: err.name, code: err.code ?? null, message: err.message }};
  }}
  return {{ text: stream.text, dom: out.textContent, types, seqs, usage: stream.usage,
           timings: stream.timings }};
}})()"""


def check(got: dict[str, Any], fmt: str, expected: str) -> None:
    assert "error" not in got, got
    assert got["text"] == expected
    assert got["dom"] == expected  # every token painted once
    seqs = got["seqs"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert got["timings"]["output_chunks"] == got["usage"]["output_tokens"]
    assert got["usage"]["input_tokens"]
    last = {"completions": None, "responses": ("response.completed", "response.incomplete"),
            "messages": ("message_stop",)}[fmt]
    if last is not None:
        assert got["types"][-1] in last


async def test_every_format_over_every_transport_in_the_page() -> None:
    async with world() as w:
        token = await w.mint()
        expected = {fmt: await reference(w, fmt, 30) for fmt in FORMATS}
        async with browser_on(w) as page:
            for transport in ("sse-fetch", "websocket", "longpoll"):
                for fmt in FORMATS:
                    got = await page.evaluate(events_script(f"{w.router_url}/v1", token,
                                                            transport, fmt, 30))
                    check(got, fmt, expected[fmt])
                    assert got["timings"]["transport"] == transport
            # EventSource's onmessage sees unnamed events only: completions, and a clear
            # refusal for the named formats.
            got = await page.evaluate(events_script(f"{w.router_url}/v1", token,
                                                    "eventsource", "completions", 30))
            check(got, "completions", expected["completions"])
            refused = await page.evaluate(f"""(() => {{ try {{
              new fb.Client({{ baseUrl: "{w.router_url}/v1", token: "{token}",
                               transport: "eventsource" }}).streamEvents("messages", {{}});
            }} catch (err) {{ return err.name; }} }})()""")
            assert refused == "TypeError"
            assert page.problems() == []


@pytest.mark.parametrize("fmt", ["responses", "messages"])
async def test_a_cut_mid_stream_resumes_in_the_page(fmt: str) -> None:
    async with world() as w:
        expected = await reference(w, fmt, TOKENS)
        token = await w.mint()
        async with TcpCutProxy(w.router_port, cut_after=CUT_AFTER) as proxy, \
                browser_on(w) as page:
            got = await page.evaluate(events_script(
                f"http://127.0.0.1:{proxy.port}/v1", token, "sse-fetch", fmt, TOKENS))
    check(got, fmt, expected)
    assert proxy.cuts_done == 1
    assert got["timings"]["output_chunks"] > 60  # the cut fell inside the stream
    assert got["timings"]["resumes"] >= 1
