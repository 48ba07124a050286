"""WAN emulator precision: configured vs measured RTT (UDP echo, TCP connect, TCP request).

A thin entry for ``firstbyte bench wan``; the measurement is
:mod:`firstbyte.benchmarks.wan.precision`. Needs root and /dev/net/tun.
"""

from __future__ import annotations

from typing import Any

from firstbyte.benchmarks.wan import precision

__all__ = ["run"]


def run(quick: bool) -> dict[str, Any]:
    return precision.run(quick)
