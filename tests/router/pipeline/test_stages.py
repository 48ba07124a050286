"""The non-IO pipeline stages as plain functions over a context: no sockets."""

from __future__ import annotations

import hashlib
import json
import time

from firstbyte.router.client_tokens import TokenSigner
from firstbyte.router.pipeline.admit import admit_chat, authenticate, check_body_size, parse_chat
from firstbyte.router.pipeline.backend import Backend, BackendPool, choose_backend
from firstbyte.router.pipeline.context import (
    CONTINUE,
    Fallback,
    LocalReply,
    RequestContext,
    Traceparent,
)
from firstbyte.router.streams import owner_of

KEYS = [b"sk-one-00000000", b"sk-two-00000000"]
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def ctx(headers: dict[str, str] | None = None, body: bytes = BODY) -> RequestContext:
    return RequestContext(
        method="POST", path="/v1/chat/completions", headers=headers or {}, body=body
    )


def test_authenticate() -> None:
    ok = ctx({"authorization": "Bearer sk-two-00000000"})
    assert authenticate(ok, KEYS) is CONTINUE
    assert ok.api_key == "sk-two-00000000"
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "Basic sk-one-00000000"},
    ):
        outcome = authenticate(ctx(headers), KEYS)
        assert isinstance(outcome, LocalReply)
        assert outcome.status == 401
        assert b"authentication_error" in outcome.body
        assert b"sk-one" not in outcome.body  # a key is never echoed
    assert authenticate(ctx({}), []) is CONTINUE  # no keys configured: open (local use)


def test_a_key_owns_its_request_a_token_its_own() -> None:
    """The owner of a request by a configured key is the key's digest, as setting
    ``api_key`` works it out (authenticate takes it from a table made once per key set)."""
    for key in KEYS:
        request = ctx({"authorization": f"Bearer {key.decode()}"})
        assert authenticate(request, KEYS) is CONTINUE
        assert request.owner == owner_of(key.decode())
        assert (request.api_key, request.by_client_token) == (key.decode(), False)
        by_setter = ctx()
        by_setter.api_key = key.decode()
        assert by_setter.owner == request.owner
    keyless = ctx()
    assert authenticate(keyless, []) is CONTINUE  # no keys, no token: the anonymous owner
    assert (keyless.api_key, keyless.owner) == (None, owner_of(None))
    keyless.api_key = "sk-set-before-00"  # a key set before is taken back, as ever
    assert authenticate(keyless, []) is CONTINUE
    assert (keyless.api_key, keyless.owner) == (None, owner_of(None))
    anonymous = ctx({"authorization": "Bearer anything-at-all"})
    assert authenticate(anonymous, []) is CONTINUE  # no keys: the digest of what came
    assert anonymous.owner == owner_of("anything-at-all")
    tokened = ctx()
    tokened.token_owner = b"t" * 32
    tokened.adopt_api_key("sk-one-00000000", owner_of("sk-one-00000000"))
    assert tokened.owner == b"t" * 32  # as setting api_key: the token's owner stays
    assert tokened.api_key == "sk-one-00000000"


def test_reprs_carry_no_key_and_no_prompt() -> None:
    request = ctx({"authorization": "Bearer sk-two-00000000"})
    assert authenticate(request, KEYS) is CONTINUE
    assert parse_chat(request) is CONTINUE
    request.backend = Backend("b", "http://127.0.0.1:1", api_key="sk-backend-0000")
    request.upstream_headers = {"authorization": "Bearer sk-two-00000000"}
    text = repr(request)
    assert "/v1/chat/completions" in text
    for secret in ("sk-two", "sk-backend", '"hi"', "'hi'"):
        assert secret not in text, secret


def test_body_limit_and_parse() -> None:
    too_big = check_body_size(ctx(body=b"x" * 11), 10)
    assert isinstance(too_big, LocalReply)
    assert too_big.status == 413
    bad = parse_chat(ctx(body=b"{not json"))
    assert isinstance(bad, LocalReply)
    assert bad.status == 400
    wrong = parse_chat(ctx(body=b'{"model": "m", "messages": [], "stream": true}'))
    assert isinstance(wrong, LocalReply)
    assert json.loads(wrong.body)["error"]["param"] == "messages"
    at_limit = ctx({"authorization": "Bearer sk-one-00000000"})
    assert admit_chat(at_limit, KEYS, len(BODY)) is CONTINUE  # the limit is inclusive
    over = admit_chat(ctx({"authorization": "Bearer sk-one-00000000"}), KEYS, len(BODY) - 1)
    assert isinstance(over, LocalReply)
    assert over.status == 413
    good = ctx({"authorization": "Bearer sk-one-00000000"})
    assert admit_chat(good, KEYS, 1 << 20, force_stream=True) is CONTINUE
    assert good.request is not None
    assert good.stream_requested
    assert good.admitted_at is not None


def test_least_in_flight_round_robin_and_fallback() -> None:
    a, b, c = Backend("a", "http://a"), Backend("b", "http://b"), Backend("c", "http://c")
    pool = BackendPool([a, b, c])
    assert [pool.pick() for _ in range(4)] == [a, b, c, a]  # ties: round robin
    b.in_flight = 0
    a.in_flight = c.in_flight = 2
    assert pool.pick() is b
    b.healthy = False
    a.in_flight = 1
    assert pool.pick() is a
    request = ctx()
    assert choose_backend(request, pool) is CONTINUE
    assert request.backend is a
    for backend in pool.backends:
        backend.healthy = False
    assert isinstance(choose_backend(ctx(), pool), Fallback)
    chosen = ctx()
    chosen.backend = c  # an earlier stage (affinity, region) already chose: respected
    assert choose_backend(chosen, pool) is CONTINUE
    assert chosen.backend is c


