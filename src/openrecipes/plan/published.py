"""A ranking beside the published cards for the same model and GPUs (the catalog, ``recipes/``): each card's exact
recipe predicted against what it measured, and where its layout ranks.

The planner sits below the card package (docs/architecture.md), so it reads only the card fields it compares
(model, gpu, layout, workload batch, result.tokens_per_s_per_gpu, the framework, the optimizer as the run command or
recipe states it) through the hostile-YAML loader; a card that is not readable is skipped here (``openrecipes card
validate`` is where cards are judged).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openrecipes.config.layout import LayoutConfig
from openrecipes.config.safe_yaml import load_plain_yaml, load_plain_yaml_file

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
    engine: str = "megatron"  # whose engine measured it: "openrecipes" (this one) or "megatron" (the seed cards)
    exact: tuple[LayoutConfig, dict[str, Any]] | None = None  # its layout and TrainingSetup fields, as it ran
    unplanned: str | None = None  # why ``exact`` is None


def published_cards(recipes: Path, model: str, gpu: str, count: int) -> list[PublishedCard]:
    """Cards under ``recipes`` for ``model`` on ``count`` GPUs of type ``gpu`` (names compared without case)."""
    found = []
    for path in sorted(recipes.glob("*/*/*.yaml")) if recipes.is_dir() else []:
        try:
            data = load_plain_yaml_file(path)[0]
        except (OSError, ValueError):
            continue
        card = _matching(data, model, gpu, count, path)
        if card is not None:
            found.append(PublishedCard(path=path, **card))
    return found


def _matching(data: Any, model: str, gpu: str, count: int, path: Path) -> dict[str, Any] | None:
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
    framework = str((data.get("stack") or {}).get("framework", "")) if isinstance(data.get("stack"), dict) else ""
    engine = "openrecipes" if framework.strip().lower().startswith("openrecipes") else "megatron"
    try:
        exact, unplanned = exact_recipe(data, engine, path), None
    except (TypeError, ValueError, AttributeError) as error:
        exact, unplanned = None, str(error).splitlines()[0]
    return {"label": str(layout.get("label", "")), "sizes": sizes, "tokens_per_s_per_gpu": float(tps),
            "engine": engine, "exact": exact, "unplanned": unplanned}


def exact_recipe(data: dict[str, Any], engine: str, path: Path | None = None
                 ) -> tuple[LayoutConfig, dict[str, Any]]:
    """The card's layout with every setting the planner models (split, microbatch, recompute, optimizer, offload,
    global batch) and the engine that ran it, as ``TrainingSetup`` fields; ValueError naming what is missing.
    ``path`` is the card's file (a recipe file beside it may hold the optimizer)."""
    from openrecipes.plan.enumerate import offload_update_for

    layout, workload = data["layout"], data.get("workload")
    if not isinstance(workload, dict):
        raise ValueError("the card has no workload block")
    split = layout.get("layer_split") or {}
    config = LayoutConfig(**{key: layout.get(key, 1) for key in _SIZES},
                          sequence_parallel=bool(layout.get("sequence_parallel", False)),
                          pp_first_stage_layers=split.get("first"), pp_last_stage_layers=split.get("last"),
                          max_tokens_per_gpu=layout.get("max_tokens_per_gpu"),
                          rows_per_microbatch=layout.get("rows_per_microbatch"))
    recompute = layout.get("recompute") or {}
    recipe = _recipe(data, path) if engine == "openrecipes" else {}
    offload = layout.get("offload") or {}
    update = ((recipe.get("offload") or {}).get("update") if engine == "openrecipes" else None) \
        or offload_update_for(engine)
    setup = {"recompute": recompute.get("granularity", "none"),
             "recompute_layers": recompute.get("num_layers") if recompute.get("method") == "block" else None,
             "optimizer": "precision-aware" if _precision_aware(data, recipe) else "adam",
             "offload_fraction": float(offload.get("optimizer_fraction", 0.0)), "offload_update": update,
             "global_batch_tokens": int(workload["global_batch"]) * int(workload["row_tokens"]), "engine": engine}
    return config, setup


