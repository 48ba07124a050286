from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from firstbyte.client_sdk._core.stream import SequenceGapError, StreamAssembler
from firstbyte.client_sdk.errors import APIError, StreamBrokenError


def chunk(content: str | None = None, *, finish: str | None = None, tool: bool = False,
          usage: bool = False) -> str:
    delta: dict[str, object] = {}
    if content is not None:
        delta["content"] = content
    if tool:
        delta["tool_calls"] = [{"index": 0, "id": "c1", "type": "function",
                                "function": {"name": "f", "arguments": "{\"a\""}}]
    obj: dict[str, object] = {"id": "x", "created": 0, "model": "m",
                              "choices": [] if usage else [
                                  {"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        obj["usage"] = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    return json.dumps(obj)


def test_deltas_in_order_usage_and_done() -> None:
    asm = StreamAssembler()
    assert asm.receive(1, chunk("")) is None  # empty role-less chunk carries nothing
    d = asm.receive(2, chunk("Hel"))
    assert d is not None
    assert d.text == "Hel"
    assert d.seq == 2
    assert d.is_content
    d = asm.receive(3, chunk(None, tool=True))
    assert d is not None
    assert d.tool_calls[0].function is not None
    assert d.is_content
    d = asm.receive(4, chunk("", finish="stop"))
    assert d is not None
    assert d.finish_reason == "stop"
    assert not d.is_content
    assert asm.receive(5, chunk(usage=True)) is None
    assert asm.usage is not None
    assert asm.usage.completion_tokens == 2
    assert asm.receive(6, "[DONE]") is None
    assert asm.done
    assert asm.last_seq == 6


def test_replayed_events_are_not_repeated() -> None:
    asm = StreamAssembler(after=2)
    assert asm.receive(1, chunk("a")) is None
    assert asm.receive(2, chunk("b")) is None
    d = asm.receive(3, chunk("c"))
    assert d is not None
    assert d.text == "c"
    assert asm.receive(3, chunk("c")) is None


def test_a_gap_is_refused_so_nothing_is_lost() -> None:
    asm = StreamAssembler()
    asm.receive(1, chunk("a"))
    with pytest.raises(SequenceGapError) as info:
        asm.receive(3, chunk("c"))
    assert info.value.expected == 2
    assert asm.last_seq == 1


def test_error_event_raises_typed_error() -> None:
    asm = StreamAssembler()
    with pytest.raises(APIError) as info:
        asm.receive(1, {"error": {"message": "upstream died", "type": "server_error",
                                  "code": "upstream_error"}})
    assert info.value.type == "server_error"
    assert info.value.status is None
    assert info.value.code == "upstream_error"


def test_error_event_as_sse_text_raises_typed_error() -> None:
    # SSE hands the assembler text: the fast typed decode must not swallow an error event.
    with pytest.raises(APIError, match="upstream died"):
        StreamAssembler().receive(1, '{"error": {"message": "upstream died"}}')
    with pytest.raises(StreamBrokenError, match="invalid chunk"):
        StreamAssembler().receive(1, '{"id": "x"}')


def test_unnumbered_events_pass_through_and_garbage_is_an_error() -> None:
    asm = StreamAssembler()
    d = asm.receive(None, chunk("x"))
    assert d is not None
    assert d.seq is None
    with pytest.raises(StreamBrokenError):
        asm.receive(None, "{not json")
    with pytest.raises(StreamBrokenError):
        asm.receive(None, '{"id": 1}')


@given(st.lists(st.integers(0, 6), min_size=1, max_size=30))
def test_resumes_from_any_earlier_point_never_repeat_a_token(backs: list[int]) -> None:
    """Each resume replays from up to ``back`` events before the last delivered one; the
    assembler turns that into every token exactly once, in order."""
    tokens = [f"t{i}" for i in range(1, 41)]
    asm = StreamAssembler()
    out: list[str] = []
    for back in backs:
        start = max(asm.last_seq - back, 0)
        for seq in range(start + 1, min(start + 5, len(tokens)) + 1):
            delta = asm.receive(seq, chunk(tokens[seq - 1]))
            if delta is not None:
                out.append(delta.text)
    assert out == tokens[: asm.last_seq]
