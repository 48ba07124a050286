"""``listen.workers = N``: N router processes on one host, one port, supervised.

The supervisor (the process ``firstbyte router`` started) forks N workers and serves nothing
itself. Each worker binds its own TCP and UDP sockets on the port with ``SO_REUSEPORT`` and runs
:func:`firstbyte.router.serve.serve`: the kernel spreads new connections over the workers by a
hash of the 4-tuple, which for UDP keeps every datagram of one QUIC connection on one worker
(see :func:`firstbyte.router.hosting.bind`). Streams, QUIC tickets and limits are shared through
``state.redis_url`` (required with more than one worker, :mod:`firstbyte.router.config`).

The supervisor forwards SIGTERM/SIGINT (drain and exit) and SIGHUP (reload: each worker reads
the config file again) to every worker, and starts a new worker in place of one that exits
while it is not stopping (crash, OOM kill), at most once a second per slot so a worker that
cannot start does not spin. It exits when every worker has: 0 after a requested stop in which
every worker exited 0 (drained), 1 if a worker failed its drain or the supervisor gave up.

Workers are forked before any event loop or thread exists in the supervisor, so each starts
from the parsed config alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import RouterConfig
from .observability.process import set_worker_slot

__all__ = ["Supervisor", "run_workers"]

log = logging.getLogger("firstbyte.router.workers")

_RESTART_MIN_INTERVAL_S = 1.0
_GIVE_UP_AFTER = 5
"""Quick deaths in a row (within a few seconds of starting) before a slot is given up."""


@dataclass
class Supervisor:
    """Fork, watch and stop the workers (see the module docstring)."""

    workers: int
    run_worker: Callable[[int], int]
    """Runs worker ``index`` in the forked child and returns its exit status."""
    pids: dict[int, int] = field(default_factory=dict)
    """Worker pid -> slot index."""
    started_at: dict[int, float] = field(default_factory=dict)
    quick_deaths: dict[int, int] = field(default_factory=dict)
    stopping: bool = False
    restarts: int = 0
    slot_restarts: dict[int, int] = field(default_factory=dict)
    """Slot index -> new processes started in it (``firstbyte_router_worker_restarts_total``)."""
    failed_stops: int = 0
    """Workers that exited non-zero after the stop was requested."""

    def spawn(self, index: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            status = 1
            try:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                # Until its event loop handles SIGHUP (a reload), a worker ignores it.
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                set_worker_slot(index, self.slot_restarts.get(index, 0))
                status = self.run_worker(index)
            except KeyboardInterrupt:
                status = 0
            except BaseException:
                log.exception("router worker %d failed", index)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        self.pids[pid] = index
        self.started_at[index] = time.monotonic()

    def forward(self, sig: int) -> None:
        for pid in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def run(self) -> int:
        """Start the workers and supervise them until they have all exited."""

        def on_stop(sig: int, _frame: object) -> None:
            self.stopping = True
            self.forward(signal.SIGTERM)

        def on_hup(sig: int, _frame: object) -> None:
            self.forward(signal.SIGHUP)

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)
        for slot in range(self.workers):
            self.spawn(slot)
        gave_up = False
        while self.pids:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries os.wait
                continue
            index: int | None = self.pids.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            if index is not None and self.stopping:
                self.failed_stops += code != 0
                continue
            if index is None:
                continue
            lived_s = time.monotonic() - self.started_at.get(index, 0.0)
            self.quick_deaths[index] = self.quick_deaths.get(index, 0) + 1 if lived_s < 5 else 0
            if self.quick_deaths[index] >= _GIVE_UP_AFTER:
                log.error("router worker %d keeps failing (exit %s); giving up on it", index, code)
                print(f"firstbyte router: worker {index} keeps failing; stopping", file=sys.stderr)
                gave_up = True
                self.stopping = True
                self.forward(signal.SIGTERM)
                continue
            log.warning("router worker %d (pid %d) exited with %s; starting another", index, pid,
                        code)
            time.sleep(max(0.0, _RESTART_MIN_INTERVAL_S - lived_s))
            if not self.stopping:
                self.restarts += 1
                self.slot_restarts[index] = self.slot_restarts.get(index, 0) + 1
                self.spawn(index)
        return 1 if gave_up or self.failed_stops else 0


def _reserve_port(config: RouterConfig) -> RouterConfig:
    """With ``listen.port = 0``, pick one port now, so every worker binds the same one."""
    if config.listen.port != 0:
        return config
    import msgspec

    family = socket.AF_INET6 if ":" in config.listen.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((config.listen.host, 0))
        port = probe.getsockname()[1]
    return msgspec.structs.replace(
        config, listen=msgspec.structs.replace(config.listen, port=port)
    )


def run_workers(config: RouterConfig, run_worker: Callable[[RouterConfig, int], int]) -> int:
    """Run ``config.listen.workers`` workers, each ``run_worker(config, index)`` in its own
    forked process, until SIGTERM/SIGINT; returns the exit status for the supervisor."""
    config = _reserve_port(config)
    supervisor = Supervisor(config.listen.workers, lambda index: run_worker(config, index))
    return supervisor.run()
