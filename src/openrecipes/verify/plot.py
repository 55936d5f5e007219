"""An SVG of two loss curves, written by hand so the check needs no plotting library.

Each curve is one ``<polyline>`` through its finite points; steps whose loss is NaN,
infinite or absent get a red tick on the step axis, so a gap in a line is explained.
The warm-up steps left out of the statistical checks are shaded.
"""

from __future__ import annotations

import os
from xml.sax.saxutils import escape, quoteattr

from openrecipes.utils import atomic_write_text, nice_ticks as _ticks, tick_labels
from openrecipes.verify.curves import LossCurve, is_finite

WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50
COLOURS = {"candidate": "#d62728", "reference": "#1f77b4"}


def render_svg(
    candidate: LossCurve,
    reference: LossCurve,
    *,
    title: str = "loss",
    skipped_steps: list[int] | None = None,
) -> str:
    steps = sorted(set(candidate.losses) | set(reference.losses))
    if not steps:
        raise ValueError("nothing to plot: both curves are empty")
    values = [v for curve in (candidate, reference) for v in curve.losses.values() if is_finite(v)]
    x_low, x_high = steps[0], steps[-1]
    if x_high == x_low:
        x_low, x_high = x_low - 1, x_high + 1
    y_low, y_high = (min(values), max(values)) if values else (0.0, 1.0)
    pad = (y_high - y_low) * 0.05 or (abs(y_high) * 0.05 or 1.0)
    y_low, y_high = y_low - pad, y_high + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x_of(step: float) -> float:
        return LEFT + (step - x_low) / (x_high - x_low) * plot_w

    def y_of(loss: float) -> float:
        return TOP + (y_high - loss) / (y_high - y_low) * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2:.1f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
    ]
    if skipped_steps:
        x0, x1 = x_of(skipped_steps[0]), x_of(skipped_steps[-1])
        parts.append(f'<rect x="{x0:.2f}" y="{TOP}" width="{max(x1 - x0, 1.0):.2f}" height="{plot_h}" '
                     'fill="#eeeeee"><title>warm-up steps, not in the statistical checks</title></rect>')
    y_ticks = _ticks(y_low, y_high)
    for value, label in zip(y_ticks, tick_labels(y_ticks)):
        y = y_of(value)
        parts.append(f'<line x1="{LEFT}" y1="{y:.2f}" x2="{WIDTH - RIGHT}" y2="{y:.2f}" stroke="#dddddd"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.2f}" text-anchor="end">{label}</text>')
    x_ticks = _ticks(x_low, x_high)
    for value, label in zip(x_ticks, tick_labels(x_ticks)):
        x = x_of(value)
        parts.append(f'<line x1="{x:.2f}" y1="{TOP + plot_h}" x2="{x:.2f}" y2="{TOP + plot_h + 5}" stroke="black"/>')
        parts.append(f'<text x="{x:.2f}" y="{TOP + plot_h + 18}" text-anchor="middle">{label}</text>')
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="black"/>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 10}" text-anchor="middle">step</text>')
    parts.append(f'<text x="16" y="{TOP + plot_h / 2:.1f}" text-anchor="middle" '
                 f'transform="rotate(-90 16 {TOP + plot_h / 2:.1f})">loss</text>')

    for index, (name, curve) in enumerate((("reference", reference), ("candidate", candidate))):
        colour = COLOURS[name]
        points = " ".join(f"{x_of(s):.2f},{y_of(v):.2f}" for s, v in sorted(curve.losses.items()) if is_finite(v))
        dash = ' stroke-dasharray="6 4"' if name == "reference" else ""
        parts.append(f'<polyline class={quoteattr(name)} fill="none" stroke="{colour}" stroke-width="1.8"{dash} '
                     f'points="{points}"><title>{escape(name)}: {escape(curve.source)}</title></polyline>')
        for step, value in sorted(curve.losses.items()):
            if not is_finite(value):
                x = x_of(step)
                parts.append(f'<line x1="{x:.2f}" y1="{TOP + plot_h - 10}" x2="{x:.2f}" y2="{TOP + plot_h}" '
                             f'stroke="{colour}" stroke-width="3"><title>{name} step {step}: '
                             f'{"absent" if value is None else value}</title></line>')
        legend_y = TOP + 16 + 16 * index
        parts.append(f'<line x1="{WIDTH - RIGHT - 150}" y1="{legend_y - 4}" x2="{WIDTH - RIGHT - 124}" '
                     f'y2="{legend_y - 4}" stroke="{colour}" stroke-width="1.8"{dash}/>')
        parts.append(f'<text x="{WIDTH - RIGHT - 118}" y="{legend_y}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_svg(
    path: str | os.PathLike,
    candidate: LossCurve,
    reference: LossCurve,
    *,
    title: str = "loss",
    skipped_steps: list[int] | None = None,
) -> None:
    """Render and write atomically: a reader never sees a half-written file."""
    atomic_write_text(path, render_svg(candidate, reference, title=title, skipped_steps=skipped_steps))
