"""Small hand-written SVG charts for the run report: axes with nice ticks, lines, steps, bars, legends."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

__all__ = ["PALETTE", "Chart", "Series", "nice_ticks", "tick_text", "color_scale", "fmt", "sim_tag"]

# Okabe-Ito colours: told apart by readers with colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
# Anchors of a light-to-dark sequential scale (for clocks and limits): low values light, high dark.
_SCALE = ((0.0, (253, 231, 37)), (0.35, (94, 201, 98)), (0.65, (33, 145, 140)), (1.0, (59, 82, 139)))


def sim_tag(simulated: bool) -> str:
    """ " (SIMULATED)" after a figure's title or number when the GPUs are simulated."""
    return " (SIMULATED)" if simulated else ""


def fmt(value: float, digits: int = 3) -> str:
    """A number with `digits` significant digits, without an exponent for everyday magnitudes."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else "n/a"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    if abs(value) >= 1e7 or abs(value) < 1e-4:
        return f"{value:.{digits - 1}e}"
    return f"{value:,.{decimals}f}"


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, target)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while True:
        ticks.append(round(value, 12))
        if value >= hi - 1e-9 * step:
            break
        value += step
    return ticks if len(ticks) >= 2 else [first, first + step]


def tick_text(ticks: Sequence[float]) -> Callable[[float], str]:
    """A formatter with as many decimals as the ticks' spacing needs (0, 20, 40; 0.5, 1.0, 1.5)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step > 0 else 0
    return lambda v: f"{v:,.{decimals}f}"


def color_scale(x: float) -> str:
    """The colour of `x` in [0, 1] on the report's sequential scale."""
    x = min(1.0, max(0.0, x))
    for (a, ca), (b, cb) in zip(_SCALE, _SCALE[1:], strict=False):
        if x <= b:
            f = (x - a) / (b - a)
            rgb = (round(u + (v - u) * f) for u, v in zip(ca, cb, strict=True))
            return "#{:02x}{:02x}{:02x}".format(*rgb)
    return "#{:02x}{:02x}{:02x}".format(*_SCALE[-1][1])


@dataclass
class Series:
    """One plotted series: points (x, y), drawn as `kind` ("line", "step", "points", "bars")."""

    label: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str
    kind: str = "line"
    dashed: bool = False
    hollow: Sequence[bool] = ()
    tips: Sequence[str] = ()
    colors: Sequence[str] = ()  # per bar/point, overriding `color`
    width: float = 0.0  # bar width in x units
    widths: Sequence[float] = ()  # per bar, overriding `width`


