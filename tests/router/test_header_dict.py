"""header_dict: a request's headers by lower-cased name, with the decoded names kept for the
next request in a table clients cannot grow."""

from __future__ import annotations

import pytest

from firstbyte.router import asgi


def test_header_names_kept_for_reuse_stay_bounded_whatever_clients_send(
    monkeypatch: pytest.MonkeyPatch,
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
