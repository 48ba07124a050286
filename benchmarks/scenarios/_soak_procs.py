"""The soak's processes: a router (``firstbyte router --config``) and sims (``firstbyte sim``), each
its own process on 127.0.0.1, and a sampler of their memory and open files.

A sim can be killed (SIGKILL: no goodbye to the router's connections) and started again on the
same port, which is how a crashed inference server looks to the router. Every child's output
goes to a log file in the run's directory: the router's log is read at the end for tracebacks.
Children end with the soak, even when it is killed outright
(:func:`firstbyte.benchmarks._parent.exit_with_parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import httpx

from firstbyte.benchmarks._parent import stop_process
from firstbyte.benchmarks.errors import PartFailed
from firstbyte.benchmarks.ports import free_port

__all__ = ["Child", "MemorySampler", "Sim", "free_port", "router_log_findings", "start_router",
           "toml"]

FIRSTBYTE = (
    sys.executable,
    "-c",
    # the `firstbyte` command, with a watchdog: it ends when the soak is killed outright
    "import sys; from firstbyte.benchmarks._parent import exit_with_parent; exit_with_parent();"
    " from firstbyte.cli import main; sys.exit(main(sys.argv[1:]))",
)
_SIM_URL = re.compile(rb"serving (http://\S+)")


def toml(data: Mapping[str, Any]) -> str:
    """``data`` as TOML: scalars and lists of scalars (JSON's syntax is TOML's for these),
    tables, and arrays of tables, one level deep (what a router config needs)."""
    head = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not _is_table(v)]
    body: list[str] = []
    for key, value in data.items():
        if isinstance(value, dict):
            body += ["", f"[{key}]", *(f"{k} = {json.dumps(v)}" for k, v in value.items())]
        elif _is_table(value):
            for item in value:
                body += ["", f"[[{key}]]", *(f"{k} = {json.dumps(v)}" for k, v in item.items())]
    return "\n".join(head + body) + "\n"


def _is_table(value: Any) -> bool:
    return isinstance(value, dict) or (
        isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)
    )


class Child:
    """One child process with its output in ``log`` (its stderr too, unless ``stderr`` names
    another file); stopped with SIGTERM, then SIGKILL."""

    def __init__(self, role: str, args: list[str], log: Path, stderr: Path | None = None) -> None:
        self.role = role
        self.log = log
        self._files: list[IO[bytes]] = [log.open("ab")]
        if stderr is not None:
            self._files.append(stderr.open("ab"))
        self.proc = subprocess.Popen(
            args, stdout=self._files[0], stdin=subprocess.DEVNULL,
            stderr=self._files[1] if stderr is not None else subprocess.STDOUT)

    def _close(self) -> None:
        for file in self._files:
            file.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash: the process gets no chance to close its connections."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._close()

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_process(self.proc, timeout_s)
        self._close()


class Sim:
    """``firstbyte sim`` in its own process; :meth:`crash` kills it and starts it again on the
    same port after ``down_s``."""

    def __init__(self, name: str, args: list[str], logs: Path) -> None:
        self.name = name
        self.args = args
        self.logs = logs
        self.port = 0
        self.child: Child | None = None
        self.crashes = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 60.0) -> None:
        # 60 s, as a router's start: CI starts every quick scenario's processes at once on
        # two cores, and a sim's imports alone took over 30 s there on a slow machine.
        log = self.logs / f"{self.name}.log"
        offset = log.stat().st_size if log.exists() else 0
        args = [*FIRSTBYTE, "sim", "--port", str(self.port), *self.args]
        self.child = Child(self.name, args, log)
        deadline = time.monotonic() + timeout_s
        while True:
            found = _SIM_URL.search(log.read_bytes()[offset:])
            if found:
                self.port = int(found.group(1).decode().rsplit(":", 1)[1])
                return
            if self.child.proc.poll() is not None or time.monotonic() > deadline:
                raise PartFailed(f"sim {self.name} did not start", _tail(log))
            await asyncio.sleep(0.05)

    async def crash(self, down_s: float) -> None:
        assert self.child is not None
        self.child.kill()
        self.crashes += 1
        await asyncio.sleep(down_s)
        for _ in range(20):  # the port may linger a moment after the kill
            try:
                await self.start()
                return
            except PartFailed:
                if self.child is not None:
                    self.child.stop()
                await asyncio.sleep(0.25)
        raise PartFailed(f"sim {self.name} did not come back on port {self.port}")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


async def start_router(config: Path, base_url: str, ca_file: str, log: Path,
                       timeout_s: float = 60.0) -> Child:
    """``firstbyte router --config CONFIG``, returned once ``/healthz`` answers 200 (warm)."""
    child = Child("router", [*FIRSTBYTE, "router", "--config", str(config)], log)
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(verify=ca_file, timeout=2) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(base_url + "/healthz")).status_code == 200:
                    return child
            if child.proc.poll() is not None or time.monotonic() > deadline:
                child.stop()
                raise PartFailed("router did not become healthy", _tail(log))
            await asyncio.sleep(0.1)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:]


def router_log_findings(log: Path, limit: int = 8) -> dict[str, Any]:
    """Tracebacks and error lines in the router's log (it runs at WARNING level): a client's
    mistake should be one line with a reason, never a traceback."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.splitlines()
    errors = [line for line in lines if " ERROR " in line or " CRITICAL " in line]
    finals = [line for i, line in enumerate(lines)
              if i > 0 and lines[i - 1].startswith("  ") and re.match(r"^\w[\w.]*(Error|Exception)",
                                                                     line)]
    distinct = Counter(finals) + Counter(line.split(" ", 2)[-1] for line in errors)
    return {
        "tracebacks": text.count("Traceback (most recent call last)"),
        "error_lines": len(errors),
        "warning_lines": sum(1 for line in lines if " WARNING " in line),
        "examples": [f"{n}x {line[:300]}" for line, n in distinct.most_common(limit)],
    }


def _status(pid: int) -> tuple[float, int] | None:
    """(RSS in MB, open files) of ``pid`` from /proc, or None when it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    return (int(found.group(1)) / 1024, fds) if found else None


class MemorySampler:
    """Samples each role's RSS and open file descriptors every ``interval_s`` (``pids`` is read
    at each sample: a restarted sim has a new pid under the same role)."""

    def __init__(self, pids: Callable[[], dict[str, int]], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, float, int]]] = {}
        """role -> [(seconds since start, RSS MB, open fds)]"""

    async def run(self, started: float) -> None:
        while True:
            now = time.monotonic() - started
            for role, pid in self.pids().items():
                found = _status(pid)
                if found is not None:
                    self.samples.setdefault(role, []).append((round(now, 2), *found))
            await asyncio.sleep(self.interval_s)

    def summary(self) -> list[dict[str, Any]]:
        """Per role: RSS first/min/max/final and growth (final - first), peak open files."""
        rows = []
        for role, samples in self.samples.items():
            rss = [s[1] for s in samples]
            rows.append({
                "label": role,
                "samples": len(samples),
                "rss_first_mb": round(rss[0], 1),
                "rss_min_mb": round(min(rss), 1),
                "rss_max_mb": round(max(rss), 1),
                "rss_final_mb": round(rss[-1], 1),
                "rss_growth_mb": round(rss[-1] - rss[0], 1),
                "fds_max": max(s[2] for s in samples),
                "fds_final": samples[-1][2],
            })
        return rows
