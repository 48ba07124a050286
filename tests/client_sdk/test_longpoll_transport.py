"""Long-poll transport: the first token arrives in the answer to the ``POST /v1/streams?wait=S``
(one HTTP exchange), polls continue from its ``next``, and a server that answers the POST with
the bare stream id (no ``wait`` support) still works, with the first poll fetching the events.

Against the protocol test server, which records which request carried which events.
"""

from __future__ import annotations

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.timings import Timings
from tests.client_sdk.conftest import API_KEY
from tests.client_sdk.protocol_server import expected_text, running_protocol_server

MESSAGES = [{"role": "user", "content": "Long-poll me."}]
TOKENS = 12
FIRST_TOKEN_DELAY_MS = 300  # the model "slow-300": long enough to see which request waited


async def stream_text(base_url: str, ca_file: str, http: str) -> tuple[str, list[int], Timings]:
    parts: list[str] = []
    seqs: list[int] = []
    async with AsyncClient(base_url, API_KEY, transport="longpoll", http=http,  # type: ignore[arg-type]
                           ca_file=ca_file, idle_timeout_s=10) as client, client.stream(
        model=f"slow-{FIRST_TOKEN_DELAY_MS}", messages=MESSAGES, max_tokens=TOKENS,
    ) as stream:
        async for delta in stream:
            parts.append(delta.text)
            if delta.seq is not None:
                seqs.append(delta.seq)
    return "".join(parts), seqs, stream.timings


@pytest.mark.parametrize("http", ["1.1", "2"])
async def test_first_token_comes_in_the_post_answer(
    tls_files: tuple[str, str, str], http: str
) -> None:
    ca_file, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file, api_key=API_KEY) as server:
        text, seqs, timings = await stream_text(server.base_url, ca_file, http)
    assert text == expected_text(TOKENS)
    assert seqs == list(range(1, len(seqs) + 1))  # every event once, in order
    # One exchange before the first token: the POST waited for, and carried, the first events.
    assert server.app.requests[0] == ("POST", "/v1/streams")
    method, first_seqs = server.app.batches[0]
    assert method == "POST"
    assert first_seqs[:1] == [1]
    # Every later poll started from the previous answer's next: nothing carried twice.
    carried = [seq for _, batch in server.app.batches for seq in batch]
    assert carried == sorted(set(carried))
    # The POST's response head (first byte) came with the first token, not a poll later.
    assert timings.first_byte_ms is not None
    assert timings.first_token_ms is not None
    assert timings.first_byte_ms > 0.5 * timings.first_token_ms, timings


async def test_a_server_answering_the_bare_stream_id_still_works(
    tls_files: tuple[str, str, str],
) -> None:
    ca_file, cert_file, key_file = tls_files
    with running_protocol_server(cert_file, key_file, api_key=API_KEY,
                                 post_batch=False) as server:
        text, seqs, timings = await stream_text(server.base_url, ca_file, "2")
    assert text == expected_text(TOKENS)
    assert seqs == list(range(1, len(seqs) + 1))
    assert server.app.batches[0][0] == "GET"  # the POST carried nothing: a poll fetched it
    # Two exchanges: the POST's answer came at once, the first token a poll later.
    assert timings.first_byte_ms is not None
    assert timings.first_token_ms is not None
    assert timings.first_byte_ms < 0.5 * timings.first_token_ms, timings
