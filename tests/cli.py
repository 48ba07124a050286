"""Run the ``firstbyte`` command in a subprocess, as a user would (no traceback expected)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

# What the console script runs: ``python -m firstbyte`` goes through the same ``main``.
FIRSTBYTE = [sys.executable, "-m", "firstbyte"]


def firstbyte(
    *args: str, timeout: float = 60, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``firstbyte ARGS...``: its exit code and captured text output."""
    return subprocess.run(
        [*FIRSTBYTE, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else dict(env),
        check=False,
    )
