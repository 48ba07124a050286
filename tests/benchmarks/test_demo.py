"""``firstbyte demo`` as a real process: exits 0 within seconds and prints TTFT."""

from __future__ import annotations

import re
import subprocess
import sys

MAIN = "import sys; from client_sdk.cli import main; sys.exit(main())"


def test_demo_streams_and_prints_ttft() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MAIN, "demo"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-3000:]
    match = re.search(r"TTFT ([\d.]+) ms\s+E2EL ([\d.]+) ms\s+tokens (\d+)", done.stdout)
    assert match, done.stdout
    ttft, e2el, tokens = float(match[1]), float(match[2]), int(match[3])
    assert 0 < ttft < e2el
    assert tokens == 32
    assert "Traceback" not in done.stderr


def test_demo_rejects_bad_options() -> None:
    done = subprocess.run(
        [sys.executable, "-c", MAIN, "demo", "--max-tokens", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--max-tokens must be >= 1" in done.stderr
