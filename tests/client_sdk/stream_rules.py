"""The SDK's stream rules as one table of cases, run against the Python SDK's sans-IO cores
(``_core/stream.py``, ``_core/longpoll.py``, ``_core/resume.py``, ``errors.retry_after_s``)
and, in Chromium, against the browser client's ``stream.js``: both must give exactly the
expected outputs.

Every case is plain JSON: the inputs, and per input the expected output (a delta, a delay, the
events a poll batch yields, the counts after a stall the server holds) or the error that ends
the case (``gap``, ``api``, ``broken``, ``stalled``; a held stall's error with its message).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from firstbyte.client_sdk._core.longpoll import PollCursor
from firstbyte.client_sdk._core.resume import ResumePolicy
from firstbyte.client_sdk._core.stream import SequenceGapError, StreamAssembler
from firstbyte.client_sdk.errors import (
    APIError,
    StreamBrokenError,
    StreamStalledError,
    retry_after_s,
)
from firstbyte.protocol.poll import PollBatch, PollEvent


def chunk(content: str | None = None, *, finish: str | None = None, role: str | None = None,
          usage: bool = False) -> str:
    delta: dict[str, object] = {}
    if content is not None:
        delta["content"] = content
    if role is not None:
        delta["role"] = role
    obj: dict[str, object] = {"id": "c", "created": 0, "model": "m", "choices": [] if usage else [
        {"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        obj["usage"] = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    return json.dumps(obj)


def delta(text: str, seq: int | None, *, finish: str | None = None,
          role: str | None = None) -> dict[str, Any]:
    return {"text": text, "seq": seq, "finish_reason": finish, "role": role,
            "is_content": bool(text)}


ERROR_EVENT = json.dumps({"error": {"message": "boom", "type": "server_error",
                                    "code": "upstream_eof"}})

ASSEMBLER: list[dict[str, Any]] = [
    {"name": "deltas in order, usage, done", "after": 0,
     "events": [[1, chunk("")], [2, chunk("Hel")], [3, chunk("", finish="stop")],
                [4, chunk(usage=True)], [5, "[DONE]"]],
     "expect": [None, delta("Hel", 2), delta("", 3, finish="stop"), None, None],
     "done": True, "last_seq": 5, "usage_tokens": 2},
    {"name": "a replay overlapping what was delivered is dropped", "after": 2,
     "events": [[1, chunk("a")], [2, chunk("b")], [3, chunk("c")], [3, chunk("c")]],
     "expect": [None, None, delta("c", 3), None], "done": False, "last_seq": 3},
    {"name": "a skipped sequence number is a gap, never skipped over", "after": 0,
     "events": [[1, chunk("a")], [3, chunk("c")]],
     "expect": [delta("a", 1), {"error": "gap", "expected": 2, "got": 3}],
     "done": False, "last_seq": 1},
    {"name": "an error event ends the stream with the API error", "after": 0,
     "events": [[1, chunk("a")], [2, ERROR_EVENT]],
     "expect": [delta("a", 1), {"error": "api", "code": "upstream_eof"}],
     "done": True, "last_seq": 2},
    {"name": "an undecodable event breaks the stream", "after": 0,
     "events": [[1, "{not json"]], "expect": [{"error": "broken"}], "done": False, "last_seq": 1},
    {"name": "JSON that is not a chunk breaks the stream", "after": 0,
     "events": [[1, '{"foo": 1}']], "expect": [{"error": "broken"}], "done": False,
     "last_seq": 1},
    {"name": "events after [DONE] are ignored", "after": 0,
     "events": [[1, chunk("a")], [2, "[DONE]"], [3, chunk("b")]],
     "expect": [delta("a", 1), None, None], "done": True, "last_seq": 3},
    {"name": "unnumbered events (a server without ids) pass in order", "after": 0,
     "events": [[None, chunk("a")], [None, chunk("b")], [None, " [DONE] "]],
     "expect": [delta("a", None), delta("b", None), None], "done": True, "last_seq": 0},
    {"name": "a role-only chunk is a delta, not content", "after": 0,
     "events": [[1, chunk(role="assistant")], [2, chunk("x")]],
     "expect": [delta("", 1, role="assistant"), delta("x", 2)], "done": False, "last_seq": 2},
    {"name": "a chunk already decoded (WebSocket, long-poll) is the same", "after": 0,
     "events": [[1, json.loads(chunk("a"))], [2, json.loads(ERROR_EVENT)]],
     "expect": [delta("a", 1), {"error": "api", "code": "upstream_eof"}],
     "done": True, "last_seq": 2},
]


def _batch(seqs: list[int], *, done: bool = False, next_seq: int | None = None,
           stream: str = "s1") -> dict[str, Any]:
    events = [{"seq": s, "data": json.loads(chunk(str(s)))} for s in seqs]
    return {"stream": stream, "events": events, "done": done,
            "next": next_seq if next_seq is not None else (max(seqs) if seqs else 0)}


POLL: list[dict[str, Any]] = [
    {"name": "batches advance the cursor; re-sent events are dropped; done ends it",
     "after": 0, "steps": [
         {"poll": 1.0, "expect": {"after": 0, "not_before": 1.0}},
         {"batch": _batch([1, 2]), "now": 1.0, "expect": [1, 2]},
         {"batch": _batch([2, 3], next_seq=3), "now": 1.5, "expect": [3]},
         {"batch": _batch([], done=True, next_seq=3), "now": 2.0, "expect": []},
         {"poll": 2.0, "expect": None}]},
    {"name": "failures back off, doubling, capped, then give up; success resets",
     "after": 4, "steps": [
         {"failure": 10.0, "expect": 0.05},
         {"poll": 10.0, "expect": {"after": 4, "not_before": 10.05}},
         {"failure": 10.1, "expect": 0.1},
         {"batch": _batch([5]), "now": 10.3, "expect": [5]},
         {"failure": 11.0, "expect": 0.05},
         {"failure": 11.1, "expect": 0.1},
         {"failure": 11.2, "expect": 0.2},
         {"failure": 11.3, "expect": 0.4},
         {"failure": 11.4, "expect": 0.8},
         {"failure": 11.5, "expect": {"error": "broken"}}]},
    {"name": "a batch of another stream breaks it", "after": 0, "steps": [
        {"batch": _batch([1], stream="other"), "now": 0.0, "expect": {"error": "broken"}}]},
    {"name": "a batch that skips ahead with no events breaks it", "after": 2, "steps": [
        {"batch": _batch([], next_seq=5), "now": 0.0, "expect": {"error": "broken"}}]},
]

HELD_OUT = ("no event for {idle} s (heartbeats do not count) after event {seq}; not sent"
            " again: the server still answers, so it holds the request")
"""The error of a stall the server held (``held``) once out of ``stall_retries``."""

RESUME: list[dict[str, Any]] = [
    {"name": "a cut before the answer is resent at once, then backs off",
     "config": {"max_resumes": 3, "backoff_s": 0.05, "stall_retries": 1}, "steps": [
         {"opened": False, "stalled": False, "expect": {"delay_s": 0.0, "resend": True}},
         {"opened": False, "stalled": False, "expect": {"delay_s": 0.1, "resend": True}},
         {"opened": True, "stalled": False, "expect": {"delay_s": 0.2, "resend": False}},
         {"opened": True, "stalled": False, "expect": {"error": "broken"}}]},
    {"name": "a cut after the answer resumes with a doubling backoff capped at 2 s",
     "config": {"max_resumes": 8, "backoff_s": 0.5, "stall_retries": 1}, "steps": [
         {"opened": True, "stalled": False, "expect": {"delay_s": 0.5, "resend": False}},
         {"opened": True, "stalled": False, "expect": {"delay_s": 1.0, "resend": False}},
         {"opened": True, "stalled": False, "expect": {"delay_s": 2.0, "resend": False}},
         {"opened": True, "stalled": False, "expect": {"delay_s": 2.0, "resend": False}}]},
    {"name": "stalls are bounded apart from cuts",
     "config": {"max_resumes": 5, "backoff_s": 0.05, "stall_retries": 1}, "steps": [
         {"opened": False, "stalled": True, "expect": {"delay_s": 0.05, "resend": True}},
         {"opened": True, "stalled": False, "expect": {"delay_s": 0.1, "resend": False}},
         {"opened": True, "stalled": True, "expect": {"error": "stalled"}}]},
    {"name": "a stall the server holds is waited out: no resume spent, never sent again",
     "config": {"max_resumes": 5, "backoff_s": 0.05, "stall_retries": 2, "idle_timeout_s": 1.5},
     "steps": [
         {"held": True, "last_seq": 0, "expect": {"stalls": 1, "resumes": 0}},
         {"held": True, "last_seq": 0, "expect": {"stalls": 2, "resumes": 0}},
         {"held": True, "last_seq": 0, "expect": {
             "error": "stalled", "message": HELD_OUT.format(idle="1.5", seq=0)}}]},
    {"name": "held and resumed stalls share one stall budget, not the resume budget",
     "config": {"max_resumes": 1, "backoff_s": 0.05, "stall_retries": 2, "idle_timeout_s": 2},
     "steps": [
         {"held": True, "last_seq": 0, "expect": {"stalls": 1, "resumes": 0}},
         # The first resume: the held stall spent none (else 0.1 s, or out of max_resumes).
         {"opened": False, "stalled": True, "expect": {"delay_s": 0.05, "resend": True}},
         {"held": True, "last_seq": 4, "expect": {
             "error": "stalled", "message": HELD_OUT.format(idle="2", seq=4)}}]},
]

# Retry-After (RFC 9110 section 10.2.3): delay-seconds, or an HTTP-date in any of the three forms
# of section 5.6.7 read as seconds from ``now`` (784111777: Sun, 06 Nov 1994 08:49:37 GMT),
# never negative; anything else is None (the client's own backoff).
NOW = 784111777.0
RETRY_AFTER: list[dict[str, Any]] = [
    {"name": "delay-seconds", "value": "2", "now": NOW, "expect": 2},
    {"name": "delay-seconds, surrounding spaces", "value": " 3 ", "now": NOW, "expect": 3},
    {"name": "a fraction of a second", "value": "1.5", "now": NOW, "expect": 1.5},
    {"name": "IMF-fixdate 30 s ahead", "value": "Sun, 06 Nov 1994 08:50:07 GMT", "now": NOW,
     "expect": 30},
    {"name": "RFC 850 date 30 s ahead", "value": "Sunday, 06-Nov-94 08:50:07 GMT", "now": NOW,
     "expect": 30},
    {"name": "asctime date 30 s ahead", "value": "Sun Nov  6 08:50:07 1994", "now": NOW,
     "expect": 30},
    {"name": "RFC 850 year over 50 ahead is the century before", "now": 1796083200.0,
     "value": "Monday, 01-Dec-98 00:00:30 GMT", "expect": 0},  # now: 1 Dec 2026
    {"name": "RFC 850 year within 50 ahead is this century", "now": 1796083200.0,
     "value": "Tuesday, 01-Dec-26 00:00:30 GMT", "expect": 30},
    {"name": "a date passed is no wait", "value": "Sun, 06 Nov 1994 08:49:07 GMT", "now": NOW,
     "expect": 0},
    {"name": "a negative number is garbage", "value": "-1", "now": NOW, "expect": None},
    {"name": "an exponent is garbage", "value": "1e3", "now": NOW, "expect": None},
    {"name": "a number with trailing garbage", "value": "2abc", "now": NOW, "expect": None},
    {"name": "a word", "value": "soon", "now": NOW, "expect": None},
    {"name": "empty", "value": "", "now": NOW, "expect": None},
    {"name": "absent", "value": None, "now": NOW, "expect": None},
    {"name": "a bare number is seconds, never a year", "value": "2030", "now": NOW,
     "expect": 2030},
    {"name": "a date with a numeric zone is not an HTTP-date",
     "value": "Sun, 06 Nov 1994 08:50:07 +0000", "now": NOW, "expect": None},
    {"name": "no such day", "value": "Wed, 30 Feb 1994 08:50:07 GMT", "now": NOW,
     "expect": None},
]

CASES = {"assembler": ASSEMBLER, "poll": POLL, "resume": RESUME, "retry_after": RETRY_AFTER}


# -- the Python side ----------------------------------------------------------------------------

def _error(exc: Exception) -> dict[str, Any]:
    if isinstance(exc, SequenceGapError):
        return {"error": "gap", "expected": exc.expected, "got": exc.got}
    if isinstance(exc, APIError):
        return {"error": "api", "code": exc.code}
    if isinstance(exc, StreamStalledError):
        return {"error": "stalled"}
    assert isinstance(exc, StreamBrokenError), exc
    return {"error": "broken"}


def run_assembler(case: dict[str, Any]) -> dict[str, Any]:
    asm = StreamAssembler(after=case["after"])
    out: list[Any] = []
    for seq, payload in case["events"]:
        try:
            d = asm.receive(seq, payload)
        except Exception as exc:
            out.append(_error(exc))
            break
        out.append(None if d is None else {
            "text": d.text, "seq": d.seq, "finish_reason": d.finish_reason, "role": d.role,
            "is_content": d.is_content})
    usage = asm.usage.completion_tokens if asm.usage is not None else None
    return {"outputs": out, "done": asm.done, "last_seq": asm.last_seq, "usage_tokens": usage}


def run_poll(case: dict[str, Any]) -> list[Any]:
    cursor = PollCursor("s1", after=case["after"])
    out: list[Any] = []
    for step in case["steps"]:
        try:
            if "poll" in step:
                p = cursor.next_poll(step["poll"])
                out.append(None if p is None else {"after": p.after, "not_before": p.not_before})
            elif "failure" in step:
                out.append(cursor.receive_failure(step["failure"]))
            else:
                b = step["batch"]
                batch = PollBatch(b["stream"], [
                    PollEvent(e["seq"], msgspec.Raw(json.dumps(e["data"]).encode()))
                    for e in b["events"]], b["done"], b["next"])
                out.append([e.seq for e in cursor.receive_batch(batch, step["now"])])
        except Exception as exc:
            out.append(_error(exc))
            break
    return out


def run_resume(case: dict[str, Any]) -> list[Any]:
    policy = ResumePolicy(**case["config"])
    out: list[Any] = []
    for step in case["steps"]:
        try:
            if step.get("held"):
                policy.held(last_seq=step["last_seq"])
                out.append({"stalls": policy.stalls, "resumes": policy.resumes})
            else:
                s = policy.broken("cut", opened=step["opened"], stalled=step["stalled"])
                out.append({"delay_s": s.delay_s, "resend": s.resend})
        except Exception as exc:
            error = _error(exc)
            if step.get("held"):
                error["message"] = str(exc)
            out.append(error)
            break
    return out


def run_retry_after(case: dict[str, Any]) -> float | None:
    return retry_after_s(case["value"], now=case["now"])


def expected(kind: str, case: dict[str, Any]) -> Any:
    if kind == "retry_after":
        return case["expect"]
    if kind == "assembler":
        return {"outputs": case["expect"], "done": case["done"], "last_seq": case["last_seq"],
                "usage_tokens": case.get("usage_tokens")}
    return [step["expect"] for step in case["steps"]]


# -- the browser side: the same table through stream.js -----------------------------------------

JS_RUNNER = """((cases) => {
  const R = window.rules;
  const error = (e) => e instanceof R.SequenceGapError ? {error: "gap", expected: e.expected, got: e.got}
    : e instanceof R.APIError ? {error: "api", code: e.code}
    : e instanceof R.StreamStalledError ? {error: "stalled"}
    : e instanceof R.StreamBrokenError ? {error: "broken"} : {error: "other: " + e};
  const run = (steps, fn) => { const out = []; for (const s of steps) {
    try { out.push(fn(s)); } catch (e) {
      out.push(s.held ? {...error(e), message: e.message} : error(e)); break; } } return out; };
  const assembler = cases.assembler.map((c) => {
    const asm = new R.StreamAssembler({after: c.after});
    const outputs = run(c.events, ([seq, payload]) => { const d = asm.receive(seq, payload);
      return d && {text: d.text, seq: d.seq, finish_reason: d.finishReason, role: d.role,
                   is_content: d.isContent}; });
    return {outputs, done: asm.done, last_seq: asm.lastSeq,
            usage_tokens: asm.usage ? asm.usage.completion_tokens : null};
  });
  const poll = cases.poll.map((c) => { const cursor = new R.PollCursor("s1", {after: c.after});
    return run(c.steps, (s) => {
      if ("poll" in s) { const p = cursor.nextPoll(s.poll);
        return p && {after: p.after, not_before: p.notBefore}; }
      if ("failure" in s) return cursor.receiveFailure(s.failure);
      return cursor.receiveBatch(s.batch, s.now).map((e) => e.seq); }); });
  const resume = cases.resume.map((c) => { const p = new R.ResumePolicy({
      maxResumes: c.config.max_resumes, backoffS: c.config.backoff_s,
      stallRetries: c.config.stall_retries, idleTimeoutS: c.config.idle_timeout_s});
    return run(c.steps, (s) => {
      if (s.held) { p.held({lastSeq: s.last_seq}); return {stalls: p.stalls, resumes: p.resumes}; }
      const r = p.broken("cut", {opened: s.opened, stalled: s.stalled});
      return {delay_s: r.delayS, resend: r.resend}; }); });
  const retry_after = cases.retry_after.map((c) => R.retryAfterS(c.value, c.now));
  return {assembler, poll, resume, retry_after};
})"""
