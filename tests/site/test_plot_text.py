"""The site's SVG charts read as a person reads numbers: tick labels without scientific notation and clear of the axis
title, a title on every panel, a legend of what is drawn only, gradient-norm and learning-rate panels from the run's
metrics, and a tooltip on every point."""

import json
import re
import xml.etree.ElementTree as ET

import yaml

from .site_fixtures import CATALOG

from openrecipes.cards.schema import Curves, Tuning
from openrecipes.cards.step_curves import curve_points
from openrecipes.site.plot import AXIS_TITLE_X, CHAR_WIDTH, loss_plot_svg, memory_bars_svg, step_plots, \
    tuning_plot_svg
from openrecipes.utils import nice_ticks, tick_labels
from openrecipes.verify.curves import LossCurve

SVG = "{http://www.w3.org/2000/svg}"
TUNED_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.yaml"


def _curves(steps: int = 30) -> Curves:
    return Curves(candidate=[{"step": s, "loss": 2.0 - 0.01 * s, "step_time_s": 1.2 + 0.001 * s,
                              "tokens_per_s_per_gpu": 12_400.0 + 7 * s, "peak_memory_gib": 61.5,
                              "grad_norm": 3.0 / (1 + s), "lr": 1e-5 * min(1.0, (s + 1) / 10)}
                             for s in range(steps)],
                  reference=[{"step": s, "loss": 2.01 - 0.01 * s} for s in range(steps)])


def _ticks(svg: str) -> list[ET.Element]:
    return [t for t in ET.fromstring(svg).iter(SVG + "text") if "tick" in (t.get("class") or "").split()]


def _texts(svg: str, css_class: str) -> list[str]:
    return [t.text for t in ET.fromstring(svg).iter(SVG + "text") if css_class in (t.get("class") or "").split()]


def test_tick_labels_are_written_as_people_write_numbers():
    assert tick_labels(nice_ticks(1230, 1250)) == ["1,230", "1,235", "1,240", "1,245", "1,250"]
    assert tick_labels(nice_ticks(12_000, 12_800)) == ["12.0k", "12.2k", "12.4k", "12.6k", "12.8k"]
    assert tick_labels(nice_ticks(0, 2.5e6)) == ["0", "0.5M", "1.0M", "1.5M", "2.0M", "2.5M"]
    assert tick_labels(nice_ticks(1.73, 1.76)) == ["1.73", "1.74", "1.75", "1.76"]
    assert tick_labels(nice_ticks(0, 0.0042)) == ["0", "0.001", "0.002", "0.003", "0.004"]


def test_every_panel_has_a_title_and_readable_ticks_clear_of_the_axis_title():
    curves = _curves()
    panels = [loss_plot_svg(curves)] + [svg for _, svg in step_plots(curves)]
    assert len(panels) == 6
    for svg in panels:
        titles = _texts(svg, "panel-title")
        assert len(titles) == 1 and titles[0], svg[:200]
        ticks = _ticks(svg)
        assert len(ticks) >= 4
        for tick in ticks:
            assert not re.search(r"\de[+-]?\d", tick.text), tick.text
        # the y labels end at the frame and are no wider than the margin left of them: the rotated axis title
        # (about 12 px tall around its centre line) keeps clear of every one
        for tick in (t for t in ticks if "y" in t.get("class").split()):
            assert float(tick.get("x")) - CHAR_WIDTH * len(tick.text) > AXIS_TITLE_X + 6, tick.text


def test_tokens_per_second_axis_reads_in_thousands():
    [svg] = [svg for key, svg in step_plots(_curves()) if key == "tokens_per_s_per_gpu"]
    labels = [t.text for t in _ticks(svg) if "y" in t.get("class").split()]
    assert "10k" in labels and all(label == "0" or label.endswith("k") for label in labels), labels


def test_gradient_norm_and_learning_rate_panels_from_the_card_points():
    plots = dict(step_plots(_curves()))
    assert {"grad_norm", "lr"} <= set(plots)
    assert _texts(plots["grad_norm"], "panel-title") == ["Gradient norm per step"]
    assert _texts(plots["lr"], "panel-title") == ["Learning rate per step"]
    # 1e-5 is labelled as multiples of a power of ten named by the axis title, not 0.000010 or 1e-05
    [axis_title] = [t for t in _texts(plots["lr"], "axis-title") if t.startswith("learning rate")]
    assert axis_title == "learning rate (×10⁻⁵)"
    assert [t.text for t in _ticks(plots["lr"]) if "y" in t.get("class").split()][-1] == "1.0"
    # no panel for a series the points do not hold
    assert "grad_norm" not in dict(step_plots(Curves(candidate=[{"step": 0, "loss": 1.0}])))


