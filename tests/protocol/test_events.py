"""The typed events a client reads, sans IO, and their agreement with the router's codecs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from firstbyte.protocol.codec import Codec, Usage, event_data, named_event
from firstbyte.protocol.events import (
    COMPLETION_EVENTS,
    MESSAGE_EVENTS,
    RESPONSE_EVENTS,
    EventFormat,
    MessageEvent,
    ResponseEvent,
)
from firstbyte.protocol.formats import COMPLETIONS, MESSAGES, RESPONSES, STREAMED
from firstbyte.protocol.sse import SSEDecoder
from tests.router.formats_upstream import CONTENT, _completions, _messages, _responses

Generator = Callable[[list[str], dict[str, Any]], Iterator[bytes]]
CASES: list[tuple[EventFormat[Any], Codec, Generator]] = [
    (COMPLETION_EVENTS, COMPLETIONS, _completions),
    (RESPONSE_EVENTS, RESPONSES, _responses),
    (MESSAGE_EVENTS, MESSAGES, _messages),
]
WORDS = ["a", "b", "c"]


def stored(codec: Codec, raw: bytes) -> bytes:
    """The payload the router's store keeps of one upstream event (see protocol.codec)."""
    (event,) = SSEDecoder().receive_data(raw)
    data = event.data.encode()
    return named_event(event.event, data) if codec.named_events else data


@pytest.mark.parametrize(("events", "codec", "generate"), CASES, ids=lambda c: str(c)[:20])
def test_client_and_router_agree_on_content_and_end(
    events: EventFormat[Any], codec: Codec, generate: Generator
) -> None:
    """Every event the upstream sends: the client's typed reading of its JSON (what every
    transport carries) says content and end exactly where the router's codec does."""
    raws = list(generate(WORDS, {"stream_options": {"include_usage": True}}))
    text = ""
    for raw in raws:
        content = raw[:1] == CONTENT
        payload = stored(codec, raw.removeprefix(CONTENT))
        if payload == b"[DONE]":
            with pytest.raises(msgspec.DecodeError):
                events.decode(payload)
            continue
        event = events.decode(event_data(payload))
        assert events.is_content(event) is codec.is_content(payload) is content
        assert events.ends(event) is (codec.end_of(payload) is not None)
        assert events.error(event) is None
        text += events.text(event)
    assert text == "a b c"


def test_usage_in_each_format() -> None:
    chunk = COMPLETION_EVENTS.decode(
        b'{"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}')
    assert COMPLETION_EVENTS.usage(chunk) == Usage(3, 5)
    done = RESPONSE_EVENTS.decode(json.dumps({
        "type": "response.completed", "sequence_number": 9,
        "response": {"id": "r", "status": "completed",
                     "usage": {"input_tokens": 4, "output_tokens": 6}}}))
    assert RESPONSE_EVENTS.usage(done) == Usage(4, 6)
    assert RESPONSE_EVENTS.ends(done)
    start = MESSAGE_EVENTS.decode(
        b'{"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 7,'
        b' "output_tokens": 1}}}')
    assert MESSAGE_EVENTS.usage(start) == Usage(7, 1)
    delta = MESSAGE_EVENTS.decode(
        b'{"type": "message_delta", "delta": {"stop_reason": "end_turn"},'
        b' "usage": {"output_tokens": 8}}')
    assert MESSAGE_EVENTS.usage(delta) == Usage(None, 8)
    assert delta.delta is not None
    assert delta.delta.stop_reason == "end_turn"


def test_error_events_become_openai_error_bodies() -> None:
    """The format's own error event (as upstreams and the router write it) reads as OpenAI's
    error body with its code; OpenAI's shape itself is no event of either format."""
    failed = RESPONSE_EVENTS.decode(
        b'{"type": "error", "code": "draining", "message": "bye", "param": null}')
    assert isinstance(failed, ResponseEvent)
    assert RESPONSE_EVENTS.error(failed) == {"error": {
        "message": "bye", "type": "draining", "param": None, "code": "draining"}}
    assert RESPONSE_EVENTS.ends(failed)
    anthropic = MESSAGE_EVENTS.decode(
        b'{"type": "error", "error": {"type": "api_error", "message": "gone",'
        b' "code": "upstream_eof"}}')
    assert isinstance(anthropic, MessageEvent)
    assert MESSAGE_EVENTS.error(anthropic) == {"error": {
        "message": "gone", "type": "api_error", "code": "upstream_eof"}}
    openai_shape = b'{"error": {"message": "lost", "type": "server_error", "code": "stream_lost"}}'
    for events in (RESPONSE_EVENTS, MESSAGE_EVENTS):
        with pytest.raises(msgspec.ValidationError):
            events.decode(openai_shape)


def test_router_error_events_read_back_as_errors() -> None:
    """What the router's codecs write into a stream, the client reads as that error."""
    for events, codec in ((RESPONSE_EVENTS, RESPONSES), (MESSAGE_EVENTS, MESSAGES)):
        payload = codec.error_event("The router shut down.", code="draining")
        error = events.error(events.decode(event_data(payload)))
        assert error is not None
        assert error["error"]["code"] == "draining"
        assert error["error"]["message"] == "The router shut down."


def test_streamed_formats_by_name() -> None:
    assert set(STREAMED) == {"chat", "completions", "responses", "messages"}
    for events in (COMPLETION_EVENTS, RESPONSE_EVENTS, MESSAGE_EVENTS):
        assert STREAMED[events.name].path == events.path
