"""deploy/systemd: the unit runs what the image runs, hardened, and systemd accepts it.

The unit is never started here (this machine's PID 1 is not systemd): `systemd-analyze verify`
checks its syntax, directives and commands; the tests below check what it promises.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from firstbyte.router.config import ListenConfig
from tests.deploy.containerfile import ROOT, read_stages

SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "firstbyte-router.service"

Unit = dict[str, dict[str, list[str]]]


def read_unit(path: Path) -> Unit:
    """Sections -> key -> every value given (a key may repeat, e.g. SystemCallFilter)."""
    unit: Unit = defaultdict(lambda: defaultdict(list))
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        unit[section][key.strip()].append(value.strip())
    return unit


def drain_timeout_s() -> float:
    """How long the router lets in-flight streams finish after SIGTERM (listen.drain_timeout_s)."""
    configured: float = ListenConfig().drain_timeout_s
    return configured


def test_the_unit_runs_the_image_entry_point() -> None:
    service = read_unit(UNIT)["Service"]
    (_, final) = read_stages()
    assert shlex.split(service["ExecStart"][0]) == final.one("ENTRYPOINT").exec_form()
    (check,) = service["ExecStartPre"]
    assert shlex.split(check) == [
        "/opt/firstbyte/bin/firstbyte", "router", "--check-config", "/etc/firstbyte/router.toml",
    ]  # fmt: skip
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["Restart"] == ["on-failure"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert float(service["TimeoutStopSec"][0]) > drain_timeout_s() + 10


def test_the_unit_runs_unprivileged_with_room_for_connections() -> None:
    service = read_unit(UNIT)["Service"]
    sysusers = (SYSTEMD / "firstbyte.sysusers").read_text().split("\n")
    (user_line,) = [line for line in sysusers if line.startswith("u ")]
    assert service["User"] == [shlex.split(user_line)[1]]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
    }.items():
        assert service[key] == [value], key
    assert int(service["LimitNOFILE"][0]) >= 65536


def test_the_port_443_drop_in_grants_one_capability() -> None:
    service = read_unit(SYSTEMD / "port-443.conf")["Service"]
    assert dict(service) == {
        "CapabilityBoundingSet": ["CAP_NET_BIND_SERVICE"],
        "AmbientCapabilities": ["CAP_NET_BIND_SERVICE"],
    }


@pytest.mark.parametrize("drop_in", [False, True], ids=["unit", "with-port-443"])
def test_systemd_analyze_verifies_the_unit(tmp_path: Path, drop_in: bool) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        why = "systemd-analyze is not installed (Debian: apt-get install systemd)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)  # CI's machines have it: a skip there would hide the check
        pytest.skip(why)
    # verify checks that the commands exist: point them at a stand-in for the venv's script.
    program = tmp_path / "firstbyte"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/firstbyte/bin/firstbyte", str(program)))
    if drop_in:
        (tmp_path / f"{UNIT.name}.d").mkdir()
        shutil.copy(SYSTEMD / "port-443.conf", tmp_path / f"{UNIT.name}.d" / "port-443.conf")
    result = subprocess.run([analyze, "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    # Unknown or misspelt directives are only warnings (exit 0): no output at all is the bar.
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