def test_every_point_has_a_tooltip_with_its_value():
    curves = _curves(steps=5)
    root = ET.fromstring(loss_plot_svg(curves))
    tips = [c.find(SVG + "title").text for c in root.iter(SVG + "circle")]
    # the card's step 3 (0-based) is the fourth step, shown as the console counts it
    assert len(tips) == 10 and "candidate, step 4: 1.97 loss" in tips and "reference, step 1: 2.01 loss" in tips
    [lr] = [svg for key, svg in step_plots(curves) if key == "lr"]
    assert "candidate, step 5: 0.000005 learning rate" in [c.find(SVG + "title").text
                                                          for c in ET.fromstring(lr).iter(SVG + "circle")]
    bars = ET.fromstring(memory_bars_svg({"start": 20.5, "backward_peak": 1234.6}))
    assert [r.find(SVG + "title").text for r in bars.iter(SVG + "rect")] == ["start: 20.5 GiB",
                                                                         "backward_peak: 1,235 GiB"]


def test_the_loss_legend_names_only_the_arms_drawn():
    assert _texts(loss_plot_svg(_curves()), "legend") == ["candidate", "reference"]
    assert _texts(loss_plot_svg(Curves(candidate=_curves().candidate)), "legend") == []


def test_the_tuning_legend_names_failures_only_when_a_trial_failed():
    tuning = yaml.safe_load(TUNED_CARD.read_text())["tuning"]
    measured = Tuning(**{**tuning, "trials": [t for t in tuning["trials"] if t.get("measured_tokens_per_s_per_gpu")]})
    svg = tuning_plot_svg(measured)
    assert "failed" not in " ".join(_texts(svg, "legend")) and 'class="failed"' not in svg
    assert not any(re.search(r"\de[+-]?\d", t.text) for t in _ticks(svg))
    failed = dict(measured.trials[-1].model_dump(), measured_tokens_per_s_per_gpu=None, failure="out_of_memory")
    with_failure = Tuning(**{**tuning, "trials": [*tuning["trials"][:1], failed]})
    assert "failed" in _texts(tuning_plot_svg(with_failure), "legend")


def test_card_points_take_gradient_norm_and_learning_rate_from_metrics(tmp_path):
    records = [{"step": 0, "loss": 2.0, "grad_norm": 4.5, "lr": 0.0, "step_time_s": 1.0, "tokens": 800},
               {"step": 1, "loss": 1.9, "grad_norm": float("nan"), "lr": 1e-4, "step_time_s": 1.0, "tokens": 800}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    points = curve_points(LossCurve(source="x", losses={0: 2.0, 1: 1.9}), tmp_path, gpus=8)
    assert points[0]["grad_norm"] == 4.5 and points[0]["lr"] == 0.0
    assert "grad_norm" not in points[1] and points[1]["lr"] == 1e-4  # a non-finite norm is left out, not plotted
    Curves(candidate=points)  # and the card's schema holds them


def test_the_tuning_chart_draws_every_sample_behind_the_quoted_gain_and_each_ablation():
    from .site_fixtures import tuned_data

    tuning = Tuning(**tuned_data(pairs=4, ablations=("offload", "recompute", "kernels"))["tuning"])
    root = ET.fromstring(tuning_plot_svg(tuning))
    tips = {c.find(SVG + "title").text for c in root.iter() if c.find(SVG + "title") is not None}
    # every start and winner sample (the first of each is its search trial), at its own value
    for role, samples in (("start", tuning.gain.start_tokens_per_s_per_gpu),
                          ("winner", tuning.gain.winner_tokens_per_s_per_gpu)):
        # the plot's own marks are the svg's children; the legend's sit inside a g.legend-mark
        drawn = [c for c in root.findall(SVG + "circle") if c.get("class") == f"measured {role}"]
        assert len(drawn) == len(samples), role
        for pair, value in enumerate(samples[1:], start=2):
            assert any(t.startswith(f"pair {pair}: {role} remeasured ") for t in tips), (role, pair)
    ablations = [p for p in root.findall(SVG + "polygon") if p.get("class") == "ablation"]
    assert len(ablations) == 3 and any("recompute set back" in t for t in tips)
    assert [t.text for t in root.iter(SVG + "text") if "group" in (t.get("class") or "")] == [
        "search trial", "remeasured pair", "ablation"]
