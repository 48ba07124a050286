"""router/shared/replies.py: RESP2 replies parsed from bytes in any split, as redis-py
returns them with ``disable_decoding``, and against a real server's bytes."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.exceptions import InvalidResponse, NoScriptError, ResponseError

from firstbyte.benchmarks.redis_server import RedisServer
from firstbyte.router.shared.replies import ReplyParser
from firstbyte.router.shared.wire import pack
from tests.router.redis_fixture import redis_server  # noqa: F401 (a fixture)


def _encode(value: Any, resp3: bool) -> bytes:
    if value is None:
        return b"_\r\n" if resp3 else b"$-1\r\n"
    if isinstance(value, bool):
        return b"#t\r\n" if value else b"#f\r\n"
    if isinstance(value, int):
        return (b"(%d\r\n" if resp3 and abs(value) > 2**40 else b":%d\r\n") % value
    if isinstance(value, float):
        return b",%r\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, dict):
        return b"%%%d\r\n" % len(value) + b"".join(
            _encode(k, resp3) + _encode(v, resp3) for k, v in value.items()
        )
    return b"*%d\r\n" % len(value) + b"".join(_encode(v, resp3) for v in value)


_scalars2 = st.none() | st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=40)
_scalars3 = (
    _scalars2
    | st.booleans()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(-(2**100), 2**100)
)
resp2_values = st.recursive(_scalars2, lambda inner: st.lists(inner, max_size=5), max_leaves=20)
resp3_values = st.recursive(
    _scalars3,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.binary(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _fed(wire: bytes, cuts: list[int]) -> tuple[list[Any], ReplyParser]:
    parser = ReplyParser()
    out: list[Any] = []
    for start, end in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        out += parser.feed(wire[start:end])
    return out, parser


@pytest.mark.parametrize("resp3", [False, True], ids=["resp2", "resp3"])
@given(data=st.data())
def test_replies_come_out_whole_whatever_the_split(resp3: bool, data: st.DataObject) -> None:
    values = data.draw(st.lists(resp3_values if resp3 else resp2_values, min_size=1, max_size=5))
    wire = b"".join(_encode(v, resp3=resp3) for v in values)
    out, parser = _fed(wire, sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=6))))
    assert out == values
    assert not parser.partial


def test_resp3_only_types() -> None:
    wire = (b"=8\r\ntxt:some\r\n~2\r\n:1\r\n:2\r\n!9\r\nERR blob!\r\n"
            b">2\r\n+invalidate\r\n*0\r\n|1\r\n+ttl\r\n:3\r\n:42\r\n")
    got, parser = _fed(wire, [])
    assert got[:2] == [b"some", [1, 2]]
    assert type(got[2]) is ResponseError
    assert str(got[2]) == "ERR blob!"
    assert got[3:] == [42]  # the push and the attribute are not replies
    assert not parser.partial


def test_simple_strings_errors_and_nil_array() -> None:
    parser = ReplyParser()
    got = parser.feed(b"+OK\r\n-NOSCRIPT No matching script\r\n-ERR bad\r\n*-1\r\n:7")
    assert got[0] == b"OK"
    assert isinstance(got[1], NoScriptError)
    assert str(got[1]) == "No matching script"
    assert type(got[2]) is ResponseError
    assert str(got[2]) == "ERR bad"
    assert got[3] is None
    assert parser.partial  # ":7" waits for its line's end
    assert parser.feed(b"\r\n") == [7]


@pytest.mark.parametrize("wire", [b"?what\r\n", b"$x\r\n", b"*1\r\n?5\r\n", b"%1\r\n*0\r\n:1\r\n"])
def test_bytes_that_are_not_resp2_raise(wire: bytes) -> None:
    with pytest.raises(InvalidResponse):
        ReplyParser().feed(wire)


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_real_servers_replies(redis_server: RedisServer, protocol: int) -> None:  # noqa: F811
    """Bytes from a real server, fed a byte at a time, in the protocol redis-py asked for in
    its HELLO (5: 2, 8: 3): a script's nested reply with a false in it, a nil, errors."""
    commands = [
        pack("HELLO", protocol),
        pack("SET", "replies:k", "v"),
        pack("EVAL", "return {1, 'two', {3, false}, redis.status_reply('FINE')}", 0),
        pack("GET", "replies:missing"),
        pack("EVALSHA", "0" * 40, 0),
        pack("INCR", "replies:k"),
    ]
    with socket.create_connection((redis_server.host, redis_server.port), timeout=5) as s:
        s.sendall(b"".join(commands))
        parser, got = ReplyParser(), []
        while len(got) < len(commands):
            chunk = s.recv(65536)
            assert chunk, "Redis closed the connection"
            for i in range(len(chunk)):
                got += parser.feed(chunk[i : i + 1])
    hello = got[0] if protocol == 3 else dict(zip(got[0][::2], got[0][1::2], strict=True))
    assert hello[b"proto"] == protocol
    assert got[1:4] == [b"OK", [1, b"two", [3, None], b"FINE"], None]
    assert isinstance(got[4], NoScriptError)
    assert type(got[5]) is ResponseError
    assert "not an integer" in str(got[5])
