"""The spill budget (sans-IO): how many requests may be spilling to peer regions at once.

It follows Envoy's retry budget, one per model: the spills in progress of a model may not
exceed ``max(min_concurrency, ratio * that model's active requests)``, so spills of a model
served by a small pool do not use up the budget another model needs (a region serving one
model has one budget, as before). Every path that spills (a saturated region
at admission, a late first token at the deadline) takes a :class:`SpillSlot` with
:meth:`SpillBudget.acquire` before it sends anything to a peer, and gives it back with
:meth:`SpillBudget.release` when the request ends. A refused acquire means no spill. Slots
come only from ``acquire`` and a slot is released at most once, so ``spilling`` is exactly
the number of slots held: it can neither drift up (a lost release) nor down (a release
without an acquire).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

__all__ = ["SpillBudget", "SpillSlot"]


@dataclass(eq=False, slots=True)
class SpillSlot:
    """One spill in progress, held by the request that spilled."""

    budget: SpillBudget
    reason: str
    model: str = ""
    released: bool = False


class SpillBudget:
    """Spill slots per model, each model's bounded by a share of its active requests (see
    the module docstring)."""

    def __init__(self, ratio: float = 0.2, min_concurrency: int = 3) -> None:
        self.ratio = ratio
        self.min_concurrency = min_concurrency
        self.spilling = 0
        """Slots held now, every model's."""
        self.spilling_by_model: Counter[str] = Counter()
        """Slots held now by model; a model holding none has no entry (bounded by the
        models spilling at once)."""
        self.acquired: Counter[str] = Counter()
        """Slots ever granted, by reason."""
        self.refused: Counter[str] = Counter()
        """Acquires refused because the budget was used up, by reason."""

    def limit(self, active: int) -> int:
        """Spills allowed at once while ``active`` requests are in progress."""
        return max(self.min_concurrency, math.floor(self.ratio * active))

    def acquire(self, active: int, reason: str, model: str = "") -> SpillSlot | None:
        """A slot of ``model``'s budget if it has room, else None (counted as refused).

        ``active`` counts ``model``'s requests in progress, the one asking included; the
        other models' spills do not count against it.
        """
        if self.spilling_by_model[model] >= self.limit(active):
            self.refused[reason] += 1
            return None
        self.spilling += 1
        self.spilling_by_model[model] += 1
        self.acquired[reason] += 1
        return SpillSlot(self, reason, model)

    def release(self, slot: SpillSlot) -> None:
        """Give ``slot`` back; releasing it again does nothing."""
        if slot.budget is not self:
            raise ValueError("this slot belongs to another spill budget")
        if not slot.released:
            slot.released = True
            self.spilling -= 1
            left = self.spilling_by_model[slot.model] - 1
            if left > 0:
                self.spilling_by_model[slot.model] = left
            else:
                del self.spilling_by_model[slot.model]

    def __repr__(self) -> str:
        return (
            f"<SpillBudget [{self.spilling} spilling | acquired {sum(self.acquired.values())},"
            f" refused {sum(self.refused.values())}]>"
        )
