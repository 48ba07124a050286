"""Long-poll documents, byte for byte."""

from __future__ import annotations

import msgspec

from firstbyte.protocol.openai import encode
from firstbyte.protocol.poll import PollBatch, PollEvent, StreamStarted


def test_batch_bytes_carry_event_data_verbatim() -> None:
    batch = PollBatch("S", [PollEvent(1, msgspec.Raw(b'{"id":"c"}'))], False, 1)
    assert encode(batch) == (
        b'{"stream":"S","events":[{"seq":1,"data":{"id":"c"}}],"done":false,"next":1}'
    )


def test_stream_started_is_the_bare_id_or_a_first_batch() -> None:
    assert encode(StreamStarted("S")) == b'{"stream":"S"}'
    bare = msgspec.json.decode(b'{"stream":"S"}', type=StreamStarted)
    assert bare.batch() is None
    raw = b'{"stream":"S","events":[{"seq":1,"data":{}}],"done":true,"next":1}'
    first = msgspec.json.decode(raw, type=StreamStarted).batch()
    assert first is not None
    assert encode(first) == raw
