"""The latency budget: where the milliseconds of one streamed request may go.

End-to-end latency is a budget, not an optimisation target::

    B_total = B_prefill + B_decode + B_io + B_safety,   B_safety = 15% of B_total

The conversational default (``LatencyBudget()``, 500 ms) splits into five *lines*, laid end to
end on the request's timeline, so each is measured from one
:class:`~firstbyte.client_sdk.timings.Timings`
offset to the next and the lines add up to the time the user waited (``render`` may overlap the
next tokens' arrival; counting it in full keeps the sum conservative):

==============  =========  ======  =====================================================
line            share of   ms at   measured from ``Timings``
                B_total    500 ms
==============  =========  ======  =====================================================
``network``     prefill    30      ``request_sent_ms`` (DNS + connect + TLS/QUIC + pool
                                   wait + writing the request)
``first_byte``  io         75      ``first_byte_ms - request_sent_ms`` (the round trip,
                                   router admission and routing, response serialisation)
``first_token`` prefill +  170     ``first_token_ms - first_byte_ms`` (70 ms model prefill
                decode             + 100 ms for the first token to be decoded and sent)
``next_tokens`` decode     100     the first five ``inter_token_ms`` gaps (5 x 20 ms)
``render``      io         50      ``render_ms - first_token_ms`` (handing the first token
                                   to the application and drawing it)
(safety)        safety     75      15%: the P95-P99 tail; never allotted to a phase
==============  =========  ======  =====================================================

So B_prefill = 30 + 70 = 100 ms, B_io = 75 + 50 = 125 ms, B_decode = 100 + 100 = 200 ms and
B_safety = 75 ms (DESIGN.md's ~100 + ~75 + ~100 + 5 x ~20 + 75 leaves 50 ms, given here to
``render``, which DESIGN.md counts among the phases). A budget of another total keeps the same
shares.

:meth:`LatencyBudget.check` compares one request's timings with the allowances and names the
lines that overran; the request is *within budget* when the lines together fit in B_total (so
an overrun that the safety share absorbs is reported but not fatal).
"""

from __future__ import annotations

import math

import msgspec

from firstbyte.client_sdk.timings import Timings

__all__ = ["PHASE_MEANING", "BudgetLine", "BudgetReport", "LatencyBudget", "LineResult"]

PHASE_MEANING: dict[str, str] = {
    "network": "connect + send",
    "first_byte": "round trip to first byte",
    "first_token": "prefill + first token",
    "next_tokens": "next tokens (decode)",
    "render": "hand to app + draw",
}
"""What each budget line is, in a few words (tables and plots name phases by this)."""


class BudgetLine(msgspec.Struct, frozen=True):
    """One phase's allowance. ``category`` is the term of B_total it is charged to."""

    name: str
    category: str
    allowance_ms: float
    measured_by: str


class LineResult(msgspec.Struct, frozen=True):
    """A line compared with a measurement; ``measured_ms`` is None when the phase was not seen."""

    name: str
    category: str
    allowance_ms: float
    measured_ms: float | None

    @property
    def overran(self) -> bool:
        return self.measured_ms is not None and self.measured_ms > self.allowance_ms

    @property
    def used_fraction(self) -> float | None:
        if self.measured_ms is None or self.allowance_ms <= 0:
            return None
        return self.measured_ms / self.allowance_ms


