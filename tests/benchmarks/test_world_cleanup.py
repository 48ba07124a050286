"""A benchmark world takes its temporary folder (certificates, GeoIP database) away however
its start or teardown ends."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from firstbyte.benchmarks.world import World


class _BrokenEmulator:
    """An emulator whose network namespaces can neither be made nor torn down."""

    hosts = ("region-a",)

    def ip(self, host: str) -> str:
        return "192.0.2.1"

    def start(self) -> None:
        raise RuntimeError("cannot create the namespaces")

    def stop(self) -> None:
        raise RuntimeError("cannot delete the namespaces")


async def test_a_failed_start_and_teardown_leave_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    world = World(regions=["region-a"], clients=[], emulator=_BrokenEmulator(),  # type: ignore[arg-type]
                  log=lambda message: None)
    with pytest.raises(RuntimeError, match="cannot delete"):
        async with world:
            pass
    assert os.listdir(tmp_path) == []
