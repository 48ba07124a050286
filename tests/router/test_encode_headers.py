"""A response's headers in bytes (``asgi._encode_headers``): each name and value encoded as
Latin-1, after the headers given encoded; the names kept for the next response stay within
``_MAX_NAMES`` of at most ``_MAX_NAME_BYTES``, so made-up names cannot grow the table; the
compiled encode_headers gives what the Python loop gives, or leaves the headers to it."""

from __future__ import annotations

import pytest

from firstbyte.router import asgi, chunkpath


@pytest.fixture(params=["compiled", "python"])
def encode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The headers encoded by the compiled encode_headers where it takes them, then by the
    Python loop alone."""
    if request.param == "python":
        monkeypatch.setattr(asgi, "_ENCODE_HEADERS", None)
    else:
        assert chunkpath.ENCODE_HEADERS is not None, "firstbyte.router._chunkpath not built"
        assert asgi._ENCODE_HEADERS is chunkpath.ENCODE_HEADERS
    return str(request.param)


def test_headers_are_encoded_and_the_names_kept_stay_bounded(
    monkeypatch: pytest.MonkeyPatch, encode_path: str
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


def test_a_header_that_is_not_latin_1_fails_as_before(encode_path: str) -> None:
    asgi._encode_headers([("x-a", "v")])  # the name known: the value decides
    with pytest.raises(UnicodeEncodeError):
        asgi._encode_headers([("x-a", "\u20ac")])
    with pytest.raises(UnicodeEncodeError):
        asgi._encode_headers([("x-\u20ac", "v")])
    with pytest.raises(AttributeError):
        asgi._encode_headers([([], "v")])  # type: ignore[list-item]


class Name(str):
    pass


SHAPES: dict[str, object] = {
    "plain": [("x-a", "1"), ("server-timing", "queue;dur=0.01")],
    "empty": [],
    "latin-1": [("x-a", "caf\xe9 \xff\x00")],
    "tuple": (("x-a", "1"),),
    "list-pairs": [["x-a", "1"]],
    "new-name": [("x-a", "1"), ("x-never-seen-before", "1")],
    "str-subclass": [(Name("x-a"), "1")],
    "a-triple": [("x-a", "1", "2")],
    "many": [("x-a", "1")] * 70,
}


@pytest.mark.parametrize("encoded", [(), ((b"content-type", b"text/plain"),),
                                     [(b"content-type", b"text/plain")]])
@pytest.mark.parametrize("shape", SHAPES)
def test_the_compiled_encode_gives_the_loops_list(
    shape: str, encoded: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    encode = chunkpath.ENCODE_HEADERS
    assert encode is not None, "firstbyte.router._chunkpath was not built"
    headers = SHAPES[shape]
    monkeypatch.setattr(asgi, "_ENCODED_NAMES", {})
    asgi._encode_headers([("x-a", "1"), ("server-timing", "x")])  # names known
    compiled = encode(encoded, headers, asgi._ENCODED_NAMES)
    monkeypatch.setattr(asgi, "_ENCODE_HEADERS", None)
    try:
        python = asgi._encode_headers(headers, encoded)  # type: ignore[arg-type]
    except ValueError:  # the triple
        assert compiled is None
        return
    if shape in ("list-pairs", "new-name", "str-subclass"):
        assert compiled is None  # left to the loop
    else:
        assert compiled == python


def test_the_compiled_encode_holds_what_it_reads_while_a_lookup_runs_python() -> None:
    """A lookup running Python that empties the list being read: the pair read is held, the
    list read again (as a list's iterator does)."""
    encode = chunkpath.ENCODE_HEADERS
    assert encode is not None, "firstbyte.router._chunkpath was not built"
    headers: list[object] = []

    class Emptying(str):
        def __eq__(self, other: object) -> bool:
            headers.clear()
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    headers.extend([("x-a", "1" * 100), ("x-b", "2")])
    names = {Emptying("x-a"): b"x-a", "x-b": b"x-b"}
    assert encode((), headers, names) == [(b"x-a", b"1" * 100)]
