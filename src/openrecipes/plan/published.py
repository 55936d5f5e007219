"""A ranking's top layout beside the published cards for the same model and GPUs (the catalog, ``recipes/``).

The planner sits below the card package (docs/architecture.md), so it reads only the few card fields it compares
(model, gpu.type, gpu.count, layout sizes, result.tokens_per_s_per_gpu) through the hostile-YAML loader; a card
that is not readable is skipped here (``openrecipes card validate`` is where cards are judged).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrecipes.config.safe_yaml import load_plain_yaml_file

# the layout sizes a card and a plan both state
_SIZES = ("tp", "pp", "cp", "ep", "etp", "dp", "vpp")
# a top prediction further than this from a card's measured tokens/s/GPU is "far" (the planner's error on our own
# calibration runs stays within about 10 %, docs/plan.md)
FAR_RATIO = 0.25


@dataclass(frozen=True, kw_only=True)
class PublishedCard:
    path: Path
    label: str
    sizes: dict[str, int]
    tokens_per_s_per_gpu: float


def published_cards(recipes: Path, model: str, gpu: str, count: int) -> list[PublishedCard]:
    """Cards under ``recipes`` for ``model`` on ``count`` GPUs of type ``gpu`` (names compared without case)."""
    found = []
    for path in sorted(recipes.glob("*/*/*.yaml")) if recipes.is_dir() else []:
        try:
            data = load_plain_yaml_file(path)[0]
        except (OSError, ValueError):
            continue
        card = _matching(data, model, gpu, count)
        if card is not None:
            found.append(PublishedCard(path=path, **card))
    return found


def _matching(data: Any, model: str, gpu: str, count: int) -> dict[str, Any] | None:
    if not isinstance(data, dict):
        return None
    hw, layout, result = data.get("gpu"), data.get("layout"), data.get("result")
    if not (isinstance(hw, dict) and isinstance(layout, dict) and isinstance(result, dict)):
        return None
    if str(data.get("model", "")).lower() != model.lower() or str(hw.get("type", "")).lower() != gpu.lower():
        return None
    tps = result.get("tokens_per_s_per_gpu")
    if hw.get("count") != count or not isinstance(tps, (int, float)) or isinstance(tps, bool):
        return None
    sizes = {key: layout.get(key, 1) for key in _SIZES}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes.values()):
        return None
    return {"label": str(layout.get("label", "")), "sizes": sizes, "tokens_per_s_per_gpu": float(tps)}


def same_layout(card: PublishedCard, layout: Any) -> bool:
    return all(card.sizes[key] == getattr(layout, key) for key in _SIZES)


def explain_gap(card: PublishedCard, ranked: list[Any], hw: Any) -> str | None:
    """Why the ranking's top layout is far from ``card`` (another layout, or a prediction off by more than
    ``FAR_RATIO``), naming the planner's assumptions; None when they agree."""
    top = ranked[0]
    predicted = top.throughput.tokens_per_s_per_gpu
    other_layout = not same_layout(card, top.layout)
    gap = predicted / card.tokens_per_s_per_gpu - 1
    if not other_layout and abs(gap) <= FAR_RATIO:
        return None
    rank = next((i for i, plan in enumerate(ranked, 1) if same_layout(card, plan.layout)), None)
    where = (f"its layout ranks #{rank} here at {ranked[rank - 1].throughput.tokens_per_s_per_gpu:,.0f} predicted"
             if rank else "its layout is not among the fitting layouts ranked here (other settings or memory)")
    what = (f"the top layout {top.layout.label()} differs" if other_layout
            else f"the top prediction {predicted:,.0f} is {gap:+.0%} off")
    eff = hw.efficiency
    return (f"published card {card.path} ({card.label or 'its layout'}, {card.tokens_per_s_per_gpu:,.0f} tokens/s/GPU "
            f"measured): {what}; {where}. The planner assumes routing at a fixed {hw.memory.moe_token_imbalance}x "
            f"imbalance on every step (its engine calibration ran with balanced routing) and its engine efficiencies "
            f"(dense {eff.dense_matmul}, expert {eff.expert_matmul}, attention {eff.attention}, links {eff.comm} of "
            "peak; plan/planner.yaml), not the card's kernels, dispatcher or routing")
