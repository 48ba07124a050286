"""The WAN emulator's packet forwarder: one process in the root namespace holding every TUN.

Started by :mod:`firstbyte.benchmarks.wan.netns` as ``python -m firstbyte.benchmarks.wan.forwarder
--config FILE``.
It creates one TUN device per host (IFF_TUN | IFF_NO_PI, so no offloads and whole IPv4
packets), prints one ``ready`` JSON line on stdout, and from then on reads packets, asks the
:class:`~firstbyte.benchmarks.wan.delayline.DelayLine` when each may leave, and writes it to the
destination host's TUN at that time. The caller moves the TUN devices into their namespaces.

Timing: ``epoll`` timers round to 1 ms, so the loop waits in ``select`` (microsecond timeouts,
with the timer slack lowered to 1 ns) until a margin before the next deadline, then polls
without sleeping until the deadline. The margin is :class:`WakeMargin`'s: how late this
machine's recent sleeps woke (a virtual CPU woken from a long idle can take a millisecond),
never less than :data:`SPIN_NS`. Every write's lateness (actual - scheduled) is recorded and
reported by the ``stats`` command.

Control (attached mode): each line on stdin is a command: ``stats`` answers one JSON line on
stdout. End of stdin means the owner is gone: the forwarder exits, closing the TUN fds, which
deletes the TUN devices. With ``--detached`` (used by ``firstbyte wan up``) stdin is not read
and the forwarder runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from firstbyte.benchmarks.wan.delayline import DelayLine, LinkParams, Verdict

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_TIMERSLACK = 29
# The least time before a deadline the loop stops sleeping and polls: select() on an idle
# machine wakes ~60-80 us late, so 200 us covers it while spinning only briefly.
SPIN_NS = 200_000
# The most: on a busy host a virtual CPU halted through a 75 ms wait woke 0.5-1.3 ms late.
MAX_SPIN_NS = 3_000_000
MAX_PACKET = 65_535
REALTIME_PRIORITY = 10
READ_BURST = 64


@dataclass(frozen=True)
class ForwarderConfig:
    """What the forwarder needs: TUN names and IPv4 addresses by host index, and the links."""

    tuns: list[str]
    ips: list[str]
    links: dict[tuple[int, int], LinkParams]
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "tuns": self.tuns,
            "ips": self.ips,
            "seed": self.seed,
            "links": [
                {
                    "src": s,
                    "dst": d,
                    "delay_ns": p.delay_ns,
                    "jitter_ns": p.jitter_ns,
                    "loss_pct": p.loss_pct,
                    "rate_bps": p.rate_bps,
                    "queue_limit_ns": p.queue_limit_ns,
                }
                for (s, d), p in self.links.items()
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ForwarderConfig:
        links = {
            (int(x["src"]), int(x["dst"])): LinkParams(
                delay_ns=int(x["delay_ns"]),
                jitter_ns=int(x["jitter_ns"]),
                loss_pct=float(x["loss_pct"]),
                rate_bps=None if x["rate_bps"] is None else float(x["rate_bps"]),
                queue_limit_ns=int(x["queue_limit_ns"]),
            )
            for x in data["links"]
        }
        return cls(list(data["tuns"]), list(data["ips"]), links, int(data["seed"]))


def open_tun(name: str) -> int:
    """Create TUN device ``name`` in the current namespace; it lives as long as the fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def _realtime() -> bool:
    """Run at a low SCHED_FIFO priority when allowed. On a busy or virtualised machine an
    ordinary process is preempted for milliseconds at a time, which would show up as delay
    the configuration never asked for; a FIFO thread that sleeps between packets only runs
    when it has work, and the kernel's RT throttling still caps it at 95% of a CPU."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except (OSError, AttributeError):
        return False
    return True


def _lower_timer_slack() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # only precision suffers


class WakeMargin:
    """How long before a deadline to stop sleeping: the latest of the last :attr:`window`
    sleeps' oversleep (woken after the timeout asked for), plus a quarter, within
    [:data:`SPIN_NS`, :data:`MAX_SPIN_NS`]. A machine whose wake-ups grow late (a virtual CPU
    descheduled while idle) widens it at once; it narrows again once they are prompt, so
    polling costs CPU only on the hours that need it."""

    def __init__(self, window: int = 32) -> None:
        self.window = window
        self._late: collections.deque[int] = collections.deque(maxlen=window)

    def woke(self, asked_ns: int, slept_ns: int) -> None:
        """A sleep asked for ``asked_ns`` and lasted ``slept_ns`` (it timed out)."""
        self._late.append(max(0, slept_ns - asked_ns))

    @property
    def ns(self) -> int:
        worst = max(self._late, default=0)
        return min(MAX_SPIN_NS, max(SPIN_NS, worst + worst // 4))


class Forwarder:
    """The IO loop around a :class:`DelayLine`."""

    def __init__(self, config: ForwarderConfig, control: int | None) -> None:
        self.config = config
        self.line = DelayLine(config.links, seed=config.seed)
        self.fds = [open_tun(name) for name in config.tuns]
        self.index_of_fd = {fd: i for i, fd in enumerate(self.fds)}
        self.host_of_ip = {bytes(map(int, ip.split("."))): i for i, ip in enumerate(config.ips)}
        self.control = control
        self.lateness_ns: collections.deque[int] = collections.deque(maxlen=20_000)
        self.forwarded = 0
        self.non_ipv4 = 0
        self.unknown_host = 0
        self.write_errors = 0
        self.max_in_flight = 0
        self.margin = WakeMargin()
        self.running = True

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []

    def stats(self) -> dict[str, Any]:
        late = sorted(self.lateness_ns)

        def pct(q: float) -> float:
            return late[min(len(late) - 1, int(q * len(late)))] / 1000.0 if late else 0.0

        counts = {v.value: 0 for v in Verdict}
        for link in self.line.links.values():
            for verdict, n in link.counts.items():
                counts[verdict.value] += n
        return {
            "forwarded": self.forwarded,
            "lost": counts[Verdict.LOST.value],
            "queue_full": counts[Verdict.QUEUE_FULL.value],
            "unroutable": self.line.unroutable + self.unknown_host,
            "non_ipv4": self.non_ipv4,
            "write_errors": self.write_errors,
            "in_flight": self.line.in_flight(),
            "max_in_flight": self.max_in_flight,
            "wake_margin_us": self.margin.ns / 1000.0,
            "lateness_us": {
                "samples": len(late),
                "p50": pct(0.5),
                "p90": pct(0.9),
                "p99": pct(0.99),
                "max": late[-1] / 1000.0 if late else 0.0,
            },
        }

    def _read_from(self, fd: int) -> None:
        src = self.index_of_fd[fd]
        clock = time.perf_counter_ns
        for _ in range(READ_BURST):
            try:
                packet = os.read(fd, MAX_PACKET)
            except BlockingIOError:
                return
            except OSError:
                return  # device gone (namespace deleted during teardown)
            # Its arrival is now, after the read: a time taken before it (when select returned)
            # would date a packet written since then too early, and release it early by as long
            # as this process was off the CPU in between (0.1-0.4 ms on a busy virtual machine).
            now = clock()
            if len(packet) < 20 or packet[0] >> 4 != 4:
                self.non_ipv4 += 1  # IPv6 router solicitations and the like: not emulated
                continue
            dst = self.host_of_ip.get(packet[16:20])
            if dst is None:
                self.unknown_host += 1
                continue
            self.line.push(packet, src, dst, now)
            self.max_in_flight = max(self.max_in_flight, self.line.in_flight())

    def _handle_control(self) -> None:
        assert self.control is not None
        data = os.read(self.control, 4096)
        if not data:
            self.running = False
            return
        for raw in data.decode(errors="replace").splitlines():
            if raw.strip() == "stats":
                sys.stdout.write(json.dumps(self.stats()) + "\n")
                sys.stdout.flush()

    def _release(self, now: int) -> None:
        for dst, packet, release in self.line.pop_due(now):
            # Lateness of the scheduling itself; the write (which runs the receiving host's
            # stack in this syscall) is part of what any real link delivery costs too.
            self.lateness_ns.append(time.perf_counter_ns() - release)
            try:
                os.write(self.fds[dst], packet)
            except OSError:
                self.write_errors += 1
                continue
            self.forwarded += 1

    def run(self) -> None:
        watched = list(self.fds)
        if self.control is not None:
            watched.append(self.control)
        clock = time.perf_counter_ns
        while self.running:
            deadline = self.line.next_deadline()
            before = clock()
            if deadline is None:
                timeout: float | None = 0.5  # wake now and then to notice SIGTERM promptly
                wait = 0
            else:
                wait = deadline - before - self.margin.ns
                timeout = wait / 1e9 if wait > 0 else 0.0
            try:
                ready, _, _ = select.select(watched, [], [], timeout)
            except InterruptedError:
                continue
            if wait > 0 and not ready:
                self.margin.woke(wait, clock() - before)
            for fd in ready:
                if fd == self.control:
                    self._handle_control()
                else:
                    self._read_from(fd)
            self._release(clock())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstbyte.benchmarks.wan.forwarder")
    parser.add_argument("--config", required=True, help="JSON file written by netns.py")
    parser.add_argument("--detached", action="store_true", help="ignore stdin; stop on SIGTERM")
    parser.add_argument("--no-realtime", action="store_true", help="stay SCHED_OTHER")
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        config = ForwarderConfig.from_json(json.load(f))
    _lower_timer_slack()
    realtime = False if args.no_realtime else _realtime()
    try:
        forwarder = Forwarder(config, None if args.detached else sys.stdin.fileno())
    except OSError as exc:
        sys.stdout.write(json.dumps({"error": f"cannot create TUN devices: {exc}"}) + "\n")
        sys.stdout.flush()
        return 1

    def _stop(signum: int, frame: object) -> None:
        forwarder.running = False

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sys.stdout.write(json.dumps({"ready": True, "pid": os.getpid(), "realtime": realtime}) + "\n")
    sys.stdout.flush()
    if args.detached:
        # Nobody reads stdout any more; don't let a write kill us with SIGPIPE or EPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    try:
        forwarder.run()
    finally:
        forwarder.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
