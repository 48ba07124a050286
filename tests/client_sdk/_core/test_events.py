"""The typed formats' stream assembly, sans IO: each event once, in order, to the end."""

from __future__ import annotations

import json

import pytest

from firstbyte.client_sdk._core.events import EventAssembler
from firstbyte.client_sdk._core.stream import SequenceGapError
from firstbyte.client_sdk.errors import APIError, StreamBrokenError
from firstbyte.protocol.codec import Usage
from firstbyte.protocol.events import COMPLETION_EVENTS, MESSAGE_EVENTS, RESPONSE_EVENTS


def response_event(kind: str, n: int, **fields: object) -> str:
    return json.dumps({"type": kind, "sequence_number": n, **fields})


def test_replays_are_dropped_and_a_gap_refused() -> None:
    asm = EventAssembler(RESPONSE_EVENTS)
    first = asm.receive(1, response_event("response.created", 0))
    assert first is not None
    assert first.type == "response.created"
    assert asm.receive(1, response_event("response.created", 0)) is None  # replayed
    delta = asm.receive(2, response_event("response.output_text.delta", 1, delta="hi"))
    assert delta is not None
    assert delta.delta == "hi"
    with pytest.raises(SequenceGapError) as gap:
        asm.receive(4, response_event("response.output_text.delta", 3, delta="!"))
    assert (gap.value.expected, asm.last_seq) == (3, 2)


def test_the_terminal_event_ends_it_and_a_late_done_is_ignored() -> None:
    asm = EventAssembler(RESPONSE_EVENTS, after=4)
    done = asm.receive(5, response_event(
        "response.completed", 9, response={"usage": {"input_tokens": 1, "output_tokens": 2}}))
    assert done is not None
    assert asm.done
    assert asm.last is done
    assert asm.usage == Usage(1, 2)
    # A long-poll or WebSocket reader is given the store's [DONE] after it.
    assert asm.receive(6, "[DONE]") is None
    assert asm.last_seq == 6


def test_done_ends_completions_and_usage_is_kept() -> None:
    asm = EventAssembler(COMPLETION_EVENTS)
    chunk = asm.receive(1, b'{"id": "c", "choices": [{"index": 0, "text": "x"}]}')
    assert chunk is not None
    assert chunk.text == "x"
    asm.receive(2, b'{"id": "c", "choices": [], "usage": {"prompt_tokens": 2,'
                   b' "completion_tokens": 1}}')
    assert not asm.done
    assert asm.receive(3, b"[DONE]") is None
    assert asm.done
    assert asm.usage == Usage(2, 1)


def test_messages_usage_merges_start_and_last_delta() -> None:
    asm = EventAssembler(MESSAGE_EVENTS)
    asm.receive(1, {"type": "message_start", "message": {"usage": {"input_tokens": 5,
                                                                   "output_tokens": 1}}})
    asm.receive(2, {"type": "message_delta", "usage": {"output_tokens": 9}})
    assert asm.usage == Usage(5, 9)
    assert asm.receive(3, {"type": "message_stop"}) is not None
    assert asm.done


@pytest.mark.parametrize("payload", [
    b'{"type": "error", "code": "draining", "message": "bye", "param": null}',
    b'{"error": {"message": "bye", "type": "server_error", "code": "draining"}}',
])
def test_error_events_raise_with_their_code(payload: bytes) -> None:
    asm = EventAssembler(RESPONSE_EVENTS)
    with pytest.raises(APIError) as err:
        asm.receive(1, payload)
    assert err.value.code == "draining"
    assert asm.done


def test_anthropic_error_event_raises_with_its_code() -> None:
    asm = EventAssembler(MESSAGE_EVENTS)
    with pytest.raises(APIError) as err:
        asm.receive(1, b'{"type": "error", "error": {"type": "api_error", "message": "x",'
                       b' "code": "stream_lost"}}')
    assert err.value.code == "stream_lost"


@pytest.mark.parametrize("payload", [b"not json", b'{"no": "type"}', b"[1, 2]"])
def test_anything_else_breaks_the_stream(payload: bytes) -> None:
    with pytest.raises(StreamBrokenError):
        EventAssembler(MESSAGE_EVENTS).receive(1, payload)
