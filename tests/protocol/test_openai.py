from __future__ import annotations

import msgspec
import pytest

from firstbyte.protocol.openai import (
    ChatCompletionChunk,
    RequestValidationError,
    decode_chunk,
    decode_request,
    encode,
    message_text,
)


def test_request_accepts_openai_shapes_and_unknown_fields() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
            },
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 5,
        "max_tokens": 9,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "some_future_field": {"x": 1},
    }
    request = decode_request(msgspec.json.encode(body))
    assert request.output_limit == 5
    assert request.wants_usage_chunk
    assert message_text(request.messages[1]) == "hi there"
    assert request.tools == body["tools"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "messages": []}', "messages"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
            "max_tokens",
        ),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', "n"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}',
            "temperature",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    ],
)
def test_invalid_values_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(RequestValidationError) as info:
        decode_request(body)
    assert info.value.param == param
    assert info.value.body().error.type == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m"}', "messages"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "messages[0].role"),
    ],
)
def test_a_missing_field_is_named_as_openai_names_it(body: bytes, param: str) -> None:
    """msgspec's text ("Object missing required field `model`") came with no ``param``."""
    with pytest.raises(RequestValidationError) as info:
        decode_request(body)
    assert (info.value.param, info.value.message) == (
        param, f"Missing required parameter: '{param}'.")


@pytest.mark.parametrize("body", [b"{not json", b"[]", b"", b'"text"'])
def test_non_object_bodies_are_rejected(body: bytes) -> None:
    with pytest.raises(RequestValidationError):
        decode_request(body)


def test_chunk_round_trip() -> None:
    raw = (
        b'{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}'
    )
    chunk = decode_chunk(raw)
    assert chunk.choices[0].delta.content == "Hi"
    assert msgspec.json.decode(encode(chunk), type=ChatCompletionChunk) == chunk


def test_n_above_1_says_why_it_is_refused() -> None:
    """msgspec's own text was "Invalid enum value 2": the client could not tell why."""
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}'
    with pytest.raises(RequestValidationError) as info:
        decode_request(body)
    assert info.value.message == (
        "Invalid value for 'n': only 1 is served: the router streams, stores and resumes one"
        " choice per request; send n requests for n answers")


def test_a_lone_surrogate_is_named_not_called_truncation() -> None:
    """JSON.stringify of a JavaScript string cut inside an emoji ends in a lone ``\\ud83d``;
    msgspec calls that "Input data was truncated", and the client looked for a cut body."""
    body = rb'{"model": "m", "messages": [{"role": "user", "content": "hi \ud83d"}]}'
    with pytest.raises(RequestValidationError) as info:
        decode_request(body)
    assert info.value.message == (
        "The request body is not valid JSON: \\ud83d at byte 60 is half of a UTF-16"
        " surrogate pair (a string cut inside a character?)")
    assert body[60:66] == rb"\ud83d"
    for cut in (body[:66], rb'{"model": "m", "content": "\\ud83d', rb'{"content": "\ud83d\ude00'):
        # A body cut short is still called truncated, an escaped backslash is no escape,
        # and a whole pair is no lone half.
        with pytest.raises(RequestValidationError) as info:
            decode_request(cut)
        assert info.value.message.endswith("Input data was truncated"), cut


def test_a_custom_tool_call_in_the_history_is_accepted() -> None:
    """OpenAI's custom tools: the assistant's call has ``custom``, no ``function``."""
    body = {"model": "m", "messages": [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "shell", "input": "ls"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "README.md"},
    ]}
    request = decode_request(msgspec.json.encode(body))
    call = request.messages[1].tool_calls[0]  # type: ignore[index]
    assert (call.type, call.function, call.custom) == ("custom", None, {"name": "shell",
                                                                        "input": "ls"})
