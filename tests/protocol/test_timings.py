"""The timings report: one document, one plausibility rule, for the SDK, the browser client and
the router."""

from __future__ import annotations

import msgspec
import pytest

from firstbyte.protocol.timings import (
    MAX_MS,
    TimingsRecord,
    connection_kind,
    decode_report,
    implausible,
)


def record(**fields: object) -> TimingsRecord:
    base: dict[str, object] = {
        "transport": "sse", "http_version": "HTTP/2", "region": "tokyo",
        "dns_ms": 1.0, "tcp_connect_ms": 2.0, "tls_handshake_ms": 3.0, "pool_wait_ms": 0.5,
        "request_sent_ms": 7.0, "first_byte_ms": 20.0, "first_token_ms": 30.0,
        "last_token_ms": 90.0, "render_ms": 31.0,
    }
    base.update(fields)
    return msgspec.convert(base, TimingsRecord)


def test_the_document_round_trips_and_omits_absent_figures() -> None:
    body = b'{"records":[{"transport":"websocket","http_version":"HTTP/1.1","region":"r",' \
           b'"warm":true,"first_token_ms":12.5}]}'
    report = decode_report(body)
    assert report.records[0].warm
    assert report.records[0].dns_ms is None
    assert msgspec.json.encode(report) == body


@pytest.mark.parametrize("body", [
    b'{"records":[{"transport":"sse","http_version":"HTTP/2","region":"r"}]}',  # no TTFT
    b'{"records":[{"transport":"sse","http_version":"HTTP/2","region":"r",'
    b'"first_token_ms":1,"prompt":"hello"}]}',  # text has no field to go in
    b'{"records":[],"user":"x"}',
    b'{"records":[{"transport":"sse","http_version":"HTTP/2","region":"r",'
    b'"first_token_ms":"1"}]}',
])
def test_anything_but_the_document_is_refused(body: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_report(body)


def test_a_plausible_record() -> None:
    assert implausible(record()) is None
    # A warm request: no setup phases; 0-RTT: the handshake ends when the request is sent.
    assert implausible(record(dns_ms=None, tcp_connect_ms=None, tls_handshake_ms=None)) is None
    assert implausible(record(quic_handshake_ms=7.0, dns_ms=None, tcp_connect_ms=None,
                              tls_handshake_ms=None, pool_wait_ms=None, zero_rtt=True)) is None
    # Coarsened browser clocks: within the slack.
    assert implausible(record(first_byte_ms=7.0 - 0.5)) is None
    assert implausible(record(first_token_ms=MAX_MS, last_token_ms=MAX_MS, render_ms=None)) \
        is None


IMPLAUSIBLE_CASES: list[tuple[dict[str, object], str]] = [
    ({"transport": "smoke-signals"}, "unknown_transport"),
    ({"http_version": "h2"}, "unknown_http_version"),
    ({"dns_ms": -0.1}, "out_of_range"),
    ({"render_ms": MAX_MS + 1}, "out_of_range"),
    ({"first_token_ms": float("nan")}, "out_of_range"),
    ({"first_token_ms": float("inf")}, "out_of_range"),
    ({"resumes": -1}, "out_of_range"),
    ({"tls_handshake_ms": 10.0}, "unordered"),  # setup 13.5 ms > request_sent 7 ms
    ({"first_byte_ms": 5.0}, "unordered"),
    ({"first_byte_ms": 40.0}, "unordered"),
    ({"last_token_ms": 25.0}, "unordered"),
    ({"render_ms": 20.0}, "unordered"),
]
"""Also run in the browser against report.js (tests/client_sdk/test_browser_client.py)."""


@pytest.mark.parametrize(("fields", "reason"), IMPLAUSIBLE_CASES)
def test_implausible_records_say_why(fields: dict[str, object], reason: str) -> None:
    assert implausible(record(**fields)) == reason


def test_connection_kind() -> None:
    assert connection_kind(record()) == "cold"
    assert connection_kind(record(warm=True)) == "warm"
    assert connection_kind(record(zero_rtt=True)) == "0rtt"
