"""Shared test fixtures. Tests that need root or network namespaces are marked ``netns``:
outside CI they skip when the machine cannot run them; with ``CI=true`` they run and fail."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # pytest-xdist (addopts: -n, --dist loadgroup) runs a group on one worker, in order: a
        # file is a group, so its module fixtures start once. tests/benchmarks is one group,
        # run as without workers: its quick runs (three scenarios at a time, a session fixture)
        # start once and end before the WAN emulator's precision tests, which need the CPU
        # that the quick runs would take (they failed beside them on three workers).
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::", 1)[0]
            group = "tests/benchmarks" if path.startswith("tests/benchmarks/") else path
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
