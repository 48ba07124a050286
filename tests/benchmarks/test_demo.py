"""``firstbyte demo`` as a real process: loopback end to end, emulated (netns) end to end, bad
options, and teardown on Ctrl-C (no namespaces or processes left behind)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.benchmarks.procs import describe, namespaces_of
from tests.cli import FIRSTBYTE

TAG = "FIRSTBYTE_DEMO_TEST_TAG"


def demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run_demo(*args, timeout=timeout)[0]


def run_demo(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run the demo to completion; its result and its pid (which names its namespaces)."""
    argv = [*FIRSTBYTE, "demo", *args]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), proc.pid


def check_output(done: subprocess.CompletedProcess[str], out: Path) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    # the latency budget table: each phase against the 500 ms budget, and the safety share
    for phase in ("network", "first_byte", "first_token", "next_tokens", "render"):
        assert f"\n  {phase} " in done.stdout
    assert "\n  safety " in done.stdout
    assert "P95-P99 tail reserve" in done.stdout
    assert "500.0" in done.stdout
    assert "Latency budget: 500 ms end to end, 75 ms (15%)" in done.stdout
    assert f"report: {out / 'report.html'}" in done.stdout
    results: dict[str, Any] = msgspec.json.decode((out / "results.json").read_bytes())
    assert results["scenario"] == "demo"
    assert (out / "summary.md").read_text().startswith("# Benchmark: demo")
    page = (out / "report.html").read_text()
    for figure in ("ttft-dots", "ttft-cdf", "budget"):
        assert f'data-figure="{figure}"' in page
    assert "This was a quick run (--quick)" in page
    assert results["conditions"]["command"].startswith("firstbyte demo")
    runs = results["runs"]
    assert {run["transport"] for run in runs} == {"sse", "websocket", "longpoll"}
    assert {run["cell"].split("/")[2] for run in runs} == {"cold", "warm", "0rtt"}
    assert all(run["failed"] == 0 and run["completed"] >= 1 for run in runs), runs
    # progress goes to stderr, results to stdout
    assert "demo: streaming from" in done.stderr
    return results


def test_help_explains() -> None:
    done = demo("--help", timeout=30)
    assert done.returncode == 0
    text = re.sub(r"-\s+", "-", " ".join(done.stdout.split()))  # argparse wraps at hyphens
    for words in ("--loopback", "--out", "--quick", "firstbyte-report", "WAN emulator",
                  "latency budget"):
        assert words in text


def test_loopback_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = demo("--loopback", "--quick", "--out", str(out))
    results = check_output(done, out)
    assert "LOOPBACK MODE" in done.stdout
    assert "LOOPBACK MODE" in done.stderr
    assert "cannot show round-trip counts" in done.stdout
    assert results["summary"]["mode"] == "loopback"
    assert all(run["rtt_ms"] == 0 for run in results["runs"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--repeat", "0"], "--repeat must be within 1..50"),
        (["--out", "FILE"], "exists and is not a directory"),
        (["--out", "FILE/sub"], "cannot create --out"),  # under a file
    ],
)
def test_bad_options_are_clear_errors(tmp_path: Path, args: list[str], message: str) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    done = demo("--loopback", *[a.replace("FILE", str(file)) for a in args], timeout=30)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def tagged_processes(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``tag`` (children of one demo)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "status").read_text()
                if "\nState:\tZ" not in status:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found


