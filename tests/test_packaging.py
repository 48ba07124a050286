"""The built wheel, installed with no extras into a clean virtualenv, as an application would.

One import name (``firstbyte``), the SDK importable without the router's or the benchmarks'
dependencies and without loading them, and every command that needs an extra saying which.
Needs PyPI (or pip's cache) for the base dependencies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    "pyproject.toml",
    "README.md",
    "firstbyte",
    *sorted(link.name for link in (ROOT / "firstbyte").iterdir() if link.is_symlink()),
)
"""What the wheel is built from: the package folder and every part its symlinks reach. Copied first: building in the checkout would leave build/
behind, and setuptools would put a stale build/'s deleted modules into later wheels."""


@dataclass(frozen=True)
class Install:
    wheel: Path
    bin: Path
    cwd: Path
    """Where the venv's commands run: not the checkout, whose folders would be importable."""

    def run(self, program: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        return subprocess.run(
            [str(self.bin / program), *args],
            capture_output=True, text=True, timeout=60, cwd=self.cwd, env=env, check=False,
        )  # fmt: skip


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            # symlinks=True: firstbyte/client_sdk -> ../client_sdk stays a link into the copy.
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=180)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("firstbyte-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q",
         "install", str(wheel)],
        check=True, timeout=300, env=env, cwd=tmp,
    )  # fmt: skip
    (tmp / "app").mkdir()
    return Install(wheel, venv / "bin", tmp / "app")


def test_the_wheel_holds_one_top_level_name(install: Install) -> None:
    with zipfile.ZipFile(install.wheel) as wheel:
        names = wheel.namelist()
        top = {name.split("/")[0] for name in names}
        entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt")))
    version = install.wheel.name.split("-")[1]
    assert top == {"firstbyte", f"firstbyte-{version}.dist-info"}
    assert "firstbyte/client_sdk/client.py" in names
    assert "firstbyte/router/sim/server.py" in names
    assert "firstbyte/client_sdk/browser/firstbyte.js" in names  # the router serves it
    assert "firstbyte = firstbyte.cli:main" in entry_points.decode()


def test_the_sdk_imports_alone(install: Install) -> None:
    code = """
import importlib, json, sys
bare = {}
for name in ("router", "benchmarks", "client_sdk"):
    try:
        importlib.import_module(name)
        bare[name] = "imported"
    except ModuleNotFoundError:
        bare[name] = "missing"
import firstbyte.client_sdk
from firstbyte.client_sdk import AsyncClient
heavy = ("firstbyte.router", "firstbyte.benchmarks", "matplotlib", "hypercorn", "aioquic")
print(json.dumps({"bare": bare, "file": firstbyte.client_sdk.__file__,
                  "loaded": sorted(m for m in sys.modules if m.startswith(heavy))}))
"""
    result = install.run("python", "-c", code)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["bare"] == {"router": "missing", "benchmarks": "missing", "client_sdk": "missing"}
    assert "site-packages" in found["file"]  # the installed copy, not the checkout
    assert found["loaded"] == []


def test_version(install: Install) -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    for program, args in (("firstbyte", ()), ("python", ("-m", "firstbyte"))):
        result = install.run(program, *args, "--version")
        assert (result.returncode, result.stdout) == (0, f"firstbyte {version}\n"), result.stderr


def test_the_probe_runs_without_extras(install: Install) -> None:
    result = install.run("firstbyte", "probe", "--help")
    assert result.returncode == 0, result.stderr
    assert "--transport" in result.stdout


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["sim", "--host", "127.0.0.1", "--port", "0"], "router"),
        (["router", "--upstream", "http://127.0.0.1:1", "--insecure-plain-http",
          "--api-key", "k" * 16, "--host", "127.0.0.1", "--port", "0"], "router"),
        (["demo", "--help"], "bench"),
        (["bench", "decode"], "bench"),
    ],
)
def test_a_command_without_its_extra_says_which(
    install: Install, argv: list[str], extra: str
) -> None:
    result = install.run("firstbyte", *argv)
    assert result.returncode == 2
    assert result.stdout == ""
    line = result.stderr
    assert line.startswith(f"firstbyte {argv[0]}: needs the {extra!r} extra (missing module ")
    assert line.endswith(f": pip install 'firstbyte[{extra}]'\n")
    assert line.count("\n") == 1, line
