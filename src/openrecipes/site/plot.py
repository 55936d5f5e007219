"""Inline SVG plots of a card's curves (loss, step time, tokens/s, memory, gradient norm, learning rate) and the
tuner's trials; no script, no external assets.

Every panel has a visible title, tick labels written as a reader writes numbers (1,240, 12.4k; never 1.24e+03), a
left margin as wide as its longest label so the axis title never covers one, a legend of what is drawn and nothing
else, and a tooltip (an SVG ``<title>``) on every point with its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from markupsafe import Markup, escape

from openrecipes.cards.schema import Curves, Tuning
from openrecipes.utils import nice_ticks, tick_labels

# the candidate's per-step series a card may hold beside its loss: (field, plot title, y-axis label)
STEP_SERIES = (("step_time_s", "Step time per step", "seconds"),
               ("tokens_per_s_per_gpu", "Tokens/s per GPU per step", "tokens/s/GPU"),
               ("peak_memory_gib", "Peak memory per step", "GiB"),
               ("grad_norm", "Gradient norm per step", "gradient norm"),
               ("lr", "Learning rate per step", "learning rate"))

WIDTH, HEIGHT = 640, 320
RIGHT, TOP, BOTTOM = 16, 52, 44
CHAR_WIDTH = 6.6  # the widest digits of the 11 px axis text, a little over its average
AXIS_TITLE_X = 14  # the rotated y-axis title's centre line
DOTS_UP_TO = 60  # a series with more points than this draws its line only; every point keeps its tooltip
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


@dataclass(frozen=True)
class _Axes:
    """A panel's scales: x over steps (or trials), y over values shown divided by ``y_factor``."""

    left: float
    x_low: float
    x_high: float
    y_low: float
    y_high: float
    y_ticks: list[float]
    y_labels: list[str]
    y_note: str  # "×10⁻⁵" when the labels are the values times 10⁵, else ""

    @property
    def plot_w(self) -> float:
        return WIDTH - self.left - RIGHT

    @property
    def plot_h(self) -> float:
        return HEIGHT - TOP - BOTTOM

    def sx(self, x: float) -> float:
        span = self.x_high - self.x_low
        return self.left + (self.plot_w * (x - self.x_low) / span if span else self.plot_w / 2)

    def sy(self, y: float) -> float:
        return TOP + self.plot_h * (1 - (y - self.y_low) / (self.y_high - self.y_low))


def _axes(x_low: float, x_high: float, values: list[float], *, from_zero: bool) -> _Axes:
    """Scales that hold every value, with round y ticks; values below 0.01 are labelled as multiples of a power of
    ten named beside the axis title."""
    low, high = (0.0 if from_zero else min(values)), max(values)
    pad = (high - low) * 0.05 or abs(high) * 0.05 or 1.0
    low, high = (low if from_zero else low - pad), high + pad
    largest = max(abs(low), abs(high))
    exponent = math.floor(math.log10(largest)) if 0 < largest < 0.01 else 0
    factor = 10.0 ** -exponent
    ticks = nice_ticks(low * factor, high * factor)
    labels = tick_labels(ticks)
    left = AXIS_TITLE_X + 12 + CHAR_WIDTH * max(len(label) for label in labels) + 8
    note = f"×10{str(exponent).translate(SUPERSCRIPT)}" if exponent else ""
    return _Axes(left=round(left), x_low=x_low, x_high=x_high, y_low=low, y_high=high,
                 y_ticks=[t / factor for t in ticks], y_labels=labels, y_note=note)


