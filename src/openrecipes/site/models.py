"""The model pages: one per verification card, with a selector over its recorded combinations.

The selector's choices (workflow, hardware, precision, combination) are generated from the card's items and each
shown result is one recorded item, rendered here in full; the script only shows and hides them, so no combination
that the card does not record can be shown. An item that `card validate` rejects is shown with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from markupsafe import Markup

from openrecipes.cards.schema import Curves
from openrecipes.cards.verification import WORKFLOWS, Item
from openrecipes.cards.verification_load import LoadedVerification
from openrecipes.site.plot import loss_plot_svg
from openrecipes.utils import shown_step

SELECTORS = (("workflow", "Workflow"), ("hardware", "Hardware"), ("precision", "Precision"),
             ("combination", "Combination"))
WORKFLOW_NAMES = {"import": "Import", "export": "Export", "pretrain": "Pretrain", "sft": "SFT",
                  "long-context-sft": "Long-context SFT", "lora": "LoRA", "image-text": "Image-text"}


def model_page_path(loaded: LoadedVerification) -> Path:
    return Path("models") / f"{loaded.path.stem}.html"


def _metric_rows(item: Item, ours: bool) -> list[tuple[str, str, str]]:
    """(id, label, value) of each recorded metric, in the order the page shows them; the window's steps from 1 when
    openrecipes recorded it (from 0), as recorded when another engine did (Megatron counts iterations from 1)."""
    met = item.metrics
    if met is None:
        return []
    show = shown_step if ours else int
    window = f" · steps {show(met.window[0])}-{show(met.window[1])}" if met.window else ""
    rows = [("initial-loss", "Initial loss", met.initial_loss), ("final-loss", "Final loss", met.final_loss),
            ("step-time", f"Step time{window}", f"{met.step_time_ms:,.3f} ms" if met.step_time_ms else None),
            ("tflops", f"Model TFLOP/s/GPU{window}",
             f"{met.model_tflops_per_gpu:,.6g}" if met.model_tflops_per_gpu else None),
            ("tokens", f"Tokens/s/GPU{window}",
             f"{met.tokens_per_s_per_gpu:,.3f}" if met.tokens_per_s_per_gpu else None),
            ("memory", "Peak memory per pipeline stage (GiB)",
             ", ".join(f"{v:g}" for v in met.peak_memory_gib_per_stage) if met.peak_memory_gib_per_stage else None),
            ("skipped", "Skipped / NaN steps", f"{met.skipped_steps} / {met.nan_steps} of {met.steps}")]
    return [(key, label, f"{value:.7g}" if isinstance(value, float) else value) for key, label, value in rows
            if value is not None]


def _item_view(loaded: LoadedVerification, index: int, item: Item) -> dict[str, object]:
    ours = _engine_is_ours(loaded)
    curve = (loss_plot_svg(Curves(candidate=item.loss_curve), title_id=f"plot-title-{index}", steps_from_zero=ours)
             if item.loss_curve else None)
    return {
        "index": index, "workflow": item.workflow, "workflow_name": WORKFLOW_NAMES[item.workflow],
        "hardware": item.hardware.type, "gpus": f"{item.hardware.count} x {item.hardware.type}",
        "precision": item.precision, "combination": item.layout.label, "status": item.status,
        "command": item.command, "observed": item.observed, "metrics": _metric_rows(item, ours), "curve": curve,
        "checks": item.checks, "checkpoint": item.checkpoint, "data": item.data, "stack": item.stack,
        "recipe": item.recipe, "recorded": item.recorded,
        "rejected": [p.message if not p.path else f"{p.path}: {p.message}" for p in loaded.item_problems(index)],
    }


def _engine_is_ours(loaded: LoadedVerification) -> bool:
    return loaded.card.engine.strip().lower() == "openrecipes"


def _options(views: list[dict[str, object]]) -> dict[str, list[str]]:
    order = {name: rank for rank, name in enumerate(WORKFLOWS)}
    options: dict[str, list[str]] = {}
    for key, _ in SELECTORS:
        values = {str(v[key]) for v in views}
        options[key] = sorted(values, key=lambda v: (order.get(v, len(order)), v))
    return options


def render_model_page(env: jinja2.Environment, loaded: LoadedVerification, *, css: Markup, js: Markup,
                      recipe_links: list[tuple[str, str]]) -> str:
    """The page of one verification card; ``recipe_links`` are (href from the page, label) of the model's cards."""
    card = loaded.card
    views = [_item_view(loaded, index, item) for index, item in enumerate(card.items)]
    # the combinations the selector may reach: exactly the items, as data for the script
    combos = [{key: str(v[key]) for key, _ in SELECTORS} | {"index": v["index"]} for v in views]
    return env.get_template("model.html.jinja").render(
        card=card, items=views, options=_options(views), selectors=SELECTORS, workflow_names=WORKFLOW_NAMES,
        combos=Markup(json.dumps(combos).replace("<", "\\u003c")), recipe_links=recipe_links, css=css, js=js,
        root="../", engine_is_ours=_engine_is_ours(loaded))
