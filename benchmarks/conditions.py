"""The conditions a benchmark ran under, for its report: the machine, the commit, the command,
and how much of the machine's CPU other processes took while it ran.

:class:`CpuWatch` is started before a run and read after it; :func:`run_conditions` collects the
rest. Everything here reads the system (``/proc``, ``git``); the report only prints the dict.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["CpuWatch", "child_pids", "machine_cpu", "process_cpu_seconds", "run_conditions"]

_CPUCLOCK_SCHED = 2
"""Linux's process CPU clocks: ``clockid = (~pid << 3) | CPUCLOCK_SCHED``, what glibc's
``clock_getcpuclockid`` returns (Python has no binding for it)."""


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of process ``pid``, all its threads, exited ones included,
    to the nanosecond; 0 where the process is gone.

    Read from the process's CPU clock, not from ``/proc/PID/stat``: ``stat`` counts in clock
    ticks (10 ms), and a benchmark phase that costs a process 60 ms would be measured
    within +-17%. Where the clock cannot be read (not Linux), the ticks are the answer."""
    try:
        return time.clock_gettime_ns((~pid << 3) | _CPUCLOCK_SCHED) / 1e9
    except (OSError, OverflowError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid`` (its own threads' children), from Linux ``/proc``;
    none where it cannot be read."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all CPUs; (0, 0) where
    ``/proc/stat`` cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(values)
    idle = values[3] + values[4]  # idle + iowait
    return (total - idle) / tick, total / tick


def _own_cpu() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuWatch:
    """The share of the machine's CPU that *other* processes used between construction and
    :meth:`foreign_share` (this process and its reaped children are not "other")."""

    def __init__(self) -> None:
        self._machine = machine_cpu()
        self._own = _own_cpu()

    def foreign_share(self) -> float | None:
        """0..1, or None where ``/proc/stat`` is unreadable."""
        busy0, total0 = self._machine
        busy1, total1 = machine_cpu()
        if total1 <= total0:
            return None
        own = _own_cpu() - self._own
        return min(1.0, max(0.0, (busy1 - busy0 - own) / (total1 - total0)))


def _commit() -> str | None:
    """The source tree's commit (with ``+dirty`` when it has changes), or None outside git."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=5, check=True).stdout
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head.strip() + ("+dirty" if dirty.strip() else "")


def _command() -> str:
    """How this run was started, as the user typed it (``firstbyte demo --quick``)."""
    args = sys.argv[1:]
    name = Path(sys.argv[0]).name if sys.argv else "python"
    if name in ("-c", "__main__.py", "") or name.endswith(".py"):
        name = "firstbyte"
    return shlex.join([name, *args])


def run_conditions(cpu: CpuWatch | None = None) -> dict[str, Any]:
    """Machine, OS, Python, commit and command; ``foreign_cpu_share`` when ``cpu`` is given."""
    out: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "commit": _commit(),
        "command": _command(),
    }
    if cpu is not None:
        out["foreign_cpu_share"] = cpu.foreign_share()
    return out
