"""Network namespaces, TUN devices and the forwarder process: set up, tear down, clean up.

Everything a run creates is named ``fb-<pid>-<k>-<host>`` (``pid`` = the creating process,
``k`` = a per-process counter) and recorded in a state file ``/run/firstbyte-wan/<run-id>.json``
*before* it is created, so :func:`teardown` can remove it after a crash. The state file names
the run's owner (pid and kernel start time, so a reused pid is not mistaken for the owner);
:func:`cleanup_stale` tears down exactly the runs whose owner is gone and never touches
anything else. Teardown is idempotent: each step tolerates what is already gone.

Each namespace gets only its loopback and its TUN device, with one /32 address and routes for
the three documentation prefixes (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24) through the
TUN: no default route, so nothing an emulated host sends can leave the machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from firstbyte.benchmarks.errors import BenchError
from firstbyte.benchmarks.wan.delayline import LinkParams
from firstbyte.benchmarks.wan.forwarder import ForwarderConfig

STATE_DIR = Path("/run/firstbyte-wan")
AVAILABLE_CC = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
CC_IN_NAMESPACE = Path("/proc/sys/net/ipv4/tcp_congestion_control")
EMULATED_PREFIXES = ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
_NETWORKS = tuple(ipaddress.ip_network(p) for p in EMULATED_PREFIXES)
HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
OUR_NAMESPACE = re.compile(r"^fb-(\d+)-(\d+)-[a-z0-9-]+$")
READY_TIMEOUT_S = 10.0
_counter = itertools.count()


class WanUnavailable(BenchError):
    """This machine (or user) cannot run the emulator: it needs root and /dev/net/tun."""


class WanError(BenchError):
    """Setting up the emulated network failed (the message says which step)."""


def check_capable() -> None:
    """Raise :class:`WanUnavailable` unless we are root with ``/dev/net/tun`` and ``ip``."""
    if os.geteuid() != 0:
        raise WanUnavailable(
            "the WAN emulator needs root (network namespaces and TUN devices); run as root"
        )
    if not os.path.exists("/dev/net/tun"):
        raise WanUnavailable("the WAN emulator needs /dev/net/tun, which this machine lacks")
    try:
        found = subprocess.run(["ip", "-V"], capture_output=True).returncode == 0
    except OSError:  # not on PATH at all
        found = False
    if not found:
        raise WanUnavailable("the WAN emulator needs iproute2's `ip` command")


def validate_host(name: str, ip: str) -> None:
    """Raise ValueError unless ``name`` is a short lowercase name and ``ip`` an IPv4 address in
    one of the emulated documentation prefixes."""
    if not HOST_NAME.match(name):
        raise ValueError(f"host name {name!r}: use 1-40 of a-z, 0-9 and '-'")
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError:
        raise ValueError(f"host {name}: {ip!r} is not an IPv4 address") from None
    if not any(addr in net for net in _NETWORKS):
        raise ValueError(
            f"host {name}: {ip} is outside the emulated prefixes {', '.join(EMULATED_PREFIXES)}"
        )


def python_env() -> dict[str, str]:
    """This environment with the directory holding the ``firstbyte`` package first on
    PYTHONPATH, so helper processes import this same copy even when it is not installed."""
    env = dict(os.environ)
    # Not resolve(): in a checkout firstbyte/benchmarks is a symlink to benchmarks/, and the
    # directory to put on the path is the one holding firstbyte/, not the symlink's target.
    root = str(Path(__file__).absolute().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def validate_hosts(hosts: list[tuple[str, str]]) -> None:
    """Raise ValueError unless every ``(name, ip)`` is valid and names and addresses unique."""
    for name, ip in hosts:
        validate_host(name, ip)
    names = [name for name, _ in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate host names in {names}")
    ips = [ip for _, ip in hosts]
    if len(set(ips)) != len(ips):
        raise ValueError(f"duplicate host addresses in {ips}")
    if len(hosts) < 2:
        raise ValueError("an emulated network needs at least two hosts")


def ip_cmd(*args: str, stdin: str | None = None, check: bool = True) -> str:
    """Run ``ip ARGS`` (``-batch -`` reads ``stdin``); raise :class:`WanError` on failure."""
    proc = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise WanError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc.stdout


def list_namespaces() -> list[str]:
    """Names of all network namespaces in /run/netns (ours and others')."""
    out = ip_cmd("netns", "list", check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str) -> list[int]:
    out = ip_cmd("netns", "pids", ns, check=False)
    return [int(tok) for tok in out.split() if tok.isdigit()]


def process_start_time(pid: int) -> int | None:
    """The kernel start time (clock ticks since boot) of ``pid``, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); starttime is field 22. A zombie counts as gone.
    return None if fields[0] == "Z" else int(fields[19])


def is_alive(pid: int, start_time: int | None) -> bool:
    current = process_start_time(pid)
    return current is not None and (start_time is None or current == start_time)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_namespace_processes(namespaces: list[str], grace_s: float = 1.0) -> None:
    """SIGTERM every process inside ``namespaces``, then SIGKILL what is left after ``grace_s``."""
    pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
    pids = [pid for pid in pids if pid != os.getpid()]
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if process_start_time(pid) is not None]
        time.sleep(0.02)
    for pid in pids:
        _kill(pid, signal.SIGKILL)


@dataclass
class RunState:
    """What a run created, persisted so that it can be removed after a crash."""

    run_id: str
    owner_pid: int
    owner_start: int | None
    namespaces: dict[str, str]  # host -> namespace
    tuns: dict[str, str]  # host -> TUN device name
    ips: dict[str, str]  # host -> address
    forwarder_pid: int | None = None
    forwarder_start: int | None = None
    detached: bool = False
    created: float = field(default_factory=time.time)
    allowed_cc_before: str | None = None
    """This machine's ``tcp_allowed_congestion_control`` before the run widened it (None: the
    run left it alone); put back at teardown."""

    @property
    def path(self) -> Path:
        return STATE_DIR / f"{self.run_id}.json"

    def save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.path)

    @classmethod
    def load(cls, path: Path) -> RunState:
        data: dict[str, Any] = json.loads(path.read_text())
        return cls(**data)

    def owner_alive(self) -> bool:
        return is_alive(self.owner_pid, self.owner_start)


def load_states() -> list[RunState]:
    """Every run recorded in the state directory (unreadable files are skipped)."""
    states = []
    for path in sorted(STATE_DIR.glob("fb-*.json")):
        try:
            states.append(RunState.load(path))
        except (OSError, ValueError, TypeError):
            continue
    return states


def teardown(state: RunState) -> None:
    """Remove everything ``state`` records; safe to call twice and after a crash."""
    namespaces = list(state.namespaces.values())
    present = set(list_namespaces())
    kill_namespace_processes([ns for ns in namespaces if ns in present])
    if state.forwarder_pid is not None and is_alive(state.forwarder_pid, state.forwarder_start):
        _kill(state.forwarder_pid, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and is_alive(state.forwarder_pid, state.forwarder_start):
            time.sleep(0.02)
        _kill(state.forwarder_pid, signal.SIGKILL)
    gone = [ns for ns in namespaces if ns in present]
    if gone:
        ip_cmd(
            "-force", "-batch", "-", stdin="".join(f"netns del {ns}\n" for ns in gone), check=False
        )
    if state.allowed_cc_before is not None:
        with contextlib.suppress(OSError):
            ALLOWED_CC.write_text(state.allowed_cc_before)
    with contextlib.suppress(FileNotFoundError):
        state.path.unlink()
    for suffix in ("forwarder.json", "forwarder.log"):
        with contextlib.suppress(FileNotFoundError):
            (STATE_DIR / f"{state.run_id}.{suffix}").unlink()


def cleanup_stale() -> list[str]:
    """Tear down every run whose owner process is gone; return the namespaces removed.

    Also removes ``fb-<pid>-<k>-<host>`` namespaces that no state file mentions (state is
    written before anything is created, but a state file can be deleted by hand) when process
    ``pid`` no longer exists. Runs of live owners are never touched.
    """
    removed: list[str] = []
    recorded: set[str] = set()
    for state in load_states():
        recorded.update(state.namespaces.values())
        if not state.owner_alive():
            existing = set(list_namespaces())
            removed += [ns for ns in state.namespaces.values() if ns in existing]
            teardown(state)
    orphans = []
    for ns in list_namespaces():
        m = OUR_NAMESPACE.match(ns)
        if m and ns not in recorded and process_start_time(int(m.group(1))) is None:
            orphans.append(ns)
    if orphans:
        kill_namespace_processes(orphans)
        ip_cmd(
            "-force",
            "-batch",
            "-",
            stdin="".join(f"netns del {ns}\n" for ns in orphans),
            check=False,
        )
        removed += orphans
    return removed


def _new_run_id() -> str:
    existing = set(list_namespaces())
    while True:
        run_id = f"fb-{os.getpid()}-{next(_counter)}"
        if (
            not any(ns.startswith(run_id + "-") for ns in existing)
            and not (STATE_DIR / f"{run_id}.json").exists()
        ):
            return run_id


class Network:
    """A running emulated network: namespaces, TUNs and the forwarder. Use :meth:`start`."""

    def __init__(self, state: RunState, forwarder: subprocess.Popen[str] | None) -> None:
        self.state = state
        self._forwarder = forwarder
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(
        cls,
        hosts: list[tuple[str, str]],
        links: dict[tuple[str, str], LinkParams],
        seed: int = 0,
        detached: bool = False,
        congestion: dict[str, str] | None = None,
    ) -> Network:
        """Create one namespace per ``(name, ip)`` host and forward between them per ``links``
        (keyed by host names, one entry per direction); a host named in ``congestion`` runs
        that TCP congestion control (else this machine's default). On failure everything
        created so far is removed before the exception propagates."""
        validate_hosts(hosts)
        names = [name for name, _ in hosts]
        for name in congestion or {}:
            if name not in names:
                raise ValueError(f"congestion names {name!r}, which is not in {names}")
        for a, b in links:
            if a not in names or b not in names:
                raise ValueError(f"link {a}->{b} names a host that is not in {names}")
        check_capable()
        cleanup_stale()
        run_id = _new_run_id()
        _, pid, k = run_id.split("-")
        state = RunState(
            run_id=run_id,
            owner_pid=os.getpid(),
            owner_start=process_start_time(os.getpid()),
            namespaces={name: f"{run_id}-{name}" for name in names},
            # IFNAMSIZ is 16 with the NUL: hex keeps "fb<pid>.<k>.<i>" within 15 characters.
            tuns={name: f"fb{int(pid):x}.{int(k):x}.{i:x}" for i, name in enumerate(names)},
            ips=dict(hosts),
            detached=detached,
        )
        if any(len(tun) > 15 for tun in state.tuns.values()):
            raise WanError("too many hosts or emulator runs in one process for TUN names")
        state.save()  # before creating anything, so a crash from here on can be cleaned up
        net = cls(state, None)
        try:
            net._setup(names, links, seed, detached)
            net._set_congestion(congestion or {})
        except BaseException:
            net.stop()
            raise
        return net

    def _setup(
        self, names: list[str], links: dict[tuple[str, str], LinkParams], seed: int, detached: bool
    ) -> None:
        state = self.state
        ip_cmd("-batch", "-", stdin="".join(f"netns add {state.namespaces[n]}\n" for n in names))
        index = {name: i for i, name in enumerate(names)}
        config = ForwarderConfig(
            tuns=[state.tuns[n] for n in names],
            ips=[state.ips[n] for n in names],
            links={(index[a], index[b]): p for (a, b), p in links.items()},
            seed=seed,
        )
        config_path = STATE_DIR / f"{state.run_id}.forwarder.json"
        config_path.write_text(json.dumps(config.to_json()))
        # -c rather than -m: the package __init__ already imports this module (runpy warns).
        code = "import sys; from firstbyte.benchmarks.wan.forwarder import main; sys.exit(main())"
        argv = [sys.executable, "-c", code, "--config", str(config_path)]
        if detached:
            argv.append("--detached")
        # Detached, the forwarder must not hold our caller's stderr open (a caller waiting for
        # EOF on it would hang): it writes to a log file next to the state file instead.
        log_path = STATE_DIR / f"{state.run_id}.forwarder.log"
        with open(log_path, "ab") if detached else contextlib.nullcontext() as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL if detached else subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
                env=python_env(),
            )
        state.forwarder_pid = proc.pid
        state.forwarder_start = process_start_time(proc.pid)
        if detached:
            state.owner_pid, state.owner_start = proc.pid, state.forwarder_start
        state.save()
        self._forwarder = proc
        assert proc.stdout is not None
        ready = _read_line(proc.stdout, READY_TIMEOUT_S)
        if not ready:
            raise WanError(f"the forwarder did not start (exit code {proc.poll()})")
        msg = json.loads(ready)
        if "error" in msg:
            raise WanError(msg["error"])
        if detached:
            proc.stdout.close()
        ip_cmd(
            "-batch",
            "-",
            stdin="".join(f"link set {state.tuns[n]} netns {state.namespaces[n]}\n" for n in names),
        )
        for n in names:
            tun = state.tuns[n]
            script = [
                "link set lo up",
                f"addr add {state.ips[n]}/32 dev {tun}",
                f"link set {tun} mtu 1500 up",
                *(
                    f"route add {prefix} dev {tun} src {state.ips[n]}"
                    for prefix in EMULATED_PREFIXES
                ),
            ]
            ip_cmd("-n", state.namespaces[n], "-batch", "-", stdin="\n".join(script) + "\n")

    def _set_congestion(self, congestion: dict[str, str]) -> None:
        """Give each named host's namespace its TCP congestion control. A namespace may only
        default to an algorithm this machine allows unprivileged sockets to pick
        (``tcp_allowed_congestion_control``), so the run adds it there and teardown puts the
        list back."""
        if not congestion:
            return
        available = AVAILABLE_CC.read_text().split()
        allowed = ALLOWED_CC.read_text().split()
        missing = sorted(set(congestion.values()) - set(available))
        if missing:
            raise WanError(
                f"TCP congestion control {', '.join(missing)} is not available on this kernel "
                f"(available: {' '.join(available)})"
            )
        extra = [cc for cc in dict.fromkeys(congestion.values()) if cc not in allowed]
        if extra:
            self.state.allowed_cc_before = " ".join(allowed)
            self.state.save()  # before the change, so a crash from here on puts it back
            ALLOWED_CC.write_text(" ".join([*allowed, *extra]))
        for host, cc in congestion.items():
            subprocess.run(
                [*self.exec_prefix(host), sys.executable, "-c",
                 f"open({str(CC_IN_NAMESPACE)!r}, 'w').write({cc!r})"],
                check=True, capture_output=True, timeout=30, env=python_env(),
            )

    def exec_prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.state.namespaces[host]]

    def forwarder_alive(self) -> bool:
        pid = self.state.forwarder_pid
        return pid is not None and is_alive(pid, self.state.forwarder_start)

    def stats(self) -> dict[str, Any]:
        """The forwarder's counters and release lateness (see ``forwarder.Forwarder.stats``)."""
        proc = self._forwarder
        if proc is None or proc.stdin is None or proc.stdout is None or proc.poll() is not None:
            raise WanError("the forwarder is not running (or runs detached)")
        with self._lock:
            proc.stdin.write("stats\n")
            proc.stdin.flush()
            line = _read_line(proc.stdout, 5.0)
        if not line:
            raise WanError("the forwarder did not answer")
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        """Tear everything down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        proc = self._forwarder
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the forwarder exits on end of input
        teardown(self.state)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
            if proc.stdout is not None:
                proc.stdout.close()


def _read_line(stream: IO[str], timeout_s: float) -> str:
    """One line from a pipe, or '' after ``timeout_s`` (a hung child must not hang us)."""
    import select

    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""
