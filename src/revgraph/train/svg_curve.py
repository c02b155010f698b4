"""A hand-written SVG line chart (no plotting library): the demo's ``loss.svg`` and ``revgraph train
--loss-curve``.

:func:`chart` draws :class:`Line` s of ``(x, y)`` points on linear axes: x from 0 to the largest x, y from 0 (or
the smallest y, when one is negative) to the largest y, both rounded up to 1, 2, 2.5 or 5 times a power of ten.
Points whose y is NaN or infinite are left out (a ``--allow-nonfinite`` run's loss), a curve of many points is
thinned to about :data:`MAX_POINTS` (every k-th point) so that the file stays small, and every text is
escaped for XML (``&``, ``<``, ``>``, and characters XML cannot hold shown as U+FFFD).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

#: The colors of the curves, in order (matplotlib's first four).
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")
#: About how many points a curve keeps at most.
MAX_POINTS = 1500

# what XML 1.0 cannot hold (C0 controls but tab, newline, carriage return; surrogates; U+FFFE and U+FFFF)
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


@dataclass
class Line:
    """One polyline of :func:`chart`: ``points`` ``[(x, y), ...]`` in the order drawn; ``label`` (if any) gets
    a legend entry in ``color``; ``markers`` draws a dot at each point (a curve of few points, such as the
    evaluations of a run)."""

    points: list[tuple[float, float]]
    color: str = COLORS[0]
    width: float = 2.5
    opacity: float = 1.0
    label: str | None = None
    markers: bool = False
    finite: list[tuple[float, float]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.finite = [(x, y) for x, y in self.points if math.isfinite(x) and math.isfinite(y)]


def chart(lines: list[Line], title: str, xlabel: str, ylabel: str, notes: tuple[str, ...] = ()) -> str:
    """The SVG text (a 720 x 420 chart) of ``lines``, with ``title``, axis labels, a legend of the labelled
    lines and ``notes`` (small grey lines under the legend). Every line is one ``<polyline>``, also one without
    finite points (then it has no points), so a reader finds one polyline per curve."""
    w, h, left, right, top, bottom = 720, 420, 64, 150, 40, 48
    pw, ph = w - left - right, h - top - bottom
    finite = [p for line in lines for p in line.finite]
    xmax = max((x for x, _ in finite), default=1.0)
    xmax = xmax if xmax > 0 else 1.0
    ymax = bound(max((y for _, y in finite), default=1.0))
    low = min((y for _, y in finite), default=0.0)
    ymin = -bound(-low) if low < 0 else 0.0
    if ymax <= ymin:
        ymax = ymin + 1.0

    def px(x: float) -> float:
        return left + pw * x / xmax

    def py(y: float) -> float:
        return top + ph * (1 - (min(y, ymax) - ymin) / (ymax - ymin))

    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
            'font-family="sans-serif" font-size="12">'),
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left + pw / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for i in range(6):  # horizontal grid lines and y labels
        v = ymin + (ymax - ymin) * i / 5
        out.append(f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + pw}" y2="{py(v):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2g}</text>')
    for e in ticks(xmax):
        out.append(f'<line x1="{px(e):.1f}" y1="{top + ph}" x2="{px(e):.1f}" y2="{top + ph + 5}" stroke="#333"/>')
        out.append(f'<text x="{px(e):.1f}" y="{top + ph + 18}" text-anchor="middle">{e:g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 10}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="16" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 16 {top + ph / 2})">'
               f'{escape(ylabel)}</text>')
    for line in lines:
        stride = max(1, len(line.finite) // MAX_POINTS)  # keep the file small
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(line.finite) if i % stride == 0)
        fade = f' opacity="{line.opacity:g}"' if line.opacity != 1 else ""
        out.append(f'<polyline points="{pts}" fill="none" stroke="{line.color}" stroke-width="{line.width:g}"'
                   f'{fade}/>')
        if line.markers:
            out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{line.color}"/>'
                       for x, y in line.finite)
    labelled = [line for line in lines if line.label is not None]
    for k, line in enumerate(labelled):
        ly = top + 16 + 20 * k
        out.append(f'<line x1="{left + pw + 12}" y1="{ly}" x2="{left + pw + 36}" y2="{ly}" stroke="{line.color}" '
                   'stroke-width="2.5"/>')
        out.append(f'<text x="{left + pw + 42}" y="{ly + 4}">{escape(line.label)}</text>')
    for k, note in enumerate(notes):
        out.append(f'<text x="{left + pw + 12}" y="{top + 16 + 20 * len(labelled) + 10 + 14 * k}" fill="#666" '
                   f'font-size="10">{escape(note)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def nice(v: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= ``v`` (1 for ``v`` <= 0 or not finite)."""
    if not math.isfinite(v) or v <= 0:
        return 1.0
    p = 10 ** math.floor(math.log10(v))
    return float(next(m * p for m in (1, 2, 2.5, 5, 10) if m * p >= v))


def bound(v: float) -> float:
    """An axis end for values up to ``v``: the next multiple of a :func:`nice` fifth of it (5.56 -> 6, where
    :func:`nice` alone gives 10 and leaves half the chart empty)."""
    if not math.isfinite(v) or v <= 0:
        return 1.0
    step = nice(v / 5)
    return math.ceil(v / step - 1e-9) * step


def ticks(xmax: float) -> list[float]:
    """The x-axis ticks from 0 to ``xmax``: about 8, a :func:`nice` distance apart."""
    step = nice(xmax / 8)
    return [i * step for i in range(int(xmax / step) + 1)]


def escape(text: str) -> str:
    """``text`` as XML character data: ``&``, ``<``, ``>`` escaped, characters XML 1.0 cannot hold (control
    characters, lone surrogates) replaced by U+FFFD."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _NOT_XML.sub("\ufffd", text)
