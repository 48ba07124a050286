"""docs/sdk-errors.md against the code: every exception it names exists with that name, every
SDK exception is in it, and every message's fixed words are in a message the SDK builds."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from firstbyte.client_sdk import errors

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "sdk-errors.md"


def rows() -> list[tuple[str, str, list[str]]]:
    """(situation, exception name, messages) for each row of the table."""
    out = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[1] in ("exception", "---"):
            continue
        situation, exception, message = cells
        out.append((situation, exception.strip("`"), re.findall(r"`([^`]+)`", message)))
    return out


def source_templates() -> list[str]:
    """Every string the SDK's code builds, with each ``{...}`` shown as ``\\0``.

    From the syntax tree, so implicitly joined literals (a message split over lines) are one.
    """
    out = []
    for path in (ROOT / "client_sdk").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.append("".join(v.value if isinstance(v, ast.Constant) else "\0"
                                   for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
    return out


def test_the_table_has_rows() -> None:
    assert len(rows()) >= 30


def test_every_exception_named_exists_and_every_sdk_exception_is_named() -> None:
    named = {exception for _, exception, _ in rows()}
    for name in named:
        cls = getattr(errors, name, None) or getattr(builtins, name)
        assert issubclass(cls, errors.FirstbyteError) or name == "TypeError", name
    public = {name for name in errors.__all__ if isinstance(getattr(errors, name), type)}
    assert public - {"FirstbyteError"} <= named, public - named


def test_every_message_is_one_the_code_builds() -> None:
    templates = source_templates()
    for situation, _, messages in rows():
        assert messages, situation
        for message in messages:
            # The words between the placeholders (the option name is an argument of
            # ConfigurationError, the status one of APIError, so pieces are checked alone).
            pieces = [p.strip(" :()'") for p in re.split(r"<[^>]+>", message)]
            for piece in filter(None, pieces):
                for part in piece.split(": "):
                    part = part.strip(" :()'")
                    if len(part) < 3:
                        continue
                    assert any(part in t for t in templates), (situation, part)
