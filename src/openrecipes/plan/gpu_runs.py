"""The layouts this engine has run on GPUs, as the project records them: the results of `bench/engine_speed.py`
under bench/results and the recipe cards this engine measured on a GPU. A ranking flags every layout outside them:
its prediction is the model's alone, no run of this engine backs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openrecipes.config.safe_yaml import load_plain_yaml_file

# what makes two layouts the same layout here: every parallel size (the microbatch and the settings may differ)
SIZES = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp")


def layout_key(layout: Any) -> tuple[int, ...]:
    return tuple(int(getattr(layout, key, 1) or 1) for key in SIZES)


@dataclass(kw_only=True)
class GpuRuns:
    """Layouts (``layout_key``) this engine ran on GPUs, each with where it is recorded."""

    layouts: dict[tuple[int, ...], list[str]] = field(default_factory=dict)
    searched: list[str] = field(default_factory=list)  # where the records were looked for

    def ran(self, layout: Any) -> bool:
        return layout_key(layout) in self.layouts

    def labels(self) -> list[str]:
        names = ("TP", "PP", "VPP", "CP", "EP", "ETP", "DP")
        return [" ".join(f"{n}{v}" for n, v in zip(names, key) if n in ("TP", "PP", "EP", "DP") or v > 1)
                for key in sorted(self.layouts)]


def engine_gpu_runs(results: Path | None, recipes: Path | None) -> GpuRuns:
    """Every layout of a successful GPU result of `bench/engine_speed.py` under ``results`` and of a card under
    ``recipes`` that this engine measured on a GPU (not a CPU); a directory that does not exist adds nothing."""
    from openrecipes.plan.calibration import measured_runs

    runs = GpuRuns()
    if results is not None and results.is_dir():
        runs.searched.append(str(results))
        for run in measured_runs(results):
            runs.layouts.setdefault(layout_key(run.layout), []).append(f"{run.source}:{run.variant}")
    if recipes is not None and recipes.is_dir():
        runs.searched.append(str(recipes))
        for path in sorted(recipes.glob("*/*/*.yaml")):
            key = _card_layout(path)
            if key is not None:
                runs.layouts.setdefault(key, []).append(str(path))
    return runs


def _card_layout(path: Path) -> tuple[int, ...] | None:
    """A card's layout when this engine measured it on a GPU, else None (another framework, a CPU, not a card)."""
    try:
        data = load_plain_yaml_file(path)[0]
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), dict) for k in ("stack", "gpu", "layout")):
        return None
    if not str(data["stack"].get("framework", "")).strip().lower().startswith("openrecipes") \
            or str(data["gpu"].get("type", "cpu")).strip().lower() == "cpu":
        return None
    sizes = [data["layout"].get(key, 1) for key in SIZES]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sizes):
        return None
    return tuple(sizes)
