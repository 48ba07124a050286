"""Request-body codings, sans-IO: which heads name which coding, and inflating within a bound."""

from __future__ import annotations

import gzip
import zlib

import pytest

from firstbyte.protocol.content_coding import (
    Coding,
    CorruptBody,
    InflatedTooLarge,
    UnsupportedCoding,
    advertises_gzip,
    gzip_body,
    inflate,
    requested_coding,
)

BODY = b'{"messages": [' + b'{"role": "user", "content": "the same words again"},' * 500 + b"]}"


@pytest.mark.parametrize(("header", "query", "coding"), [
    (None, None, Coding.IDENTITY),
    ("identity", None, Coding.IDENTITY),
    ("GZIP", None, Coding.GZIP),
    ("x-gzip", None, Coding.GZIP),
    (" deflate ", None, Coding.DEFLATE),
    ("identity, gzip", None, Coding.GZIP),
    (None, "gzip", Coding.GZIP),
    ("identity", "gzip", Coding.IDENTITY),  # the header wins over the URL
])
def test_the_coding_a_head_names(header: str | None, query: str | None, coding: Coding) -> None:
    assert requested_coding(header, query) is coding


@pytest.mark.parametrize("header", ["br", "zstd", "gzip, gzip", "gzip, deflate", "gzip;q=1"])
def test_unsupported_or_stacked_codings(header: str) -> None:
    with pytest.raises(UnsupportedCoding):
        requested_coding(header)


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-15)
    return packer.compress(data) + packer.flush()


@pytest.mark.parametrize(("packed", "coding"), [
    (gzip_body(BODY), Coding.GZIP),
    (gzip.compress(BODY[:100]) + gzip.compress(BODY[100:]), Coding.GZIP),  # two members
    (zlib.compress(BODY), Coding.DEFLATE),
    (_raw_deflate(BODY), Coding.DEFLATE),
    (BODY, Coding.IDENTITY),
])
def test_inflate_gives_the_body_back(packed: bytes, coding: Coding) -> None:
    assert inflate(packed, coding, len(BODY)) == BODY


def test_inflate_stops_one_byte_past_the_bound() -> None:
    with pytest.raises(InflatedTooLarge):
        inflate(gzip_body(BODY), Coding.GZIP, len(BODY) - 1)
    with pytest.raises(InflatedTooLarge):  # a bomb: 64 MiB of zeros, never held whole
        inflate(gzip.compress(bytes(64 << 20)), Coding.GZIP, 1 << 20)


@pytest.mark.parametrize(("packed", "coding"), [
    (gzip_body(BODY)[:-9], Coding.GZIP),  # truncated
    (gzip_body(BODY) + b"junk", Coding.GZIP),  # not a second member
    (zlib.compress(BODY) + b"junk", Coding.DEFLATE),
    (BODY, Coding.GZIP),
    (b"", Coding.GZIP),
    (b"\x1f\x8b" + b"\xff" * 30, Coding.GZIP),
])
def test_corrupt_data_is_refused(packed: bytes, coding: Coding) -> None:
    with pytest.raises(CorruptBody):
        inflate(packed, coding, 1 << 20)


def test_gzip_body_is_deterministic_and_small() -> None:
    assert gzip_body(BODY) == gzip_body(BODY)
    assert len(gzip_body(BODY)) < len(BODY) // 3


@pytest.mark.parametrize(("header", "gzip_taken"), [
    ("gzip, deflate", True),
    ("deflate, GZIP", True),
    ("gzip;q=0.5", True),
    ("gzip; q=0", False),
    ("gzip;q=0.000", False),
    ("deflate", False),
    ("", False),
    (None, False),
])
def test_advertises_gzip(header: str | None, gzip_taken: bool) -> None:
    assert advertises_gzip(header) is gzip_taken
