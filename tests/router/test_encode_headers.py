"""A response's headers in bytes (``asgi._encode_headers``): each name and value encoded as
Latin-1, after the headers given encoded; the names kept for the next response stay within
``_MAX_NAMES`` of at most ``_MAX_NAME_BYTES``, so made-up names cannot grow the table."""

from __future__ import annotations

import pytest

from firstbyte.router import asgi


def test_headers_are_encoded_and_the_names_kept_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(asgi, "_ENCODED_NAMES", {})
    monkeypatch.setattr(asgi, "_MAX_NAMES", 4)
    long_name = "x-" + "a" * (asgi._MAX_NAME_BYTES + 1)
    headers = [(f"x-made-up-{i}", f"v{i}") for i in range(6)] + [
        (long_name, "caf\xe9"), ("x-made-up-0", "again"),
    ]
    for _ in range(2):  # names new, then known
        out = asgi._encode_headers(headers, ((b"content-type", b"text/plain"),))
        assert out == [(b"content-type", b"text/plain")] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers
        ]
    assert len(asgi._ENCODED_NAMES) == 4
    assert long_name not in asgi._ENCODED_NAMES


def test_a_header_that_is_not_latin_1_fails_as_before() -> None:
    with pytest.raises(UnicodeEncodeError):
        asgi._encode_headers([("x-a", "\u20ac")])
    with pytest.raises(UnicodeEncodeError):
        asgi._encode_headers([("x-\u20ac", "v")])
    with pytest.raises(AttributeError):
        asgi._encode_headers([([], "v")])  # type: ignore[list-item]
