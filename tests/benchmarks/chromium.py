"""The system Chromium for the tests that drive it (reports, the browser client, bench browser)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from firstbyte.benchmarks.browser import chromium_path
from tests.apt import apt_lock


def install_chromium() -> tuple[str | None, str]:
    """The system Chromium, installed with apt-get when missing (CI is root on a fresh
    machine); else None and why."""
    found = chromium_path()
    if found:
        return found, ""
    why = "chromium is not installed and apt-get is not available"
    if shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            with apt_lock():
                for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q",
                                                           "chromium"]):
                    subprocess.run(argv, check=True, capture_output=True, timeout=900, env=env)
        except (subprocess.SubprocessError, OSError) as exc:
            why = f"installing chromium failed: {exc}"
    return chromium_path(), why


def chromium_or_skip() -> str:
    """:func:`install_chromium`; a failure fails the test under CI=true, skips it elsewhere."""
    found, why = install_chromium()
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)
