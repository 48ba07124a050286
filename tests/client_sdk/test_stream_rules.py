"""One table of stream rules (tests/client_sdk/stream_rules.py), two clients: the Python SDK's
sans-IO cores here, the browser client's stream.js in headless Chromium."""

from __future__ import annotations

from typing import Any

import pytest

from tests.benchmarks.test_report_browser import chromium  # noqa: F401 (the fixture)
from tests.client_sdk.browser_stack import browser_on, world
from tests.client_sdk.stream_rules import (
    CASES,
    JS_RUNNER,
    expected,
    run_assembler,
    run_poll,
    run_resume,
    run_retry_after,
)

RUNNERS = {"assembler": run_assembler, "poll": run_poll, "resume": run_resume,
           "retry_after": run_retry_after}
ALL = [(kind, case) for kind, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("kind", "case"), ALL, ids=[f"{k}: {c['name']}" for k, c in ALL])
def test_python_sdk_follows_the_rule(kind: str, case: dict[str, Any]) -> None:
    assert RUNNERS[kind](case) == expected(kind, case)


@pytest.mark.usefixtures("chromium")
async def test_browser_client_follows_every_rule() -> None:
    import json

    async with world() as w, browser_on(w) as page:
        got = await page.evaluate(f"{JS_RUNNER}({json.dumps(CASES)})")
    for kind, cases in CASES.items():
        for case, answer in zip(cases, got[kind], strict=True):
            assert answer == expected(kind, case), f"{kind}: {case['name']}"
