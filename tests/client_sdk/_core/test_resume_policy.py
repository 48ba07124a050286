"""``ResumePolicy.held``: a stall while the server holds the request is waited out, within
``stall_retries``, without spending a resume. The same rule is a case of ``stream_rules.py``
for both clients; here the Python error's ``idle_s`` too."""

from __future__ import annotations

import pytest

from firstbyte.client_sdk._core.resume import ResumePolicy
from firstbyte.client_sdk.errors import StreamStalledError


def test_held_stalls_count_against_stall_retries_and_spend_no_resume() -> None:
    policy = ResumePolicy(stall_retries=2, idle_timeout_s=1.5)
    policy.held()
    policy.held()
    assert (policy.stalls, policy.resumes) == (2, 0)
    with pytest.raises(StreamStalledError) as raised:
        policy.held(last_seq=0)
    assert str(raised.value) == (
        "no event for 1.5 s (heartbeats do not count) after event 0; not sent again: the"
        " server still answers, so it holds the request")
    assert raised.value.idle_s == 1.5


def test_held_and_resumed_stalls_share_one_budget() -> None:
    policy = ResumePolicy(stall_retries=1)
    policy.held()
    with pytest.raises(StreamStalledError, match="resumed 0 times"):
        policy.broken(None, opened=True, stalled=True)
