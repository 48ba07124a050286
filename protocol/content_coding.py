"""Request-body compression: which codings a router takes, how a body is packed and unpacked.

A long conversation's request body (an 8K-token history is 32-40 KB of JSON) is more than
TCP's initial window (10 segments, ~14.5 KB), so its upload costs one more round trip than a
short prompt's; gzip (~3x on English JSON) brings it back under the window. A router takes
``Content-Encoding: gzip`` or ``deflate`` on every inference endpoint and on
``POST /v1/edge/warm``, and says so with ``Accept-Encoding: gzip, deflate`` on its warm-up
answers (RFC 7694 section 3); a client compresses only bodies over
:data:`COMPRESS_MIN_BYTES` and only for a server that said so.

Sans-IO: :func:`requested_coding` judges a request's head, :func:`inflate` unpacks a body
within a bound (a decompression bomb costs at most the bound), :func:`gzip_body` packs one.
"""

from __future__ import annotations

import enum
import gzip
import zlib

__all__ = [
    "ACCEPT_ENCODING",
    "ACCEPT_ENCODING_HEADER",
    "COMPRESS_MIN_BYTES",
    "CONTENT_ENCODING_HEADER",
    "QUERY_PARAM",
    "Coding",
    "CorruptBody",
    "InflatedTooLarge",
    "UnsupportedCoding",
    "advertises_gzip",
    "gzip_body",
    "inflate",
    "requested_coding",
]

ACCEPT_ENCODING_HEADER = "accept-encoding"
CONTENT_ENCODING_HEADER = "content-encoding"
ACCEPT_ENCODING = "gzip, deflate"
"""What a router answers in ``Accept-Encoding``: the request codings it takes."""
QUERY_PARAM = "encoding"
"""The CORS simple start's stand-in for ``Content-Encoding`` (not a safelisted request
header, so a ``text/plain`` start cannot send it): ``?encoding=gzip``."""
COMPRESS_MIN_BYTES = 10 * 1024
"""Clients compress only bodies over this: a smaller one already fits in the first flight."""


class Coding(enum.Enum):
    IDENTITY = "identity"
    GZIP = "gzip"
    DEFLATE = "deflate"


_NAMES = {"identity": Coding.IDENTITY, "": Coding.IDENTITY, "gzip": Coding.GZIP,
          "x-gzip": Coding.GZIP, "deflate": Coding.DEFLATE}


class UnsupportedCoding(ValueError):
    """A coding the router does not take (``br``, ``zstd``) or more than one stacked."""


class CorruptBody(ValueError):
    """The body is not valid data of its coding (corrupt, truncated, trailing bytes)."""


class InflatedTooLarge(ValueError):
    """Unpacked, the body is larger than the bound."""


def requested_coding(header: str | None, query: str | None = None) -> Coding:
    """The coding of a request's body from its ``Content-Encoding`` header, else (the simple
    start) its ``?encoding=``; :class:`UnsupportedCoding` for anything but one of gzip,
    deflate or identity (``identity`` may be listed around the one real coding)."""
    value = header if header is not None else query
    if value is None:
        return Coding.IDENTITY
    real: list[Coding] = []
    for name in value.split(","):
        coding = _NAMES.get(name.strip().lower())
        if coding is None:
            raise UnsupportedCoding(value)
        if coding is not Coding.IDENTITY:
            real.append(coding)
    if len(real) > 1:
        raise UnsupportedCoding(value)  # stacked: no client of ours sends it
    return real[0] if real else Coding.IDENTITY


def _zlib_wrapped(data: bytes) -> bool:
    """RFC 1950's two-byte header (method 8, check bits): ``deflate`` as RFC 9110 defines it,
    as browsers send it; without it the data is taken as raw RFC 1951 deflate."""
    return (len(data) >= 2 and data[0] & 0x0F == 8 and data[0] >> 4 <= 7
            and (data[0] << 8 | data[1]) % 31 == 0)


def inflate(body: bytes, coding: Coding, max_bytes: int) -> bytes:
    """``body`` unpacked. Incremental, never holding more than ``max_bytes + 1`` bytes of
    output: :class:`InflatedTooLarge` past ``max_bytes``, :class:`CorruptBody` for data that
    is not ``coding``'s (concatenated gzip members are one body, as RFC 1952 allows)."""
    if coding is Coding.IDENTITY:
        return body
    # gzip (31), else zlib-wrapped deflate (15) or raw deflate (-15), as the data says.
    wbits = 31 if coding is Coding.GZIP else 15 if _zlib_wrapped(body) else -15
    out = bytearray()
    data = body
    inflater = zlib.decompressobj(wbits)
    try:
        while True:
            out += inflater.decompress(data, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise InflatedTooLarge(max_bytes)
            data = inflater.unconsumed_tail
            if inflater.eof:
                data = inflater.unused_data
                if not data:
                    return bytes(out)
                if coding is not Coding.GZIP:
                    raise CorruptBody("bytes after the end of the deflate stream")
                inflater = zlib.decompressobj(wbits)  # the next gzip member
            elif not data:
                raise CorruptBody("the data ends before its end of stream")
    except zlib.error as exc:
        raise CorruptBody(str(exc)) from None


def gzip_body(body: bytes) -> bytes:
    """``body`` gzipped at the library's default level (no name, no time: the same body packs
    to the same bytes)."""
    return gzip.compress(body, mtime=0)


def advertises_gzip(accept_encoding: str | None) -> bool:
    """Does an ``Accept-Encoding`` response header say the server takes gzip request bodies
    (``gzip`` listed, and not with ``q=0``)."""
    if not accept_encoding:
        return False
    for item in accept_encoding.split(","):
        name, _, params = item.partition(";")
        if name.strip().lower() in ("gzip", "x-gzip"):
            q = params.strip().lower().replace(" ", "")
            return not (q.startswith("q=") and q[2:].rstrip("0.") == "")
    return False
