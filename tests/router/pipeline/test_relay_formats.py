"""The relay with formats of named events (Responses, Anthropic Messages), sans IO."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from firstbyte.protocol.codec import event_data, event_name
from firstbyte.protocol.formats import MESSAGES, RESPONSES
from firstbyte.router.pipeline.relay import Append, EventFramer, Finish, FirstToken, Relay

UPSTREAM = (
    b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    b"event: response.output_text.delta\n"
    b'data: {"type":"response.output_text.delta","delta":"w0","sequence_number":1}\n\n'
    b": a comment\n"
    b"event: response.output_text.delta\r\n"
    b'data: {"type":"response.output_text.delta","delta":"w1","sequence_number":2}\r\n\r\n'
    b"event: response.completed\n"
    b'data: {"type":"response.completed","sequence_number":3}\n\n'
)


@given(st.lists(st.integers(min_value=1, max_value=len(UPSTREAM)), max_size=8))
def test_named_framing_is_indifferent_to_splits(cuts: list[int]) -> None:
    framer = EventFramer(named=True)
    points = sorted(set(cuts))
    pieces = [UPSTREAM[a:b] for a, b in zip([0, *points], [*points, len(UPSTREAM)], strict=True)]
    payloads = [p for piece in pieces for p in framer.receive_data(piece)]
    assert [event_name(p) for p in payloads] == [
        b"response.created", b"response.output_text.delta", b"response.output_text.delta",
        b"response.completed",
    ]
    assert [json.loads(event_data(p))["sequence_number"] for p in payloads] == [0, 1, 2, 3]


def test_the_fast_path_keeps_the_upstreams_bytes() -> None:
    block = b'event: message_stop\ndata: {"type":"message_stop"}'
    assert EventFramer(named=True).receive_data(block + b"\n\n") == [block]


def test_relay_ends_a_named_stream_at_its_terminal_event() -> None:
    relay = Relay(codec=RESPONSES)
    relay.start(0.0)
    relay.receive_head(200, 0.01)
    actions = relay.receive_data(UPSTREAM + b'event: late\ndata: {"type":"late"}\n\n', 0.02)
    append = actions[0]
    assert isinstance(append, Append)
    assert [event_name(p) for p in append.payloads][-1] == b"response.completed"
    assert any(isinstance(a, FirstToken) for a in actions)
    finish = [a for a in actions if isinstance(a, Finish)]
    assert finish == [Finish(True, "ok")]
    assert relay.receive_data(b'event: more\ndata: {"type":"more"}\n\n', 0.03) == []


def test_relay_ends_a_cut_named_stream_with_its_own_error_event() -> None:
    relay = Relay(codec=MESSAGES)
    relay.start(0.0)
    relay.receive_head(200, 0.01)
    relay.receive_data(b'event: message_start\ndata: {"type":"message_start"}\n\n', 0.02)
    (finish,) = relay.receive_end(0.03)
    assert isinstance(finish, Finish)
    assert finish.error is not None
    assert event_name(finish.error) == b"error"
    assert json.loads(event_data(finish.error))["error"]["code"] == "upstream_eof"
