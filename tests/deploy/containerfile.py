"""Read deploy/Containerfile as a builder would: stages of instructions, continuation lines
joined, comments dropped. Enough for the tests to run what it says, not a full parser."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "deploy" / "Containerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    """Upper case: ``RUN``, ``COPY``, ..."""
    args: str

    def words(self) -> list[str]:
        """The shell form split as ``sh`` would (no expansion)."""
        return shlex.split(self.args)

    def exec_form(self) -> list[str]:
        """The JSON (exec) form's argument list, e.g. ENTRYPOINT's."""
        value = json.loads(self.args)
        assert isinstance(value, list), self
        return [str(word) for word in value]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        (found,) = self.all(keyword)
        return found


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Containerfile ends inside a continued line"
    return lines


def read_stages(path: Path = CONTAINERFILE) -> list[Stage]:
    """The stages in order; ARGs before the first FROM are substituted into FROM lines."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest).split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        else:
            assert stages, f"{keyword} before FROM"
            stages[-1].instructions.append(Instruction(keyword, rest))
    return stages
