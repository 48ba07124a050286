"""The SDK's phase timings agree with curl's ``-w`` figures against the same server.

Compared, on fresh HTTP/1.1 TLS connections to the real router (the fastest of alternating
runs, see below):
- TLS handshake: curl ``time_appconnect - time_connect``, SDK ``tls_handshake_ms``;
- first byte once the request is out: curl ``time_starttransfer - time_pretransfer`` (curl
  stamps pretransfer when its DO phase, which writes the request, is done), SDK
  ``first_byte_ms - request_sent_ms``.

Like for like: each curl invocation makes two transfers with ``Connection: close`` and only the
second is used. curl's first transfer in a process pays one-time costs inside those very spans
(OpenSSL initialisation and CA loading before the ClientHello, visible with ``curl -v
--trace-time``; extra work in the first DO phase that overlaps the server's wait), as the SDK
would if it did not build its one ``SSLContext`` ahead of the request. The second transfer
opens a new TCP+TLS connection with that state warm, which is what the SDK measures.

Each side's figure is its fastest run of a round: on loopback both are 1-8 ms of CPU work
(OpenSSL, the router's Python request handling) rather than round trips, and the noise of this
shared 2-core machine (the tests beside this one, a garbage collection of the test process's
heap) only ever adds to a run, by as much as the figure itself. The fastest run is the cost
without that noise; a median is not, when a neighbour's load lasts the whole round. In CI the
SDK's median first byte once read 5.8-6.4 ms against curl's 1.7-1.9 in all three rounds; with
three CPU-bound processes beside it here, medians read 6.4 against 2.4 ms and the fastest runs
2.1 against 1.7 (the SDK shares its process and loop with the router and the sim, curl does
not, so load on the test's process lands on the SDK's side).

Tolerance: ``max(3 ms, 50 %)`` of curl's figure, in one of three rounds. 3 ms absorbs what
noise is left, 50 % the per-connection ``SSL_CTX`` curl still builds and asyncio's callback
latency. A wrong measurement (DNS or connect counted into TLS, first byte taken at the first
token, a clock read at the wrong layer) is off by more than that; ``test_tolerance_is_not_vacuous`` pins it.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics

import pytest

from firstbyte.client_sdk.client import AsyncClient
from tests.client_sdk.conftest import ROUTER_KEY, Stack

RUNS = 7
ROUNDS = 3
BODY = ('{"model":"sim-instant","stream":true,"max_tokens":4,'
        '"messages":[{"role":"user","content":"Tell me about latency."}]}')


async def curl_once(stack: Stack) -> tuple[float, float]:
    curl = shutil.which("curl")
    assert curl is not None, "curl is needed for this comparison"
    transfer = [
        "-o", "/dev/null", "--http1.1", "--cacert", stack.ca_file,
        "--resolve", f"localhost:{stack.port}:127.0.0.1",
        "-H", f"authorization: Bearer {ROUTER_KEY}", "-H", "content-type: application/json",
        "-H", "connection: close", "--data", BODY,
        "-w", "%{time_connect} %{time_appconnect} %{time_pretransfer} %{time_starttransfer}\n",
        f"{stack.base_url}/chat/completions",
    ]
    proc = await asyncio.create_subprocess_exec(
        curl, "-sS", *transfer, "--next", *transfer,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    lines = out.decode().split()
    assert len(lines) == 8, out
    connect, appconnect, pretransfer, starttransfer = (float(x) * 1000 for x in lines[4:])
    assert connect < appconnect, "the second transfer must have opened a new TLS connection"
    return appconnect - connect, starttransfer - pretransfer


async def sdk_once(stack: Stack) -> tuple[float, float]:
    messages = [{"role": "user", "content": "Tell me about latency."}]
    async with AsyncClient(stack.base_url, ROUTER_KEY, http="1.1", ca_file=stack.ca_file) as client, \
            client.stream(model="sim-instant", max_tokens=4, messages=messages) as stream:
        async for _ in stream:
            pass
    t = stream.timings
    assert t.tls_handshake_ms is not None
    assert t.first_byte_ms is not None
    assert t.request_sent_ms is not None
    return t.tls_handshake_ms, t.first_byte_ms - t.request_sent_ms


def agree(sdk: float, curl: float) -> bool:
    return abs(sdk - curl) <= max(3.0, 0.5 * curl)


async def test_tls_and_first_byte_agree_with_curl(stack: Stack) -> None:
    """The fastest of :data:`RUNS` alternating runs agree, in one of :data:`ROUNDS` rounds: a
    burst of load from the tests beside this one can hold either side for a round; a wrong
    measurement disagrees in all."""
    await sdk_once(stack)  # warm up imports and the router's first-request paths
    await curl_once(stack)
    rounds = []
    for _ in range(ROUNDS):
        sdk_tls, sdk_fb, curl_tls, curl_fb = [], [], [], []
        for _ in range(RUNS):
            tls, fb = await sdk_once(stack)
            sdk_tls.append(tls)
            sdk_fb.append(fb)
            tls, fb = await curl_once(stack)
            curl_tls.append(tls)
            curl_fb.append(fb)
        fastest = {name: round(min(values), 2) for name, values in [
            ("sdk_tls", sdk_tls), ("curl_tls", curl_tls), ("sdk_fb", sdk_fb),
            ("curl_fb", curl_fb)]}
        print("fastest (ms):", fastest, "medians (ms):", {
            name: round(statistics.median(values), 2) for name, values in [
                ("sdk_fb", sdk_fb), ("curl_fb", curl_fb)]})
        rounds.append(fastest)
        if agree(fastest["sdk_tls"], fastest["curl_tls"]) and \
                agree(fastest["sdk_fb"], fastest["curl_fb"]):
            return
    pytest.fail(f"SDK and curl disagree in every round: {rounds}")


@pytest.mark.parametrize("value", [0.5, 2.0, 10.0])
def test_tolerance_is_not_vacuous(value: float) -> None:
    assert not agree(value + max(3.5, value), value)