def _value(value: float) -> str:
    """A value in a tooltip or beside a bar: four significant digits, thousands separated, never 1e+03."""
    if value == 0 or not math.isfinite(value):
        return str(value) if not math.isfinite(value) else "0"
    decimals = max(0, 3 - math.floor(math.log10(abs(value))))
    text = f"{value:,.{min(decimals, 12)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _frame(css_class: str, title_id: str, title: str, axes: _Axes, x_ticks: list[float], x_label: str,
           y_label: str) -> list[str]:
    """The opening of a plot: the svg element, its title (for screen readers and on screen), the frame, y ticks
    with grid lines, x ticks and both axis titles."""
    left, plot_w, plot_h = axes.left, axes.plot_w, axes.plot_h
    parts = [
        f'<svg class="{css_class}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-labelledby="{title_id}">',
        f'<title id="{title_id}">{escape(title)}</title>',
        f'<text class="panel-title" x="{left}" y="{TOP - 32}">{escape(title)}</text>',
        f'<rect x="{left}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#d9dee5"/>',
    ]
    for value, label in zip(axes.y_ticks, axes.y_labels):
        y = axes.sy(value)
        parts.append(f'<line class="grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                     'stroke="#eef1f5"/>')
        parts.append(f'<text class="tick y" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for value, label in zip(x_ticks, tick_labels(x_ticks) if x_ticks else []):
        x = axes.sx(value)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}" y2="{TOP + plot_h + 4}" stroke="#999"/>')
        parts.append(f'<text class="tick x" x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">'
                     f'{label}</text>')
    parts.append(f'<text class="axis-title" x="{left + plot_w / 2:.1f}" y="{HEIGHT - 6}" '
                 f'text-anchor="middle">{x_label}</text>')
    y_title = f"{y_label} ({axes.y_note})" if axes.y_note else y_label
    parts.append(f'<text class="axis-title" transform="translate({AXIS_TITLE_X} {TOP + plot_h / 2:.1f}) '
                 f'rotate(-90)" text-anchor="middle">{escape(y_title)}</text>')
    return parts


def _step_ticks(axes: _Axes) -> list[float]:
    """Whole steps only: a run of three steps gets 0, 1, 2, not 0.5."""
    ticks = [t for t in nice_ticks(axes.x_low, axes.x_high) if float(t).is_integer()]
    return ticks or [axes.x_low]


def _series(name: str, points: list[tuple[float, float]], axes: _Axes, unit: str) -> list[str]:
    """A line through ``points`` and, on each, a dot whose tooltip says its step and value (the dot is see-through
    on a long series, where dots would hide the line)."""
    coords = " ".join(f"{axes.sx(x):.1f},{axes.sy(y):.1f}" for x, y in points)
    parts = [f'<polyline class="{name}" data-points="{len(points)}" fill="none" stroke-width="2" '
             f'points="{coords}"/>']
    opacity = "" if len(points) <= DOTS_UP_TO else ' fill-opacity="0"'
    for x, y in points:
        parts.append(f'<circle class="point {name}" cx="{axes.sx(x):.1f}" cy="{axes.sy(y):.1f}" r="3"{opacity}>'
                     f'<title>{name}, step {x:g}: {_value(y)} {unit}</title></circle>')
    return parts


def _legend(entries: list[tuple[str, str, str]], left: float) -> list[str]:
    """One entry per (class, text, mark) drawn, in a row between the panel's title and its frame, so it never covers
    a point; mark is "line" (a line sample before the text) or "text" (the text alone, coloured)."""
    parts, x, y = [], left, TOP - 8
    for name, text, mark in entries:
        if mark == "line":
            parts.append(f'<line class="legend {name}" x1="{x:.1f}" x2="{x + 24:.1f}" y1="{y - 4}" y2="{y - 4}" '
                         'stroke-width="2"/>')
            x += 30
        parts.append(f'<text class="legend {name}" x="{x:.1f}" y="{y}">{escape(text)}</text>')
        x += CHAR_WIDTH * len(text) + 16
    return parts


def loss_plot_svg(curves: Curves, title_id: str = "plot-title") -> Markup:
    """SVG markup for the candidate (solid) and reference (dashed) loss per step.

    Only numbers go into the markup; the labels are fixed text, so nothing from a card needs escaping.
    ``title_id`` must be unique on the page (a model page has one plot per item); the caller makes it.
    """
    arms = [("candidate", [(p.step, p.loss) for p in curves.candidate])]
    if curves.reference:
        arms.append(("reference", [(p.step, p.loss) for p in curves.reference]))
    points = [p for _, arm in arms for p in arm]
    axes = _axes(min(x for x, _ in points), max(x for x, _ in points), [y for _, y in points], from_zero=False)
    parts = _frame("plot", title_id, "Training loss per step", axes, _step_ticks(axes), "step", "loss")
    for name, arm in arms:
        parts += _series(name, arm, axes, "loss")
    if len(arms) > 1:
        parts += _legend([(name, name, "line") for name, _ in arms], axes.left)
    parts.append("</svg>")
    return Markup("\n".join(parts))


def series_plot_svg(points: list[tuple[int, float]], *, key: str, title: str, y_label: str) -> Markup:
    """One series over steps (a line with a dot per step), y from zero; only numbers and fixed labels go in."""
    axes = _axes(min(x for x, _ in points), max(x for x, _ in points), [y for _, y in points], from_zero=True)
    parts = _frame(f"plot series {key}", f"{key}-title", title, axes, _step_ticks(axes), "step", y_label)
    parts += _series("candidate", points, axes, y_label)
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


def tuning_plot_svg(tuning: Tuning) -> Markup:
    """SVG markup of the tuner's trials: measured tokens/s/GPU (dots), the planner's prediction when each was chosen
    (hollow squares, joined to the measurement), failures (crosses on the axis, their class in a tooltip), and the
    starting point's throughput as a dashed line; the legend names only what is drawn. Only numbers and fixed labels
    go into the markup, except the failure classes, which the schema limits to a fixed set and are escaped all the
    same."""
    trials = list(tuning.trials)
    values = [tuning.start_tokens_per_s_per_gpu, tuning.tuned_tokens_per_s_per_gpu]
    values += [v for t in trials for v in (t.measured_tokens_per_s_per_gpu, t.predicted_tokens_per_s_per_gpu) if v]
    axes = _axes(-0.5, max(t.trial for t in trials) + 0.5, values, from_zero=True)
    numbers = sorted({t.trial for t in trials})
    parts = _frame("plot tuning", "tuning-title", "Tuner trials: predicted and measured tokens/s per GPU", axes,
                   numbers if len(numbers) <= 15 else _step_ticks(axes), "trial", "tokens/s/GPU")
    start_y = axes.sy(tuning.start_tokens_per_s_per_gpu)
    parts.append(f'<line class="start-line" x1="{axes.left}" x2="{axes.left + axes.plot_w}" y1="{start_y:.1f}" '
                 f'y2="{start_y:.1f}" stroke="#888" stroke-dasharray="6 4"><title>starting point: '
                 f'{_value(tuning.start_tokens_per_s_per_gpu)} tokens/s/GPU</title></line>')
    for t in trials:
        parts += _trial_marks(t, axes)
    drawn = [("measured", "measured", any(t.measured_tokens_per_s_per_gpu is not None for t in trials)),
             ("predicted", "predicted", any(t.predicted_tokens_per_s_per_gpu is not None for t in trials)),
             ("failed", "failed (x)", any(t.measured_tokens_per_s_per_gpu is None for t in trials)),
             ("start-line", "starting point", True)]
    parts += _legend([(name, text, "text") for name, text, shown in drawn if shown], axes.left)
    parts.append("</svg>")
    return Markup("\n".join(parts))


def _trial_marks(t, axes: _Axes) -> list[str]:
    """A trial's prediction (square), measurement (dot, joined to the prediction) or failure (cross)."""
    x, parts = axes.sx(t.trial), []
    measured, predicted = t.measured_tokens_per_s_per_gpu, t.predicted_tokens_per_s_per_gpu
    if predicted is not None:
        y = axes.sy(predicted)
        if measured is not None:
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{axes.sy(measured):.1f}" '
                         'stroke="#c3cad4"/>')
        parts.append(f'<rect class="predicted" data-trial="{t.trial}" x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" '
                     f'height="8" fill="none" stroke="#6b7a8f"><title>trial {t.trial}: predicted '
                     f'{_value(predicted)} tokens/s/GPU</title></rect>')
    if measured is not None:
        radius = 6 if t.role == "winner" else 4
        parts.append(f'<circle class="measured {t.role}" data-trial="{t.trial}" cx="{x:.1f}" '
                     f'cy="{axes.sy(measured):.1f}" r="{radius}"><title>trial {t.trial} ({t.role}): measured '
                     f'{_value(measured)} tokens/s/GPU</title></circle>')
    else:
        y = TOP + axes.plot_h - 8
        parts.append(f'<g class="failed" data-trial="{t.trial}"><title>trial {t.trial}: failed, '
                     f'{escape(str(t.failure))}</title>'
                     f'<line x1="{x - 5:.1f}" x2="{x + 5:.1f}" y1="{y - 5:.1f}" y2="{y + 5:.1f}" stroke="#c0392b" '
                     f'stroke-width="2"/><line x1="{x - 5:.1f}" x2="{x + 5:.1f}" y1="{y + 5:.1f}" '
                     f'y2="{y - 5:.1f}" stroke="#c0392b" stroke-width="2"/></g>')
    return parts


