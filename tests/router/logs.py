"""What a router in the test's process logged, read from pytest's ``caplog``: its access
records (the ``fields`` of each ``firstbyte.access`` line) and its upstreams' state lines."""

from __future__ import annotations

from typing import Any

import pytest

CHAT_PATH = "/v1/chat/completions"


def access_records(caplog: pytest.LogCaptureFixture, path: str | None = None) -> list[dict[str, Any]]:
    """Each access line's fields, in order; only requests to ``path`` when it is given."""
    records = [getattr(r, "fields", {}) for r in caplog.records if r.name == "firstbyte.access"]
    return [r for r in records if path is None or r.get("path") == path]


def upstream_state_lines(caplog: pytest.LogCaptureFixture, name: str) -> list[str]:
    """The router's lines about upstream ``name``'s state (down, back, ...), in order."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "firstbyte.router" and r.getMessage().startswith(f"upstream {name} ")
    ]