def default_sigint() -> None:
    """In the child before exec: SIGINT back to its default, whatever the test run inherited.

    A shell starts background jobs (``nohup pytest ... &``) with SIGINT ignored, and an ignored
    signal stays ignored across exec: the demo would never see the Ctrl-C this test sends.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_mid_run(
    tmp_path: Path, *args: str, sig: signal.Signals = signal.SIGINT
) -> tuple[int, int, str]:
    """Start the demo, send ``sig`` once it streams, wait for it; (pid, exit code, stderr).
    The demo's temporary files go under ``tmp_path / "tmp"``: a demo killed with SIGKILL
    cannot remove them, and they stay with the test's own folder, not in the system's."""
    tag = uuid.uuid4().hex
    (tmp_path / "tmp").mkdir()
    proc = subprocess.Popen(
        [*FIRSTBYTE, "demo", "--out", str(tmp_path / "r"), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, TAG: tag, "TMPDIR": str(tmp_path / "tmp")},
        preexec_fn=default_sigint,
    )
    assert proc.stderr is not None
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            lines.append(line)
            if not line or "demo: streaming from" in line:
                break
        assert "demo: streaming from" in lines[-1], "".join(lines)[-3000:]
        assert tagged_processes(tag), "the demo's region processes should be running"
        time.sleep(1.0)  # the clients are mid-stream now
        proc.send_signal(sig)
        code = proc.wait(timeout=30)
        lines.append(proc.stderr.read())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: describe(pid) for pid in tagged_processes(tag)}
    assert left == {}, "processes left behind"
    return proc.pid, code, "".join(lines)


def test_the_demo_gets_ctrl_c_even_when_the_test_run_ignores_it() -> None:
    # As under `nohup pytest &`: this process ignores SIGINT, and the child would inherit that.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        child = subprocess.run(
            [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
            capture_output=True, text=True, check=True, preexec_fn=default_sigint)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "default_int_handler" in child.stdout  # Python's own: Ctrl-C raises KeyboardInterrupt


def test_ctrl_c_on_loopback_leaves_nothing_behind(tmp_path: Path) -> None:
    _, code, stderr = interrupt_mid_run(tmp_path, "--loopback", "--repeat", "20")
    assert code == 130, stderr[-3000:]
    assert "interrupted; every process and namespace of the demo has been removed" in stderr
    assert list((tmp_path / "tmp").iterdir()) == []  # and every temporary file


def test_sigterm_tears_down_like_ctrl_c(tmp_path: Path) -> None:
    _, code, stderr = interrupt_mid_run(tmp_path, "--loopback", "--repeat", "20",
                                        sig=signal.SIGTERM)
    assert code == 130, stderr[-3000:]


def test_helpers_of_a_killed_demo_end_by_themselves(tmp_path: Path) -> None:
    # SIGKILL allows no teardown: the region and client processes notice their parent is gone
    _, code, _ = interrupt_mid_run(tmp_path, "--loopback", "--repeat", "20", sig=signal.SIGKILL)
    assert code == -signal.SIGKILL


@pytest.mark.netns
def test_emulated_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done, pid = run_demo("--quick", "--out", str(out))
    results = check_output(done, out)
    assert "an emulated world" in done.stdout
    assert "LOOPBACK" not in done.stdout
    assert results["summary"]["mode"] == "emulated"
    # three regions, clients at real distances from them
    assert "region-us-east" in done.stderr
    assert "region-eu-central" in done.stderr
    assert "region-ap-northeast" in done.stderr
    rtts = {run["client"]: run["rtt_ms"] for run in results["runs"]}
    assert rtts == {"client-tokyo": 9.0, "client-london": 42.0}
    # at 42 ms a cold HTTP/2 request pays the TCP and TLS round trips; a warm one does not.
    # Lower bounds only: the emulator makes them physical, and noise can only add to a time.
    london = {run["cell"]: run for run in results["runs"] if run["client"] == "client-london"}
    cold, warm = london["sse/2/cold"], london["sse/2/warm"]
    assert cold["p50_connect_ms"] >= 2 * 42.0 * 0.98  # TCP handshake + TLS 1.3 handshake
    assert cold["p50_ttft_ms"] >= 3 * 42.0 * 0.98
    assert warm["p50_connect_ms"] == 0
    assert warm["p50_ttft_ms"] >= 42.0 * 0.98
    # the emulator's own precision is part of the report
    assert "emulator precision: every measured RTT within" in done.stdout
    assert len(results["emulator_precision"]) == 2 * 3  # per client: UDP, TCP connect, request
    assert namespaces_of(pid) == []


@pytest.mark.netns
def test_ctrl_c_in_the_emulated_world_leaves_nothing_behind(tmp_path: Path) -> None:
    pid, code, stderr = interrupt_mid_run(tmp_path, "--repeat", "20")
    assert code == 130, stderr[-3000:]
    assert "emulated world" in stderr
    assert namespaces_of(pid) == [], "namespaces left behind"
    assert list((tmp_path / "tmp").iterdir()) == [], "temporary files left behind"