class BudgetReport(msgspec.Struct, frozen=True):
    """The result of :meth:`LatencyBudget.check` for one request."""

    total_ms: float
    safety_ms: float
    lines: list[LineResult]

    @property
    def measured_ms(self) -> float:
        """The time the measured lines took together."""
        return sum(line.measured_ms for line in self.lines if line.measured_ms is not None)

    @property
    def overruns(self) -> list[str]:
        """Names of the lines that took longer than their allowance, in timeline order."""
        return [line.name for line in self.lines if line.overran]

    @property
    def safety_used_ms(self) -> float:
        """How much of the safety share the overruns ate (0 when no line overran)."""
        allotted = sum(line.allowance_ms for line in self.lines if line.measured_ms is not None)
        return max(0.0, self.measured_ms - allotted)

    @property
    def within_budget(self) -> bool:
        """True when the measured lines fit in B_total, counting the safety share."""
        return self.measured_ms <= self.total_ms

    def explain(self) -> str:
        """In words: which phases overran and whether the request still fits the budget
        (and what absorbed the overrun: the other phases' spare time or the safety share)."""
        over = [line for line in self.lines if line.overran]
        total = f"{self.total_ms:.0f} ms"
        if not over:
            if self.within_budget:
                return f"Every phase within its allowance; {self.measured_ms:.1f} ms of {total}."
            return f"Over budget: {self.measured_ms:.1f} ms of {total}."
        what = "; ".join(
            f"{PHASE_MEANING.get(line.name, line.name)} ({line.name}) took "
            f"{line.measured_ms or 0.0:.1f} ms, {(line.used_fraction or 0.0) * 100:.0f}% of its "
            f"{line.allowance_ms:.0f} ms allowance"
            for line in over
        )
        if not self.within_budget:
            return f"{what}; the request took {self.measured_ms:.1f} ms, over the {total} budget."
        if self.safety_used_ms <= 0:
            return (
                f"{what}, but the request as a whole fits the {total} budget "
                f"({self.measured_ms:.1f} ms): the other phases finished under their "
                "allowances by more than that, so the safety share was not touched."
            )
        return (
            f"{what}, but the request as a whole fits the {total} budget "
            f"({self.measured_ms:.1f} ms): the other phases' spare time covered part of it and "
            f"the safety share the remaining {self.safety_used_ms:.1f} ms "
            f"({self.safety_used_ms / self.safety_ms * 100:.0f}% of it)."
        )

    def render(self) -> str:
        """A plain-text table: each line (what it is, its share of the budget) against its
        allowance, then the safety share and the total; then :meth:`explain` when a line
        overran."""
        rows: list[tuple[str, ...]] = []
        for line in self.lines:
            measured = "-" if line.measured_ms is None else _ms(line.measured_ms)
            used = line.used_fraction
            status = "not seen" if used is None else f"{used * 100:.0f}%"
            if line.overran:
                status += "  OVER"
            rows.append((line.name, PHASE_MEANING.get(line.name, line.category),
                         f"{line.allowance_ms:.1f}", _share(line.allowance_ms, self.total_ms),
                         measured, status))
        safety_status = (
            f"{self.safety_used_ms / self.safety_ms * 100:.0f}% used"
            if (self.safety_ms > 0)
            else "-"
        )
        rows.append(
            (
                "safety",
                "P95-P99 tail reserve",
                f"{self.safety_ms:.1f}",
                _share(self.safety_ms, self.total_ms),
                f"{self.safety_used_ms:.1f}",
                safety_status,
            )
        )
        verdict = "within budget" if self.within_budget else "OVER BUDGET"
        rows.append(("total", "", f"{self.total_ms:.1f}", "100%", f"{self.measured_ms:.1f}",
                     verdict))
        header = ("phase", "what it is", "allowance ms", "share", "measured ms", "used")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

        def fmt(row: tuple[str, ...]) -> str:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [row[i].rjust(widths[i]) for i in (2, 3, 4)]
            cells.append(row[5])
            return "  ".join(cells).rstrip()

        rule = "  ".join("-" * w for w in widths)
        body = [fmt(header), rule, *(fmt(r) for r in rows[:-1]), rule, fmt(rows[-1])]
        if self.overruns:
            body.append(self.explain())
        return "\n".join(body)


