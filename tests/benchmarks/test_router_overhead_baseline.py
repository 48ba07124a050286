"""``bench router_overhead --baseline REV``: another revision's router, run beside today's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx

from firstbyte.benchmarks.scenarios import _baseline_router
from firstbyte.benchmarks.scenarios import router_overhead as ro
from tests.cli import firstbyte


def test_an_unknown_revision_is_one_line_before_anything_runs() -> None:
    done = firstbyte("bench", "router_overhead", "--quick", "--baseline", "no-such-rev",
                     timeout=30)
    assert done.returncode == 2
    assert "argument --baseline: no commit 'no-such-rev'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_revision_is_resolved_to_its_commit() -> None:
    root = _baseline_router.repository()
    assert root is not None  # the tests run from a checkout (CI clones the repository)
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert _baseline_router.revision("HEAD") == head
    assert _baseline_router.describe(head).startswith(head[:7])


def test_a_revisions_router_serves_a_stream_from_its_own_sources() -> None:
    """The sources are that revision's (laid out as the checkout), and config keys the
    revision does not know are dropped, not fatal."""
    commit = _baseline_router.revision("HEAD")
    with ro._server(ro._SIM, ro.PROFILE, "16", "60") as sim:
        config = ro._router_config(sim.url, "uvicorn")
        config["limits"]["no_such_limit"] = 1  # what a newer benchmark may ask of old code
        with _baseline_router.checked_out(commit) as sources:
            serve = sources / "firstbyte" / "router" / "serve.py"
            assert serve.is_file()
            marker = sources / "imported"
            with serve.open("a") as module:  # leaves a mark when this copy is imported
                module.write(f"\nopen({str(marker)!r}, 'w').close()\n")
            with ro._server(_baseline_router.SNIPPET, str(sources), json.dumps(config)) as child:
                timings = asyncio.run(_one_stream(child.url))
                line = _access_line(child)
            assert marker.exists()
        assert not sources.exists()  # removed on exit
    assert timings.output_chunks == 6
    assert (line["path"], line["status"], line["output_tokens"]) == ("/v1/chat/completions", 200, 6)


def test_a_revisions_router_runs_its_own_compiled_path() -> None:
    """Built as `pip install` builds today's: a baseline without it would run its Python
    path alone, and the ratio would compare that as well as the revisions."""
    commit = _baseline_router.revision("HEAD")
    with _baseline_router.checked_out(commit) as sources:
        assert list((sources / "router").glob("_chunkpath*.so"))
        shown = subprocess.run(
            [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
             "from firstbyte.router import chunkpath; "
             "print(chunkpath.BUILT, chunkpath.READ_PATH is not None, chunkpath.__file__)",
             str(sources)],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.split()
    assert shown[:2] == ["True", "True"]
    assert shown[2].startswith(str(sources))


def test_todays_router_writes_its_access_lines_as_firstbyte_router_does() -> None:
    """The CPU the run measures includes the access line a deployed router writes."""
    with ro._server(ro._SIM, ro.PROFILE, "16", "60") as sim:
        config = ro._router_config(sim.url, "auto")
        with ro._server(ro._ROUTER, json.dumps(config)) as child:
            timings = asyncio.run(_one_stream(child.url))
            line = _access_line(child)
    assert timings.output_chunks == 6
    assert (line["path"], line["transport"], line["output_tokens"]) == (
        "/v1/chat/completions", "sse", 6
    )


def _access_line(child: ro._Child) -> dict[str, object]:
    """The first access line in ``child``'s log (written as its request ends)."""
    assert child.log is not None
    deadline = time.monotonic() + 10
    while True:
        for text in child.log.read_text().splitlines():
            if text.startswith("{") and '"logger":"firstbyte.access"' in text:
                line: dict[str, object] = json.loads(text)
                return line
        assert time.monotonic() < deadline, child.log.read_text()[-2000:]
        time.sleep(0.05)


async def _one_stream(url: str) -> ro.Timings:
    async with httpx.AsyncClient(timeout=30) as client:
        return await ro._one(client, url, 6, 1)