def memory_bars_svg(phases: dict[str, float], name: str = "memory-stages",
                    title: str = "Memory per stage of a step (GiB)") -> Markup:
    """Horizontal bars of memory per named part, in the order given, under a visible title; the names are escaped.
    ``name`` is the svg's class and title id (unique on the page)."""
    row, left, top = 22, 170, TOP - 20
    height = top + row * len(phases) + 16
    high = max(phases.values()) * 1.15 or 1.0
    width = WIDTH - left - RIGHT - 60
    parts = [f'<svg class="plot {name}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" '
             f'width="{WIDTH}" height="{height}" role="img" aria-labelledby="{name}-title">',
             f'<title id="{name}-title">{escape(title)}</title>',
             f'<text class="panel-title" x="{left}" y="{top - 12}">{escape(title)}</text>']
    for index, (part, value) in enumerate(phases.items()):
        y = top + row * index
        label = f"{_value(value)} GiB"
        parts.append(f'<text x="{left - 6}" y="{y + 14}" text-anchor="end">{escape(part)}</text>')
        parts.append(f'<rect class="bar" x="{left}" y="{y + 3}" width="{width * value / high:.1f}" height="{row - 6}"'
                     f' fill="#0b5cad"><title>{escape(part)}: {label}</title></rect>')
        parts.append(f'<text x="{left + width * value / high + 4:.1f}" y="{y + 14}">{label}</text>')
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
