"""The relay core, sans IO: bytes and times in, actions out (no sockets, no clock)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from firstbyte.protocol.anthropic import MESSAGES
from firstbyte.protocol.responses import RESPONSES
from firstbyte.protocol.sse import SSEDecoder
from firstbyte.router.pipeline.relay import (
    Action,
    Append,
    EventFramer,
    Finish,
    FirstToken,
    Relay,
    ReleaseHead,
    SwitchBackend,
)


def chunk(content: str | None = None, role: str | None = None) -> bytes:
    delta: dict[str, str] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return msgspec.json.encode(
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
    )


ROLE = chunk(role="assistant", content="")
HELLO = chunk("Hello")
WORLD = chunk(" world")
BODY = b"".join(b"data: " + p + b"\n\n" for p in (ROLE, HELLO, WORLD, b"[DONE]"))


def appended(actions: list[Action]) -> list[bytes]:
    return [p for a in actions if isinstance(a, Append) for p in a.payloads]


def feed(relay: Relay, pieces: list[bytes], t0: float = 10.0) -> list[Action]:
    actions: list[Action] = []
    for i, piece in enumerate(pieces):
        actions += relay.receive_data(piece, t0 + i * 0.01)
    return actions


def test_events_pass_through_byte_exact_with_done_and_first_token() -> None:
    relay = Relay()
    relay.start(10.0)
    head = relay.receive_head(200, 10.002)
    assert head == [ReleaseHead(200, b"", head[0].elapsed_ms)]
    assert abs(head[0].elapsed_ms - 2.0) < 1e-6
    actions = relay.receive_data(BODY, 10.05)
    assert appended(actions) == [ROLE, HELLO, WORLD]
    assert FirstToken(actions[1].upstream_ttft_ms) in actions  # type: ignore[union-attr]
    first = next(a for a in actions if isinstance(a, FirstToken))
    assert abs(first.upstream_ttft_ms - 50.0) < 1e-6
    assert actions[-1] == Finish(True, "ok")
    assert relay.receive_end(10.06) == []  # the body's end after [DONE]: nothing more


@given(st.lists(st.integers(min_value=0, max_value=len(BODY)), max_size=12))
def test_every_split_gives_the_same_actions(cuts: list[int]) -> None:
    bounds = sorted({0, len(BODY), *cuts})
    pieces = [BODY[a:b] for a, b in itertools.pairwise(bounds)]
    relay = Relay()
    relay.start(0.0)
    relay.receive_head(200, 0.0)
    actions = feed(relay, pieces)
    assert appended(actions) == [ROLE, HELLO, WORLD]
    assert sum(isinstance(a, FirstToken) for a in actions) == 1
    assert [a for a in actions if isinstance(a, Finish)] == [Finish(True, "ok")]


SSE_BYTES = st.lists(
    st.sampled_from(
        [
            b'data: {"a": 1}\n\n',
            b"data: x\n",
            b"data:y\n\n",
            b": ping\n\n",
            b"id: 7\n",
            b"event: e\n",
            b"retry: 5\n",
            b"\n",
            b"\r\n",
            b"\r",
            b"data: \xc3\xa9t\xc3\xa9\r\n\r\n",
            b"\xef\xbb\xbf",
            b"data: [DONE]\n\n",
            b"data: \n\n",
        ]
    ),
    max_size=12,
).map(b"".join)


@given(SSE_BYTES, st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_framer_matches_the_full_decoder_for_any_stream_and_split(
    data: bytes, cuts: list[int]
) -> None:
    expected = [e.data.encode() for e in SSEDecoder().receive_data(data)]
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    framer = EventFramer()
    got: list[bytes] = []
    for a, b in itertools.pairwise(bounds):
        got += framer.receive_data(data[a:b])
    assert got == expected


@pytest.mark.parametrize(
    "later",
    [b"\xef\xbb\xbfdata: b\n\n", b"data: b\n\n", b"data: b\r\n\r\n", b": c\n\ndata: b\n\n"],
)
def test_a_first_read_of_one_event_leaves_the_framer_as_the_loop_does(later: bytes) -> None:
    # The stream's first read cut on its own (its role chunk): past the start (a BOM
    # later is no BOM), between events (idle: Relay.feed cuts the next read itself).
    framer = EventFramer()
    assert framer.receive_data(b"data: a\n\n") == [b"a"]
    assert framer.idle
    expected = [e.data.encode() for e in SSEDecoder().receive_data(b"data: a\n\n" + later)]
    assert [b"a", *framer.receive_data(later)] == expected


@pytest.mark.parametrize(
    "later",
    [b"\xef\xbb\xbfdata: b\n\n", b"data: b\n\n", b"data: b\r\n\r\n", b": c\n\ndata: b\n\n"],
)
def test_a_first_read_cut_elsewhere_leaves_the_framer_as_its_own_cut_does(
    later: bytes,
) -> None:
    # The compiled read path cuts a stream's first read (its role chunk, even where it came
    # with the head) when the framer is idle, which it is at the start: the relay takes the
    # framer past the start as the framer's own cut would (a BOM later is no BOM).
    assert EventFramer().idle
    relay = Relay()
    relay.start(1.0)
    relay.receive_head(200, 1.01)
    assert relay.feed_events([ROLE], 1.02) == [ROLE]
    expected = [e.data.encode() for e in SSEDecoder().receive_data(b"data: x\n\n" + later)]
    assert relay.feed(later, 1.03) == expected[1:]
    framer = relay._framer  # the next attempt gets a framer of its own
    relay.start(2.0)
    assert relay._framer is not framer


def test_head_waits_for_the_first_token_under_a_deadline() -> None:
    relay = Relay(hold_head=True)
    relay.start(1.0)
    assert relay.receive_head(200, 1.01) == []
    actions = relay.receive_data(b"data: " + ROLE + b"\n\n", 1.02)
    assert actions == [Append([ROLE])]
    actions = relay.receive_data(b"data: " + HELLO + b"\n\n", 1.5)
    assert ReleaseHead(200, b"", actions[-1].elapsed_ms) == actions[-1]  # type: ignore[union-attr]


def test_deadline_switches_only_before_content_and_drops_the_second_preamble() -> None:
    relay = Relay(hold_head=True)
    relay.start(0.0)
    relay.receive_head(200, 0.01)
    relay.receive_data(b"data: " + ROLE + b"\n\n", 0.02)
    assert relay.deadline_fired(0.5) == [SwitchBackend()]
    relay.start(0.5)  # the next upstream: its role chunk is dropped, the client has one
    relay.receive_head(200, 0.51)
    actions = relay.receive_data(b"data: " + ROLE + b"\n\ndata: " + HELLO + b"\n\n", 0.6)
    assert appended(actions) == [HELLO]
    assert relay.deadline_fired(0.7) == []


def test_refusal_is_the_head_and_an_error_event() -> None:
    relay = Relay(hold_head=True)
    relay.start(0.0)
    body = b'{"error": {"message": "busy", "type": "server_error"}}'
    actions = relay.receive_head(503, 0.004, body)
    assert actions[0] == ReleaseHead(503, body, actions[0].elapsed_ms)  # type: ignore[union-attr]
    finish = actions[1]
    assert isinstance(finish, Finish)
    assert finish.outcome == "upstream_503"
    assert msgspec.json.decode(finish.error or b"") == {
        "error": {"message": "busy", "type": "server_error"}
    }


def test_a_refusal_in_a_format_of_named_events_keeps_the_upstreams_message() -> None:
    # A long-poll, WebSocket or resumed reader of a Responses or Messages stream gets the
    # stored error event, not the upstream's body: it must carry the upstream's message.
    openai_body = b'{"error": {"message": "role must be user", "type": "invalid_request_error"}}'
    anthropic_body = (
        b'{"type": "error", "error": {"type": "invalid_request_error", "message": "bad role"}}'
    )
    for codec, body, message in (
        (RESPONSES, openai_body, "role must be user"),
        (MESSAGES, anthropic_body, "bad role"),
        (MESSAGES, b"<html>busy</html>", "Upstream answered 400."),
    ):
        relay = Relay(hold_head=True, codec=codec)
        relay.start(0.0)
        finish = relay.receive_head(400, 0.004, body)[1]
        assert isinstance(finish, Finish)
        event = SSEDecoder().receive_data((finish.error or b"") + b"\n\n")
        data = msgspec.json.decode(event[0].data)
        error = data.get("error", data)  # Anthropic nests it; Responses' event is flat
        assert error["message"] == message, (codec.name, data)
        assert error["code"] == "upstream_400"


def test_early_end_and_failure_are_error_events() -> None:
    relay = Relay()
    relay.start(0.0)
    relay.receive_head(200, 0.0)
    relay.receive_data(b"data: " + HELLO + b"\n\ndata: " + WORLD[:5], 0.1)
    (finish,) = relay.receive_end(0.2)
    assert isinstance(finish, Finish)
    assert finish.outcome == "upstream_eof"
    assert b"before [DONE]" in (finish.error or b"")

    failing = Relay()
    failing.start(0.0)
    actions = failing.fail("ConnectError", 0.1)
    assert isinstance(actions[0], ReleaseHead)
    assert actions[0].status == 502
    # A code of its own, as every other error body of the router (it was null).
    assert msgspec.json.decode(actions[0].body)["error"]["code"] == "upstream_error"
    assert isinstance(actions[1], Finish)
    assert b"ConnectError" in (actions[1].error or b"")
    assert failing.receive_data(b"data: x\n\n", 0.2) == []


def _responses_events(count: int) -> bytes:
    """The start of a Responses stream: ``count`` (2 or more) events numbered from 0."""
    names = ["response.created", "response.in_progress"]
    names += ["response.output_text.delta"] * (count - 2)
    events = []
    for number, name in enumerate(names):
        data: dict[str, Any] = {"type": name, "sequence_number": number}
        if name.endswith(".delta"):
            data["delta"] = "w"
        events.append(b"event: %s\ndata: %s\n\n" % (name.encode(), msgspec.json.encode(data)))
    return b"".join(events)


def test_every_responses_error_the_relay_adds_takes_the_next_sequence_number() -> None:
    def error_number(finish: Action | None) -> Any:
        assert isinstance(finish, Finish), finish
        (event,) = SSEDecoder().receive_data((finish.error or b"") + b"\n\n")
        assert event.event == "error"
        return msgspec.json.decode(event.data)["sequence_number"]

    for ends in ("eof", "fail", "refused"):
        relay = Relay(codec=RESPONSES)
        relay.start(0.0)
        if ends == "refused":  # answered with an error before any event: the first number
            assert error_number(relay.receive_head(503, 0.1, b"busy")[-1]) == 0
            continue
        relay.receive_head(200, 0.0)
        appended_now = appended(relay.receive_data(_responses_events(5), 0.1))
        assert len(appended_now) == 5
        actions = relay.receive_end(0.2) if ends == "eof" else relay.fail("ReadTimeout", 0.2)
        assert error_number(actions[-1]) == 5, ends

    # Before any event, an upstream gone is the first event too.
    early = Relay(codec=RESPONSES)
    early.start(0.0)
    early.receive_head(200, 0.0)
    assert error_number(early.receive_end(0.1)[-1]) == 0


def test_an_event_without_end_past_the_limit_fails_the_stream() -> None:
    relay = Relay()
    relay._framer = EventFramer(max_event_bytes=100)
    relay.receive_head(200, 0.0)
    actions = relay.receive_data(b"data: " + b"x" * 200, 0.1)
    assert isinstance(actions[-1], Finish)
    assert actions[-1].outcome == "upstream_error"


USAGE = msgspec.json.encode({
    "id": "c1", "object": "chat.completion.chunk", "choices": [],
    "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13},
})
USAGE_BODY = b"".join(b"data: " + p + b"\n\n" for p in (ROLE, HELLO, WORLD, USAGE, b"[DONE]"))


@given(cuts=st.lists(st.integers(min_value=1, max_value=len(USAGE_BODY) - 1), max_size=6))
def test_the_usage_chunk_is_read_and_dropped_when_the_client_did_not_ask(
    cuts: list[int],
) -> None:
    """However the body is split, the usage is known at the end; the usage-only chunk is
    dropped with ``strip_usage`` and passed on without it."""
    bounds = [0, *sorted(set(cuts)), len(USAGE_BODY)]
    pieces = [USAGE_BODY[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    for strip in (True, False):
        relay = Relay(strip_usage=strip)
        relay.start(10.0)
        relay.receive_head(200, 10.001)
        actions = feed(relay, pieces)
        expected = [ROLE, HELLO, WORLD] if strip else [ROLE, HELLO, WORLD, USAGE]
        assert appended(actions) == expected
        assert relay.usage is not None
        assert (relay.usage.input_tokens, relay.usage.output_tokens) == (11, 2)
        assert Finish(True, "ok") in actions


def test_usage_on_a_chunk_with_choices_is_read_and_the_chunk_kept() -> None:
    last = msgspec.json.encode({"choices": [{"index": 0, "delta": {"content": "!"}}],
                                "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    relay = Relay(strip_usage=True)
    relay.start(10.0)
    relay.receive_head(200, 10.001)
    actions = feed(relay, [b"data: " + HELLO + b"\n\n", b"data: " + last + b"\n\n"])
    assert appended(actions) == [HELLO, last]
    assert relay.usage is not None
    assert relay.usage.input_tokens == 5


def test_an_error_event_is_not_taken_for_usage() -> None:
    error = b'{"error":{"message":"boom","code":"x"}}'
    relay = Relay(strip_usage=True)
    relay.start(10.0)
    relay.receive_head(200, 10.001)
    actions = feed(relay, [b"data: " + HELLO + b"\n\n", b"data: " + error + b"\n\n"])
    assert appended(actions) == [HELLO, error]
    assert relay.usage is None


FEED_EVENTS = st.lists(
    st.sampled_from(
        [
            b"data: " + HELLO + b"\n\n",
            b"data: " + WORLD + b"\n\n",
            b"data: " + ROLE + b"\n\n",
            b"data: " + USAGE + b"\n\n",
            b"data: {}}\n\n",
            b"data: [1]\n\n",
            b"data: \n\n",
            b": ping\n\n",
            b"data: x\r\n\r\n",
            b"event: e\ndata: y\n\n",
            b"data: [DONE]\n\n",
        ]
    ),
    max_size=10,
)


@given(
    FEED_EVENTS,
    st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
    st.booleans(),
    st.booleans(),
)
def test_feed_appends_and_acts_as_receive_data_for_any_stream_and_split(
    events: list[bytes], cuts: list[int], whole: bool, strip: bool
) -> None:
    """The hot path (:meth:`Relay.feed`) and :meth:`Relay.receive_data` make the same
    appends, the same other actions and the same usage, however the bytes come (an event a
    read, or split anywhere); one whole content event a read after the first content takes
    the fast cut."""
    events = [b"data: " + ROLE + b"\n\n", b"data: " + HELLO + b"\n\n", *events]
    if whole:
        pieces = list(events)
    else:
        data = b"".join(events)
        bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
        pieces = [data[a:b] for a, b in itertools.pairwise(bounds)]
    pieces += [b"data: " + WORLD + b"\n\n"] * 2  # whole events, once streaming
    slow, fast = Relay(strip_usage=strip), Relay(strip_usage=strip)
    expected: list[Action] = []
    got: list[Action] = []
    for relay in (slow, fast):
        relay.start(10.0)
        relay.receive_head(200, 10.001)
    for i, piece in enumerate(pieces):
        now = 10.01 + i * 0.01
        expected += slow.receive_data(piece, now)
        payloads = fast.feed(piece, now)
        if payloads is None:
            got += fast.take_actions()
        elif payloads:
            got.append(Append(payloads))
    assert appended(got) == appended(expected)
    assert [a for a in got if not isinstance(a, Append)] == [
        a for a in expected if not isinstance(a, Append)
    ]
    assert (fast.usage, fast.done, fast.appended) == (slow.usage, slow.done, slow.appended)
    if not slow.done and fast._framer.idle:
        # Still streaming, on the fast framing: the last two reads were cut fast.
        assert fast.fast_reads >= 2
