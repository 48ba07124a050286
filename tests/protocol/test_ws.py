"""The WebSocket messages, byte for byte (docs/protocol.md, "WebSocket")."""

from __future__ import annotations

import msgspec
import pytest

from firstbyte.protocol import ws


def test_client_messages_bytes() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    assert ws.encode(ws.Request(msgspec.Raw(body))) == b'{"type":"request","body":' + body + b"}"
    assert ws.encode(ws.Resume("abc", 7)) == b'{"type":"resume","stream":"abc","after":7}'


def test_server_messages_bytes() -> None:
    assert ws.encode(ws.Start("S")) == b'{"type":"start","stream":"S"}'
    assert ws.encode(ws.Start("S", "tokyo", "osaka", "https://osaka.example/v1")) == (
        b'{"type":"start","stream":"S","region":"tokyo","better_region":"osaka",'
        b'"better_region_url":"https://osaka.example/v1"}'
    )
    chunk = b'{"id":"c","choices":[]}'
    assert ws.encode(ws.Event("S", 3, msgspec.Raw(chunk))) == (
        b'{"type":"event","stream":"S","seq":3,"data":' + chunk + b"}"
    )
    assert ws.encode(ws.Done("S", 4)) == b'{"type":"done","stream":"S","seq":4}'
    error = b'{"message":"m","type":"t","param":null,"code":"c"}'
    assert ws.encode(ws.Error(None, msgspec.Raw(error), 503, 7)) == (
        b'{"type":"error","stream":null,"error":' + error + b',"status":503,"retry_after":7}'
    )
    assert ws.encode(ws.Error("S", msgspec.Raw(error), 404)) == (
        b'{"type":"error","stream":"S","error":' + error + b',"status":404,"retry_after":null}'
    )
    # An older router's error has no status nor retry_after: still valid, without them.
    older = ws.decode_server_message(b'{"type":"error","stream":null,"error":' + error + b"}")
    assert isinstance(older, ws.Error)
    assert (older.status, older.retry_after) == (None, None)


@pytest.mark.parametrize(
    "message",
    [
        ws.Start("S", "tokyo"),
        ws.Event("S", 1, msgspec.Raw(b'{"a":1}')),
        ws.Done("S", 2),
        ws.Error("S", msgspec.Raw(b'{"message":"x"}')),
    ],
)
def test_server_messages_round_trip(message: ws.ServerMessage) -> None:
    decoded = ws.decode_server_message(ws.encode(message))
    assert decoded is not None
    assert ws.encode(decoded) == ws.encode(message)


def test_client_messages_round_trip() -> None:
    for message in (ws.Request(msgspec.Raw(b"{}")), ws.Resume("S", 0)):
        assert ws.encode(ws.decode_client_message(ws.encode(message))) == ws.encode(message)
    assert ws.decode_client_message('{"type":"resume","stream":"S"}') == ws.Resume("S", 0)


def test_readers_skip_unknown_server_types_and_fields() -> None:
    assert ws.decode_server_message(b'{"type":"progress","stream":"S"}') is None
    start = ws.decode_server_message(b'{"type":"start","stream":"S","new_field":1}')
    assert start == ws.Start("S")


@pytest.mark.parametrize(
    "raw",
    [b"not json", b'{"stream":"S"}', b'{"type":"event","stream":"S"}', b"[1]"],
)
def test_malformed_server_messages_raise(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        ws.decode_server_message(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"type":"hello"}',
        b'{"type":"resume","stream":""}',
        b'{"type":"resume","stream":"S","after":-1}',
        b'{"type":"request"}',
        b"{",
    ],
)
def test_invalid_client_messages_raise(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        ws.decode_client_message(raw)
