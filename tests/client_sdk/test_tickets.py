"""QUIC session tickets kept across restarts: the store's promises, and 0-RTT from a second
process that never talked to the server before (a real router, a real aioquic handshake)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from firstbyte.client_sdk.client import AsyncClient
from firstbyte.client_sdk.errors import ConfigurationError
from firstbyte.client_sdk.tickets import FileTicketStore, MemoryTicketStore
from tests.client_sdk.conftest import ROUTER_KEY, Stack

LATER = time.time() + 3600


def test_a_ticket_is_taken_once() -> None:
    store = MemoryTicketStore()
    store.put("a:443", b"t1", LATER)
    assert store.take("a:443") == b"t1"
    assert store.take("a:443") is None


def test_the_file_store_survives_a_new_instance_and_takes_once(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    FileTicketStore(path).put("a:443", b"t1", LATER)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds a resumption secret
    assert FileTicketStore(path).take("a:443") == b"t1"
    assert FileTicketStore(path).take("a:443") is None
    assert [p.name for p in tmp_path.iterdir()] == ["tickets.json"]  # no temporary file left


def test_the_file_store_drops_expired_tickets_and_keeps_a_bounded_number(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    store = FileTicketStore(path, max_entries=3)
    store.put("old:443", b"x", time.time() - 1)
    for i in range(5):
        store.put(f"s{i}:443", b"t", LATER + i)
    kept = json.loads(path.read_bytes())["tickets"]
    assert sorted(kept) == ["s2:443", "s3:443", "s4:443"]  # those that expire last
    assert store.take("old:443") is None


def test_a_corrupt_or_huge_file_reads_as_empty(tmp_path: Path) -> None:
    path = tmp_path / "tickets.json"
    path.write_text("{not json")
    store = FileTicketStore(path)
    assert store.take("a:443") is None
    store.put("a:443", b"t1", LATER)  # and is replaced by a good one
    assert store.take("a:443") == b"t1"
    path.write_bytes(b" " * (64 * (16 << 10) * 2 + 8192))
    assert store.take("a:443") is None


def test_a_ticket_store_path_in_a_missing_folder_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"^ticket_store: .*nowhere: no such directory"):
        AsyncClient("https://localhost:1/v1", ticket_store=tmp_path / "nowhere" / "t.json")
    with pytest.raises(TypeError, match="ticket_store must be None, a file path or a TicketStore"):
        AsyncClient("https://localhost:1/v1", ticket_store=42)  # type: ignore[arg-type]


_ONE_REQUEST = """
import asyncio, sys
from firstbyte.client_sdk.client import AsyncClient

async def main(url, key, ca_file, tickets):
    async with AsyncClient(url, key, http="3", ca_file=ca_file, ticket_store=tickets) as client:
        async with client.stream(model="sim-instant", max_tokens=3,
                                 messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join([d.text async for d in stream])
    t = stream.timings
    print(t.zero_rtt, t.quic_handshake_ms is not None, t.output_chunks, bool(text))

asyncio.run(main(*sys.argv[1:]))
"""


async def run_client_process(stack: Stack, tickets: Path) -> list[str]:
    """One request from a fresh Python process; its ``zero_rtt``, handshake, chunks, text."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ONE_REQUEST, stack.base_url, ROUTER_KEY, stack.ca_file,
        str(tickets), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ})
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert err == b""
    return out.decode().split()


async def test_a_restarted_process_sends_its_first_request_as_0rtt(stack: Stack,
                                                                    tmp_path: Path) -> None:
    tickets = tmp_path / "quic-tickets.json"
    first = await run_client_process(stack, tickets)
    assert first == ["False", "True", "3", "True"]  # full handshake; the router sent a ticket
    assert f"localhost:{stack.port}" in FileTicketStore(tickets)
    second = await run_client_process(stack, tickets)
    assert second == ["True", "True", "3", "True"]  # a new process, resumed with 0-RTT
    third = await run_client_process(stack, tickets)  # the ticket from the 0-RTT connection
    assert third == ["True", "True", "3", "True"]


async def test_without_a_ticket_file_a_restart_pays_the_full_handshake(stack: Stack,
                                                                      tmp_path: Path) -> None:
    # The case the file exists for: memory (the default) does not outlive the process.
    for _ in range(2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _ONE_REQUEST.replace("ticket_store=tickets",
                                                       "ticket_store=None"),
            stack.base_url, ROUTER_KEY, stack.ca_file, "unused",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert out.decode().split()[0] == "False", err.decode()
