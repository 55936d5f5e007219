"""A small catalog for the site tests: the real cards plus variants made from them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CATALOG = REPO / "recipes"
QWEN_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.yaml"
MUSE_CARD = CATALOG / "muse-spark-open" / "h200" / "attune-tp4-pp16-ep8.yaml"
SEED_CARDS = (QWEN_CARD, MUSE_CARD)  # the catalog's cards from the seeds: what the site tests are written against


def qwen_data() -> dict[str, Any]:
    return yaml.safe_load(QWEN_CARD.read_text())


def write(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=100))
    return path


def copy_seed_cards(recipes: Path) -> Path:
    """The catalog's seed cards alone, at their paths under ``recipes``."""
    for card in SEED_CARDS:
        (recipes / card.parent.relative_to(CATALOG)).mkdir(parents=True, exist_ok=True)
        shutil.copy(card, recipes / card.relative_to(CATALOG))
    return recipes


def _window_times(mean: float, cv: float, steps: int) -> list[float]:
    """Step times alternating around ``mean`` whose population CV is ``cv``."""
    signs = [(-1) ** s for s in range(steps)]
    centre = sum(signs) / steps
    spread = (sum((v - centre) ** 2 for v in signs) / steps) ** 0.5
    return [mean * (1 + cv * (v - centre) / spread) for v in signs]


def catalog_with_variant(root: Path) -> Path:
    """The catalog plus an unverified pretrain variant of the Qwen card that has loss curves."""
    recipes = copy_seed_cards(root / "recipes")
    data = qwen_data()
    data["status"] = "unverified"
    data["workload"]["workflow"] = "pretrain"
    data["layout"]["label"] = "TP1 PP1 EP8 DP8 curves"
    data["workload"]["dataset"]["build"].update(skipped_invalid={"unknown role": 3, "non-text content part": 1},
                                                tokens_in_unsupervised_rows=4096)
    step_tokens, gpus = data["workload"]["global_batch"] * data["workload"]["row_tokens"], data["gpu"]["count"]
    mean = step_tokens / data["result"]["tokens_per_s_per_gpu"] / gpus
    first, last = data["result"]["window"]
    times = [mean] * first + _window_times(mean, data["result"]["step_time_cv_percent"] / 100, last - first + 1)
    # a step's tokens/s/GPU is its tokens / its time / GPUs, and the window's times give the card's headline
    # tokens/s/GPU and step-time CV (the card checks hold them to each other)
    data["curves"] = {
        "candidate": [{"step": s, "loss": 2.0 - 0.05 * s, "step_time_s": time,
                       "tokens_per_s_per_gpu": step_tokens / time / gpus, "peak_memory_gib": 60.0,
                       "grad_norm": 2.0 / (1 + s), "lr": 1e-5 * min(1.0, (s + 1) / 5)}
                      for s, time in enumerate(times)],
        "reference": [{"step": s, "loss": 2.01 - 0.05 * s} for s in range(20)],
        "memory_phases_gib": {"start": 20.5, "forward_peak": 55.0, "backward_peak": 60.0, "optimizer_peak": 31.2},
    }
    data["recipe"] = "name: variant\nmodel: qwen3-30b-a3b\nglobal_batch: 128\n"
    write(recipes / "qwen3-30b-a3b" / "h200" / "variant-with-curves.yaml", data)
    return recipes


def card_workflows() -> list[str]:
    """The workflows the card schema knows, in its order."""
    from typing import get_args

    from openrecipes.cards.schema import Workload

    return [value for arg in get_args(Workload.model_fields["workflow"].annotation) for value in get_args(arg)]


def catalog_of_workflows(root: Path, copies: dict[str, int] | None = None) -> tuple[Path, dict[str, list[str]]]:
    """A catalog of Qwen cards, ``copies[workflow]`` (default 1) of each workflow the card schema knows; returns it
    and, per workflow, the site pages of its cards."""
    recipes, pages = root / "recipes", {}
    for workflow in card_workflows():
        pages[workflow] = []
        for copy in range((copies or {}).get(workflow, 1)):
            data = qwen_data()
            data["workload"]["workflow"] = workflow
            data["layout"]["label"] = f"TP1 PP1 EP8 DP8 {workflow} {copy}"
            write(recipes / "qwen3-30b-a3b" / "h200" / f"{workflow}-{copy}.yaml", data)
            pages[workflow].append(f"qwen3-30b-a3b/h200/{workflow}-{copy}.html")
    return recipes, pages



TUNED_CARD = CATALOG / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.yaml"


def tuned_data(pairs: int = 3, ablations: tuple[str, ...] = ("offload", "recompute")) -> dict[str, Any]:
    """The catalog's tuned card with ``pairs`` interleaved start/winner pairs (the first its two search trials, the
    rest remeasured a little apart) and an ablation of each knob, every figure following from its samples."""
    import statistics

    data = yaml.safe_load(TUNED_CARD.read_text())
    tuning = data["tuning"]
    first = {t["role"]: t["measured_tokens_per_s_per_gpu"] for t in tuning["trials"] if t["role"] != "trial"}
    start = [first["start"] * (1 + 0.01 * k * (-1) ** k) for k in range(pairs)]
    winner = [first["winner"] * (1 - 0.005 * k * (-1) ** k) for k in range(pairs)]
    gains = [w / s - 1 for s, w in zip(start, winner)]
    tuning["gain"] = {"start_tokens_per_s_per_gpu": start, "winner_tokens_per_s_per_gpu": winner,
                      "pair_gains": gains, "median_gain": statistics.median(gains),
                      "start_spread": (max(start) - min(start)) / statistics.median(start)}
    tuning["start_tokens_per_s_per_gpu"] = statistics.median(start)
    tuning["tuned_tokens_per_s_per_gpu"] = statistics.median(winner)
    data["result"]["runs"] = pairs  # the card's result: the median of the winner's samples (the trial's, here)
    # each ablation a little slower than the winner: the knob set back gives some of the gain back
    measured = [statistics.median(winner) / (1.1 + 0.2 * index) for index in range(len(ablations))]
    tuning["ablations"] = [{"knob": knob, "measured_tokens_per_s_per_gpu": value,
                            "contribution": statistics.median(winner) / value - 1}
                           for knob, value in zip(ablations, measured)]
    return data


def cpu_data() -> dict[str, Any]:
    """The Qwen card as if its run had been on the CPU: processes, the host's memory, no MFU."""
    data = qwen_data()
    data["gpu"] = {"type": "cpu", "memory_gb": 25.3, "count": 8, "per_node": 8, "instance": None}
    data["status"] = "unverified"
    data["result"]["mfu"] = None
    data["result"]["usd_per_million_tokens"] = None
    return data
