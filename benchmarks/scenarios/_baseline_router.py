"""The router as it was at another git revision, for ``bench router_overhead --baseline REV``.

A claim like "the router's CPU per chunk fell by half" holds only side by side: the same
machine varies by a third from one hour to the next (nginx's CPU per chunk moved 16-26 µs
between two quiet runs here). With ``--baseline REV`` the benchmark extracts that revision's
sources (``git archive``, into a temporary directory), runs its router next to today's in the
same alternating phases, and reports the ratio.

The revision's router is started by :data:`SNIPPET` with the old sources first on
``sys.path``, its compiled per-chunk path built as ``pip install`` builds today's
(:func:`build_compiled`). Its configuration is the one today's benchmark gives its
routers, as a dict: keys the old config does not know yet are dropped one by one (with a
note of which), so any revision with ``firstbyte.router.serve.running_router`` can be
measured.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

import firstbyte

__all__ = ["SNIPPET", "build_compiled", "checked_out", "describe", "repository", "revision"]

SNIPPET = r"""
import asyncio, inspect, json, re, sys
sys.path.insert(0, sys.argv[1])  # the revision's sources before the installed ones
import msgspec
from firstbyte.router.config import RouterConfig
from firstbyte.router.serve import running_router
# SOURCES CONFIG_JSON: CONFIG_JSON is what today's benchmark gives its routers
wanted = json.loads(sys.argv[2])
def build(data):
    while True:
        try:
            return msgspec.convert(data, RouterConfig)
        except msgspec.ValidationError as exc:  # "unknown field `x` - at `$.limits`"
            text = str(exc)
            if "unknown field" not in text:
                raise
            field = text.split("`")[1]
            section = data
            for name, index in re.findall(r"\.(\w+)(?:\[(\d+)\])?", text.partition("$")[2]):
                section = section[name] if not index else section[name][int(index)]
            del section[field]
            print(f"baseline: {field} not in this revision's config", file=sys.stderr)
try:  # logs as today's routers in the run have them (_ROUTER): an access line a request
    from firstbyte.router.observability.logs import configure
    configure("info", "json", sys.stderr)
except (ImportError, TypeError):
    pass  # a revision before them
async def main():
    config = build(wanted)
    options = {"tune_gc": True} if "tune_gc" in inspect.signature(running_router).parameters else {}
    async with running_router(config, **options) as ep:
        print(ep.base_url, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
try:
    from firstbyte.router.hosting import loop_factory
    factory = loop_factory()
except ImportError:
    factory = None
with asyncio.Runner(loop_factory=factory) as runner:
    runner.run(main())
"""


def repository() -> Path | None:
    """The git checkout this installed ``firstbyte`` runs from (an editable install), or
    None (a wheel: there is no history to take a revision from)."""
    root = Path(firstbyte.__file__).resolve().parent.parent
    found = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--show-toplevel"],
        capture_output=True, text=True, check=False,
    )
    return Path(found.stdout.strip()) if found.returncode == 0 else None


def revision(text: str) -> str:
    """``--baseline``'s value as a full commit hash; an argparse error (one line) if this is
    not a git checkout or the revision is not in it."""
    root = repository()
    if root is None:
        raise argparse.ArgumentTypeError(
            "needs firstbyte installed from a git checkout (pip install -e .)"
        )
    found = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{text}^{{commit}}"],
        capture_output=True, text=True, check=False,
    )
    if found.returncode != 0:
        raise argparse.ArgumentTypeError(f"no commit {text!r} in {root}")
    return found.stdout.strip()


def describe(commit: str) -> str:
    """``HASH subject`` of a commit, for the report."""
    root = repository()
    assert root is not None
    shown = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%h %s", commit],
        capture_output=True, text=True, check=True,
    )
    return shown.stdout.strip()


@contextlib.contextmanager
def checked_out(commit: str) -> Iterator[Path]:
    """The sources of ``commit`` in a temporary directory (removed on exit), laid out as the
    checkout is: ``firstbyte/`` with its links to ``router/``, ``protocol/``, ..."""
    root = repository()
    assert root is not None
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", commit],
        capture_output=True, check=True,
    )
    with tempfile.TemporaryDirectory(prefix="firstbyte-baseline-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            if hasattr(tarfile, "tar_filter"):  # Python 3.11.4 and later
                tar.extractall(tmp, filter="tar")
            else:
                tar.extractall(tmp)  # our own repository's archive: nothing to filter
        build_compiled(Path(tmp))
        yield Path(tmp)


_BUILD = """
from setuptools import Distribution, Extension
from setuptools.command.build_ext import build_ext
# Not `setup.py build_ext`: that reads pyproject.toml, whose fields the machine's own
# setuptools may be too old for (pip builds with its own, newer, in isolation).
ext = Extension("firstbyte.router._chunkpath", sources=["firstbyte/router/_chunkpath.c"])
command = build_ext(Distribution({"ext_modules": [ext], "script_name": "setup.py"}))
command.inplace = True
command.ensure_finalized()
command.run()
"""


def build_compiled(sources: Path) -> None:
    """Build the revision's compiled per-chunk path in place, as ``pip install`` builds
    today's, when the revision has one (``router/_chunkpath.c``): without it the revision's
    router would run its Python path alone, and the ratio would compare more than the
    revisions. A :class:`~firstbyte.cli.CLIError` (one line) if it does not build."""
    from firstbyte.cli import CLIError

    if not (sources / "firstbyte" / "router" / "_chunkpath.c").exists():
        return  # a revision before the compiled path
    built = subprocess.run(
        [sys.executable, "-c", _BUILD], cwd=sources, capture_output=True, text=True,
        check=False,
    )
    if built.returncode != 0:
        last = (built.stderr.strip().splitlines() or ["no output"])[-1]
        raise CLIError(f"--baseline: the revision's compiled path did not build: {last}")
