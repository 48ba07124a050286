"""The top-level ``firstbyte`` command: version, dispatch, lazy imports, missing extras."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.cli import firstbyte

ROOT = Path(__file__).resolve().parent.parent

HEAVY = ("firstbyte.router", "firstbyte.benchmarks", "hypercorn", "matplotlib", "aioquic")
"""What ``firstbyte probe`` must not import: the router, the benchmarks, their servers and
plots, and HTTP/3 until it is asked for."""


def _loaded(*args: str) -> set[str]:
    """The modules ``firstbyte ARGS...`` has imported when it exits (``-X importtime`` would miss
    the ones ``importlib.import_module`` loads, so the child reports ``sys.modules``)."""
    code = (
        "import contextlib, io, json, sys\n"
        "from firstbyte.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(sys.argv[1:])\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    loaded: list[str] = json.loads(result.stdout)
    return set(loaded)


def test_version_is_the_project_version() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    result = firstbyte("--version")
    assert (result.returncode, result.stdout, result.stderr) == (0, f"firstbyte {version}\n", "")


def test_probe_imports_only_the_sdk() -> None:
    loaded = _loaded("probe", "--help")
    assert "firstbyte.client_sdk.probe" in loaded  # the measurement sees the subcommand
    heavy = sorted(m for m in loaded if m.startswith(HEAVY))
    assert heavy == []


def test_each_subcommand_imports_only_its_own_module() -> None:
    loaded = _loaded("sim", "--help")
    assert "firstbyte.router.sim.cli" in loaded
    assert not any(m.startswith(("firstbyte.benchmarks", "firstbyte.client_sdk.probe"))
                   for m in loaded)


def test_no_command_prints_the_list() -> None:
    result = firstbyte()
    assert result.returncode == 2
    for name in ("sim", "probe", "router", "bench", "wan", "demo"):
        assert f"\n    {name} " in result.stdout


def test_unknown_command_is_one_usage_error() -> None:
    result = firstbyte("nope")
    assert result.returncode == 2
    assert "invalid choice: 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["bench", "decode", "--quik"], "firstbyte bench decode: error: unrecognized arguments:"
                                        " --quik (see firstbyte bench decode --help)"),
        (["probe", "https://localhost:1/v1", "extra"],
         "firstbyte probe: error: unrecognized arguments: extra (see firstbyte probe --help)"),
        (["--bogus"], "firstbyte: error: unrecognized arguments: --bogus (see firstbyte --help)"),
    ],
)
def test_a_mistyped_option_names_the_command_it_was_given_to(argv: list[str], said: str) -> None:
    """argparse answered every stray option with the top-level usage line."""
    result = firstbyte(*argv)
    assert result.returncode == 2
    assert result.stderr == said + "\n"


@pytest.mark.parametrize(
    ("argv", "blocked", "extra"),
    [
        (["sim", "--host", "127.0.0.1", "--port", "0"], "uvicorn", "router"),
        (["demo", "--help"], "trustme", "bench"),
    ],
)
def test_a_missing_dependency_names_the_extra(argv: list[str], blocked: str, extra: str) -> None:
    # A None entry in sys.modules makes importing that module raise ModuleNotFoundError, as on
    # an install without the extra (tests/test_packaging.py checks a real one).
    code = f"import sys; sys.modules[{blocked!r}] = None; from firstbyte.cli import main; " \
        "sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        f"firstbyte {argv[0]}: needs the {extra!r} extra (missing module {blocked!r}):"
        f" pip install -e '.[{extra}]'\n"
    )
