from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from firstbyte.client_sdk._core.longpoll import PollCursor, decode_batch
from firstbyte.client_sdk.errors import StreamBrokenError
from firstbyte.protocol.poll import PollBatch, PollEvent


def batch(seqs: list[int], *, done: bool = False, nxt: int | None = None) -> PollBatch:
    events = [PollEvent(seq=s, data=msgspec.Raw(b'{"n":%d}' % s)) for s in seqs]
    return PollBatch(stream="S", events=events, done=done,
                     next=nxt if nxt is not None else (seqs[-1] if seqs else 0))


def test_cursor_advances_and_builds_the_next_poll() -> None:
    cursor = PollCursor("S", after=3, wait_s=5)
    poll = cursor.next_poll(now=10.0)
    assert poll is not None
    assert (poll.path, poll.after, poll.not_before) == ("/streams/S/poll", 3, 10.0)
    assert poll.params == {"after": "3", "wait": "5"}
    fresh = cursor.receive_batch(batch([4, 5]), now=10.1)
    assert [e.seq for e in fresh] == [4, 5]
    assert cursor.after == 5
    assert cursor.next_poll(now=10.2).after == 5  # type: ignore[union-attr]


def test_replayed_events_are_dropped_and_order_is_by_sequence() -> None:
    cursor = PollCursor("S", after=2)
    fresh = cursor.receive_batch(batch([4, 1, 2, 3]), now=0.0)
    assert [e.seq for e in fresh] == [3, 4]
    assert cursor.receive_batch(batch([3, 4]), now=0.0) == []
    assert cursor.after == 4


def test_empty_batch_is_a_heartbeat() -> None:
    cursor = PollCursor("S", after=7)
    assert cursor.receive_batch(batch([], nxt=7), now=1.0) == []
    assert cursor.after == 7
    assert not cursor.done


def test_done_ends_polling() -> None:
    cursor = PollCursor("S")
    cursor.receive_batch(batch([1, 2], done=True, nxt=3), now=0.0)
    assert cursor.done
    assert cursor.next_poll(now=1.0) is None


def test_failures_back_off_exponentially_then_give_up() -> None:
    cursor = PollCursor("S", after=9, max_failures=3, backoff_s=0.1, backoff_max_s=0.25)
    assert cursor.receive_failure(now=5.0) == pytest.approx(0.1)
    assert cursor.next_poll(now=5.0).not_before == pytest.approx(5.1)  # type: ignore[union-attr]
    assert cursor.receive_failure(now=6.0) == pytest.approx(0.2)
    assert cursor.receive_failure(now=7.0) == pytest.approx(0.25)
    with pytest.raises(StreamBrokenError, match="gave up after 3 retries at event 9"):
        cursor.receive_failure(now=8.0)


def test_success_resets_the_failure_count_and_keeps_position() -> None:
    cursor = PollCursor("S", max_failures=1)
    cursor.receive_failure(now=0.0)
    cursor.receive_batch(batch([1]), now=0.1)
    assert cursor.failures == 0
    assert cursor.after == 1
    cursor.receive_failure(now=0.2)  # allowed again
    assert cursor.next_poll(now=0.2).after == 1  # type: ignore[union-attr]


def test_foreign_or_skipping_batches_are_errors() -> None:
    cursor = PollCursor("S")
    with pytest.raises(StreamBrokenError, match="not ours"):
        cursor.receive_batch(PollBatch(stream="T", events=[], done=False, next=0), now=0.0)
    with pytest.raises(StreamBrokenError, match="skips"):
        cursor.receive_batch(batch([], nxt=4), now=0.0)


def test_decode_batch() -> None:
    raw = b'{"stream":"S","events":[{"seq":1,"data":{"a":1}}],"done":false,"next":1}'
    got = decode_batch(raw)
    assert (got.stream, got.done, got.next) == ("S", False, 1)
    assert [(e.seq, bytes(e.data)) for e in got.events] == [(1, b'{"a":1}')]
    with pytest.raises(StreamBrokenError, match="invalid long-poll answer"):
        decode_batch(b'{"stream":"S"}')


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 8)), min_size=1, max_size=40))
def test_any_overlapping_replays_deliver_each_event_exactly_once(
    windows: list[tuple[int, int]],
) -> None:
    """Whatever a flaky network makes the server return (replays from any earlier point,
    batches of any size), the cursor hands out 1..N once each, in order."""
    cursor = PollCursor("S")
    delivered: list[int] = []
    for back, size in windows:
        start = max(cursor.after - back, 0)  # a retried poll may replay from further back
        seqs = list(range(start + 1, start + 1 + size))
        if not seqs:
            continue
        delivered += [e.seq for e in cursor.receive_batch(batch(seqs), now=0.0)]
    assert delivered == list(range(1, cursor.after + 1))
