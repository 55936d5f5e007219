"""The hand-written SVG of two loss curves."""

import xml.etree.ElementTree as ET

import pytest

from openrecipes.verify.curves import LossCurve
from openrecipes.verify.plot import _ticks, render_svg, write_svg

SVG = "{http://www.w3.org/2000/svg}"


def test_nan_points_are_left_out_of_the_line_and_marked(tmp_path):
    cand = LossCurve(source="cand <a&b>", losses={0: 3.0, 1: float("nan"), 2: 2.0, 3: None, 4: 1.5})
    ref = LossCurve(source="ref", losses={0: 3.0, 1: 2.5, 2: 2.0, 3: 1.7, 4: 1.5})
    path = tmp_path / "p.svg"
    write_svg(path, cand, ref, title="a < b", skipped_steps=[0])
    root = ET.fromstring(path.read_text())  # escapes in the title and the source keep it well-formed
    lines = {p.get("class"): p.get("points").split() for p in root.iter(SVG + "polyline")}
    assert len(lines["reference"]) == 5 and len(lines["candidate"]) == 3
    marks = [t.text for t in root.iter(SVG + "title") if t.text and t.text.startswith("candidate step")]
    assert marks == ["candidate step 1: nan", "candidate step 3: absent"]
    assert [p.name for p in tmp_path.iterdir()] == ["p.svg"]  # no temporary file left behind


def test_points_are_inside_the_plot_area():
    ref = LossCurve(source="r", losses={s: 10.0 - s for s in range(10)})
    root = ET.fromstring(render_svg(ref, ref))
    width, height = float(root.get("width")), float(root.get("height"))
    for line in root.iter(SVG + "polyline"):
        for pair in line.get("points").split():
            x, y = map(float, pair.split(","))
            assert 0 < x < width and 0 < y < height


def test_single_step_and_flat_curves_render():
    one = LossCurve(source="x", losses={7: 2.0})
    ET.fromstring(render_svg(one, one))


@pytest.mark.parametrize("low, high", [(0.0, 10.0), (1.83, 11.2), (0.001, 0.0042)])
def test_ticks_are_round_and_cover_the_range(low, high):
    ticks = _ticks(low, high)
    assert 2 <= len(ticks) <= 11
    assert all(low - 1e-12 <= t <= high + 1e-12 for t in ticks)
    steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1
