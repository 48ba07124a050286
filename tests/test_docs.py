"""The docs stay honest: a short README, the Quickstart CI runs, links that resolve, and only
``firstbyte`` subcommands (and bench scenarios) that exist."""

from __future__ import annotations

import fnmatch
import importlib
import re
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_COMMAND = re.compile(r"\bfirstbyte ([a-z][a-z0-9_-]*)(?: ([A-Za-z][A-Za-z0-9_-]*))?")
_WHEEL = re.compile(r"firstbyte-[^\s\"'/()\[\]]*\.whl")


def _without_code_blocks(text: str) -> str:
    return _FENCE.sub("", text)


def _code(text: str) -> list[str]:
    """Every fenced block and inline code span: where commands are written."""
    blocks = _FENCE.findall(text)
    return blocks + _INLINE_CODE.findall(_without_code_blocks(text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in _HEADING.findall(_without_code_blocks(page.read_text()))}


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _ci_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.strip() for line in lines if line.strip().startswith("pip install")]
    assert len(commands) == 1, f".ci/run: expected one install-and-test line, got {commands}"
    return commands[0]


def _subcommands() -> set[str]:
    """The CLI's subcommand table, found through the console script pyproject.toml declares."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    module_name = pyproject["project"]["scripts"]["firstbyte"].partition(":")[0]
    table = getattr(importlib.import_module(module_name), "SUBCOMMANDS", None)
    assert table, f"{module_name} has no SUBCOMMANDS table: update this test"
    return set(table)


def _scenarios() -> set[str]:
    found = (ROOT / "benchmarks" / "scenarios").glob("[!_]*.py")
    from firstbyte.benchmarks.cli import _RESERVED  # all, compare, screenshot: not scenarios

    return {path.stem for path in found} | _RESERVED


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_quickstart_is_the_demo_and_what_ci_runs() -> None:
    quickstart = _section(README.read_text(), "Quickstart")
    commands = [
        line.strip()
        for block in _FENCE.findall(quickstart)
        for line in block.splitlines()
        if line.strip()
    ]
    assert commands == ["pip install -e '.[all]' && firstbyte demo", _ci_command()]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_without_code_blocks(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_commands_exist(page: Path) -> None:
    subcommands, scenarios = _subcommands(), _scenarios()
    unknown = set()
    for code in _code(page.read_text()):
        for command, argument in _COMMAND.findall(code):
            if command not in subcommands:
                unknown.add(f"firstbyte {command}")
            elif command == "bench" and argument.islower() and argument not in scenarios:
                unknown.add(f"firstbyte bench {argument}")
    assert not unknown, f"{page.relative_to(ROOT)} names commands the CLI lacks: {sorted(unknown)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_wheels_are_what_pip_wheel_builds_here(page: Path) -> None:
    """The wheel holds a compiled module (setup.py), so pip names it for the Python and
    platform that built it: a command naming ``py3-none-any`` installs a file that is not
    there. A glob a page names matches this machine's wheel; a name written out carries a
    CPython tag (an example of one machine's)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    python = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = re.sub(r"[-.]", "_", sysconfig.get_platform())
    built = f"firstbyte-{version}-{python}-{python}-{platform}.whl"
    wrong = {
        name
        for code in _code(page.read_text())
        for name in _WHEEL.findall(code)
        if not (fnmatch.fnmatchcase(built, name) if "*" in name else
                re.fullmatch(rf"firstbyte-{re.escape(version)}-(cp3\d+)-\1-\w+\.whl", name))
    }  # fmt: skip
    assert not wrong, f"{page.relative_to(ROOT)} names wheels pip does not build: {sorted(wrong)}"
