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
        (b'{"messages": [{"role": "user", "content": "x"}]}', None),
    ],
)
def test_invalid_values_name_the_field(body: bytes, param: str | None) -> None:
    with pytest.raises(RequestValidationError) as info:
        decode_request(body)
    assert info.value.param == param
    assert info.value.body().error.type == "invalid_request_error"
    if param is None:
        assert "model" in info.value.message


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
