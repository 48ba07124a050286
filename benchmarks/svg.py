"""Small, deterministic SVG charts for the HTML reports: dot plots, CDF panels, stacked bars
and a line panel with a noise band.

Every function takes plain numbers and returns one ``<svg>`` element as a string (no IO, no
randomness: the same numbers give the same bytes). Legends are not drawn here: the page puts
them in HTML (:func:`legend`), where they wrap on a phone instead of covering the plot. The
charts size themselves by ``viewBox`` and the page's CSS makes them as wide as the column, so
a panel drawn 360 units wide is read at about its own size on a phone.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

__all__ = [
    "Marker",
    "Series",
    "cdf_panel",
    "dot_plot",
    "legend",
    "line_panel",
    "nice_ticks",
    "stacked_bars",
]

FONT = 12
TEXT = "#222"
GRID = "#ddd"
AXIS = "#888"
BAND = "#e4e4e4"


class Series(NamedTuple):
    """One thing drawn in a chart: its name (for the legend), colour and stroke dash."""

    name: str
    colour: str
    dash: str = ""


class Marker(NamedTuple):
    """A vertical reference line on a time axis (a round trip, the budget)."""

    value: float
    label: str
    colour: str = "#555"
    dash: str = "4 3"


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``high`` (1, 2 or 5 times a power of ten apart)."""
    if not high > 0 or not math.isfinite(high):
        return [0.0, 1.0]
    raw = high / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    n = math.ceil(high / step - 1e-9)
    return [round(i * step, 10) for i in range(n + 1)]


def _num(value: float) -> str:
    return f"{value:.1f}".rstrip("0").rstrip(".")


def _tick_label(value: float) -> str:
    return f"{value:g}" if abs(value) < 10_000 else f"{value / 1000:g}k"


def _text(x: float, y: float, text: str, *, anchor: str = "start", size: int = FONT,
          weight: str = "normal", colour: str = TEXT) -> str:
    return (f'<text x="{_num(x)}" y="{_num(y)}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{colour}">{html.escape(text)}</text>')


def _line(x1: float, y1: float, x2: float, y2: float, colour: str, *, width: float = 1,
          dash: str = "") -> str:
    dashed = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<line x1="{_num(x1)}" y1="{_num(y1)}" x2="{_num(x2)}" y2="{_num(y2)}" '
            f'stroke="{colour}" stroke-width="{width:g}"{dashed}/>')


def _svg(width: float, height: float, title: str, body: Sequence[str], kind: str) -> str:
    return (f'<svg class="chart {kind}" viewBox="0 0 {_num(width)} {_num(height)}" '
            f'role="img" xmlns="http://www.w3.org/2000/svg" '
            f'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif">'
            f"<title>{html.escape(title)}</title>" + "".join(body) + "</svg>")


class _XAxis(NamedTuple):
    left: float
    right: float
    ticks: list[float]

    @property
    def high(self) -> float:
        return self.ticks[-1]

    def x(self, value: float) -> float:
        return self.left + (self.right - self.left) * min(max(value, 0.0), self.high) / self.high

    def draw(self, top: float, bottom: float, unit: str) -> list[str]:
        out = []
        for tick in self.ticks:
            x = self.x(tick)
            out.append(_line(x, top, x, bottom, GRID))
            out.append(_text(x, bottom + FONT + 2, _tick_label(tick), anchor="middle",
                             size=FONT - 1))
        out.append(_line(self.left, bottom, self.right, bottom, AXIS))
        out.append(_text(self.right, bottom + 2 * FONT + 5, unit, anchor="end", size=FONT - 1,
                         colour="#555"))
        return out


def _markers(axis: _XAxis, markers: Sequence[Marker], top: float, bottom: float) -> list[str]:
    """Reference lines with their labels above the plot area, staggered when close."""
    out: list[str] = []
    last_x = -1e9
    row = 0
    for marker in sorted(markers, key=lambda m: m.value):
        if not 0 <= marker.value <= axis.high:
            continue
        x = axis.x(marker.value)
        row = row + 1 if x - last_x < 70 and row == 0 else 0
        last_x = x
        out.append(_line(x, top, x, bottom, marker.colour, width=1.5, dash=marker.dash))
        anchor = "end" if x + len(marker.label) * 6.5 > axis.right + 8 else "start"
        dx = -3 if anchor == "end" else 3
        out.append(_text(x + dx, top - 4 - row * (FONT + 1), marker.label, anchor=anchor,
                         size=FONT - 1, colour=marker.colour))
    return out


