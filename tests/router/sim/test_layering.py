"""The sim is its own product inside ``router/``: of the router it uses only the hosting
(sockets, servers, the metrics text format), so it can move or ship apart from the router."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import firstbyte.router.sim

SIM_DIR = Path(firstbyte.router.sim.__file__).parent
ALLOWED = ("firstbyte.router.sim", "firstbyte.router.hosting")


def _allowed(module: str) -> bool:
    return module == "firstbyte.router" or module.startswith(
        (*ALLOWED, *(a + "." for a in ALLOWED))
    )


def _imported_modules(path: Path) -> list[str]:
    """Every module an import statement in ``path`` names, lazy ones inside functions too,
    relative imports resolved against the sim package."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = ["firstbyte", "router", "sim"][: 4 - node.level]
                base = ".".join([*parts, base] if base else parts)
            names += [base] + [f"{base}.{alias.name}" for alias in node.names]
    return names


def test_no_sim_module_imports_router_internals() -> None:
    sources = sorted(SIM_DIR.glob("*.py"))
    assert len(sources) > 5
    offending = {
        f"{path.name}: {name}"
        for path in sources
        for name in _imported_modules(path)
        if name.startswith(("firstbyte.router", "router")) and not _allowed(name)
    }
    assert not offending, sorted(offending)


def test_importing_the_whole_sim_loads_no_router_module_but_hosting() -> None:
    modules = [f"firstbyte.router.sim.{p.stem}" for p in sorted(SIM_DIR.glob("*.py")) if p.stem != "__init__"]
    code = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('firstbyte.router'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = json.loads(done.stdout)
    assert "firstbyte.router.sim.server" in loaded
    assert "firstbyte.router.hosting" in loaded
    assert [m for m in loaded if not _allowed(m)] == []
