"""One import name: nothing in the repository reaches the code by the bare folder names.

The folders ``client_sdk/``, ``router/`` and ``benchmarks/`` are importable from a checkout's
root, so ``import router`` would work here and fail (or load someone else's ``router``) once
installed. This scans every Python file's imports and every string that is code or a module
path (``-m ...``, ``-c "from ..."``, ``"pkg.mod:attr"``), plus pyproject.toml, the CI script
and docs/. (ruff's banned-api rule cannot do it: it reads relative imports inside ``router/``
as ``router.*``.)
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BARE = ("client_sdk", "router", "benchmarks")
SKIPPED_DIRS = {"build", "dist", "firstbyte-report", "reports", "bench-results"}
"""Generated folders; hidden ones (.git, .venv, caches) are skipped too."""

_NAME = "|".join(BARE)
_CODE = [
    re.compile(rf"-m\s+(?:{_NAME})\b"),
    re.compile(rf"(?:^|[\s;:(])from\s+(?:{_NAME})(?:\.[\w.]+)?\s+import\b", re.MULTILINE),
    re.compile(rf"(?:^|[\s;:(])import\s+(?:{_NAME})\b(?!\s*[`'\"])", re.MULTILINE),
]
"""A bare name used as a module in code text: ``-m router``, ``from router.x import``,
``import router``."""
_MODULE_PATH = re.compile(rf"^(?:{_NAME})(?:\.\w+)*(?::\w+)?$")
"""A whole string that may be a module path: ``router.sim.server:granian_app``."""
_QUOTED = re.compile(r"(?<=[\"'`])[\w.:]+(?=[\"'`])")


def _sources(*suffixes: str) -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*")):
        parts = path.relative_to(ROOT).parts
        if any(p.startswith(".") or p in SKIPPED_DIRS for p in parts[:-1]):
            continue
        # firstbyte/client_sdk etc. are symlinks to the folders: scan each file once.
        if parts[0] == "firstbyte" and len(parts) > 2:
            continue
        if path.suffix in suffixes and path.is_file():
            yield path


def _is_module(dotted: str) -> bool:
    """Whether ``pkg.mod[:attr]`` is a module path: it has an attribute, or names a module in
    this repository (so ``router.toml``, a file name, is not one)."""
    module, colon, _ = dotted.partition(":")
    if colon:
        return True  # an entry point or an app factory: "pkg.mod:attr"
    if "." not in module:
        return False  # a lone word: a subcommand, a region or a host name
    base = ROOT.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _text_violations(text: str) -> list[str]:
    found = [m.group(0).strip() for pattern in _CODE for m in pattern.finditer(text)]
    if _MODULE_PATH.match(text) and _is_module(text):
        found.append(text)
    return found


def bare_name_uses(path: Path) -> list[str]:
    """``line: what`` for each use of a bare name in ``path``."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":  # TOML, shell, Markdown: each line, and each quoted string in it
        return [
            f"{n}: {hit}" for n, line in enumerate(text.splitlines(), 1)
            for piece in (line, *_QUOTED.findall(line)) for hit in _text_violations(piece)
        ]  # fmt: skip
    found: list[str] = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if a.name.partition(".")[0] in BARE]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.partition(".")[0] in BARE:
                found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{node.lineno}: {hit!r}" for hit in _text_violations(node.value)]
        elif isinstance(node, ast.List | ast.Tuple | ast.Call):
            found += [f"{arg.lineno}: -m {arg.value}" for arg in _dash_m_arguments(node)
                      if arg.value.partition(".")[0] in BARE]
    return found


def _dash_m_arguments(node: ast.List | ast.Tuple | ast.Call) -> Iterator[ast.Constant]:
    """The string after each ``"-m"`` in an argv list or call: ``[python, "-m", "router"]``."""
    items = node.args if isinstance(node, ast.Call) else node.elts
    for flag, arg in itertools.pairwise(items):
        if (isinstance(flag, ast.Constant) and flag.value == "-m"
                and isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            yield arg


def test_the_scan_sees_the_code() -> None:
    scanned = {p.relative_to(ROOT).as_posix() for p in _sources(".py")}
    assert {"client_sdk/client.py", "router/cli.py", "benchmarks/cli.py", "firstbyte/cli.py",
            "tests/cli.py"} <= scanned
    assert not any(p.startswith("firstbyte/router/") for p in scanned)


PLANTED = [
    "import router\n",
    "import client_sdk.types as t\n",
    "from benchmarks.wan import Emulator\n",
    "ARGV = ['python', '-m', 'client_sdk', 'probe']\n",
    "ARGV = ['python', '-m', 'benchmarks.scenarios.sim_cpu']\n",
    "CODE = 'import sys; from router.cli import main; sys.exit(main())'\n",
    "CODE = '''\nimport asyncio\nfrom client_sdk import AsyncClient\n'''\n",
    "TARGET = 'router.sim.server:granian_app'\n",
    "import importlib\nimportlib.import_module('router.cli')\n",
]
FINE = [
    "from firstbyte.router.cli import main\n",
    "ARGV = ['python', '-m', 'firstbyte.benchmarks.scenarios.sim_cpu']\n",
    "TARGET = 'firstbyte.router.sim.server:granian_app'\n",
    "CONFIG = 'router.toml'\n",
    "ARGV = ['firstbyte', 'router', '--config', 'router.toml']\n",
    '"""The router and the sim import ``client_sdk.types`` only."""\n',
]


@pytest.mark.parametrize(
    ("source", "caught"), [*((s, True) for s in PLANTED), *((s, False) for s in FINE)]
)
def test_the_scan_tells_bare_names_from_new_names_and_prose(
    tmp_path: Path, source: str, caught: bool
) -> None:
    path = tmp_path / "example.py"
    path.write_text(source)
    assert bool(bare_name_uses(path)) is caught


def test_nothing_uses_the_bare_names() -> None:
    files = [*_sources(".py", ".toml"), ROOT / ".ci" / "run", ROOT / "README.md"]
    files += (ROOT / "docs").rglob("*.md")
    found = {
        path.relative_to(ROOT).as_posix(): uses
        for path in files
        if path != Path(__file__).resolve()  # its planted examples are the point
        and (uses := bare_name_uses(path))
    }
    assert found == {}
