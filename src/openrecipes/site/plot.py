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
from openrecipes.utils import nice_ticks, shown_step, tick_labels

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


def _frame(css_class: str, title_id: str, title: str, axes: _Axes, x_ticks: list[float], x_label: str | None,
           y_label: str, *, x_tick_labels: list[str] | None = None) -> list[str]:
    """The opening of a plot: the svg element, its title (for screen readers and on screen), the frame, y ticks
    with grid lines, x ticks (labelled as numbers unless ``x_tick_labels`` names them) and both axis titles (the
    x axis's left to the caller when ``x_label`` is None)."""
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
    for value, label in zip(x_ticks, x_tick_labels or (tick_labels(x_ticks) if x_ticks else [])):
        x = axes.sx(value)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP + plot_h}" y2="{TOP + plot_h + 4}" stroke="#999"/>')
        parts.append(f'<text class="tick x" x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">'
                     f'{label}</text>')
    if x_label is not None:
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
    """One entry per (class, text, mark) drawn, between the panel's title and its frame, so it never covers a point;
    mark is "line" (a line sample before the text) or a kind of ``_mark`` (the mark as the plot draws it). Entries
    that do not fit one row go on a second, above the first."""
    def indent(mark: str) -> int:  # where the text starts: after a line sample, or after a mark
        return 30 if mark in ("line", "dash") else 18

    rows, row, x = [], [], left
    for entry in entries:
        width = indent(entry[2]) + CHAR_WIDTH * len(entry[1])
        if row and x + width > WIDTH - RIGHT:
            rows.append(row)
            row, x = [], left
        row.append((x, entry))
        x += width + 14
    rows.append(row)
    parts = []
    for index, placed in enumerate(rows):
        y = TOP - 8 - 13 * (len(rows) - 1 - index)
        for x, (name, text, mark) in placed:
            if mark == "line":
                parts.append(f'<line class="legend {name}" x1="{x:.1f}" x2="{x + 24:.1f}" y1="{y - 4}" '
                             f'y2="{y - 4}" stroke-width="2"/>')
            else:
                parts.append(f'<g class="legend-mark {name}">{_mark(mark, x + (0 if mark == "dash" else 6), y - 4)}'
                             '</g>')
            parts.append(f'<text class="legend {name}" x="{x + indent(mark):.1f}" y="{y}">{escape(text)}</text>')
    return parts


def loss_plot_svg(curves: Curves, title_id: str = "plot-title", *, steps_from_zero: bool = True) -> Markup:
    """SVG markup for the candidate (solid) and reference (dashed) loss per step, the steps shown from 1
    (``shown_step``) unless ``steps_from_zero`` is False (another engine's record, kept in its own count).

    Only numbers go into the markup; the labels are fixed text, so nothing from a card needs escaping.
    ``title_id`` must be unique on the page (a model page has one plot per item); the caller makes it.
    """
    show = shown_step if steps_from_zero else int
    arms = [("candidate", [(show(p.step), p.loss) for p in curves.candidate])]
    if curves.reference:
        arms.append(("reference", [(show(p.step), p.loss) for p in curves.reference]))
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
        points = [(shown_step(p.step), getattr(p, key)) for p in curves.candidate if getattr(p, key) is not None]
        if points:
            plots.append((key, series_plot_svg(points, key=key, title=title, y_label=y_label)))
    return plots


def _tuning_columns(tuning: Tuning) -> tuple[list[tuple[float, str]], list[tuple[str, float, float]], list[float],
                                             list[float]]:
    """The chart's x positions: each search trial at its number, then (after a gap) each remeasured start/winner
    pair, then each ablation. Returns the ticks as (x, label), the groups as (caption, first x, last x), and the x of
    each remeasured pair (pairs 2, 3, ...: pair 1 is the two search trials) and of each ablation."""
    trials = sorted({t.trial for t in tuning.trials})
    last = trials[-1]
    pairs = len(tuning.gain.pair_gains) if tuning.gain else 1
    pair_x = [float(last + k) for k in range(2, pairs + 1)]
    after = last + (pairs if pairs > 1 else 0)
    ablation_x = [float(after + j) for j in range(1, len(tuning.ablations) + 1)]
    ticks = [(float(n), str(n)) for n in trials] + [(x, str(k)) for k, x in enumerate(pair_x, start=2)]
    ticks += [(x, f"A{j}") for j, x in enumerate(ablation_x, start=1)]
    groups = [("search trial", trials[0], last)]
    groups += [("remeasured pair", pair_x[0], pair_x[-1])] if pair_x else []
    groups += [("ablation", ablation_x[0], ablation_x[-1])] if ablation_x else []
    return ticks, groups, pair_x, ablation_x