def test_traceparent_is_continued_or_started() -> None:
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    joined = Traceparent.continue_from(incoming)
    assert joined.trace_id == "0af7651916cd43dd8448eb211c80319c"
    assert joined.parent_id != "b7ad6b7169203331"
    assert len(joined.parent_id) == 16
    for bad in (None, "", "garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01"):
        fresh = Traceparent.continue_from(bad)
        assert len(fresh.trace_id) == 32
        assert fresh.trace_id != "0" * 32


def test_server_timing_names_what_is_known() -> None:
    request = ctx()
    assert request.server_timing() == ""
    request.admitted_at = request.received_at + 0.002
    request.routed_at = request.admitted_at + 0.001
    timing = request.server_timing(upstream_ttft=12.5)
    assert timing == "queue;dur=2.00, route;dur=1.00, upstream-ttft;dur=12.50"


def test_server_timing_durations_are_two_decimal_formats() -> None:
    """Each duration is its value in ms as ``format(ms, ".2f")`` writes it (halves, signs,
    zero's sign, huge and not-finite values included), whatever builds the text."""
    values = [0.0, -0.0, 0.005, 0.015, 2.675, 1.005, -3.14159, 123456789.125, 1e300, 1e-300,
              float("inf"), float("-inf"), float("nan")]
    for queue_ms in values:
        for route_ms in values[:4]:
            request = ctx()
            request.received_at = 1000.0
            request.admitted_at = request.received_at + queue_ms / 1000
            request.routed_at = request.admitted_at + route_ms / 1000
            queue = (request.admitted_at - request.received_at) * 1000
            route = (request.routed_at - request.admitted_at) * 1000
            assert request.server_timing(upstream_headers=queue_ms, a_b=route_ms) == (
                f"queue;dur={queue:.2f}, route;dur={route:.2f}, "
                f"upstream-headers;dur={queue_ms:.2f}, a-b;dur={route_ms:.2f}"
            )
            request.routed_at = None
            assert request.server_timing() == f"queue;dur={queue:.2f}"
    request = ctx()
    assert request.server_timing(only=1.005) == f"only;dur={1.005:.2f}"


def test_server_timing_upstream_headers_is_server_timing_with_that_entry() -> None:
    """The streamed head's own method writes what ``server_timing(upstream_headers=ms)``
    writes, whatever of queue and route is known."""
    values = [0.0, -0.0, 0.005, 2.675, 1.005, 123456789.125, float("inf"), float("nan")]
    for ms in values:
        request = ctx()
        assert request.server_timing_upstream_headers(ms) == request.server_timing(
            upstream_headers=ms
        )
        request.admitted_at = request.received_at + ms / 1000
        assert request.server_timing_upstream_headers(ms) == request.server_timing(
            upstream_headers=ms
        )
        request.routed_at = request.admitted_at + 0.0015
        assert request.server_timing_upstream_headers(ms) == request.server_timing(
            upstream_headers=ms
        )


def _body(**more: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **more}
                      ).encode()


def test_a_request_by_key_names_its_subject_a_token_keeps_its_own() -> None:
    def subject(headers: dict[str, str], body: bytes) -> str | None:
        request = ctx({"authorization": "Bearer sk-one-00000000", **headers}, body)
        assert admit_chat(request, KEYS, 1 << 20) is CONTINUE
        return request.subject

    assert subject({}, BODY) is None
    assert subject({}, _body(user="u-1")) == "u-1"
    assert subject({}, _body(user="u-1", safety_identifier="s-1")) == "s-1"
    assert subject({"x-firstbyte-subject": "h-1"}, _body(user="u-1")) == "h-1"
    assert subject({}, _body(user="x" * 500)) == "sha256:" + hashlib.sha256(
        b"x" * 500).hexdigest()
    signer = TokenSigner(b"k" * 32, max_ttl_s=60, default_ttl_s=60)
    # A token of a configured key (one of a removed key's is refused as revoked).
    token = signer.mint(owner_of(KEYS[0].decode()), time.time(), subject="alice").token
    by_token = ctx({"authorization": f"Bearer {token}", "x-firstbyte-subject": "mallory"},
                   _body(user="mallory"))
    assert admit_chat(by_token, KEYS, 1 << 20, tokens=signer) is CONTINUE
    assert (by_token.subject, by_token.reader_subject) == ("alice", "alice")


def test_a_contexts_repr_keeps_the_key_the_prompt_and_the_headers_out() -> None:
    tp = Traceparent("a" * 32, "b" * 16)
    c = RequestContext(
        "POST", "/v1/chat/completions", {"authorization": "Bearer sk-secret"},
        client=("1.2.3.4", 5), traceparent=tp, body=b"my prompt", received_at=1.5,
    )
    c.api_key, c.subject, c.region = "sk-secret", "user-7", "eu"
    assert repr(c) == (
        "RequestContext(method='POST', path='/v1/chat/completions', client=('1.2.3.4', 5), "
        "http_version='1.1', received_at=1.5, codec=<ChatCodec chat /v1/chat/completions>, "
        f"stream_requested=False, traceparent={tp!r}, backend=None, region='eu', "
        "admitted_at=None, routed_at=None, upstream_sent_at=None, first_token_at=None, "
        "outcome='', error_code=None, route_reason='', upstream_error='', model_label='', "
        "usage=None)"
    )
    assert c.owner == owner_of("sk-secret")
    assert c != RequestContext("POST", "/v1/chat/completions", {})  # by identity
    assert hash(c) == hash(c)
