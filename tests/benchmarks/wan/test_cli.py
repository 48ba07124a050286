"""``firstbyte wan``: clear errors without root or with a bad profile, and a real up / exec /
status / down cycle."""

from __future__ import annotations

import os
import subprocess

import pytest

from firstbyte.benchmarks.wan import netns
from firstbyte.benchmarks.wan.netns import python_env
from firstbyte.cli import main
from tests.cli import firstbyte


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return firstbyte(*args, env=python_env())


@pytest.mark.parametrize("action", [["precision"], ["up", "transpacific"], ["cleanup"], ["down"]])
def test_without_root_the_error_says_so(
    action: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # This machine's python lives under /root, so a real unprivileged user cannot start it;
    # pretend to be one for the check itself.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["wan", *action]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err
    assert "Traceback" not in err


def test_without_iproute2_the_error_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: object
) -> None:
    """Root with /dev/net/tun but no `ip` on PATH: one line (it was a FileNotFoundError
    traceback), so the demo and the benchmarks fall back to loopback."""
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os.path, "exists", lambda path: True)
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `ip`
    with pytest.raises(netns.WanUnavailable, match="needs iproute2's `ip` command"):
        netns.check_capable()
    assert main(["wan", "down"]) == 2
    err = capsys.readouterr().err
    assert "needs iproute2's `ip` command" in err
    assert "Traceback" not in err


def test_unknown_profile_is_a_clear_error() -> None:
    done = run("wan", "up", "no-such-profile")
    assert done.returncode == 2
    assert "no profile 'no-such-profile'" in done.stderr
    assert "transpacific" in done.stderr
    assert "Traceback" not in done.stderr


def test_precision_rejects_bad_numbers() -> None:
    done = run("wan", "precision", "--count", "0")
    assert done.returncode == 2
    assert "--count" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.netns
def test_up_exec_status_down() -> None:
    up = run("wan", "up", "transpacific")
    assert up.returncode == 0, up.stderr
    run_id = up.stdout.split()[2]
    try:
        assert "client-beijing" in up.stdout
        assert "192.0.2.10" in up.stdout
        state = netns.RunState.load(netns.STATE_DIR / f"{run_id}.json")
        assert state.detached
        assert set(state.namespaces.values()) <= set(netns.list_namespaces())
        # The forwarder outlives the command that started it.
        assert state.forwarder_pid is not None
        assert netns.is_alive(state.forwarder_pid, state.forwarder_start)
        ex = run("wan", "exec", "client-beijing", "--", "ip", "-o", "-4", "addr")
        assert ex.returncode == 0, ex.stderr
        assert "192.0.2.10/32" in ex.stdout
        status = run("wan", "status")
        assert run_id in status.stdout
        assert "alive" in status.stdout
        # A live `up` run is not stale.
        assert run("wan", "cleanup").returncode == 0
        assert set(state.namespaces.values()) <= set(netns.list_namespaces())
        missing = run("wan", "exec", "nobody", "--", "true")
        assert missing.returncode == 2
        assert "no running emulator has a host 'nobody'" in missing.stderr
    finally:
        down = run("wan", "down", run_id)
    assert down.returncode == 0, down.stderr
    assert f"run {run_id} down" in down.stdout
    assert not set(state.namespaces.values()) & set(netns.list_namespaces())
    assert not netns.is_alive(state.forwarder_pid, state.forwarder_start)


@pytest.mark.netns
def test_down_needs_a_name_when_several_runs_are_up() -> None:
    ids = []
    try:
        for _ in range(2):
            up = run("wan", "up", "transpacific")
            assert up.returncode == 0, up.stderr
            ids.append(up.stdout.split()[2])
        down = run("wan", "down")
        assert down.returncode == 2
        assert "several runs are up" in down.stderr
        assert all(i in down.stderr for i in ids)
    finally:
        for run_id in ids:
            assert run("wan", "down", run_id).returncode == 0
