"""The emulator through real network namespaces, TUN devices and the forwarder: measured RTT
against configured, handshake costs in round trips, isolation, teardown and crash cleanup."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from firstbyte.benchmarks.stats import percentile
from firstbyte.benchmarks.wan import Emulator, Host, PairPrecision, PrecisionReport, netns
from firstbyte.benchmarks.wan.netns import python_env
from tests.machine import alone, steadiest

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module", autouse=True)
def _machine_to_this_module() -> Iterator[None]:
    """Timing through the emulator reads the host too: the other workers wait (tests/machine.py)."""
    with alone():
        yield

RTT = 150.0
CLIENT, SERVER, NEAR = "client-tokyo", "region-us", "region-ap"
HOSTS = [Host(CLIENT, "192.0.2.10"), Host(SERVER, "198.51.100.10"), Host(NEAR, "198.51.100.11")]


@pytest.fixture(scope="module")
def wan() -> Iterator[Emulator]:
    with Emulator(HOSTS, {(CLIENT, SERVER): RTT, (CLIENT, NEAR): 20.0}) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def report(wan: Emulator) -> PrecisionReport:
    bounds = {"udp": 1.0, "tcp-connect": 1.0, "tcp-request": 1.0}
    return steadiest(
        lambda: wan.precision([(CLIENT, SERVER)], count=20, methods=("udp", "tcp")),
        lambda r: all(precise(p, bounds[p.method]) for p in r.pairs),
    )


def precise(pair: PairPrecision, own_bound_ms: float) -> bool:
    """:func:`assert_precise` as a predicate."""
    return (
        0.0 <= pair.floor_error_ms <= own_bound_ms
        and 0.0 <= pair.error_ms <= max(own_bound_ms, 0.1 * pair.configured_rtt_ms)
    )


def _result(report: PrecisionReport, method: str) -> PairPrecision:
    (pair,) = [p for p in report.pairs if p.method == method]
    assert pair.configured_rtt_ms == RTT
    assert pair.samples == 20
    assert pair.lost == 0
    return pair


def assert_precise(pair: PairPrecision, own_bound_ms: float, report: PrecisionReport) -> None:
    """The emulator adds at most ``own_bound_ms`` to a round trip and never delivers early
    (the fastest sample: a busy host only delays packets, it never speeds them up); the
    median, host included, stays within the 10% of configured that benchmarks judge by.
    The median alone drifted +3-4 ms on hours when the suite's other tests held both cores."""
    assert 0.0 <= pair.floor_error_ms <= own_bound_ms, report.render()
    assert pair.min_ms <= pair.median_ms, report.render()
    assert 0.0 <= pair.error_ms <= max(own_bound_ms, 0.1 * pair.configured_rtt_ms), report.render()


def test_udp_echo_rtt_matches_configured_within_1ms(report: PrecisionReport) -> None:
    assert_precise(_result(report, "udp"), 1.0, report)


def test_tcp_connect_costs_one_rtt_within_1ms(report: PrecisionReport) -> None:
    assert_precise(_result(report, "tcp-connect"), 1.0, report)


def test_tcp_request_response_costs_one_rtt(report: PrecisionReport) -> None:
    # timed by the kernel's receive stamps, the echo server's hold subtracted: the emulator's
    # own cost, as tight as the other probes' (it read +2.4 to +3.8 ms timed by wake-ups)
    assert_precise(_result(report, "tcp-request"), 1.0, report)


def test_forwarder_reports_its_lateness(report: PrecisionReport) -> None:
    late = report.forwarder["lateness_us"]
    assert late["samples"] >= 20 * 2 * 3
    # Most packets leave on time: the forwarder polls through the last stretch before a
    # release, for as long as its recent sleeps overslept (a fixed 200 us read 200-400 us
    # at the median on hours when a woken virtual CPU was a millisecond late).
    assert late["p50"] < 100, report.forwarder
    assert 200 <= report.forwarder["wake_margin_us"] <= 3000
    assert report.forwarder["forwarded"] >= late["samples"]
    assert report.forwarder["lost"] == 0
    assert "max_abs_error_ms" in report.to_dict()


def test_each_pair_has_its_own_delay(wan: Emulator) -> None:
    near = steadiest(lambda: wan.precision([(CLIENT, NEAR)], count=20),
                     lambda r: precise(r.pairs[0], 1.0))
    (pair,) = near.pairs
    assert pair.configured_rtt_ms == 20.0
    assert_precise(pair, 1.0, near)
    # the pair nobody configured gets default_rtt_ms (0): just the forwarder's own cost
    direct = steadiest(lambda: wan.precision([(SERVER, NEAR)], count=10),
                       lambda r: r.pairs[0].min_ms < 1.0 and r.pairs[0].median_ms < 5.0)
    assert direct.pairs[0].min_ms < 1.0, direct.render()
    assert direct.pairs[0].median_ms < 5.0, direct.render()


