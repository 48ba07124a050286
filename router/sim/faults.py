"""Fault injection: the grammar of ``--fault SPEC`` and the per-request, seeded choice.

Grammar (``--fault`` may be given several times; every fault applies independently)::

    SPEC   := KIND [":" PARAM ("," PARAM)*]
    PARAM  := NAME "=" VALUE
    KIND   := "stall" | "drop" | "delay" | "error503"

    stall:after=N[,ms=M][,rate=R]
                              after N content tokens, stop sending but keep the connection open;
                              with ``ms``, send on after M milliseconds (a tool call's gap)
    drop:after=N[,rate=R]     after N content tokens, close the connection abruptly (no [DONE])
    delay:ms=M[,rate=R]       wait M milliseconds before sending the response's first byte
    error503:rate=R           answer 503 with an OpenAI error body, for a fraction R of requests

``rate`` (0..1, default 1) is the fraction of requests the fault hits. Which requests are hit
is deterministic: the n-th request to arrive is hit by fault k when a PRNG seeded with
``(seed, k, n)`` draws below the rate, so the same seed and request order always fail the same
requests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["Fault", "FaultKind", "FaultPlan", "FaultSpecError", "RequestFaults", "parse_fault"]


class FaultKind(Enum):
    STALL = "stall"
    DROP = "drop"
    DELAY = "delay"
    ERROR503 = "error503"


_PARAMS: dict[FaultKind, tuple[set[str], set[str]]] = {
    # kind: (required params, optional params)
    FaultKind.STALL: ({"after"}, {"ms", "rate"}),
    FaultKind.DROP: ({"after"}, {"rate"}),
    FaultKind.DELAY: ({"ms"}, {"rate"}),
    FaultKind.ERROR503: ({"rate"}, set()),
}


class FaultSpecError(ValueError):
    """A ``--fault`` SPEC that does not follow the grammar; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    rate: float = 1.0
    after: int = 0
    """``stall``/``drop``: content tokens sent before the fault."""
    ms: float | None = None
    """``delay``: milliseconds before the first byte; ``stall``: how long it lasts (None: for
    good)."""


def parse_fault(spec: str) -> Fault:
    """Parse one SPEC (see the module docstring); :class:`FaultSpecError` if malformed."""
    kind_text, _, params_text = spec.strip().partition(":")
    try:
        kind = FaultKind(kind_text.strip())
    except ValueError:
        kinds = ", ".join(k.value for k in FaultKind)
        raise FaultSpecError(f"unknown fault {kind_text!r} in {spec!r}; kinds: {kinds}") from None
    required, optional = _PARAMS[kind]
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in params_text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not value.strip():
            raise FaultSpecError(f"expected NAME=VALUE, got {item!r} in {spec!r}")
        if name not in required | optional:
            allowed = ", ".join(sorted(required | optional))
            raise FaultSpecError(f"{kind.value} takes {allowed}; got {name!r} in {spec!r}")
        values[name] = value.strip()
    missing = required - values.keys()
    if missing:
        raise FaultSpecError(f"{kind.value} needs {', '.join(sorted(missing))} in {spec!r}")
    rate = _number(values.get("rate", "1"), "rate", spec)
    if not 0.0 <= rate <= 1.0:
        raise FaultSpecError(f"rate must be between 0 and 1 in {spec!r}")
    after = _number(values.get("after", "0"), "after", spec)
    if after < 0 or after != int(after):
        raise FaultSpecError(f"after must be a non-negative integer in {spec!r}")
    ms = _number(values["ms"], "ms", spec) if "ms" in values else None
    if ms is not None and ms < 0:
        raise FaultSpecError(f"ms must be >= 0 in {spec!r}")
    return Fault(kind=kind, rate=rate, after=int(after), ms=ms)


def _number(text: str, name: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FaultSpecError(f"{name} must be a number, got {text!r} in {spec!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise FaultSpecError(f"{name} must be finite in {spec!r}")
    return value


@dataclass(frozen=True, slots=True)
class RequestFaults:
    """What happens to one request. ``None`` fields mean "no such fault"."""

    error503: bool = False
    delay_s: float = 0.0
    stall_after: int | None = None
    stall_s: float | None = None
    """How long the stall lasts; None: until the client leaves."""
    drop_after: int | None = None

    @property
    def any(self) -> bool:
        return (
            self.error503
            or self.delay_s > 0
            or self.stall_after is not None
            or (self.drop_after is not None)
        )


NO_FAULTS = RequestFaults()


class FaultPlan:
    """Decides, request by request in arrival order, which faults hit it."""

    def __init__(self, faults: Sequence[Fault], seed: int = 0) -> None:
        self.faults = tuple(faults)
        self.seed = seed
        self._count = 0

    def next_request(self) -> RequestFaults:
        """The faults for the next arriving request (advances the arrival counter)."""
        n = self._count
        self._count += 1
        if not self.faults:
            return NO_FAULTS
        error503 = False
        delay_s = 0.0
        stall: int | None = None
        stall_s: float | None = None
        drop: int | None = None
        for k, fault in enumerate(self.faults):
            if fault.rate < 1.0 and random.Random(f"{self.seed}/{k}/{n}").random() >= fault.rate:
                continue
            if fault.kind is FaultKind.ERROR503:
                error503 = True
            elif fault.kind is FaultKind.DELAY:
                delay_s += (fault.ms or 0.0) / 1000.0
            elif fault.kind is FaultKind.STALL:
                if stall is None or fault.after < stall:  # the earliest stall is the one seen
                    stall = fault.after
                    stall_s = None if fault.ms is None else fault.ms / 1000.0
            else:
                drop = fault.after if drop is None else min(drop, fault.after)
        return RequestFaults(
            error503=error503, delay_s=delay_s, stall_after=stall, stall_s=stall_s, drop_after=drop
        )
