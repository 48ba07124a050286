"""The packet-level WAN emulator: hosts in network namespaces, a userspace delay line between.

See :mod:`firstbyte.benchmarks.wan.emulator` for the API (:class:`Emulator`, :class:`Host`),
:mod:`firstbyte.benchmarks.wan.geo` for geography profiles, and README "The WAN emulator".
"""

from __future__ import annotations

from firstbyte.benchmarks.wan.delayline import LinkParams
from firstbyte.benchmarks.wan.emulator import (
    Emulator,
    Host,
    PairPrecision,
    PrecisionReport,
    RunResult,
)
from firstbyte.benchmarks.wan.netns import WanError, WanUnavailable

__all__ = [
    "Emulator",
    "Host",
    "LinkParams",
    "PairPrecision",
    "PrecisionReport",
    "RunResult",
    "WanError",
    "WanUnavailable",
]
