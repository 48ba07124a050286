"""header_dict: a request's headers by lower-cased name, with the decoded names kept for the
next request in a table clients cannot grow; the compiled decode_headers gives what the
Python loop gives, or leaves the headers to it."""

from __future__ import annotations

import pytest

from firstbyte.router import asgi, chunkpath


@pytest.fixture(params=["compiled", "python"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The headers decoded by the compiled decode_headers where it takes them, then by the
    Python loop alone."""
    if request.param == "python":
        monkeypatch.setattr(asgi, "_DECODE_HEADERS", None)
    else:
        assert chunkpath.DECODE_HEADERS is not None, "firstbyte.router._chunkpath not built"
        assert asgi._DECODE_HEADERS is chunkpath.DECODE_HEADERS
    return str(request.param)


def test_header_names_kept_for_reuse_stay_bounded_whatever_clients_send(
    monkeypatch: pytest.MonkeyPatch, decode_path: str
) -> None:
    """``header_dict`` keeps decoded names for the next request, never values, at most
    ``_MAX_NAMES`` of them and none longer than ``_MAX_NAME_BYTES``: made-up names from a
    client cannot grow the table, and every request still reads its own headers right."""
    monkeypatch.setattr(asgi, "_NAMES", {})
    monkeypatch.setattr(asgi, "_MAX_NAMES", 4)
    long_name = b"X-" + b"a" * asgi._MAX_NAME_BYTES
    headers = [(b"Authorization", b"Bearer sk-secret"), (long_name, b"1")]
    headers += [(f"X-Made-Up-{i}".encode(), str(i).encode()) for i in range(10)]
    found = asgi.header_dict({"headers": headers})
    assert found["authorization"] == "Bearer sk-secret"
    assert found[long_name.decode().lower()] == "1"
    assert found["x-made-up-9"] == "9"
    assert len(asgi._NAMES) == 4
    assert long_name not in asgi._NAMES
    assert all("sk-secret" not in v for v in asgi._NAMES.values())


SHAPES: dict[str, object] = {
    "plain": [(b"host", b"x"), (b"content-type", b"application/json")],
    "repeated": [(b"x-a", b"1"), (b"host", b"x"), (b"x-a", b"2")],
    "empty": [],
    "latin-1": [(b"x-a", b"caf\xe9 \xff\x00")],
    "tuple": ((b"host", b"x"), (b"x-a", b"1")),
    "list-pairs": [[b"host", b"x"], [b"x-a", b"1"]],
    "new-name": [(b"host", b"x"), (b"X-Never-Seen-Before", b"1")],
    "bytearray-value": [(b"host", bytearray(b"x"))],
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_compiled_decode_gives_the_loops_dict(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = chunkpath.DECODE_HEADERS
    assert decode is not None, "firstbyte.router._chunkpath was not built"
    headers = SHAPES[shape]
    monkeypatch.setattr(asgi, "_NAMES", {})
    asgi.header_dict({"headers": [(b"host", b"x"), (b"x-a", b"1"), (b"content-type", b"")]})
    compiled = decode(headers, asgi._NAMES)  # before the loop learns a new name
    monkeypatch.setattr(asgi, "_DECODE_HEADERS", None)
    python = asgi.header_dict({"headers": headers})
    if shape in ("list-pairs", "new-name", "bytearray-value"):
        assert compiled is None  # left to the loop
        monkeypatch.setattr(asgi, "_DECODE_HEADERS", decode)
        assert asgi.header_dict({"headers": headers}) == python
    else:
        assert compiled is not None
        assert list(compiled.items()) == list(python.items())


def test_headers_that_are_no_list_or_tuple_are_the_loops(decode_path: str) -> None:
    found = asgi.header_dict({"headers": iter([(b"host", b"x"), (b"x-a", b"1")])})
    assert found == {"host": "x", "x-a": "1"}
    with pytest.raises(AttributeError):
        asgi.header_dict({"headers": [("host", "x")]})


def test_the_compiled_decode_holds_what_it_reads_while_a_lookup_runs_python() -> None:
    """A lookup running Python that empties the list being read: the pair read is held, the
    list read again (as a list's iterator does)."""
    decode = chunkpath.DECODE_HEADERS
    assert decode is not None, "firstbyte.router._chunkpath was not built"
    headers: list[object] = []

    class Emptying(bytes):
        def __eq__(self, other: object) -> bool:
            headers.clear()
            return bytes.__eq__(self, other)  # type: ignore[operator]

        __hash__ = bytes.__hash__

    headers.extend([(b"x-a", b"1" * 100), (b"x-b", b"2")])
    assert decode(headers, {Emptying(b"x-a"): "x-a", b"x-b": "x-b"}) == {"x-a": "1" * 100}