def dot_plot(
    title: str,
    rows: Sequence[str],
    series: Sequence[Series],
    values: Mapping[tuple[str, str], tuple[float, float | None]],
    *,
    markers: Sequence[Marker] = (),
    x_max: float | None = None,
    unit: str = "ms",
    width: int = 380,
    label_width: int = 78,
) -> str:
    """One row per ``rows`` entry, one dot per series at its value; ``values[(row, series)]``
    is ``(centre, tail)``, the tail (e.g. P95) drawn as a thin line from the dot when given."""
    row_h = 22
    top, left, right = 20 + FONT * 2, label_width, width - 12
    bottom = top + row_h * max(len(rows), 1)
    every = [v for pair in values.values() for v in pair if v is not None]
    high = x_max or max([*every, *(m.value for m in markers), 1.0]) * 1.05
    axis = _XAxis(left, right, nice_ticks(high))
    body = [_text(4, FONT + 2, title, weight="bold")]
    body += axis.draw(top, bottom, unit)
    body += _markers(axis, markers, top, bottom)
    for i, row in enumerate(rows):
        y = top + row_h * (i + 0.5)
        body.append(_text(left - 6, y + FONT / 2 - 2, row, anchor="end"))
        body.append(_line(left, y, right, y, "#f0f0f0"))
        for s in series:
            got = values.get((row, s.name))
            if got is None:
                continue
            centre, tail = got
            if tail is not None and tail > centre:
                body.append(_line(axis.x(centre), y, axis.x(tail), y, s.colour, width=2.5))
            body.append(f'<circle cx="{_num(axis.x(centre))}" cy="{_num(y)}" r="5" '
                        f'fill="{s.colour}" stroke="#fff" stroke-width="1"><title>'
                        f"{html.escape(f'{row}, {s.name}: {centre:.1f} {unit}')}"
                        "</title></circle>")
    return _svg(width, bottom + 2 * FONT + 10, title, body, "dots")


def cdf_panel(
    title: str,
    lines: Sequence[tuple[Series, Sequence[float]]],
    *,
    markers: Sequence[Marker] = (),
    x_max: float | None = None,
    unit: str = "ms",
    width: int = 380,
    height: int = 200,
) -> str:
    """Empirical CDFs (fraction of requests at or below x), one step line per series."""
    top, left, right = 20 + FONT * 2, 36, width - 12
    bottom = height - 2 * FONT - 10
    every = [v for _, values in lines for v in values]
    high = x_max or max([*every, *(m.value for m in markers), 1.0]) * 1.05
    axis = _XAxis(left, right, nice_ticks(high))
    body = [_text(4, FONT + 2, title, weight="bold")]
    body += axis.draw(top, bottom, unit)
    for fraction in (0.0, 0.5, 1.0):
        y = bottom - (bottom - top) * fraction
        body.append(_line(left, y, right, y, GRID))
        body.append(_text(left - 4, y + 4, f"{fraction:g}", anchor="end", size=FONT - 1))
    body += _markers(axis, markers, top, bottom)
    for s, values in lines:
        ordered = sorted(values)
        if not ordered:
            continue
        n = len(ordered)
        points: list[tuple[float, float]] = [(axis.x(ordered[0]), bottom)]
        for i, v in enumerate(ordered):
            y = bottom - (bottom - top) * (i + 1) / n
            points += [(axis.x(v), points[-1][1]), (axis.x(v), y)]
        path = " ".join(f"{_num(x)},{_num(y)}" for x, y in points)
        dash = f' stroke-dasharray="{s.dash}"' if s.dash else ""
        body.append(f'<polyline points="{path}" fill="none" stroke="{s.colour}" '
                    f'stroke-width="2"{dash}><title>{html.escape(s.name)}</title></polyline>')
    return _svg(width, height, title, body, "cdf")


