from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from firstbyte.protocol.sse import (
    HEARTBEAT,
    SSEDecoder,
    SSEEvent,
    SSEProtocolError,
    encode_comment,
    encode_event,
)

STREAM = (
    b"\xef\xbb\xbf: comment\r\n"
    b'id: 1\r\ndata: {"a": 1}\r\n\r\n'
    b"event: error\nid: 2\ndata: line one\ndata: line two\n\n"
    b": ping\n\n"
    b"retry: 1500\rdata:no-space\r\r"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent(data='{"a": 1}', id="1"),
    SSEEvent(data="line one\nline two", event="error", id="2"),
    SSEEvent(data="no-space", id="2", retry=1500),
    SSEEvent(data="[DONE]", id="2"),
]


def decode_pieces(pieces: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for piece in pieces:
        events.extend(decoder.receive_data(piece))
    return events


def test_whole_stream_decodes_exactly() -> None:
    assert decode_pieces([STREAM]) == EXPECTED


def test_byte_by_byte_decodes_exactly() -> None:
    assert decode_pieces([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=20))
def test_any_split_decodes_exactly(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert decode_pieces(pieces) == EXPECTED


@given(
    st.lists(
        st.text(
            alphabet=st.characters(blacklist_characters="\r\n\x00", blacklist_categories=("Cs",)),
            max_size=30,
        ),
        max_size=5,
    ),
    st.integers(min_value=0, max_value=10**9),
)
def test_encode_then_decode_round_trips(lines: list[str], seq: int) -> None:
    data = "\n".join(lines)
    events = decode_pieces([encode_event(data, id=seq), encode_comment("ping")])
    assert events == [SSEEvent(data=data, id=str(seq))]


def test_line_over_limit_is_rejected() -> None:
    decoder = SSEDecoder(max_line_bytes=64)
    with pytest.raises(SSEProtocolError):
        decoder.receive_data(b"data: " + b"x" * 100)


def test_event_over_limit_is_rejected() -> None:
    decoder = SSEDecoder(max_event_bytes=100)
    with pytest.raises(SSEProtocolError):
        decoder.receive_data(b"data: " + b"x" * 60 + b"\n" + b"data: " + b"y" * 60 + b"\n")


def test_id_with_nul_is_ignored_and_last_event_id_persists() -> None:
    decoder = SSEDecoder()
    decoder.receive_data(b"id: 7\ndata: a\n\n")
    events = decoder.receive_data(b"id: 8\x00\ndata: b\n\n")
    assert events == [SSEEvent(data="b", id="7")]
    assert decoder.last_event_id == "7"


def test_heartbeat_is_no_event_for_any_decoder() -> None:
    """The heartbeat between two ``id:``-carrying events is no event: for the WHATWG decoder
    here and for the official openai SDK's, which dispatches a blank line after an ``id``."""
    from openai._streaming import SSEDecoder as OpenAIDecoder

    wire = encode_event('{"a":1}', id=1) + HEARTBEAT * 3 + encode_event("[DONE]", id=2)
    assert decode_pieces([wire]) == [SSEEvent('{"a":1}', id="1"), SSEEvent("[DONE]", id="2")]
    theirs = list(OpenAIDecoder().iter_bytes(iter([wire[i : i + 3] for i in range(0, len(wire), 3)])))
    assert [(e.data, e.id) for e in theirs] == [('{"a":1}', "1"), ("[DONE]", "2")]


def test_comment_is_one_line() -> None:
    assert encode_comment("ping") == b": ping\n"
    with pytest.raises(ValueError, match="one line"):
        encode_comment("two\nlines")


def reference_decode(stream: bytes) -> list[SSEEvent]:
    """The WHATWG event-stream rules transcribed line by line: the whole stream at once."""
    text = stream.decode()
    text = text.removeprefix("\ufeff")
    lines = re.split("\r\n|\r|\n", text)[:-1]  # the last piece has no line end: not a line
    events: list[SSEEvent] = []
    data: list[str] = []
    event_type, last_id, retry = "", None, None
    for line in lines:
        if not line:
            if data:
                events.append(SSEEvent(data="\n".join(data), event=event_type or "message",
                                       id=last_id, retry=retry))
            data, event_type, retry = [], "", None
            continue
        if line.startswith(":"):
            continue
        name, sep, value = line.partition(":")
        value = value.removeprefix(" ") if sep else ""
        if name == "data":
            data.append(value)
        elif name == "event":
            event_type = value
        elif name == "id" and "\0" not in value:
            last_id = value
        elif name == "retry" and value.isascii() and value.isdigit():
            retry = int(value)
    return events


_TEXT = st.text(alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)),
                max_size=12)
_LINES = st.one_of(
    _TEXT.map(lambda t: "data: " + t), _TEXT.map(lambda t: "data:" + t), st.just("data"),
    st.integers(0, 10**6).map(lambda n: f"id: {n}"), _TEXT.map(lambda t: "id:" + t),
    _TEXT.map(lambda t: "event: " + t), st.integers(0, 9999).map(lambda n: f"retry: {n}"),
    _TEXT.map(lambda t: "retry:" + t), _TEXT.map(lambda t: ":" + t), _TEXT, st.just(""),
    st.just(""), st.just(""),
)


@given(
    st.booleans(),
    st.lists(st.tuples(_LINES, st.sampled_from(["\n", "\r", "\r\n"])), max_size=30),
    st.lists(st.integers(min_value=0, max_value=10**4), max_size=12),
)
def test_any_stream_split_anywhere_decodes_as_the_rules_say(
    bom: bool, lines: list[tuple[str, str]], cuts: list[int]
) -> None:
    stream = ("\ufeff" if bom else "").encode() + "".join(a + b for a, b in lines).encode()
    points = sorted({c % (len(stream) + 1) for c in cuts})
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert decode_pieces(pieces) == reference_decode(stream)
