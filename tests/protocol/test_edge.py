"""The ``/v1/edge/status`` documents, byte for byte and round trip."""

from __future__ import annotations

import msgspec

from firstbyte.protocol.edge import (
    BackendStatus,
    EdgeStatus,
    EdgeStatusReport,
    PeerLink,
    PublicEdgeStatus,
    prefix_hash,
)
from firstbyte.protocol.openai import encode

PEERS = [PeerLink(name="osaka", url="https://osaka.example", up=True)]
STATUS = EdgeStatus(
    region="tokyo", healthy=True, saturated=False, in_flight=2, capacity=8, queue_wait_ms=1.5,
    latitude=35.68, longitude=139.69, public_url="https://tokyo.example", ttft_ms=None,
    warm_prefixes=[prefix_hash("sys")],
    backends=[BackendStatus(name="b0", healthy=True, in_flight=2, load=2, max_in_flight=8,
                            saturated=False)],
    peers=PEERS,
)


def test_public_document_bytes() -> None:
    public = PublicEdgeStatus(region="tokyo", healthy=True, public_url=None, latitude=35.68,
                              longitude=139.69, peers=PEERS)
    assert encode(public) == (
        b'{"region":"tokyo","healthy":true,"public_url":null,"latitude":35.68,'
        b'"longitude":139.69,"peers":[{"name":"osaka","url":"https://osaka.example","up":true}]}'
    )


def test_report_is_the_status_then_the_routers_counters() -> None:
    report = EdgeStatusReport(**msgspec.structs.asdict(STATUS), streams=3,
                              warm={"b0": {"sys": "warm"}}, time=1700000000.5)
    expected = {**msgspec.to_builtins(STATUS), "streams": 3, "warm": {"b0": {"sys": "warm"}},
                "time": 1700000000.5}
    assert encode(report) == encode(expected)
    assert encode(report).endswith(
        b',"streams":3,"warm":{"b0":{"sys":"warm"}},"time":1700000000.5}'
    )


def test_round_trips_and_smaller_readers_read_larger_documents() -> None:
    body = encode(STATUS)
    assert msgspec.json.decode(body, type=EdgeStatus) == STATUS
    public = msgspec.json.decode(body, type=PublicEdgeStatus)
    assert (public.region, public.public_url, public.peers) == ("tokyo", "https://tokyo.example",
                                                                 PEERS)
    report = EdgeStatusReport(**msgspec.structs.asdict(STATUS), streams=0, warm={}, time=0.0)
    assert msgspec.json.decode(encode(report), type=EdgeStatus) == STATUS


def test_prefix_hash_is_the_first_16_hex_digits_of_sha256() -> None:
    assert prefix_hash("sys") == "518b67e652531c5f"
