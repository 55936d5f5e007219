"""Inline SVG plots of a card's curves (loss, step time, tokens/s, memory) and the tuner's trials; no script, no
external assets."""

from __future__ import annotations

from markupsafe import Markup, escape

from openrecipes.cards.schema import CurvePoint, Curves, Tuning

# the candidate's per-step series a card may hold beside its loss: (field, plot title, y-axis label)
STEP_SERIES = (("step_time_s", "Step time per step", "seconds"),
               ("tokens_per_s_per_gpu", "Tokens/s per GPU per step", "tokens/s/GPU"),
               ("peak_memory_gib", "Peak memory per step", "GiB"))

WIDTH, HEIGHT = 640, 300
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 40
TICKS = 5



def _frame(css_class: str, title_id: str, title: str, y_low: float, y_high: float, sy) -> list[str]:
    """The opening of a plot: the svg element, its title, the frame and the y-axis ticks."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<svg class="{css_class}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-labelledby="{title_id}">',
        f'<title id="{title_id}">{title}</title>',
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#d9dee5"/>',
    ]
    for value in _ticks(y_low, y_high):
        y = sy(value)
        parts.append(f'<line x1="{LEFT - 4}" x2="{LEFT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#999"/>')
        parts.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{value:.3g}</text>')
    return parts

def _ticks(low: float, high: float) -> list[float]:
    if high == low:
        return [low]
    return [low + (high - low) * i / (TICKS - 1) for i in range(TICKS)]


def loss_plot_svg(curves: Curves, title_id: str = "plot-title") -> Markup:
    """SVG markup for the candidate (solid) and reference (dashed) loss per step.

    Only numbers go into the markup; the labels are fixed text, so nothing from a card needs escaping.
    ``title_id`` must be unique on the page (a model page has one plot per item); the caller makes it.
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

    parts = _frame("plot", title_id, "Training loss per step", y_low, y_high, sy)
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


def tuning_plot_svg(tuning: Tuning) -> Markup:
    """SVG markup of the tuner's trials: measured tokens/s/GPU (dots), the planner's prediction when each was chosen
    (hollow squares, joined to the measurement), failures (crosses on the axis, their class in a tooltip), and the
    starting point's throughput as a dashed line. Only numbers and fixed labels go into the markup, except the
    failure classes, which the schema limits to a fixed set and are escaped all the same."""
    trials = list(tuning.trials)
    values = [tuning.start_tokens_per_s_per_gpu, tuning.tuned_tokens_per_s_per_gpu]
    values += [v for t in trials for v in (t.measured_tokens_per_s_per_gpu, t.predicted_tokens_per_s_per_gpu) if v]
    y_low, y_high = 0.0, max(values) * 1.1
    x_high = max(t.trial for t in trials) or 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(trial: float) -> float:
        return LEFT + 12 + (plot_w - 24) * trial / x_high

    def sy(value: float) -> float:
        return TOP + plot_h * (1 - (value - y_low) / (y_high - y_low))

    parts = _frame("plot tuning", "tuning-title", "Tuner trials: predicted and measured tokens/s per GPU", y_low,
                   y_high, sy)
    for trial in trials:
        parts.append(f'<text x="{sx(trial.trial):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">'
                     f'{trial.trial}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle">trial</text>')
    parts.append(f'<text transform="translate(12 {TOP + plot_h / 2:.1f}) rotate(-90)" '
                 'text-anchor="middle">tokens/s/GPU</text>')
    start_y = sy(tuning.start_tokens_per_s_per_gpu)
    parts.append(f'<line class="start-line" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{start_y:.1f}" y2="{start_y:.1f}" '
                 'stroke="#888" stroke-dasharray="6 4"/>')
    for t in trials:
        x = sx(t.trial)
        measured, predicted = t.measured_tokens_per_s_per_gpu, t.predicted_tokens_per_s_per_gpu
        if predicted is not None:
            y = sy(predicted)
            parts.append(f'<rect class="predicted" data-trial="{t.trial}" x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" '
                         f'height="8" fill="none" stroke="#6b7a8f"/>')
            if measured is not None:
                parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{sy(measured):.1f}" '
                             'stroke="#c3cad4"/>')
        if measured is not None:
            radius = 6 if t.role == "winner" else 4
            parts.append(f'<circle class="measured {t.role}" data-trial="{t.trial}" cx="{x:.1f}" '
                         f'cy="{sy(measured):.1f}" r="{radius}"/>')
        else:
            y = TOP + plot_h - 8
            parts.append(f'<g class="failed" data-trial="{t.trial}"><title>{escape(str(t.failure))}</title>'
                         f'<line x1="{x - 5:.1f}" x2="{x + 5:.1f}" y1="{y - 5:.1f}" y2="{y + 5:.1f}" stroke="#c0392b" '
                         f'stroke-width="2"/><line x1="{x - 5:.1f}" x2="{x + 5:.1f}" y1="{y + 5:.1f}" '
                         f'y2="{y - 5:.1f}" stroke="#c0392b" stroke-width="2"/></g>')
    legend = [("measured", "measured"), ("predicted", "predicted"), ("failed", "failed (x)"),
              ("start-line", "starting point")]
    for index, (name, text) in enumerate(legend):
        parts.append(f'<text class="legend {name}" x="{WIDTH - RIGHT - 110}" y="{TOP + 14 + 14 * index}">'
                     f'{text}</text>')
    parts.append("</svg>")
    return Markup("\n".join(parts))


