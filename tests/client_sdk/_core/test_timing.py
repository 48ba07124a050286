from __future__ import annotations

import msgspec
import pytest

from firstbyte.client_sdk._core.timing import TimingRecorder, httpcore_event, parse_server_timing
from firstbyte.client_sdk.timings import Timings


def feed_all(rec: TimingRecorder, events: list[tuple[str, float]]) -> Timings:
    for name, now in events:
        rec.feed(name, now)
    return rec.timings()


def test_cold_request_phases_and_offsets_from_injected_clock() -> None:
    rec = TimingRecorder(100.0, transport="sse", wall=1.5)
    t = feed_all(rec, [
        ("dns.started", 100.000), ("dns.complete", 100.002),
        ("pool_wait.started", 100.002),
        ("pool_wait.complete", 100.003), ("tcp_connect.started", 100.003),
        ("tcp_connect.complete", 100.013),
        ("tls_handshake.started", 100.013), ("tls_handshake.complete", 100.033),
        ("request_sent", 100.034), ("first_byte", 100.050),
        ("token", 100.060), ("render", 100.061), ("token", 100.070), ("token", 100.085),
    ])
    assert t.started_at == 1.5
    assert t.dns_ms == pytest.approx(2.0)
    assert t.pool_wait_ms == pytest.approx(1.0)
    assert t.tcp_connect_ms == pytest.approx(10.0)
    assert t.tls_handshake_ms == pytest.approx(20.0)
    assert t.request_sent_ms == pytest.approx(34.0)
    assert t.first_byte_ms == pytest.approx(50.0)
    assert t.first_token_ms == pytest.approx(60.0)
    assert t.render_ms == pytest.approx(61.0)
    assert t.last_token_ms == pytest.approx(85.0)
    assert t.inter_token_ms == pytest.approx([10.0, 15.0])
    assert t.output_chunks == 3
    assert t.tpot_ms == pytest.approx(12.5)
    assert t.warm is False
    assert t.connect_ms == pytest.approx(32.0)


def test_warm_request_has_no_connection_phases() -> None:
    rec = TimingRecorder(0.0)
    t = feed_all(rec, [("pool_wait.started", 0.0), ("pool_wait.complete", 0.0005),
                       ("request_sent", 0.001), ("first_byte", 0.004), ("token", 0.005)])
    assert t.warm is True
    assert (t.dns_ms, t.tcp_connect_ms, t.tls_handshake_ms, t.quic_handshake_ms) == (None,) * 4
    assert t.first_byte_ms == pytest.approx(4.0)
    assert t.inter_token_ms == []


def test_phases_after_first_byte_belong_to_a_resume_not_this_request() -> None:
    rec = TimingRecorder(0.0)
    t = feed_all(rec, [
        ("tcp_connect.started", 0.0), ("tcp_connect.complete", 0.001), ("first_byte", 0.002),
        ("token", 0.003), ("resume", 0.010),
        ("tcp_connect.started", 0.010), ("tcp_connect.complete", 0.020), ("first_byte", 0.030),
        ("request_sent", 0.030), ("token", 0.031),
    ])
    assert t.tcp_connect_ms == pytest.approx(1.0)
    assert t.first_byte_ms == pytest.approx(2.0)
    assert t.request_sent_ms is None
    assert t.resumes == 1
    assert t.inter_token_ms == pytest.approx([28.0])


def test_retried_connect_is_summed_and_pool_wait_counted_once() -> None:
    rec = TimingRecorder(0.0)
    t = feed_all(rec, [
        ("pool_wait.started", 0.0), ("pool_wait.complete", 0.001),
        ("tcp_connect.started", 0.001), ("tcp_connect.complete", 0.004),
        ("pool_wait.complete", 0.009),
        ("tcp_connect.started", 0.005), ("tcp_connect.complete", 0.007),
    ])
    assert t.tcp_connect_ms == pytest.approx(5.0)
    assert t.pool_wait_ms == pytest.approx(1.0)


def test_complete_without_start_is_ignored_and_unknown_events_raise() -> None:
    rec = TimingRecorder(0.0)
    rec.feed("tls_handshake.complete", 1.0)
    assert rec.timings().tls_handshake_ms is None
    with pytest.raises(ValueError, match="unknown phase"):
        rec.feed("bogus.started", 0.0)
    with pytest.raises(ValueError, match="unknown event"):
        rec.feed("tcp_connect.halfway", 0.0)
    with pytest.raises(ValueError, match="unknown event"):
        rec.feed("nonsense", 0.0)


def test_httpcore_trace_names_map_to_phases() -> None:
    rec = TimingRecorder(0.0)
    rec.feed("pool_wait.started", 0.0)
    trace = [
        ("connection.connect_tcp.started", 0.001), ("connection.connect_tcp.complete", 0.002),
        ("connection.start_tls.started", 0.002), ("connection.start_tls.complete", 0.005),
        ("http2.send_connection_init.started", 0.005),
        ("http2.send_request_headers.started", 0.006),
        ("http2.send_request_body.complete", 0.007),
        ("http2.receive_response_headers.started", 0.007),
        ("http2.receive_response_headers.complete", 0.010),
    ]
    for name, now in trace:
        rec.feed_httpcore(name, now)
    t = rec.timings()
    assert t.pool_wait_ms == pytest.approx(1.0)
    assert t.tcp_connect_ms == pytest.approx(1.0)
    assert t.tls_handshake_ms == pytest.approx(3.0)
    assert t.request_sent_ms == pytest.approx(7.0)
    assert t.first_byte_ms == pytest.approx(10.0)
    assert httpcore_event("http11.receive_response_body.started") == ()


def test_server_timing_header() -> None:
    assert parse_server_timing('queue;dur=0.5, route;dur=0.1;desc="x", upstream-ttft;dur=3, cache') == {
        "queue": 0.5, "route": 0.1, "upstream-ttft": 3.0, "cache": 0.0}
    assert parse_server_timing("") == {}
    assert parse_server_timing("a;dur=oops") == {"a": 0.0}


def test_record_round_trips_as_json() -> None:
    rec = TimingRecorder(0.0, transport="websocket")
    rec.feed("first_byte", 0.001)
    rec.feed("token", 0.002)
    t = rec.timings()
    assert msgspec.json.decode(msgspec.json.encode(t), type=Timings) == t
