"""A real HAProxy in front of routers, for the tests that need a balancer: the system's,
installed with apt-get when missing (CI is root on a fresh Debian), in TCP mode on an
ephemeral loopback port, with a stats socket that tells each server's state and sessions."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.apt import apt_lock


def haproxy_or_skip() -> str:
    """The system HAProxy, installed with apt-get when missing (CI is root on a fresh
    Debian); a failure fails the test under CI=true and skips it elsewhere."""
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    why = "haproxy is not installed and apt-get is not available"
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "haproxy"]
        with apt_lock():
            for argv in (install, ["apt-get", "update", "-q"], install):
                done = subprocess.run(argv, capture_output=True, timeout=900, env=env,
                                      check=False)
                if argv is install and done.returncode == 0:
                    break
                why = f"installing haproxy failed: {done.stderr.decode(errors='replace')[-500:]}"
        found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    if found:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


@dataclass(frozen=True)
class Balancer:
    port: int
    """The loopback port clients connect to."""
    stats_socket: Path
    log: Path
    """HAProxy's output (its warnings: a server going DOWN, ...)."""

    async def servers(self) -> dict[str, dict[str, str]]:
        """``show stat`` of every server: {"backend/server": {column: value}} (``status``
        ``UP``/``DOWN``, ``stot`` the sessions it was given, ...)."""
        reader, writer = await asyncio.open_unix_connection(str(self.stats_socket))
        writer.write(b"show stat\n")
        await writer.drain()
        text = (await reader.read()).decode()
        writer.close()
        rows = csv.DictReader(text.removeprefix("# ").splitlines())
        return {f"{row['pxname']}/{row['svname']}": row for row in rows
                if row["svname"] not in ("FRONTEND", "BACKEND")}


@contextlib.asynccontextmanager
async def running_haproxy(
    backends: str, directory: Path, name: str = "haproxy", default_backend: str = "router"
) -> AsyncIterator[Balancer]:
    """HAProxy in TCP mode relaying a loopback port (a socket bound here and handed over as
    ``fd@N``) to ``default_backend`` of ``backends`` (HAProxy ``backend`` sections); files
    named ``name`` in ``directory``."""
    binary = haproxy_or_skip()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.set_inheritable(True)
    fd = listener.fileno()
    stats_socket = directory / f"{name}.sock"
    config = directory / f"{name}.cfg"
    config.write_text(
        f"global\n    maxconn 200\n    stats socket {stats_socket} mode 600 level user\n"
        "defaults\n    mode tcp\n    timeout connect 5s\n"
        "    timeout client 30s\n    timeout server 30s\n"
        f"frontend clients\n    bind fd@{fd}\n    default_backend {default_backend}\n"
        + backends
    )
    log_path = directory / f"{name}.log"
    proc = _spawn(binary, config, fd, log_path)
    try:
        for _ in range(200):
            if proc.poll() is not None:
                raise AssertionError(f"haproxy exited: {log_path.read_text()}")
            if stats_socket.exists():
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"haproxy made no stats socket: {log_path.read_text()}")
        await asyncio.sleep(0.2)  # its first health checks
        yield Balancer(listener.getsockname()[1], stats_socket, log_path)
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        listener.close()


def _spawn(binary: str, config: Path, fd: int, log_path: Path) -> subprocess.Popen[bytes]:
    """HAProxy in the foreground (``-db``), listening on the inherited ``fd``."""
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(
            [binary, "-db", "-f", str(config)], pass_fds=[fd], stdout=log_file,
            stderr=subprocess.STDOUT,
        )
