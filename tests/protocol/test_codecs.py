"""The codecs of every format, sans IO: what the router reads of requests and events."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from firstbyte.protocol.codec import CHAT, Codec, Usage, event_data, event_name, named_event
from firstbyte.protocol.formats import (
    BY_PATH,
    COMPLETIONS,
    EMBEDDINGS,
    MAX_EMBEDDING_INPUTS,
    MESSAGES,
    RESPONSES,
)
from firstbyte.protocol.openai import RequestValidationError


def _named(name: str, **data: object) -> bytes:
    return named_event(name, json.dumps({"type": name, **data}).encode())


def test_every_endpoint_has_its_codec() -> None:
    assert set(BY_PATH) == {
        "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
        "/v1/embeddings",
    }
    assert all(codec.path == path for path, codec in BY_PATH.items())


def test_completions_request_view() -> None:
    view = COMPLETIONS.decode_request(
        b'{"model": "m", "prompt": ["a", "b", 3], "stream": true, "max_tokens": 7,'
        b' "user": "u", "echo": true}'
    )
    assert (view.model, view.stream, view.max_tokens, view.user) == ("m", True, 7, "u")
    assert view.messages[0].content == "ab"
    with pytest.raises(RequestValidationError) as err:
        COMPLETIONS.decode_request(b'{"model": "m", "prompt": "x", "max_tokens": 0}')
    assert err.value.param == "max_tokens"


def test_responses_request_view() -> None:
    body = {
        "model": "m", "instructions": "be brief", "stream": True, "max_output_tokens": 9,
        "safety_identifier": "s", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "x"},
            {"role": "assistant", "content": "earlier"},
            {"type": "reasoning", "summary": []},
        ],
    }
    view = RESPONSES.decode_request(json.dumps(body).encode())
    # a function's call and output read as the turns they are (routing: not an opening)
    assert [(m.role, m.content) for m in view.messages] == [
        ("system", "be brief"), ("user", "hello"), ("assistant", "{}"), ("tool", "x"),
        ("assistant", "earlier"),
    ]
    assert (view.max_tokens, view.safety_identifier, view.stream) == (9, "s", True)
    assert RESPONSES.decode_request(b'{"model": "m", "input": "hi"}').messages[0].content == "hi"


def test_messages_request_view() -> None:
    body = {
        "model": "m", "max_tokens": 5, "stream": True, "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "sys"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}],
    }
    view = MESSAGES.decode_request(json.dumps(body).encode())
    assert [(m.role, m.content) for m in view.messages] == [("system", "sys"), ("user", "q")]
    assert (view.user, view.max_tokens, view.stream) == ("u1", 5, True)
    with pytest.raises(RequestValidationError) as err:  # max_tokens is required there
        MESSAGES.decode_request(b'{"model": "m", "messages": [{"role": "user", "content": "q"}]}')
    assert err.value.param is None or "max_tokens" in err.value.message


@pytest.mark.parametrize(
    ("codec", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
        (COMPLETIONS, {"prompt": "hi"}),
        (RESPONSES, {"input": "hi"}),
        (MESSAGES, {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
def test_stream_null_reads_as_not_streamed(codec: Codec, body: dict[str, object]) -> None:
    """OpenAI types ``stream`` as ``boolean or null`` (vLLM too): null is no stream, not a
    400."""
    view = codec.decode_request(json.dumps({"model": "m", **body, "stream": None}).encode())
    assert view.stream is False


def test_embeddings_never_stream() -> None:
    assert not EMBEDDINGS.streams
    view = EMBEDDINGS.decode_request(b'{"model": "m", "input": ["a", "b"], "user": "u"}')
    assert (view.model, view.messages[0].content, view.user) == ("m", "ab", "u")


def test_embeddings_take_at_most_openais_2048_inputs() -> None:
    assert MAX_EMBEDDING_INPUTS == 2048
    most = json.dumps({"model": "m", "input": ["a"] * MAX_EMBEDDING_INPUTS}).encode()
    assert EMBEDDINGS.decode_request(most).messages[0].content == "a" * MAX_EMBEDDING_INPUTS
    for too_many in (["a"] * (MAX_EMBEDDING_INPUTS + 1), [[1, 2]] * 20_000):
        body = json.dumps({"model": "m", "input": too_many}).encode()
        with pytest.raises(RequestValidationError) as err:
            EMBEDDINGS.decode_request(body)
        assert err.value.param == "input"
        assert "2048" in str(err.value)


def test_content_end_and_usage_of_each_format() -> None:
    delta = _named("response.output_text.delta", delta="w", sequence_number=4)
    completed = _named(
        "response.completed", sequence_number=9,
        response={"usage": {"input_tokens": 3, "output_tokens": 5}},
    )
    assert RESPONSES.is_content(delta)
    assert not RESPONSES.is_content(_named("response.created", sequence_number=0))
    assert RESPONSES.end_of(delta) is None
    assert RESPONSES.end_of(completed) == "ok"
    assert RESPONSES.end_of(_named("response.failed")) == "upstream_error"
    assert RESPONSES.usage(completed) == Usage(3, 5)

    start = _named("message_start", message={"usage": {"input_tokens": 11, "output_tokens": 1}})
    text = _named("content_block_delta", index=0, delta={"type": "text_delta", "text": "w"})
    thinking = _named("content_block_delta", index=0, delta={"type": "thinking_delta"})
    end = _named("message_delta", delta={}, usage={"output_tokens": 6})
    stop = _named("message_stop")
    assert MESSAGES.is_content(text)
    assert not MESSAGES.is_content(thinking)
    assert MESSAGES.end_of(stop) == "ok"
    assert MESSAGES.end_of(_named("error", error={"type": "overloaded_error"})) is not None
    assert MESSAGES.stream_usage([start, text, end, stop]) == Usage(11, 6)

    chunk = b'{"choices":[{"index":0,"text":"w"}]}'
    assert COMPLETIONS.is_content(chunk)
    assert not COMPLETIONS.is_content(b'{"choices":[{"index":0,"text":""}]}')
    usage = b'{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":4}}'
    assert COMPLETIONS.stream_usage([chunk, usage]) == Usage(2, 4)
    assert CHAT.stream_usage([usage]) == Usage(2, 4)


def test_error_events_are_in_the_formats_own_shape() -> None:
    responses = RESPONSES.error_event("gone", code="upstream_eof")
    assert event_name(responses) == b"error"
    assert json.loads(event_data(responses)) == {
        "type": "error", "sequence_number": 0, "code": "upstream_eof", "message": "gone",
        "param": None,
    }
    messages = json.loads(event_data(MESSAGES.error_event("gone", code="upstream_eof")))
    assert messages["type"] == "error"
    assert messages["error"]["message"] == "gone"
    assert json.loads(CHAT.error_event("gone", code="x"))["error"]["code"] == "x"


def test_a_responses_error_event_is_numbered_after_the_streams_last_event() -> None:
    def number(after: bytes | None) -> Any:
        event = RESPONSES.error_event("gone", code="upstream_eof", after=after)
        return json.loads(event_data(event)).get("sequence_number")

    assert number(None) == 0  # the stream's first event
    assert number(_named("response.output_text.delta", delta="w", sequence_number=4)) == 5
    # The number is the event's own, not one inside its text or its response.
    assert number(_named("response.output_text.delta", delta='"sequence_number":9',
                         sequence_number=2)) == 3
    # An upstream that does not number its events: no number made up.
    assert number(named_event("message", b'{"type":"x"}')) is None
    assert number(named_event("message", b"[1]")) is None
    # Formats that do not number their events are as before.
    assert MESSAGES.error_event("gone", after=b"x") == MESSAGES.error_event("gone")
    assert CHAT.error_event("gone", after=b"x") == CHAT.error_event("gone")


def test_event_data_of_several_data_lines() -> None:
    payload = named_event("e", b'{"a":\n1}')
    assert payload == b'event: e\ndata: {"a":\ndata: 1}'
    assert json.loads(event_data(payload)) == {"a": 1}
    assert event_data(b'{"plain":1}') == b'{"plain":1}'


def _content_as_dicts(payload: bytes) -> bool:
    """Chat's first-content test as it reads a chunk decoded into dicts: the definition
    :meth:`ChatCodec.is_content` answers as, whichever way it decodes."""
    if b'"delta"' not in payload:
        return False
    try:
        chunk: Any = msgspec.json.decode(payload)
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or delta.get("refusal"):
                return True
    except (msgspec.DecodeError, AttributeError, TypeError):
        return False
    return False


_CHUNK_HEAD = b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
_CHAT_CHUNKS = [
    _CHUNK_HEAD + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}]}',
    _CHUNK_HEAD + b'"system_fingerprint":null,"choices":[{"index":0,"delta":{"content":" w"},'
    b'"logprobs":null,"finish_reason":null}],"usage":null}',
    _CHUNK_HEAD + b'"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1}}',
    b'{"choices":[{"delta":{"content":"x","content":""}}]}',  # the last of a member counts
    b'{"choices":[{"delta":{"content":""},"delta":{"content":"x"}}]}',
    b'{"choices":[{"delta":{"content":"x"}}],"choices":null}',
    b'{"choices":[{"delta":{"content":"x"},"delta":1}]}',
    b'{"choices":[{"delta":{"content":"x"}}, "junk"]}',  # content first: content
    b'{"choices":["junk", {"delta":{"content":"x"}}]}',  # junk first: none
    b'{"choices":[{"delta":null}]}',
    b'{"choices":[{"delta":0}]}',
    b'{"choices":[{"delta":"s"}]}',
    b'{"choices":{}}',
    b'{"choices":"ab"}',
    b'{"choices":0}',
    b'[{"delta":{"content":"x"}}]',
    b'"delta"',
    b'{"delta": 1}',
    b'{"choices":[{"delta":{"tool_calls":[{}]}}]}',
    b'{"choices":[{"delta":{"tool_calls":[]}}]}',
    b'{"choices":[{"delta":{"refusal":"no"}}]}',
    b'{"choices":[{"delta":{"content":0}}]}',
    b'{"choices":[{"delta":{"content":1.5}}]}',
    b'{"choices":[{"delta":{"content":{"a":1}}}]}',
    b'{"choices":[{"delta":{"content":"x"}}],"extra":1}',  # another member
    b'{"choices":[{"delta":{"content":"x","extra":{"deep":[1e999]}}}]}',
    b'{"\\u0063hoices":[{"delta":{"content":"x"}}]}',  # an escaped member name
    b'{"choices":[{"\\u0064elta":{"content":"x"}}]}',
    b'{"choices":[{"delta":{"content":"caf\xc3\xa9 \\u00e9"}}]}',
    # What decoding refuses and skipping a member would not: not content.
    b'{"model":"\xff\xfe","choices":[{"delta":{"content":"x"}}]}',
    b'{"id":1e999,"choices":[{"delta":{"content":"x"}}]}',
    b'{"choices":[{"delta":{"content":"x"}}],"usage":{"a":-1e999}}',
    b'{"id":"\\ud800","choices":[{"delta":{"content":"x"}}]}',
    b'{"choices":[{"delta":{"content":"x"}}],"id":01}',
    b'{"choices":[{"delta":{"content":"x"}}]} x',
    b'{"choices":[{"delta":{"content":"x"}}',
    b'{"created":123456789012345678901234567890,"choices":[{"delta":{"content":"x"}}]}',
]


@pytest.mark.parametrize("payload", _CHAT_CHUNKS)
def test_chat_content_is_what_the_chunk_read_as_dicts_says(payload: bytes) -> None:
    assert CHAT.is_content(payload) is _content_as_dicts(payload)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner,
                                                                max_size=2),
    max_leaves=4,
)
_DELTAS = st.one_of(
    _JSON_VALUES,
    st.dictionaries(
        st.sampled_from(["role", "content", "tool_calls", "refusal", "reasoning", "other"]),
        _JSON_VALUES, max_size=3,
    ),
)
_CHOICES = st.one_of(
    _JSON_VALUES,
    st.dictionaries(
        st.sampled_from(["index", "delta", "logprobs", "finish_reason", "other"]),
        _DELTAS, max_size=3,
    ),
)


@given(
    st.dictionaries(
        st.sampled_from(["id", "created", "model", "choices", "usage", "other"]),
        st.one_of(_JSON_VALUES, st.lists(_CHOICES, max_size=3)),
        max_size=4,
    )
)
def test_chat_content_of_any_chunk_is_what_it_read_as_dicts_says(chunk: dict[str, Any]) -> None:
    payload = json.dumps(chunk).encode()
    if b'"delta"' not in payload:
        payload = payload.replace(b"{", b'{"delta": {}, ', 1) if chunk else b'{"delta": 1}'
    assert CHAT.is_content(payload) is _content_as_dicts(payload)
