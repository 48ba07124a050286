"""The built wheel, installed with no extras into a clean virtualenv, as an application would.

One import name (``firstbyte``), the SDK importable without the router's or the benchmarks'
dependencies and without loading them, and every command that needs an extra saying which.
The wheel and the sdist are built in a checkout where ``firstbyte demo`` has run and
benchmarks have left their outputs, as the README's first command leaves it: they hold
``firstbyte/`` and nothing else of it. Needs PyPI (or pip's cache) for the base dependencies
and the build backend.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    "pyproject.toml",
    "setup.py",
    "README.md",
    "LICENSE",
    "MANIFEST.in",
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


JUNK = ("bench-results/run.json", "reports/index.html", "notes.py", "scratch/__init__.py")
"""What else lies in a working checkout besides the demo's firstbyte-report/: benchmark
outputs and a stray module and package of the operator's own."""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout after ``firstbyte demo --quick --loopback`` ran in it."""
    src = tmp_path_factory.mktemp("checkout") / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            # symlinks=True: firstbyte/client_sdk -> ../client_sdk stays a link into the copy.
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    # cwd=src: `python -m firstbyte` runs the copy, and the report lands in src/ as it would.
    demo = subprocess.run(
        [sys.executable, "-m", "firstbyte", "demo", "--quick", "--loopback"],
        cwd=src, env=_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert (src / "firstbyte-report" / "results.json").is_file()
    for junk in JUNK:
        (src / junk).parent.mkdir(parents=True, exist_ok=True)
        (src / junk).write_text("{}\n" if junk.endswith(".json") else "\n")
    return src


@pytest.fixture(scope="module")
def install(checkout: Path, tmp_path_factory: pytest.TempPathFactory) -> Install:
    tmp = tmp_path_factory.mktemp("packaging")
    # Built from a copy of the checkout: building in it would leave build/ behind, and the
    # sdist test builds from the same checkout.
    src = tmp / "src"
    shutil.copytree(checkout, src, symlinks=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=180)  # fmt: skip
    (wheel,) = (tmp / "dist").glob("firstbyte-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = _env()
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q",
         "install", str(wheel)],
        check=True, timeout=300, env=env, cwd=tmp,
    )  # fmt: skip
    (tmp / "app").mkdir()
    return Install(wheel, venv / "bin", tmp / "app")


def _modules() -> set[str]:
    """Every module of the package as it lies in the checkout (through the symlinks)."""
    found = set()
    # os.walk, not Path.rglob: rglob does not follow the symlinks (3.11).
    for directory, subdirs, files in os.walk(ROOT / "firstbyte", followlinks=True):
        subdirs[:] = [d for d in subdirs if d != "__pycache__"]
        relative = Path(directory).relative_to(ROOT).as_posix()
        found.update(f"{relative}/{name}" for name in files if name.endswith(".py"))
    assert len(found) > 100, found  # the parts behind the symlinks, not only firstbyte/*.py
    return found


def test_the_wheel_holds_one_top_level_name(install: Install) -> None:
    with zipfile.ZipFile(install.wheel) as wheel:
        names = wheel.namelist()
        top = {name.split("/")[0] for name in names}
        entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt")))
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    version = install.wheel.name.split("-")[1]
    dist_info = f"firstbyte-{version}.dist-info"
    assert top == {"firstbyte", dist_info}  # not firstbyte-report/ nor any of JUNK
    assert "firstbyte/client_sdk/client.py" in names
    assert "firstbyte/router/sim/server.py" in names
    assert "firstbyte/client_sdk/browser/firstbyte.js" in names  # the router serves it
    assert _modules() <= set(names)  # every part the symlinks reach
    assert {"firstbyte/py.typed", f"{dist_info}/licenses/LICENSE"} <= set(names)
    # The compiled per-chunk path was built into it (firstbyte.router.chunkpath).
    compiled = [n for n in names if n.startswith("firstbyte/router/_chunkpath.")]
    assert len(compiled) == 1, compiled
    assert compiled[0].endswith(".so")
    assert "firstbyte = firstbyte.cli:main" in entry_points.decode()
    assert "License-Expression: Apache-2.0" in metadata.decode().splitlines()


def test_the_sdist_holds_the_package_and_what_builds_it(
    checkout: Path, tmp_path: Path
) -> None:
    """``python -m build``: the sdist, then a wheel built from that sdist, whose files are
    then the same as the checkout's (nothing the sdist forgot)."""
    src = tmp_path / "src"
    shutil.copytree(checkout, src, symlinks=True)
    result = subprocess.run(
        [sys.executable, "-m", "build", "-o", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=400, check=False, env=_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # setuptools says "warning"/"Warning" for what it will stop accepting (a license table,
    # a data folder outside `packages`); byte-compiling is off in an isolated build.
    warnings = [line for line in (result.stdout + result.stderr).splitlines()
                if "warn" in line.lower() and "byte-compiling is disabled" not in line]
    assert warnings == []
    (sdist,) = (tmp_path / "dist").glob("firstbyte-*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("firstbyte-*.whl")
    root = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        members = {m.name.removeprefix(f"{root}/") for m in tar.getmembers() if m.isfile()}
        assert not [m.name for m in tar.getmembers() if m.issym() or m.islnk()]
    top = {name.split("/")[0] for name in members}
    assert top == {"firstbyte", "firstbyte.egg-info", "PKG-INFO", "pyproject.toml",
                   "setup.py", "README.md", "LICENSE", "MANIFEST.in", "setup.cfg"}  # fmt: skip
    assert _modules() | {"firstbyte/py.typed"} <= members
    assert "firstbyte/router/_chunkpath.c" in members  # the compiled path's source
    with zipfile.ZipFile(wheel) as built:
        names = set(built.namelist())
    # The wheel holds the compiled module where the sdist holds its C source.
    compiled = {n for n in names if n.startswith("firstbyte/router/_chunkpath.") and
                n.endswith(".so")}  # fmt: skip
    assert len(compiled) == 1, names
    assert {n for n in names if n.startswith("firstbyte/")} - compiled == {
        n for n in members if n.startswith("firstbyte/") and not n.endswith(".c")
    }


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


def test_a_module_deleted_since_the_last_build_is_not_in_the_next_wheel(tmp_path: Path) -> None:
    """The README builds in the checkout, where the last build's ``build/lib`` stays: a module
    since deleted (a ``git pull`` that removed or renamed it) must not ride along."""
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(ROOT / name, src / name)
    stale = src / "router" / "stale_module.py"
    stale.write_text('"""Deleted before the second build."""\n')
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps"]
    for build in ("first", "second"):
        subprocess.run([*pip, "-w", str(tmp_path / build), "."], cwd=src, env=_env(),
                       check=True, timeout=300)  # fmt: skip
        stale.unlink(missing_ok=True)
    (first,) = (tmp_path / "first").glob("firstbyte-*.whl")
    (second,) = (tmp_path / "second").glob("firstbyte-*.whl")
    assert "firstbyte/router/stale_module.py" in zipfile.ZipFile(first).namelist()
    names = zipfile.ZipFile(second).namelist()
    assert "firstbyte/router/stale_module.py" not in names
    assert "firstbyte/router/relay.py" in names or "firstbyte/router/chunkpath.py" in names
    assert [n for n in names if n.startswith("firstbyte/router/_chunkpath.")]  # still built