def stacked_bars(
    title: str,
    rows: Sequence[str],
    segments: Sequence[Series],
    values: Mapping[str, Mapping[str, float]],
    *,
    limit: Marker | None = None,
    band: tuple[float, float] | None = None,
    unit: str = "ms",
    width: int = 560,
    label_width: int = 110,
) -> str:
    """Horizontal bars, one per row, of the segments laid end to end (``values[row][name]``);
    ``limit`` is a vertical line (a budget), ``band`` a shaded span (its safety share)."""
    row_h = 24
    top, left, right = 20 + FONT * 2, label_width, width - 12
    bottom = top + row_h * max(len(rows), 1)
    totals = [sum(values.get(row, {}).values()) for row in rows]
    high = max([*totals, limit.value if limit else 0.0, 1.0]) * 1.05
    axis = _XAxis(left, right, nice_ticks(high))
    body = [_text(4, FONT + 2, title, weight="bold")]
    if band is not None:
        x0, x1 = axis.x(band[0]), axis.x(band[1])
        body.append(f'<rect x="{_num(x0)}" y="{_num(top)}" width="{_num(x1 - x0)}" '
                    f'height="{_num(bottom - top)}" fill="{BAND}"/>')
    body += axis.draw(top, bottom, unit)
    for i, row in enumerate(rows):
        y = top + row_h * i + 4
        body.append(_text(left - 6, y + row_h / 2 + 2, row, anchor="end"))
        start = 0.0
        for s in segments:
            v = values.get(row, {}).get(s.name, 0.0)
            if v <= 0:
                continue
            x0, x1 = axis.x(start), axis.x(start + v)
            body.append(f'<rect x="{_num(x0)}" y="{_num(y)}" width="{_num(max(x1 - x0, 0.5))}" '
                        f'height="{row_h - 8}" fill="{s.colour}"><title>'
                        f"{html.escape(f'{row}: {s.name} {v:.1f} {unit}')}</title></rect>")
            start += v
    if limit is not None:
        body += _markers(axis, [limit], top, bottom)
    return _svg(width, bottom + 2 * FONT + 10, title, body, "bars")


def line_panel(
    title: str,
    xs: Sequence[str],
    lines: Sequence[tuple[Series, Sequence[float | None]]],
    *,
    band: Sequence[float | None] = (),
    band_label: str = "",
    unit: str = "ms",
    width: int = 380,
    height: int = 220,
) -> str:
    """Values at a few categorical x positions, one line per series, around a zero line;
    ``band[i]`` (a half-width) shades -b..+b at position i (a noise floor)."""
    top, left, right = 20 + FONT * 2, 44, width - 16
    bottom = height - 2 * FONT - 6
    every = [v for _, ys in lines for v in ys if v is not None]
    every += [b for b in band if b is not None] + [-b for b in band if b is not None]
    low, high = min([*every, 0.0]), max([*every, 0.0])
    pad = (high - low) * 0.1 or 1.0
    low, high = low - pad, high + pad
    step = (right - left) / max(len(xs), 1)

    def x(i: int) -> float:
        return left + step * (i + 0.5)

    def y(v: float) -> float:
        return bottom - (bottom - top) * (v - low) / (high - low)

    body = [_text(4, FONT + 2, title, weight="bold")]
    for i, half in enumerate(band):
        if half is None:
            continue
        body.append(f'<rect x="{_num(x(i) - step * 0.35)}" y="{_num(y(half))}" '
                    f'width="{_num(step * 0.7)}" height="{_num(max(y(-half) - y(half), 1))}" '
                    f'fill="{BAND}"><title>{html.escape(band_label)}</title></rect>')
    span = high - low
    raw = nice_ticks(span, 4)
    tick_step = raw[1] if len(raw) > 1 else 1.0
    tick = math.ceil(low / tick_step) * tick_step
    while tick <= high:
        body.append(_line(left, y(tick), right, y(tick), AXIS if abs(tick) < 1e-9 else GRID))
        body.append(_text(left - 4, y(tick) + 4, f"{round(tick, 6):g}", anchor="end",
                          size=FONT - 1))
        tick += tick_step
    for i, name in enumerate(xs):
        body.append(_text(x(i), bottom + FONT + 4, name, anchor="middle", size=FONT - 1))
    body.append(_text(4, top - 6, unit, size=FONT - 1, colour="#555"))
    for s, ys in lines:
        points = [(x(i), y(v)) for i, v in enumerate(ys) if v is not None]
        if len(points) > 1:
            path = " ".join(f"{_num(px)},{_num(py)}" for px, py in points)
            body.append(f'<polyline points="{path}" fill="none" stroke="{s.colour}" '
                        f'stroke-width="2"/>')
        for (px, py), v in zip(points, [v for v in ys if v is not None], strict=True):
            body.append(f'<circle cx="{_num(px)}" cy="{_num(py)}" r="4" fill="{s.colour}">'
                        f"<title>{html.escape(f'{s.name}: {v:+.2f} {unit}')}</title></circle>")
    return _svg(width, height, title, body, "lines")


def legend(series: Sequence[Series], extra: Sequence[tuple[str, str]] = ()) -> str:
    """An HTML legend (it wraps on narrow screens); ``extra`` adds (css class, text) items
    such as a reference line's meaning."""
    items = []
    for s in series:
        style = (f"border-top:3px dashed {s.colour};background:none" if s.dash
                 else f"background:{s.colour}")
        items.append(f'<li><span class="swatch" style="{style}"></span>'
                     f"{html.escape(s.name)}</li>")
    items += [f'<li><span class="swatch {cls}"></span>{html.escape(text)}</li>'
              for cls, text in extra]
    return '<ul class="legend">' + "".join(items) + "</ul>"
