"""Paths and header names: the constants are the wire strings docs/protocol.md names."""

from __future__ import annotations

import pytest

from firstbyte.protocol import headers, paths


def test_paths() -> None:
    assert paths.CHAT_COMPLETIONS == "/v1/chat/completions"
    assert paths.EDGE_STATUS == "/v1/edge/status"
    assert paths.EDGE_TIMINGS == "/v1/edge/timings"
    assert paths.stream("abc") == "/v1/streams/abc"
    assert paths.stream_poll("abc") == "/v1/streams/abc/poll"
    assert paths.WEBSOCKET == "/v1/ws"
    assert (paths.HEALTHZ, paths.METRICS) == ("/healthz", "/metrics")


def test_at_base_puts_a_path_under_a_clients_api_base() -> None:
    assert paths.at_base(paths.CHAT_COMPLETIONS, "/api/v1") == "/api/v1/chat/completions"
    assert paths.at_base(paths.stream_poll("S"), "") == "/streams/S/poll"
    with pytest.raises(ValueError, match="not under /v1"):
        paths.at_base(paths.HEALTHZ, "/api")


def test_header_names() -> None:
    assert headers.STREAM_HEADER == "x-firstbyte-stream"
    assert headers.BETTER_REGION_HEADER == "x-firstbyte-better-region"
    assert headers.BETTER_REGION_URL_HEADER == headers.BETTER_REGION_HEADER + "-url"
    names = [getattr(headers, n) for n in headers.__all__]
    assert all(n == n.lower() and n.startswith("x-firstbyte-") for n in names)