class LatencyBudget(msgspec.Struct, frozen=True, kw_only=True):
    """A latency budget of ``total_ms`` split into shares (fractions of the total).

    The shares must add up to 1. The defaults are the conversational budget described in
    the module docstring; ``LatencyBudget(total_ms=800)`` keeps the split and scales it.
    """

    total_ms: float = 500.0
    safety_share: float = 0.15
    network_share: float = 0.06
    first_byte_share: float = 0.15
    first_token_share: float = 0.34
    next_tokens_share: float = 0.20
    render_share: float = 0.10
    next_tokens: int = 5
    """How many tokens after the first the ``next_tokens`` line covers."""

    def __post_init__(self) -> None:
        if not (self.total_ms > 0 and math.isfinite(self.total_ms)):
            raise ValueError(f"total_ms must be a positive number, not {self.total_ms!r}")
        shares = (
            self.safety_share,
            self.network_share,
            self.first_byte_share,
            self.first_token_share,
            self.next_tokens_share,
            self.render_share,
        )
        if any(share < 0 for share in shares):
            raise ValueError("budget shares must not be negative")
        if not math.isclose(sum(shares), 1.0, abs_tol=1e-9):
            raise ValueError(f"budget shares must add up to 1, not {sum(shares):.4f}")
        if self.next_tokens < 1:
            raise ValueError("next_tokens must be at least 1")

    @property
    def safety_ms(self) -> float:
        return self.total_ms * self.safety_share

    @property
    def per_token_ms(self) -> float:
        """The allowance for each token after the first (20 ms in the default budget)."""
        return self.total_ms * self.next_tokens_share / self.next_tokens

    def lines(self) -> list[BudgetLine]:
        """The per-phase allowances in timeline order (the safety share is not a line)."""
        t = self.total_ms
        return [
            BudgetLine("network", "prefill", t * self.network_share, "request_sent_ms"),
            BudgetLine(
                "first_byte", "io", t * self.first_byte_share, "first_byte_ms - request_sent_ms"
            ),
            BudgetLine(
                "first_token",
                "prefill+decode",
                t * self.first_token_share,
                "first_token_ms - first_byte_ms",
            ),
            BudgetLine(
                "next_tokens",
                "decode",
                t * self.next_tokens_share,
                f"sum of the first {self.next_tokens} inter_token_ms",
            ),
            BudgetLine("render", "io", t * self.render_share, "render_ms - first_token_ms"),
        ]

    def categories(self) -> dict[str, float]:
        """B_prefill, B_decode, B_io and B_safety in milliseconds (they add up to B_total)."""
        t = self.total_ms
        # The first_token line is model prefill (70/170 of it at the default split) plus the
        # first decoded token; keep that ratio when the budget is scaled.
        prefill_part = self.first_token_share * (70.0 / 170.0)
        return {
            "prefill": t * (self.network_share + prefill_part),
            "decode": t * (self.first_token_share - prefill_part + self.next_tokens_share),
            "io": t * (self.first_byte_share + self.render_share),
            "safety": self.safety_ms,
        }

    def check(self, timings: Timings) -> BudgetReport:
        """Compare one request's timings with the allowances.

        A phase whose end was not recorded is reported as not seen (``measured_ms`` None) and
        is neither an overrun nor counted in the total. When fewer than ``next_tokens`` tokens
        followed the first, the ``next_tokens`` allowance shrinks to the tokens seen.
        """
        lines = self.lines()
        sent, first_byte, first_token = (
            timings.request_sent_ms,
            timings.first_byte_ms,
            timings.first_token_ms,
        )
        gaps = timings.inter_token_ms[: self.next_tokens]

        network = sent
        if network is None and first_byte is not None:
            # No separate send event: the connect phases are the best lower bound.
            network = timings.connect_ms + (timings.pool_wait_ms or 0.0)
        measured: list[float | None] = [
            network,
            _span(sent if sent is not None else network, first_byte),
            _span(first_byte, first_token),
            sum(gaps) if first_token is not None and gaps else None,
            None,
        ]
        allowances = [line.allowance_ms for line in lines]
        if gaps and len(gaps) < self.next_tokens:
            allowances[3] = self.per_token_ms * len(gaps)
        if timings.render_ms is not None and first_token is not None:
            measured[4] = max(0.0, timings.render_ms - first_token)
        results = [
            LineResult(line.name, line.category, allowance, value)
            for line, allowance, value in zip(lines, allowances, measured, strict=True)
        ]
        return BudgetReport(total_ms=self.total_ms, safety_ms=self.safety_ms, lines=results)


def _ms(value: float) -> str:
    """Milliseconds for the table: one decimal, two below 0.1 ms (a render of 13 µs is not 0)."""
    return f"{value:.2f}" if 0 < value < 0.05 else f"{value:.1f}"


def _share(part: float, total: float) -> str:
    return f"{part / total * 100:.0f}%" if total > 0 else "-"


def _span(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return max(0.0, end - start)