def _recipe(data: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """The resolved recipe of a card of this engine: its ``recipe`` text, else the recipe file beside the card that
    its ``run`` command trains (`openrecipes train X.yaml`); {} when neither is there."""
    text = data.get("recipe")
    if isinstance(text, str):
        recipe = load_plain_yaml(text, f"{path or 'the card'}: recipe")[0]
        return recipe if isinstance(recipe, dict) else {}
    words = str(data.get("run", "")).split()
    for index, word in enumerate(words[:-1]):
        beside = path.parent / Path(words[index + 1]).name if path is not None else None
        if word == "train" and beside is not None and beside.suffix == ".yaml" and beside.is_file():
            recipe = load_plain_yaml_file(beside)[0]
            return recipe if isinstance(recipe, dict) else {}
    return {}


def _precision_aware(data: dict[str, Any], recipe: dict[str, Any]) -> bool:
    """This engine's recipe says optimizer.precision_aware; a Megatron-LM run passes --use-precision-aware-optimizer."""
    optimizer = recipe.get("optimizer") if isinstance(recipe.get("optimizer"), dict) else {}
    return optimizer.get("precision_aware") is True or "--use-precision-aware-optimizer" in str(data.get("run", ""))


def same_layout(card: PublishedCard, layout: Any) -> bool:
    return all(card.sizes[key] == getattr(layout, key) for key in _SIZES)


def engine_name(engine: str) -> str:
    """How a plan names whose memory and speed model it used."""
    return "openrecipes" if engine == "openrecipes" else "generic"


def _settings(plan: Any) -> str:
    layout, setup = plan.layout, plan.setup
    return (f"{layout.max_tokens_per_gpu:,} tokens/GPU, recompute {setup.recompute}, {setup.optimizer}, offload "
            f"{setup.offload_fraction:g}, {engine_name(setup.engine)} model")


def exact_plan(card: PublishedCard, shape: Any, hw: Any) -> Any:
    """The planner's prediction of the card's exact recipe (raises ValueError when the planner cannot model it)."""
    from openrecipes.plan.enumerate import evaluate
    from openrecipes.plan.memory import TrainingSetup

    if card.exact is None:
        raise ValueError(card.unplanned or "the card's recipe is not readable")
    layout, setup = card.exact
    return evaluate(shape, layout, TrainingSetup(**setup), hw)


def compare_card(card: PublishedCard, ranked: list[Any], hw: Any, shape: Any) -> dict[str, Any]:
    """The card beside the planner: its exact recipe predicted against what it measured (the like-for-like error),
    where its layout ranks (under the ranking's own settings), and, when the two are far apart, the planner's
    assumptions that may explain it. ``why`` holds the text a person reads."""
    measured = card.tokens_per_s_per_gpu
    out: dict[str, Any] = {"card": str(card.path), "layout": card.label, "tokens_per_s_per_gpu": measured,
                           "measured_with": card.engine, "exact_recipe": None}
    lines = [f"published card {card.path} ({card.label or 'its layout'}, {measured:,.0f} tokens/s/GPU measured with "
             f"{'openrecipes' if card.engine == 'openrecipes' else 'Megatron-LM'}):"]
    try:
        plan = exact_plan(card, shape, hw)
    except ValueError as error:
        plan, error_text = None, str(error).splitlines()[0]
        lines.append(f"  its exact recipe is not planned here: {error_text}")
        out["exact_recipe_unplanned"] = error_text
    far = plan is None
    if plan is not None:
        predicted = plan.throughput.tokens_per_s_per_gpu
        error = predicted / measured - 1
        far = abs(error) > FAR_RATIO
        fit = "" if plan.fits else f"; predicted NOT to fit ({plan.peak_memory_gib:.1f} GiB peak)"
        lines.append(f"  its exact recipe ({plan.layout.label()}, {_settings(plan)}) predicts {predicted:,.0f} "
                     f"tokens/s/GPU: {error:+.1%} against measured{fit}")
        out["exact_recipe"] = {"predicted_tokens_per_s_per_gpu": round(predicted, 1), "error": round(error, 4),
                               "engine": plan.setup.engine, "fits": plan.fits,
                               "peak_memory_gib": round(plan.peak_memory_gib, 1)}
    rank = next((i for i, p in enumerate(ranked, 1) if same_layout(card, p.layout)), None)
    out["layout_rank"] = rank
    if rank:
        mate = ranked[rank - 1]
        lines.append(f"  its layout ranks #{rank} of {len(ranked)} here at {mate.throughput.tokens_per_s_per_gpu:,.0f}"
                     f" predicted, with the ranking's settings ({_settings(mate)})")
    elif ranked:
        lines.append("  its layout is not among the fitting layouts ranked here (other settings or memory)")
    if ranked and not same_layout(card, ranked[0].layout):
        far, top = True, ranked[0]
        lines.append(f"  the top layout {top.layout.label()} ({_settings(top)}) predicts "
                     f"{top.throughput.tokens_per_s_per_gpu:,.0f}")
    if far:
        lines.append("  " + _assumptions(hw))
    out["why"] = "\n".join(lines)
    return out


def _assumptions(hw: Any) -> str:
    eff = hw.efficiency
    return (f"The planner assumes routing at a fixed {hw.memory.moe_token_imbalance}x imbalance on every step (its "
            f"engine calibration ran with balanced routing) and its engine efficiencies (dense {eff.dense_matmul}, "
            f"expert {eff.expert_matmul}, attention {eff.attention}, links {eff.comm} of peak; plan/planner.yaml), "
            "not the card's kernels, dispatcher or routing")