def test_namespaces_have_no_route_outside_the_emulated_prefixes(wan: Emulator) -> None:
    code = textwrap.dedent(
        """
        import socket
        for target in ("8.8.8.8", "10.0.0.1", "127.0.0.53"):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                s.connect((target, 53))
                s.send(b"x")
                print(target, "sent")
            except OSError as exc:
                print(target, exc.errno)
        """
    )
    out = wan.run_sync(CLIENT, [sys.executable, "-c", code]).stdout.split("\n")
    import errno

    assert f"8.8.8.8 {errno.ENETUNREACH}" in out
    assert f"10.0.0.1 {errno.ENETUNREACH}" in out
    # loopback inside the namespace is its own, not the machine's resolver
    assert "127.0.0.53 sent" in out or f"127.0.0.53 {errno.ECONNREFUSED}" in out
    routes = wan.run_sync(CLIENT, ["ip", "route", "show", "table", "all"]).stdout
    assert "default" not in routes


SERVER_CODE = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    req = b""
    while not req.endswith(b"\\r\\n\\r\\n"):
        req += c.recv(4096)
    c.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok")
    c.close()
"""

CLIENT_CODE = """
import json, socket, sys, time
s = socket.socket()  # no getaddrinfo: its first call loads NSS modules (~1 ms of CPU)
t0 = time.perf_counter()
s.connect((sys.argv[1], int(sys.argv[2])))
t1 = time.perf_counter()
s.sendall(b"GET / HTTP/1.1\\r\\nhost: x\\r\\n\\r\\n")
first = s.recv(1)
t2 = time.perf_counter()
print(json.dumps({"connect_ms": (t1 - t0) * 1e3, "first_byte_ms": (t2 - t1) * 1e3}))
"""


async def test_async_api_cold_request_costs_two_rtts() -> None:
    rtt = 80.0
    hosts = [Host("c", "192.0.2.20"), Host("s", "203.0.113.20")]
    async with Emulator(hosts, {("c", "s"): rtt}) as wan:
        server = await wan.spawn(
            "s", [sys.executable, "-c", SERVER_CODE, "203.0.113.20"], stdout=subprocess.PIPE
        )
        assert server.stdout is not None
        port = int(await server.stdout.readline())
        results = []
        for _ in range(5):
            run = await wan.run("c", [sys.executable, "-c", CLIENT_CODE, "203.0.113.20", str(port)])
            assert run.returncode == 0, run.stderr
            results.append(json.loads(run.stdout))
        connect = percentile([r["connect_ms"] for r in results], 50)
        first_byte = percentile([r["first_byte_ms"] for r in results], 50)
        # TCP handshake = 1 RTT, then request -> first response byte = 1 RTT. These endpoints
        # are ordinary processes (not SCHED_FIFO like the probes): allow them some wake-up time.
        assert rtt <= connect <= rtt + 5, results
        assert rtt <= first_byte <= rtt + 5, results
        namespaces = list(wan.network.state.namespaces.values())
    assert server.returncode is not None  # killed on exit
    assert not set(namespaces) & set(netns.list_namespaces())


def _our_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_teardown_removes_everything_and_is_idempotent() -> None:
    wan = Emulator([Host("a", "192.0.2.30"), Host("b", "192.0.2.31")], {("a", "b"): 10.0})
    wan.start()
    state = wan.network.state
    sleeper = wan.popen("a", ["sleep", "300"])
    assert set(state.namespaces.values()) <= set(netns.list_namespaces())
    assert state.path.exists()
    wan.stop()
    wan.stop()
    assert sleeper.wait(timeout=5) is not None
    assert not set(state.namespaces.values()) & set(netns.list_namespaces())
    assert not state.path.exists()
    assert not any(tun in _our_links() for tun in state.tuns.values())
    assert state.forwarder_pid is not None
    assert netns.process_start_time(state.forwarder_pid) is None
    netns.teardown(state)  # once more from the record alone: nothing left, no error


CRASHING_OWNER = """
import os, sys, time
from firstbyte.benchmarks.wan import Emulator, Host
wan = Emulator([Host("x", "192.0.2.40"), Host("y", "198.51.100.40")], {("x", "y"): 10.0}).start()
sleeper = wan.popen("y", ["sleep", "300"])
state = wan.network.state
print(state.run_id, state.forwarder_pid, sleeper.pid, flush=True)
time.sleep(300)
"""


def test_cleanup_after_a_crash_removes_only_dead_runs(wan: Emulator) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", CRASHING_OWNER],
        stdout=subprocess.PIPE,
        text=True,
        env=python_env(),
    )
    try:
        assert owner.stdout is not None
        run_id, forwarder_pid, sleeper_pid = owner.stdout.readline().split()
        state = netns.RunState.load(netns.STATE_DIR / f"{run_id}.json")
        # The crash: owner and forwarder die without any cleanup.
        os.kill(int(forwarder_pid), signal.SIGKILL)
        owner.kill()
        owner.wait(timeout=5)
    finally:
        if owner.poll() is None:
            owner.kill()
    deadline = time.monotonic() + 5
    while netns.process_start_time(int(forwarder_pid)) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    # Left behind: namespaces, the process inside one, the state file.
    assert set(state.namespaces.values()) <= set(netns.list_namespaces())
    assert netns.process_start_time(int(sleeper_pid)) is not None
    assert state.path.exists()

    removed = netns.cleanup_stale()
    assert set(state.namespaces.values()) <= set(removed)
    assert not set(state.namespaces.values()) & set(netns.list_namespaces())
    assert not state.path.exists()
    deadline = time.monotonic() + 5
    while netns.process_start_time(int(sleeper_pid)) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert netns.process_start_time(int(sleeper_pid)) is None
    # The live run of this process was not touched and still forwards.
    assert set(wan.network.state.namespaces.values()) <= set(netns.list_namespaces())
    assert wan.precision([(CLIENT, NEAR)], count=3).pairs[0].lost == 0
    # (Other runs on this machine may be stale; ours are not.)
    assert not set(wan.network.state.namespaces.values()) & set(netns.cleanup_stale())


def test_loss_and_rate_limit_through_real_namespaces() -> None:
    hosts = [Host("a", "192.0.2.50"), Host("b", "192.0.2.51")]
    with Emulator(hosts, {("a", "b"): 10.0}, loss_pct=30.0, seed=1) as lossy:
        report = lossy.precision([("a", "b")], count=60)
        # each echo crosses two lossy directions: ~51% lost
        assert 15 <= report.pairs[0].lost <= 45, report.render()
        assert report.forwarder["lost"] >= report.pairs[0].lost
    bulk = textwrap.dedent(
        """
        import socket, sys, time
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        t0 = time.perf_counter()
        s.sendall(b"x" * 400_000)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        print(time.perf_counter() - t0)
        """
    )
    sink = textwrap.dedent(
        """
        import socket, sys
        s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)
        print(s.getsockname()[1], flush=True)
        c, _ = s.accept()
        while c.recv(65536):
            pass
        c.sendall(b"k")
        """
    )
    with Emulator(hosts, {("a", "b"): 10.0}, rate_mbit=8.0) as slow:
        server = slow.popen(
            "b", [sys.executable, "-c", sink, "192.0.2.51"], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        seconds = float(slow.run_sync("a", [sys.executable, "-c", bulk, "192.0.2.51", port]).stdout)
    # 400 kB at 8 Mbit/s = 0.4 s of serialisation (plus headers and slow start).
    assert 0.4 <= seconds <= 1.5


TLS_SERVER = """
import socket, ssl, sys
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
ctx.load_cert_chain(sys.argv[2])
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
while True:
    raw, _ = s.accept()
    try:
        c = ctx.wrap_socket(raw, server_side=True)
        req = b""
        while not req.endswith(b"\\r\\n\\r\\n"):
            req += c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok")
        c.close()
    except (ssl.SSLError, OSError):
        raw.close()
