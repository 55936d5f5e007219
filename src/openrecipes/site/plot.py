"""An inline SVG line plot of loss curves; no script, no external assets."""

from __future__ import annotations

from markupsafe import Markup

from openrecipes.cards.schema import CurvePoint, Curves

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 40
TICKS = 5


def _ticks(low: float, high: float) -> list[float]:
    if high == low:
        return [low]
    return [low + (high - low) * i / (TICKS - 1) for i in range(TICKS)]


def loss_plot_svg(curves: Curves) -> Markup:
    """SVG markup for the candidate (solid) and reference (dashed) loss per step.

    Only numbers go into the markup; the labels are fixed text, so nothing from a card needs escaping.
    """
    arms: list[tuple[str, list[CurvePoint]]] = [("candidate", list(curves.candidate))]
    if curves.reference:
        arms.append(("reference", list(curves.reference)))
    points = [p for _, arm in arms for p in arm]
    x_low, x_high = min(p.step for p in points), max(p.step for p in points)
    y_low, y_high = min(p.loss for p in points), max(p.loss for p in points)
    pad = (y_high - y_low) * 0.05 or abs(y_high) * 0.05 or 1.0
    y_low, y_high = y_low - pad, y_high + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(step: float) -> float:
        return LEFT + (plot_w * (step - x_low) / (x_high - x_low) if x_high != x_low else plot_w / 2)

    def sy(loss: float) -> float:
        return TOP + plot_h * (1 - (loss - y_low) / (y_high - y_low))

    parts = [
        f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-labelledby="plot-title">',
        '<title id="plot-title">Training loss per step</title>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#d9dee5"/>',
    ]
    for value in _ticks(y_low, y_high):
        y = sy(value)
        parts.append(f'<line x1="{LEFT - 4}" x2="{LEFT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#999"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.3g}</text>')
    steps = sorted({round(v) for v in _ticks(x_low, x_high)})
    for step in steps:
        x = sx(step)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}" y2="{TOP + plot_h + 4}" stroke="#999"/>')
        parts.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle">step</text>')
    parts.append(f'<text transform="translate(12 {TOP + plot_h / 2:.1f}) rotate(-90)" '
                 'text-anchor="middle">loss</text>')
    for index, (name, arm) in enumerate(arms):
        coords = " ".join(f"{sx(p.step):.1f},{sy(p.loss):.1f}" for p in arm)
        parts.append(f'<polyline class="{name}" data-points="{len(arm)}" fill="none" '
                     f'stroke-width="2" points="{coords}"/>')
        legend_y = TOP + 14 + 16 * index
        parts.append(f'<line class="{name}" x1="{WIDTH - RIGHT - 110}" x2="{WIDTH - RIGHT - 86}" '
                     f'y1="{legend_y - 4}" y2="{legend_y - 4}" stroke-width="2"/>')
        parts.append(f'<text x="{WIDTH - RIGHT - 80}" y="{legend_y}">{name}</text>')
    parts.append("</svg>")
    return Markup("\n".join(parts))
