"""The request-head bounds as a sans-IO scanner: each bound exactly at its edge, and the same
verdict however the bytes are split into reads."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firstbyte.router.hosting.head_guards import (
    h2_header_list_size,
    h11_incomplete_size,
)
from firstbyte.router.hosting.heads import (
    HeadLimits,
    HeadScanner,
    UnalignedHead,
    check_fields,
    max_head_bytes,
    refusal_body,
    refusal_h1,
)

LIMITS = HeadLimits(
    max_request_line_bytes=100, max_header_line_bytes=60, max_header_bytes=200, max_headers=5
)


def _head(request_line: bytes, *fields: bytes, end: bytes = b"\r\n") -> bytes:
    return b"".join(line + end for line in (request_line, *fields)) + end


def _scan(data: bytes, cuts: list[int] | None = None) -> tuple[int | None, bool]:
    """The refusal's status (None if none) and whether the head was seen complete, feeding
    ``data`` cut at ``cuts``."""
    scanner = HeadScanner(LIMITS)
    points = [0, *sorted(set(c for c in cuts or [] if 0 < c < len(data))), len(data)]
    for start, end in itertools.pairwise(points):
        refusal = scanner.feed(data[start:end])
        if refusal is not None:
            return refusal.status, scanner.complete
    return None, scanner.complete


def _line(n: int, prefix: bytes = b"GET /") -> bytes:
    """A line of exactly ``n`` bytes (without its line end)."""
    return prefix + b"a" * (n - len(prefix) - len(b" HTTP/1.1")) + b" HTTP/1.1"


def _field(n: int) -> bytes:
    return b"x-f: " + b"v" * (n - 5)


CASES = [
    pytest.param(_head(_line(100)), None, id="request-line-at-bound"),
    pytest.param(_head(_line(101)), 414, id="request-line-over"),
    pytest.param(_line(101) + b"a" * 10, 414, id="request-line-over-unended"),
    pytest.param(_head(_line(30), _field(60)), None, id="header-line-at-bound"),
    pytest.param(_head(_line(30), _field(61)), 431, id="header-line-over"),
    pytest.param(_head(_line(30))[:-2] + _field(61), 431, id="header-line-over-unended"),
    pytest.param(_head(_line(30), *[_field(50)] * 4), None, id="total-at-200"),
    pytest.param(_head(_line(30), *[_field(50)] * 3, _field(51)), 431, id="total-over"),
    pytest.param(_head(_line(30), *[b"a: b"] * 5), None, id="count-at-bound"),
    pytest.param(_head(_line(30), *[b"a: b"] * 6), 431, id="count-over"),
    pytest.param(_head(_line(30), *[b"a: b"] * 5, end=b"\n"), None, id="bare-lf-ends"),
    pytest.param(b"\r\n" + _head(_line(30)), None, id="blank-line-before-request"),
    pytest.param(b"\r\n" * 60 + _head(_line(30)), 414, id="blank-lines-count-toward-the-line"),
]


@pytest.mark.parametrize(("data", "status"), CASES)
def test_each_bound_at_its_edge(data: bytes, status: int | None) -> None:
    refused, complete = _scan(data)
    assert refused == status
    assert complete == (status is None and data.endswith((b"\n\n", b"\n\r\n")))


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from([c.values for c in CASES]), cuts=st.lists(st.integers(0, 400)))
def test_the_verdict_does_not_depend_on_how_the_bytes_are_split(
    case: tuple[bytes, int | None], cuts: list[int]
) -> None:
    data, status = case
    assert _scan(data, cuts)[0] == status


def test_what_follows_the_head_is_not_scanned() -> None:
    scanner = HeadScanner(LIMITS)
    assert scanner.feed(_head(_line(30)) + b"x" * 10_000) is None
    assert scanner.complete
    assert scanner.feed(b"y" * 10_000) is None


def test_an_over_long_line_is_refused_before_its_end_arrives() -> None:
    """Nothing past the bound needs to be read: the piece crossing it is refused."""
    scanner = HeadScanner(LIMITS)
    assert scanner.feed(b"GET / HTTP/1.1\r\nx-big: ") is None
    refusal = scanner.feed(b"v" * 100)
    assert refusal is not None
    assert refusal.code == "header_too_large"


def test_decoded_fields_are_checked_like_lines() -> None:
    assert check_fields(b"/" * 100, [(b"a", b"b")] * 5, LIMITS) is None
    refused = check_fields(b"/" * 101, [], LIMITS)
    assert refused is not None
    assert refused.status == 414
    refused = check_fields(b"/", [(b"a", b"b")] * 6, LIMITS)
    assert refused is not None
    assert refused.code == "too_many_headers"
    refused = check_fields(b"/", [(b"x-f", b"v" * 56)], LIMITS)  # 3 + 2 + 56 = 61
    assert refused is not None
    assert refused.code == "header_too_large"
    refused = check_fields(b"/", [(b"x-f", b"v" * 50)] * 4, LIMITS)  # 4 x 55 = 220
    assert refused is not None
    assert refused.code == "headers_too_large"


def test_refusals_are_openai_error_bodies_and_close() -> None:
    refusal = check_fields(b"/", [(b"a", b"b")] * 6, LIMITS)
    assert refusal is not None
    import json

    error = json.loads(refusal_body(refusal))["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "too_many_headers"
    response = refusal_h1(refusal)
    assert response.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"\r\nconnection: close\r\n" in response


def test_the_parsers_own_bounds_leave_room_for_any_head_within_ours() -> None:
    defaults = HeadLimits()
    # The largest head the scanner passes, in HTTP/1.1 bytes.
    largest = defaults.max_request_line_bytes + defaults.max_header_bytes + 2 * (
        defaults.max_headers + 2
    )
    assert h11_incomplete_size(defaults) >= largest
    # ... and in HPACK's accounting: each field's name and value, plus 32.
    hpack = defaults.max_header_bytes + defaults.max_request_line_bytes + 32 * (
        defaults.max_headers + 5
    )
    assert h2_header_list_size(defaults) >= hpack
    assert h2_header_list_size(defaults) < 2**16  # below hypercorn's default


def test_a_head_seen_from_its_middle_is_bounded_by_its_size() -> None:
    bound = max_head_bytes(LIMITS)
    assert bound == 100 + 200 + 2 * 7
    head = UnalignedHead(LIMITS)
    assert head.add(bound) is None
    refusal = head.add(1)
    assert refusal is not None
    assert refusal.status == 431