"""

TLS_CLIENT = """
import json, socket, ssl, sys, time
ctx = ssl.create_default_context(cafile=sys.argv[3])
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
out = []
for _ in range(3):
    raw = socket.socket()
    # Without TCP_NODELAY, Nagle holds the request behind the unacknowledged TLS Finished:
    # one more RTT (which this emulator shows, as a real path does).
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    raw.connect((sys.argv[1], int(sys.argv[2])))
    t1 = time.perf_counter()
    c = ctx.wrap_socket(raw, server_hostname="region.test")
    t2 = time.perf_counter()
    c.sendall(b"GET / HTTP/1.1\\r\\nhost: region.test\\r\\n\\r\\n")
    c.recv(1)
    t3 = time.perf_counter()
    out.append([(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3])
    c.close()
print(json.dumps(out))
"""


def test_cold_tls13_request_costs_three_rtts(tmp_path: Path) -> None:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("region.test")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    rtt = 60.0
    hosts = [Host("c", "192.0.2.70"), Host("s", "198.51.100.70")]
    with Emulator(hosts, {("c", "s"): rtt}) as wan:
        server = wan.popen(
            "s",
            [sys.executable, "-c", TLS_SERVER, "198.51.100.70", str(tmp_path / "server.pem")],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        run = wan.run_sync(
            "c", [sys.executable, "-c", TLS_CLIENT, "198.51.100.70", port, str(tmp_path / "ca.pem")]
        )
        assert run.returncode == 0, run.stderr
    phases = json.loads(run.stdout)
    connect, handshake, first_byte = (percentile([p[i] for p in phases], 50) for i in range(3))
    # TCP: 1 RTT; TLS 1.3: 1 RTT (+ its crypto); request to first byte: 1 RTT. The slack is a
    # quarter of an RTT a phase (the Python ends' own work, which CI's load stretched to 8 ms
    # on a slow machine): another round trip or a delayed ACK (40 ms) still fails it.
    slack = rtt / 4
    assert rtt <= connect <= rtt + slack, phases
    assert rtt <= handshake <= rtt + slack, phases
    assert rtt <= first_byte <= rtt + slack, phases
    assert 3 * rtt <= connect + handshake + first_byte <= 3 * rtt + 2 * slack, phases


def test_jitter_spreads_round_trips_within_its_bound() -> None:
    hosts = [Host("a", "192.0.2.80"), Host("b", "192.0.2.81")]

    def within(rtts: list[float]) -> bool:
        slowest = sorted(rtts)
        return slowest[0] >= 30.0 and slowest[-3] <= 51.0 and slowest[-1] <= 55.0

    with Emulator(hosts, {("a", "b"): 40.0}, jitter_ms=5.0, seed=2) as wan:
        (pair,) = wan.precision([("a", "b")], count=40).pairs
        argv = [
            sys.executable, "-m", "firstbyte.benchmarks.wan.echo", "udp-ping",
            "--to", "192.0.2.81", "--port", str(wan.echo_port("b", "udp")),
            "--count", "40", "--interval-ms", "25",
        ]
        rtts: list[float] = steadiest(
            lambda: json.loads(wan.run_sync("a", argv).stdout)["rtt_ms"], within
        )
    assert pair.lost == 0
    # Each direction moves by up to +-5 ms: round trips land within 30..50 ms (plus the
    # forwarder's own sub-millisecond cost) and really do spread. Never early; the host may
    # hold back a packet or two by a millisecond (one read 51.4 ms), so the two slowest of
    # 40 may pass 51 ms, but none by more than the jitter itself.
    slowest = sorted(rtts)
    assert slowest[0] >= 30.0, rtts
    assert slowest[-3] <= 51.0, rtts
    assert slowest[-1] <= 55.0, rtts
    assert slowest[-1] - slowest[0] > 4.0, rtts


def test_geography_profile_runs_with_its_configured_rtts() -> None:
    from firstbyte.benchmarks.wan import geo

    profile = geo.load_profile("transpacific")
    with profile.emulator() as wan:
        report = steadiest(lambda: wan.precision(count=8),
                           lambda r: all(precise(p, 1.0) for p in r.pairs))
    sites = {s.name: s for s in profile.sites}
    assert len(report.pairs) == 3
    for pair in report.pairs:
        assert pair.configured_rtt_ms == profile.rtt_ms(sites[pair.src], sites[pair.dst])
        assert pair.samples == 8
        assert_precise(pair, 1.0, report)


def _congestion_control(wan: Emulator, host: str) -> str:
    argv = wan.command(host, [sys.executable, "-c", "print(open("
                              "'/proc/sys/net/ipv4/tcp_congestion_control').read().strip())"])
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def test_a_client_host_runs_its_own_congestion_control_and_the_machine_is_put_back() -> None:
    allowed = netns.ALLOWED_CC.read_text()
    machine = netns.CC_IN_NAMESPACE.read_text().strip()
    hosts = [Host("cc-client", "192.0.2.30", "cubic"), Host("cc-server", "198.51.100.30")]
    with Emulator(hosts) as wan:
        assert _congestion_control(wan, "cc-client") == "cubic"
        assert _congestion_control(wan, "cc-server") == machine
        assert "cubic" in netns.ALLOWED_CC.read_text().split()
    assert netns.ALLOWED_CC.read_text() == allowed
