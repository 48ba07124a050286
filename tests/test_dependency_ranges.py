"""Every dependency range in pyproject.toml stops at what the suite ran on, and the lowest
versions .ci/run tests are the floors the ranges declare (docs/libraries.md)."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOWEST = ROOT / ".ci" / "constraints-lowest.txt"


def _requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) of every declared dependency but the project's own extras."""
    found = [("build-system", Requirement(r)) for r in PYPROJECT["build-system"]["requires"]]
    project = PYPROJECT["project"]
    found += [("dependencies", Requirement(r)) for r in project["dependencies"]]
    for extra, listed in project["optional-dependencies"].items():
        found += [(extra, Requirement(r)) for r in listed]
    return [(where, r) for where, r in found if r.name != project["name"]]


def _floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==")]
    return max(floors) if floors else None


def test_every_range_has_a_floor_and_a_ceiling() -> None:
    # A range open at the top lets a fresh machine install a release nobody ran: a new ruff
    # or mypy adds checks, a new pytest or library breaks what the tests lean on.
    open_ended = [
        f"{where}: {requirement}"
        for where, requirement in _requirements()
        if _floor(requirement) is None
        or not any(s.operator in ("<", "<=", "==", "~=") for s in requirement.specifier)
    ]
    assert not open_ended, "ranges without a floor or a ceiling: " + "; ".join(open_ended)


def test_the_lowest_versions_tested_are_the_declared_floors() -> None:
    declared: dict[str, Version] = {}
    for _, requirement in _requirements():
        floor = _floor(requirement)
        if floor is not None:
            declared[requirement.name.lower()] = max(floor, declared.get(requirement.name.lower(),
                                                                         floor))
    pinned = {}
    for line in LOWEST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pinned[name.strip().lower()] = Version(version.strip())
    assert pinned, "the lowest-versions constraints pin nothing"
    wrong = {name: (str(version), str(declared.get(name))) for name, version in pinned.items()
             if declared.get(name) != version}
    assert not wrong, f"pinned for the lowest run vs declared floor: {wrong}"


def test_the_workers_run_each_group_together(request: pytest.FixtureRequest) -> None:
    # The suite runs one file to a worker (tests/conftest.py marks each test's group, and
    # pytest-xdist's loadgroup reads the group from a suffix it adds to the node id). pytest
    # 9.2 computes node ids from a field pytest-xdist 3.8 does not set: the suffix is lost,
    # every file spreads over the workers, and tests/benchmarks' quick runs start four times.
    groups = [mark.args[0] for mark in request.node.iter_markers("xdist_group")]
    assert groups == ["tests/test_dependency_ranges.py"]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert request.node.nodeid.endswith("@tests/test_dependency_ranges.py"), (
            f"pytest-xdist sees no group in {request.node.nodeid}")
