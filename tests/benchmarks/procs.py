"""What a benchmark process leaves on this machine: its processes and its network namespaces."""

from __future__ import annotations

import subprocess
from pathlib import Path


def namespaces_of(pid: int) -> list[str]:
    """The network namespaces the world of process ``pid`` created (``fb-PID-...``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in out.stdout.splitlines()
            if line.startswith(f"fb-{pid}-")]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has ended)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``: children, their children, ..."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[0] != "Z":
                parents[int(entry.name)] = stat[1]
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def describe(pid: int) -> str:
    """State and command line of ``pid``, for assertion messages."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except OSError:
        return "(gone)"
    return f"{state.strip()} {cmdline[:200]}"
