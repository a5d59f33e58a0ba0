"""Small inline SVG charts for `ft report`: the page must stand alone (no script, no font or library
fetched from anywhere: compute clusters and the reader's laptop may have no internet). Every label
is escaped; the charts are built from numbers only."""

from __future__ import annotations

import math
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH, HEIGHT = 720, 240
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 16, 40
LINE = "#2563eb"  # the series' colour (the browser test looks for it in the screenshot)
MARK = "#dc2626"  # faults and restarts
COLOURS = {"training": "#16a34a", "redone after faults": "#f59e0b", "starting": "#60a5fa",
           "recovering": "#dc2626", "other": "#9ca3af"}


@dataclass(frozen=True)
class Marker:
    x: float
    label: str


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering [low, high]."""
    if not high > low or not math.isfinite(high - low):
        return [low] if math.isfinite(low) else []
    raw = (high - low) / count
    if raw < 1e-300:  # a span too small to divide (subnormal): one tick
        return [low]
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]


def label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


DRAWABLE = 1e100  # and never NaN: abs(nan) <= anything is False


def line_chart(segments: list[list[tuple[float, float]]], x_title: str, y_title: str,
               markers: list[Marker] = (), y_from_zero: bool = False) -> Markup:
    """A polyline per segment of (x, y) points (a start of the run: a restart goes back to its
    checkpoint's step), with axes, round ticks, and dashed vertical markers (the restarts)."""
    # Beyond DRAWABLE a range overflows (1e308 - -1e308 is inf): no chart of a training run needs it.
    segments = [[(x, y) for x, y in segment if abs(x) <= DRAWABLE and abs(y) <= DRAWABLE] for segment in segments]
    points = [point for segment in segments for point in segment]
    if len(points) < 2:
        return Markup('<p class="empty">not enough steps to draw</p>')
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = (0.0 if y_from_zero else min(ys)), max(ys)
    if y1 == y0:
        y1 = y0 + 1
    plot_w, plot_h = WIDTH - MARGIN_LEFT - MARGIN_RIGHT, HEIGHT - MARGIN_TOP - MARGIN_BOTTOM

    def px(x: float) -> float:
        return MARGIN_LEFT + (x - x0) / ((x1 - x0) or 1) * plot_w

    def py(y: float) -> float:
        return MARGIN_TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
             f'height="{HEIGHT}" role="img" aria-label="{escape(y_title)} by {escape(x_title)}">']
    for y in ticks(y0, y1):
        parts.append(f'<line x1="{MARGIN_LEFT}" x2="{WIDTH - MARGIN_RIGHT}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                     'stroke="#e5e7eb"/>')
        parts.append(f'<text x="{MARGIN_LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{label(y)}</text>')
    for x in ticks(x0, x1):
        parts.append(f'<text x="{px(x):.1f}" y="{HEIGHT - MARGIN_BOTTOM + 16}" text-anchor="middle">'
                     f'{label(x)}</text>')
    for marker in markers:
        if x0 <= marker.x <= x1:
            parts.append(f'<line x1="{px(marker.x):.1f}" x2="{px(marker.x):.1f}" y1="{MARGIN_TOP}" '
                         f'y2="{HEIGHT - MARGIN_BOTTOM}" stroke="{MARK}" stroke-dasharray="4 3">'
                         f'<title>{escape(marker.label)}</title></line>')
    for segment in segments:
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in segment)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{LINE}" stroke-width="2"/>')
    parts.append(f'<line x1="{MARGIN_LEFT}" x2="{MARGIN_LEFT}" y1="{MARGIN_TOP}" y2="{HEIGHT - MARGIN_BOTTOM}" '
                 'stroke="#374151"/>')
    parts.append(f'<text x="{MARGIN_LEFT + plot_w / 2:.0f}" y="{HEIGHT - 6}" text-anchor="middle">'
                 f'{escape(x_title)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


@dataclass(frozen=True)
class Span:
    lane: str  # the job (a requeue is a new lane)
    start: float
    end: float
    text: str


def timeline_chart(spans: list[Span], faults: list[Marker], t0: float) -> Markup:
    """The training step's starts as bars, a lane per job, faults as red ticks; minutes since t0."""
    if not spans:
        return Markup('<p class="empty">no start recorded</p>')
    lanes = list(dict.fromkeys(span.lane for span in spans))
    t1 = max([span.end for span in spans] + [m.x for m in faults])
    lane_h, top = 28, 8
    height = top + lane_h * len(lanes) + 36
    plot_w = WIDTH - MARGIN_LEFT - MARGIN_RIGHT

    def px(t: float) -> float:
        return MARGIN_LEFT + (t - t0) / ((t1 - t0) or 1) * plot_w

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" '
             f'height="{height}" role="img" aria-label="starts and faults over time">']
    for index, lane in enumerate(lanes):
        y = top + index * lane_h
        parts.append(f'<text x="{MARGIN_LEFT - 6}" y="{y + 17}" text-anchor="end">{escape(lane)}</text>')
    for span in spans:
        y = top + lanes.index(span.lane) * lane_h
        parts.append(f'<rect x="{px(span.start):.1f}" y="{y + 4}" width="{max(px(span.end) - px(span.start), 2):.1f}" '
                     f'height="{lane_h - 8}" fill="{LINE}" stroke="#fff" stroke-width="2" rx="3">'
                     f'<title>{escape(span.text)}</title></rect>')
    for fault in faults:
        parts.append(f'<line x1="{px(fault.x):.1f}" x2="{px(fault.x):.1f}" y1="{top}" '
                     f'y2="{top + lane_h * len(lanes)}" stroke="{MARK}" stroke-width="2">'
                     f'<title>{escape(fault.label)}</title></line>')
    for minute in ticks(0, (t1 - t0) / 60):
        parts.append(f'<text x="{px(t0 + minute * 60):.1f}" y="{height - 14}" text-anchor="middle">'
                     f'{label(minute)}</text>')
    parts.append(f'<text x="{MARGIN_LEFT + plot_w / 2:.0f}" y="{height - 1}" text-anchor="middle">'
                 'minutes since the first start</text></svg>')
    return Markup("".join(parts))


def breakdown_bar(shares: dict[str, float]) -> Markup:
    """One stacked bar of where the wall time went, with its legend."""
    total = sum(max(v, 0) for v in shares.values())
    if total <= 0:
        return Markup('<p class="empty">no time accounted yet</p>')
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} 64" width="{WIDTH}" height="64" '
             'role="img" aria-label="where the time went">']
    x = 0.0
    for name, value in shares.items():
        width = max(value, 0) / total * WIDTH
        if width > 0:
            parts.append(f'<rect x="{x:.1f}" y="0" width="{width:.1f}" height="28" fill="{COLOURS.get(name, "#000")}">'
                         f'<title>{escape(name)}: {value:.0f} s</title></rect>')
        x += width
    legend_x = 0
    for name, value in shares.items():
        parts.append(f'<rect x="{legend_x}" y="40" width="12" height="12" fill="{COLOURS.get(name, "#000")}"/>'
                     f'<text x="{legend_x + 16}" y="51">{escape(name)} {value / total:.0%}</text>')
        legend_x += 140
    parts.append("</svg>")
    return Markup("".join(parts))
