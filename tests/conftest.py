"""Shared test fixtures. Tests that need root or network namespaces are marked ``netns``:
outside CI they skip when the machine cannot run them; with ``CI=true`` they run and fail."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests import machine

_LOCKS_MADE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    # The controller (or the only process) makes the run's lock folder, before pytest-xdist
    # starts its workers, which inherit the variable (tests/machine.py).
    if not hasattr(config, "workerinput"):
        os.environ[machine.LOCKS_ENV] = tempfile.mkdtemp(prefix="firstbyte-test-locks-")
        config.stash[_LOCKS_MADE] = os.environ[machine.LOCKS_ENV]


def pytest_unconfigure(config: pytest.Config) -> None:
    made = config.stash.get(_LOCKS_MADE, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(machine.LOCKS_ENV, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Every test is counted in the room for its setup, call and teardown, so that a test in
    ``machine.alone()`` waits for it and it waits for that test (tests/machine.py)."""
    machine.enter_test()
    try:
        yield
    finally:
        machine.leave_test()


BENCHMARK_FILES_OF_THEIR_OWN = frozenset(f"tests/benchmarks/{name}" for name in (
    "test_routing_bench.py", "test_demo.py", "test_bench_signals.py", "test_report_browser.py",
    "test_router_overhead_baseline.py", "test_compare.py",
))
"""Files of tests/benchmarks that are groups of their own: they use neither the quick runs nor
the machine alone, and assert no upper bound on a time. In the benchmarks' group they ran one
after another behind the quick runs (~80 s of the ~360 s that group took, the suite's last)."""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # pytest-xdist (addopts: -n, --dist loadgroup) runs a group on one worker, in order: a
        # file is a group, so its module fixtures start once. tests/benchmarks is one group
        # (but BENCHMARK_FILES_OF_THEIR_OWN), run as without workers: its quick runs (three
        # scenarios at a time, a session fixture) start once and end before the WAN
        # emulator's precision tests, which need the CPU that the quick runs would take (they
        # failed beside them on three workers).
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::", 1)[0]
            group = path
            if path.startswith("tests/benchmarks/") and path not in BENCHMARK_FILES_OF_THEIR_OWN:
                group = "tests/benchmarks"
            item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("CI") == "true":
        return
    can_netns = os.geteuid() == 0 and os.path.exists("/dev/net/tun")
    if can_netns:
        return
    skip = pytest.mark.skip(reason="needs root and /dev/net/tun (runs, and fails, under CI=true)")
    for item in items:
        if "netns" in item.keywords:
            item.add_marker(skip)
