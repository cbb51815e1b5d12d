"""Inline SVG line charts for the HTML report: no JavaScript, no server, no image files.

`line_chart(chart_id, title, series, ...)` returns one `<svg>` element: axes with rounded ticks,
one polyline per series (at most MAX_POINTS points each, evenly thinned), optional vertical
markers (alarm steps) and a legend on the title's line. Non-finite values break the line instead of bending it.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass

MAX_POINTS = 800
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
WIDTH, HEIGHT = 520, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 12, 28, 36
LEGEND_CHAR_PX = 6.2  # rough width of a legend character at the report's 11 px font


@dataclass(frozen=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    faint: bool = False  # drawn thin and light (raw values under a smoothed line)


def smooth(ys: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over `window` values (non-finite values skipped)."""
    out, acc = [], []
    for y in ys:
        acc.append(y)
        recent = [v for v in acc[-window:] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if recent else math.nan)
    return out


def ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    for mult in (1, 2, 5, 10):
        if raw <= mult * step:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.2e}"


def line_chart(
    chart_id: str,
    title: str,
    series: Sequence[Series],
    x_label: str = "step",
    marks: Sequence[float] = (),
) -> str:
    """One chart as an `<svg>` element (its `data-points` attribute counts the drawn points)."""
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in s.ys if math.isfinite(y)]
    if not xs or not ys:
        return f'<svg id="{chart_id}" class="chart empty" data-points="0"></svg>'
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or abs(y0) * 0.05 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return TOP + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [f'<text x="{LEFT}" y="18" class="title">{html.escape(title)}</text>']
    for t in ticks(y0, y1):
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
            f'class="grid"/><text x="{LEFT - 6}" y="{py(t) + 4:.1f}" '
            f'text-anchor="end">{_label(t)}</text>'
        )
    for t in ticks(x0, x1):
        parts.append(
            f'<text x="{px(t):.1f}" y="{HEIGHT - BOTTOM + 16}" '
            f'text-anchor="middle">{_label(t)}</text>'
        )
    parts.append(
        f'<text x="{LEFT + pw / 2}" y="{HEIGHT - 4}" text-anchor="middle">'
        f"{html.escape(x_label)}</text>"
    )
    for m in marks:
        parts.append(
            f'<line x1="{px(m):.1f}" x2="{px(m):.1f}" y1="{TOP}" y2="{TOP + ph}" class="mark"/>'
        )
    drawn = 0
    for k, s in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        for run in _runs(s.xs, s.ys):
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
            width, opacity = (1, 0.35) if s.faint else (1.8, 1.0)
            parts.append(
                f'<polyline points="{pts}" fill="none" stroke="{color}" '
                f'stroke-width="{width}" stroke-opacity="{opacity}"/>'
            )
            drawn += len(run)
    parts += _legend(series)
    return (
        f'<svg id="{chart_id}" class="chart" data-points="{drawn}" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'xmlns="http://www.w3.org/2000/svg">{"".join(parts)}</svg>'
    )


def _runs(xs: Sequence[float], ys: Sequence[float]) -> list[list[tuple[float, float]]]:
    """The finite stretches of a series, thinned to at most MAX_POINTS points in all."""
    stride = max(1, math.ceil(len(xs) / MAX_POINTS))
    runs: list[list[tuple[float, float]]] = [[]]
    for i in range(0, len(xs), stride):
        if math.isfinite(ys[i]):
            runs[-1].append((xs[i], ys[i]))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _legend(series: Sequence[Series]) -> list[str]:
    """The series' labels in one row on the title's line, right-aligned (above the plot, so
    they never hide a curve)."""
    parts, x = [], WIDTH - RIGHT - 4
    for k in reversed(range(len(series))):
        label = series[k].label
        parts.append(
            f'<text x="{x}" y="18" text-anchor="end" fill="{PALETTE[k % len(PALETTE)]}">'
            f"{html.escape(label)}</text>"
        )
        x -= int(LEGEND_CHAR_PX * len(label)) + 14
    return parts