def tuning_plot_svg(tuning: Tuning) -> Markup:
    """SVG markup of everything the tuner measured: each search trial's tokens/s/GPU (dots), the planner's prediction
    when it was chosen (hollow squares, joined to the measurement), failures (crosses on the axis, their class in a
    tooltip), the start and the winner measured again in interleaved pairs (the samples the quoted gain and spread
    come from), each ablation (a diamond: the winner with one knob set back), and the starting point's throughput as
    a dashed line. The legend shows each mark drawn, as drawn. Only numbers and fixed labels go into the markup,
    except the failure classes and ablation knobs, which are escaped."""
    trials, gain = list(tuning.trials), tuning.gain
    ticks, groups, pair_x, ablation_x = _tuning_columns(tuning)
    remeasured = list(zip(gain.start_tokens_per_s_per_gpu[1:], gain.winner_tokens_per_s_per_gpu[1:])) if gain else []
    values = [tuning.start_tokens_per_s_per_gpu, tuning.tuned_tokens_per_s_per_gpu]
    values += [v for t in trials for v in (t.measured_tokens_per_s_per_gpu, t.predicted_tokens_per_s_per_gpu) if v]
    values += [v for pair in remeasured for v in pair]
    values += [a.measured_tokens_per_s_per_gpu for a in tuning.ablations if a.measured_tokens_per_s_per_gpu]
    axes = _axes(ticks[0][0] - 0.5, ticks[-1][0] + 0.5, values, from_zero=True)
    parts = _frame("plot tuning", "tuning-title", "Tuner runs: predicted and measured tokens/s per GPU", axes,
                   [x for x, _ in ticks], None, "tokens/s/GPU", x_tick_labels=[label for _, label in ticks])
    for caption, first, last in groups:
        parts.append(f'<text class="axis-title group" x="{(axes.sx(first) + axes.sx(last)) / 2:.1f}" '
                     f'y="{HEIGHT - 6}" text-anchor="middle">{caption}</text>')
    for (_, _, before), (_, first, _) in zip(groups, groups[1:]):  # a dashed rule between two groups
        x = axes.sx((before + first) / 2)
        parts.append(f'<line class="group-rule" x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + axes.plot_h}" '
                     'stroke="#c3cad4" stroke-dasharray="3 3"/>')
    start_y = axes.sy(tuning.start_tokens_per_s_per_gpu)
    parts.append(_mark("dash", axes.left, start_y, width=axes.plot_w, tip=(
        f"starting point: {_value(tuning.start_tokens_per_s_per_gpu)} tokens/s/GPU")))
    for t in trials:
        parts += _trial_marks(t, axes)
    drawn = {"trial", "start", "winner"} & {t.role for t in trials if t.measured_tokens_per_s_per_gpu is not None}
    for k, ((start, winner), x) in enumerate(zip(remeasured, map(axes.sx, pair_x)), start=2):
        parts.append(_mark("start", x, axes.sy(start), tip=f"pair {k}: start remeasured {_value(start)} tokens/s/GPU"))
        parts.append(_mark("winner", x, axes.sy(winner),
                           tip=f"pair {k}: winner remeasured {_value(winner)} tokens/s/GPU"))
        drawn |= {"start", "winner"}
    for j, (ablation, x) in enumerate(zip(tuning.ablations, map(axes.sx, ablation_x)), start=1):
        if ablation.measured_tokens_per_s_per_gpu is not None:
            parts.append(_mark("ablation", x, axes.sy(ablation.measured_tokens_per_s_per_gpu),
                               tip=f"ablation A{j}, {ablation.knob} set back to the start's: "
                                   f"{_value(ablation.measured_tokens_per_s_per_gpu)} tokens/s/GPU"))
            drawn.add("ablation")
    drawn |= {"predicted"} if any(t.predicted_tokens_per_s_per_gpu is not None for t in trials) else set()
    drawn |= {"failed"} if any(t.measured_tokens_per_s_per_gpu is None for t in trials) else set()
    parts += _legend([(kind, text, kind) for kind, text in TUNING_LEGEND if kind in drawn | {"dash"}], axes.left)
    parts.append("</svg>")
    return Markup("\n".join(parts))


