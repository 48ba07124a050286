"""The operator pages name only what exists: config keys, `firstbyte router` flags, metric
families, and (in router.md's "Reload") every key a reload refuses."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from firstbyte.router.cli import add_arguments
from firstbyte.router.config import RouterConfig
from firstbyte.router.reload import RESTART_KEYS

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / name for name in
         ("deployment.md", "observability.md", "limits.md", "router.md")]
_CODE = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"(?<![\w./\[-])([a-z_]+)\.([a-z][a-z0-9_]*)(?![\w(/.\[-])")
_METRIC = re.compile(r"\b((?:firstbyte|process)_[a-z0-9_]*[a-z0-9])\b")
_RENAMED = {"firstbyte_peer_rtt_ms"}
"""Old names the "Renamed metrics" table lists: they are gone on purpose."""


def _keys() -> dict[str, set[str]]:
    """Config section -> its keys (``""``: the top level)."""
    out: dict[str, set[str]] = {"": set()}

    def struct_of(info: Any) -> Any:
        if isinstance(info, msgspec.inspect.UnionType):
            found = [struct_of(t) for t in info.types]
            return next((t for t in found if t is not None), None)
        if isinstance(info, msgspec.inspect.ListType):
            return struct_of(info.item_type)
        return info if isinstance(info, msgspec.inspect.StructType) else None

    for field in msgspec.inspect.type_info(RouterConfig).fields:  # type: ignore[attr-defined]
        out[""].add(field.name)
        inner = struct_of(field.type)
        if inner is not None:
            out[field.name] = {f.name for f in inner.fields}
    return out


def _source_text() -> str:
    files = [*(ROOT / "router").rglob("*.py"), *(ROOT / "router").glob("*.c")]
    return "\n".join(path.read_text() for path in files)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_config_keys_exist(page: Path) -> None:
    keys = _keys()
    unknown = set()
    for code in _CODE.findall(page.read_text()):
        for section, name in _DOTTED.findall(code):
            if section in keys and section and name not in keys[section]:
                unknown.add(f"{section}.{name}")
    assert not unknown, f"{page.name} names config keys that do not exist: {sorted(unknown)}"


def test_router_flag_table_names_real_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    known = {flag for action in parser._actions for flag in action.option_strings}
    text = (ROOT / "docs" / "router.md").read_text()
    table = re.search(r"^\| flag \| meaning \|\n(.*?)\n\n", text, re.M | re.S)
    assert table, "router.md has no flag table"
    named = set(re.findall(r"(?<![\w-])(-v|--[a-z][a-z0-9-]*)", table.group(1)))
    assert named - known == set(), f"router.md's flag table: no such flags {named - known}"
    # And every flag the router has is in the table (-h aside).
    assert known - named - {"-h", "--help", "--pid"} == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_metrics_are_emitted_by_the_router(page: Path) -> None:
    source = _source_text()
    # Families named in an f-string (f"firstbyte_backend_{name}"): the prefix, then a quoted rest.
    prefixes = re.findall(r'f"((?:firstbyte|process)_[a-z_]*)\{', source)

    def emitted(base: str) -> bool:
        if f'"{base}' in source or f"'{base}" in source:
            return True
        return any(base.startswith(p) and f'"{base[len(p):]}"' in source for p in prefixes)

    missing = set()
    for code in _CODE.findall(page.read_text()):
        for name in _METRIC.findall(code):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            if name not in _RENAMED and not emitted(base):
                missing.add(name)
    assert not missing, f"{page.name} names metrics the router does not emit: {sorted(missing)}"


def test_reload_section_names_every_key_that_needs_a_restart() -> None:
    text = (ROOT / "docs" / "router.md").read_text()
    section = re.search(r"^## Reload\n(.*?)(?=^## )", text, re.M | re.S)
    assert section
    body = section.group(1)
    missing = [key for key in RESTART_KEYS
               if f"`{key}`" not in body and f"`{key.rpartition('.')[2]}`" not in body
               and f"`[{key}]`" not in body]
    assert not missing, f"router.md, Reload: a reload refuses these, unnamed there: {missing}"