@dataclass
class Chart:
    """A chart of series on linear axes, rendered as one `<svg>` element."""

    title: str
    x_label: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    width: int = 920
    height: int = 260
    x_range: tuple[float, float] | None = None
    y_range: tuple[float, float] | None = None
    markers: list[tuple[float, str, str]] = field(default_factory=list)  # (x, label, colour): vertical lines
    css_class: str = "chart"
    x_format: Callable[[float], str] = fmt
    legend: bool = True
    simulated: bool = False
    _left: int = 64
    _right: int = 16
    _top: int = 48
    _bottom: int = 44

    def _extent(self) -> tuple[float, float, float, float]:
        xs = [x for s in self.series for x in s.xs]
        ys = [y for s in self.series for y in s.ys if y is not None and math.isfinite(y)]
        x0, x1 = self.x_range or ((min(xs), max(xs)) if xs else (0.0, 1.0))
        pad = max(s.width for s in self.series) / 2 if self.series else 0.0
        x0, x1 = x0 - pad, x1 + pad
        if self.y_range is not None:
            y0, y1 = self.y_range
        else:
            y0, y1 = (min(0.0, min(ys)), max(ys)) if ys else (0.0, 1.0)
            y1 = y1 + 0.06 * (y1 - y0 or 1.0)
        if x1 <= x0:
            x1 = x0 + 1.0
        return x0, x1, y0, y1

    def render(self) -> str:
        """The chart as an `<svg>` string (title, axes with ticks and units, legend, series)."""
        x0, x1, y0, y1 = self._extent()
        yt = nice_ticks(y0, y1)
        y0, y1 = min(y0, yt[0]), max(y1, yt[-1])
        y_text = tick_text(yt)
        xt = nice_ticks(x0, x1, 8)
        x_text = tick_text(xt) if self.x_format is fmt else self.x_format
        w, h = self.width, self.height
        pw, ph = w - self._left - self._right, h - self._top - self._bottom

        def px(x: float) -> float:
            return self._left + (x - x0) / (x1 - x0) * pw

        def py(y: float) -> float:
            return self._top + ph - (y - y0) / (y1 - y0) * ph

        out = [
            f'<svg class="{self.css_class}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" '
            f'width="{w}" height="{h}" role="img" aria-label="{escape(self.title)}">',
            f'<text class="title" x="{self._left}" y="18">{escape(self.title)}</text>',
        ]
        if self.simulated:
            out.append(
                f'<text class="sim-tag" x="{w - self._right}" y="18" text-anchor="end">SIMULATED</text>'
            )
        for t in yt:
            y = py(t)
            out.append(
                f'<line class="grid" x1="{self._left}" x2="{w - self._right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            )
            out.append(
                f'<text class="tick" x="{self._left - 6}" y="{y + 4:.1f}" text-anchor="end">{y_text(t)}</text>'
            )
        for t in xt:
            if x0 <= t <= x1:
                x = px(t)
                out.append(
                    f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{self._top + ph}" y2="{self._top + ph + 4}"/>'
                )
                out.append(
                    f'<text class="tick" x="{x:.1f}" y="{self._top + ph + 17}" text-anchor="middle">'
                    f"{escape(x_text(t))}</text>"
                )
        out.append(
            f'<rect class="frame" x="{self._left}" y="{self._top}" width="{pw}" height="{ph}" fill="none"/>'
        )
        out.append(
            f'<text class="label" x="{self._left + pw / 2:.1f}" y="{h - 6}" text-anchor="middle">'
            f"{escape(self.x_label)}</text>"
        )
        cy = self._top + ph / 2
        out.append(
            f'<text class="label" x="14" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 14 {cy:.1f})">'
            f"{escape(self.y_label)}</text>"
        )
        for x, label, color in self.markers:
            if x0 <= x <= x1:
                out.append(
                    f'<line class="marker" x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{self._top}" '
                    f'y2="{self._top + ph}" stroke="{color}"/>'
                )
                # Right of the line, or left of it near the right edge, so the label stays inside.
                left_of = px(x) + 8 * len(label) > w - self._right
                lx, anchor = (px(x) - 4, "end") if left_of else (px(x) + 4, "start")
                out.append(
                    f'<text class="marker-label" x="{lx:.1f}" y="{self._top + 12}" fill="{color}" '
                    f'text-anchor="{anchor}">{escape(label)}</text>'
                )
        for s in self.series:
            out.extend(_series(s, px, py, y0))
        if self.legend:
            out.append(self._legend(w))
        out.append("</svg>")
        return "\n".join(out)

    def _legend(self, w: int) -> str:
        items, x = [], self._left
        y = self._top - 10
        for s in self.series:
            if not s.label:
                continue
            dash = ' stroke-dasharray="6 4"' if s.dashed else ""
            if s.kind in ("points", "bars"):
                sym = f'<rect x="{x}" y="{y - 8}" width="10" height="10" fill="{s.color}"/>'
            else:
                sym = f'<line x1="{x}" x2="{x + 18}" y1="{y - 3}" y2="{y - 3}" stroke="{s.color}" stroke-width="2.5"{dash}/>'
            items.append(sym + f'<text class="legend" x="{x + 24}" y="{y}">{escape(s.label)}</text>')
            x += 34 + 7 * len(s.label)
        return '<g class="legend">' + "".join(items) + "</g>" if items else ""


def _series(
    s: Series, px: Callable[[float], float], py: Callable[[float], float], y_base: float
) -> list[str]:
    """SVG elements of one series (None values break lines)."""
    if s.kind in ("line", "step"):
        return _polylines(s, px, py)
    if s.kind == "points":
        return _points(s, px, py)
    if s.kind == "bars":
        return _bars(s, px, py, y_base)
    return []


def _polylines(s: Series, px: Callable[[float], float], py: Callable[[float], float]) -> list[str]:
    dash = ' stroke-dasharray="6 4"' if s.dashed else ""
    parts: list[list[str]] = [[]]
    prev: tuple[float, float] | None = None
    for x, y in zip(s.xs, s.ys, strict=True):
        if y is None or not math.isfinite(y):
            parts.append([])
            prev = None
            continue
        if s.kind == "step" and prev is not None:
            parts[-1].append(f"{px(x):.1f},{py(prev[1]):.1f}")
        parts[-1].append(f"{px(x):.1f},{py(y):.1f}")
        prev = (x, y)
    return [
        f'<polyline class="series" fill="none" stroke="{s.color}" stroke-width="1.8"{dash} '
        f'points="{" ".join(pts)}"><title>{escape(s.label)}</title></polyline>'
        for pts in parts
        if len(pts) > 1
    ]


def _points(s: Series, px: Callable[[float], float], py: Callable[[float], float]) -> list[str]:
    out: list[str] = []
    for k, (x, y) in enumerate(zip(s.xs, s.ys, strict=True)):
        if y is None:
            continue
        hollow = k < len(s.hollow) and s.hollow[k]
        fill = "white" if hollow else (s.colors[k] if k < len(s.colors) else s.color)
        tip = f"<title>{escape(s.tips[k])}</title>" if k < len(s.tips) else ""
        out.append(
            f'<circle class="point" cx="{px(x):.1f}" cy="{py(y):.1f}" r="4.5" fill="{fill}" '
            f'stroke="{s.color}" stroke-width="1.6">{tip}</circle>'
        )
    return out


def _bars(s: Series, px: Callable[[float], float], py: Callable[[float], float], y_base: float) -> list[str]:
    out: list[str] = []
    base = py(max(0.0, y_base))
    for k, (x, y) in enumerate(zip(s.xs, s.ys, strict=True)):
        if y is None:
            continue
        half = (s.widths[k] if k < len(s.widths) else s.width) / 2
        left, right = px(x - half), px(x + half)
        top = py(y)
        color = s.colors[k] if k < len(s.colors) else s.color
        tip = f"<title>{escape(s.tips[k])}</title>" if k < len(s.tips) else ""
        out.append(
            f'<rect class="bar" x="{left:.2f}" y="{min(top, base):.1f}" width="{max(0.6, right - left):.2f}" '
            f'height="{abs(base - top):.1f}" fill="{color}">{tip}</rect>'
        )
    return out
