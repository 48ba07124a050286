"""The packages' layering, read from their sources: protocol <- client_sdk, protocol <- router.

``firstbyte.protocol`` imports nothing of firstbyte; the SDK imports the protocol (and itself)
only; the router imports the protocol but not the SDK; the benchmarks may import anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# ``firstbyte`` itself (the version), ``firstbyte.cli`` (the dispatcher, home of CLIError) and
# ``firstbyte.tasks`` (stopping a task without swallowing a cancel) are the neutral top: every
# part may use them.
NEUTRAL = ("firstbyte", "firstbyte.cli", "firstbyte.tasks")
ALLOWED: dict[str, tuple[str, ...]] = {
    "protocol": ("firstbyte.protocol",),
    "client_sdk": (*NEUTRAL, "firstbyte.protocol", "firstbyte.client_sdk"),
    "router": (*NEUTRAL, "firstbyte.protocol", "firstbyte.router"),
}


def firstbyte_imports(path: Path, root: Path = ROOT) -> list[str]:
    """Every ``firstbyte...`` module ``path`` imports, at any depth, relative ones resolved."""
    package = path.relative_to(root).parent.parts
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(("firstbyte", *base, *([node.module] if node.module else [])))
            else:
                module = node.module or ""
            found.append(module)
    return [m for m in found if m == "firstbyte" or m.startswith("firstbyte.")]


def violations(package: str, root: Path = ROOT) -> list[str]:
    allowed = ALLOWED[package]
    out = []
    for path in sorted((root / package).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for module in firstbyte_imports(path, root):
            exact = module in allowed and module in NEUTRAL
            if not exact and not any(
                module.startswith(a + ".") or module == a for a in allowed if a not in NEUTRAL
            ):
                out.append(f"{rel} imports {module}")
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_may(package: str) -> None:
    assert violations(package) == []


def test_the_check_sees_violations(tmp_path: Path) -> None:
    """Plain, ``from``, nested and relative imports are all seen (a test of the test)."""
    (tmp_path / "router" / "sim").mkdir(parents=True)
    (tmp_path / "router" / "sim" / "x.py").write_text(
        "import firstbyte.router.app\n"
        "from firstbyte.client_sdk import AsyncClient\n"
        "from ...client_sdk._core import stream\n"
        "from .. import ws\n"
        "def f():\n    from firstbyte.benchmarks import world\n"
    )
    (tmp_path / "router" / "sim" / "cli.py").write_text(
        "from firstbyte.cli import CLIError\nfrom firstbyte.client_sdk.probe import main\n"
    )
    (tmp_path / "protocol").mkdir()
    (tmp_path / "protocol" / "y.py").write_text("from firstbyte.client_sdk import errors\n")
    assert violations("router", tmp_path) == [
        "router/sim/cli.py imports firstbyte.client_sdk.probe",
        "router/sim/x.py imports firstbyte.client_sdk",
        "router/sim/x.py imports firstbyte.client_sdk._core",
        "router/sim/x.py imports firstbyte.benchmarks",
    ]
    assert violations("protocol", tmp_path) == ["protocol/y.py imports firstbyte.client_sdk"]