# the tuning chart's marks in legend order: (kind, legend text); "dash" is the starting point's throughput
TUNING_LEGEND = (("trial", "trial"), ("start", "start"), ("winner", "winner"), ("predicted", "predicted"),
                 ("failed", "failed"), ("ablation", "ablation"), ("dash", "start's throughput"))


def _mark(kind: str, x: float, y: float, *, tip: str = "", width: float = 24, trial: int | None = None) -> str:
    """One mark of the tuning chart, drawn the same in the plot and in its legend: a dot (trial, start, winner), a
    hollow square (predicted), a cross (failed), a diamond (ablation) or a dashed line ``width`` long (dash)."""
    title = f"<title>{escape(tip)}</title>" if tip else ""
    data = f' data-trial="{trial}"' if trial is not None else ""
    if kind in ("trial", "start", "winner"):
        radius = 6 if kind == "winner" else 4
        return f'<circle class="measured {kind}"{data} cx="{x:.1f}" cy="{y:.1f}" r="{radius}">{title}</circle>'
    if kind == "predicted":
        return (f'<rect class="predicted"{data} x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="none" '
                f'stroke="#6b7a8f">{title}</rect>')
    if kind == "ablation":
        return (f'<polygon class="ablation" points="{x:.1f},{y - 5:.1f} {x + 5:.1f},{y:.1f} {x:.1f},{y + 5:.1f} '
                f'{x - 5:.1f},{y:.1f}">{title}</polygon>')
    if kind == "failed":
        return (f'<g class="failed"{data}>{title}<line x1="{x - 5:.1f}" x2="{x + 5:.1f}" y1="{y - 5:.1f}" '
                f'y2="{y + 5:.1f}" stroke="#c0392b" stroke-width="2"/><line x1="{x - 5:.1f}" x2="{x + 5:.1f}" '
                f'y1="{y + 5:.1f}" y2="{y - 5:.1f}" stroke="#c0392b" stroke-width="2"/></g>')
    assert kind == "dash", kind
    return (f'<line class="start-line" x1="{x:.1f}" x2="{x + width:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#888" '
            f'stroke-dasharray="6 4">{title}</line>')


def _trial_marks(t, axes: _Axes) -> list[str]:
    """A trial's prediction (square), measurement (dot, joined to the prediction) or failure (cross)."""
    x, parts = axes.sx(t.trial), []
    measured, predicted = t.measured_tokens_per_s_per_gpu, t.predicted_tokens_per_s_per_gpu
    if predicted is not None:
        y = axes.sy(predicted)
        if measured is not None:
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{axes.sy(measured):.1f}" '
                         'stroke="#c3cad4"/>')
        parts.append(_mark("predicted", x, y, trial=t.trial,
                           tip=f"trial {t.trial}: predicted {_value(predicted)} tokens/s/GPU"))
    if measured is not None:
        parts.append(_mark(t.role, x, axes.sy(measured), trial=t.trial,
                           tip=f"trial {t.trial} ({t.role}): measured {_value(measured)} tokens/s/GPU"))
    else:
        parts.append(_mark("failed", x, TOP + axes.plot_h - 8, trial=t.trial,
                           tip=f"trial {t.trial}: failed, {t.failure}"))
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