def series_plot_svg(points: list[tuple[int, float]], *, key: str, title: str, y_label: str) -> Markup:
    """One series over steps (a line with a dot per step), y from zero; only numbers and fixed labels go in."""
    x_low, x_high = min(x for x, _ in points), max(x for x, _ in points)
    y_low, y_high = 0.0, max(y for _, y in points) * 1.1 or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(step: float) -> float:
        return LEFT + (plot_w * (step - x_low) / (x_high - x_low) if x_high != x_low else plot_w / 2)

    def sy(value: float) -> float:
        return TOP + plot_h * (1 - (value - y_low) / (y_high - y_low))

    parts = _frame(f"plot series {key}", f"{key}-title", title, y_low, y_high, sy)
    for step in sorted({round(v) for v in _ticks(x_low, x_high)}):
        parts.append(f'<text x="{sx(step):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">{step}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 4}" text-anchor="middle">step</text>')
    parts.append(f'<text transform="translate(12 {TOP + plot_h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">{y_label}</text>')
    coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
    parts.append(f'<polyline class="candidate" data-points="{len(points)}" fill="none" stroke-width="2" '
                 f'points="{coords}"/>')
    parts.append("</svg>")
    return Markup("\n".join(parts))


def step_plots(curves: Curves) -> list[tuple[str, Markup]]:
    """(field, SVG) for each per-step series the candidate's points hold, in ``STEP_SERIES`` order."""
    plots = []
    for key, title, y_label in STEP_SERIES:
        points = [(p.step, getattr(p, key)) for p in curves.candidate if getattr(p, key) is not None]
        if points:
            plots.append((key, series_plot_svg(points, key=key, title=title, y_label=y_label)))
    return plots


def memory_bars_svg(phases: dict[str, float], name: str = "memory-stages",
                    title: str = "Memory per stage of a step (GiB)") -> Markup:
    """Horizontal bars of memory per named part, in the order given; the names are escaped. ``name`` is the svg's
    class and title id (unique on the page)."""
    row, left = 22, 170
    height = TOP + row * len(phases) + BOTTOM
    high = max(phases.values()) * 1.1 or 1.0
    width = WIDTH - left - RIGHT
    parts = [f'<svg class="plot {name}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
             f'width="{WIDTH}" height="{height}" role="img" aria-labelledby="{name}-title">',
             f'<title id="{name}-title">{escape(title)}</title>']
    for index, (name, value) in enumerate(phases.items()):
        y = TOP + row * index
        parts.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{escape(name)}</text>')
        parts.append(f'<rect class="bar" x="{left}" y="{y + 3}" width="{width * value / high:.1f}" height="{row - 6}"'
                     f' fill="#0b5cad"/>')
        parts.append(f'<text x="{left + width * value / high + 4:.1f}" y="{y + 14}">{value:.3g} GiB</text>')
    parts.append("</svg>")
    return Markup("\n".join(parts))


def pipeline_memory_svg(curves: Curves) -> Markup | None:
    """Bars of the candidate's peak memory of each pipeline stage (the largest over its recorded steps), or None when
    the run recorded none."""
    recorded = [p.peak_memory_gib_per_stage for p in curves.candidate if p.peak_memory_gib_per_stage]
    if not recorded or len({len(stages) for stages in recorded}) != 1:
        return None
    peaks = [max(values) for values in zip(*recorded)]
    return memory_bars_svg({f"stage {index}": value for index, value in enumerate(peaks)}, name="pipeline-memory",
                           title="Peak memory per pipeline stage (GiB)")
