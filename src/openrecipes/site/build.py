"""Build the static recipe site: one index with filters and sortable columns, one page per card, and beside each
page the card's YAML file.

Everything a page needs is inline (CSS, the scripts, the SVG plots), so the site works
from a file share or behind a firewall. Every string from a card goes through Jinja's
autoescaping; links are only made from http(s) URLs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import quote, urlsplit

import jinja2
from markupsafe import Markup

from openrecipes.cards.schema import Gpu
from openrecipes.cards.schema_bounds import WEB_SCHEMES
from openrecipes.cards.validate import LoadedCard, validate_paths
from openrecipes.cards.verification_load import LoadedVerification, load_verification_dir
from openrecipes.config.hardware import is_cpu
from openrecipes.site.models import model_page_path, render_model_page
from openrecipes.site.notes import note_blocks
from openrecipes.site.plot import loss_plot_svg, memory_bars_svg, pipeline_memory_svg, step_plots, tuning_plot_svg
from openrecipes.utils import check_output_dir, guarded_output_dir, shown_step

# marks a directory as ours, so a rebuild may replace it and nothing else is ever replaced
SITE_MARKER = ".openrecipes-site"
# what a card's status means, beside its badge on the page and in the badge's tooltip on the index: "verified" is a
# mark its writer asked for (docs/cards.md), not something the site or a reader can infer from the numbers
STATUS_MEANING = {
    "verified": "marked verified by whoever wrote the card (`card new --status verified`, or `openrecipes tune` "
                "after its gain checks), which `card validate` allows only when the checks a verified card must "
                "pass (pinned revisions, a passing convergence check) pass",
    "unverified": "not marked verified by a person (or by the tuner's checks): its figures are as measured, but the "
                  "checks a verified card must pass (pinned revisions, a passing convergence check) were not asked "
                  "of it",
}
FILTER_LABELS = (("model", "Model"), ("engine", "Engine"), ("depth", "Depth"), ("gpu", "GPU"), ("status", "Status"),
                 ("workflow", "Workflow"), ("modality", "Modality"))


@dataclass(frozen=True, kw_only=True)
class BuiltSite:
    out: Path
    pages: list[Path]  # relative to out, one per card
    filters: dict[str, list[str]]
    model_pages: list[Path] = ()  # relative to out, one per verification card


class _PageEnvironment(jinja2.Environment):
    """``{{ view.items }}`` on a dict reads its key ``items`` when it has one, never the dict's method of that name
    (Jinja tries the attribute first, and a page would show ``<built-in method items of dict object at 0x...>``)."""

    def getattr(self, obj: object, attribute: str) -> object:
        if isinstance(obj, dict) and attribute in obj:
            return obj[attribute]
        return super().getattr(obj, attribute)


def _environment() -> jinja2.Environment:
    env = _PageEnvironment(
        loader=jinja2.PackageLoader("openrecipes.site", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=False,
    )
    env.filters["shown_step"] = shown_step  # a card's 0-based step as the page shows it
    return env


def _asset(name: str) -> Markup:
    # our own package files, inlined verbatim into <style> / <script>
    return Markup(resources.files("openrecipes.site").joinpath("templates", name).read_text())


def _number(value: float, decimals: int = 2) -> str:
    return f"{value:,.{decimals}f}"


def filter_value(loaded: LoadedCard, key: str) -> str:
    card = loaded.card
    if key == "engine":
        return engine_of(loaded)
    if key == "depth":
        return depth_of(loaded)[0]
    return {"model": card.model, "gpu": card.gpu.type, "status": card.status,
            "workflow": card.workload.workflow or "", "modality": card.workload.modality}[key]


def filter_options(cards: list[LoadedCard]) -> dict[str, list[str]]:
    """Each filter's choices: exactly the values the cards hold, nothing else."""
    return {key: sorted({filter_value(c, key) for c in cards} - {""}) for key, _ in FILTER_LABELS}


def page_path(loaded: LoadedCard, root: Path) -> Path:
    """Where a card's page goes: its path under the catalog, with .html for .yaml."""
    try:
        relative = loaded.path.resolve().relative_to(root.resolve())
    except ValueError:
        relative = Path(loaded.path.name)
    return relative.with_suffix(".html")


def same_model(a: str, b: str) -> bool:
    """Two cards name one model whatever their case, spaces, dashes or underscores ("Qwen3-MoE tiny" is
    qwen3-moe-tiny, the registry's name a recipe card carries)."""
    def plain(name: str) -> str:
        return re.sub(r"[\s_-]+", "-", name.strip().lower())

    return plain(a) == plain(b)


def _href(path: Path) -> str:
    return "/".join(quote(part) for part in path.parts)


def _safe_url(url: str | None) -> str | None:
    if url and urlsplit(url).scheme in WEB_SCHEMES:
        return url
    return None


def devices(gpu: Gpu) -> tuple[str, str]:
    """(label, text) of a card's devices: "GPUs", "8 x H200 141 GB (p5en.48xlarge, 8 per node)"; a CPU run has no
    GPU and no GPU memory: "Processes", "2 CPU processes" (on how many hosts, when more than one)."""
    if is_cpu(gpu.type):
        hosts = -(-gpu.count // gpu.per_node)
        on = f" on {hosts} hosts" if hosts > 1 else ""
        return "Processes", f"{gpu.count} CPU process{'es' if gpu.count != 1 else ''}{on}"
    instance = f"{gpu.instance}, " if gpu.instance else ""
    return "GPUs", f"{gpu.count} x {gpu.type} {gpu.memory_gb:g} GB ({instance}{gpu.per_node} per node)"


def _metrics(loaded: LoadedCard) -> dict[str, object]:
    card = loaded.card
    res, lay, gpu = card.result, card.layout, card.gpu
    conv = card.correctness.convergence
    build = card.workload.dataset.build
    return {
        # to one decimal, as the tuner's console and every tuning figure quote tokens/s: one figure, written one way
        "tokens": _number(res.tokens_per_s_per_gpu, 1),
        "usd": f"${res.usd_per_million_tokens:,.2f}" if res.usd_per_million_tokens is not None else "—",
        "mfu": f"{res.mfu:.1%}" if res.mfu is not None else "—",
        "active_params": f"{res.active_params.count:,}",
        "cv": f"{res.step_time_cv_percent:.2f}%",
        "devices": devices(gpu),
        "convergence": (
            f"{conv.result}: correlation {conv.correlation:.7g}, final loss difference "
            f"{conv.final_loss_difference:.3g}, {conv.pointwise_failures} pointwise failures over "
            f"{conv.steps} steps" if conv is not None else "not run"),
        "window_tokens": f"{res.window_tokens:,}",
        "row_tokens": f"{card.workload.row_tokens:,}",
        "rows_name": build.name if build is not None else card.workload.dataset.name,
        "layout": [
            ("TP", lay.tp), ("PP", lay.pp), ("VPP", lay.vpp), ("CP", lay.cp), ("EP", lay.ep),
            ("ETP", lay.etp), ("DP", lay.dp), ("SP", "yes" if lay.sequence_parallel else "no"),
            ("Layer split", f"first {lay.layer_split.first}, last {lay.layer_split.last}"
             if lay.layer_split else "even"),
            ("Rows / microbatch", lay.rows_per_microbatch),
            ("Max tokens / GPU", f"{lay.max_tokens_per_gpu:,}" if lay.max_tokens_per_gpu else "—"),
            ("Recompute", " ".join(str(v) for v in (
                lay.recompute.granularity, lay.recompute.method, lay.recompute.num_layers) if v)
             if lay.recompute else "off"),
            ("Optimizer offload", f"{lay.offload.optimizer_fraction:g}" if lay.offload else "off"),
            ("Dispatcher", lay.dispatcher),
        ],
        "stack": [(name, value) for name, value in card.stack.model_dump().items() if value],
    }


def other_framework(loaded: LoadedCard) -> str | None:
    """The framework a card was measured with when it is not openrecipes (the seed cards: miles on Megatron-LM),
    whose run command is theirs and does not run with `openrecipes train`; None for openrecipes' own cards."""
    stack = loaded.card.stack
    if stack.framework.strip().lower().startswith("openrecipes"):
        return None
    name = stack.framework.split()[0].strip("'\",;()")
    return f"{name}/Megatron-LM" if stack.megatron_lm else name


def engine_of(loaded: LoadedCard) -> str:
    """The engine that measured the card: openrecipes, or the other framework (``other_framework``)."""
    return other_framework(loaded) or "openrecipes"


def depth_of(loaded: LoadedCard) -> tuple[str, str]:
    """(filter value, text) of the model's depth on the card: "full depth" or "reduced depth" (``card new`` names a
    model with a ``num_hidden_layers`` override "<model> with num_hidden_layers=N"), the text with the layer counts
    where the registry knows the model."""
    from openrecipes.cards.reference import model_layers

    base, _, overrides = loaded.card.model.partition(" with ")
    full = model_layers(base)
    layers = next((value.strip() for key, _, value in (pair.strip().partition("=") for pair in overrides.split(","))
                   if key.strip() == "num_hidden_layers" and value.strip().isdigit()), None)
    if layers is None or (full is not None and int(layers) >= full):
        return "full depth", f"full depth ({full} layers)" if full else "full depth"
    return "reduced depth", f"reduced depth: {layers} of {full} layers" if full else f"reduced depth: {layers} layers"


def _index_row(loaded: LoadedCard, href: str) -> dict[str, str]:
    card = loaded.card
    metrics = _metrics(loaded)
    return {
        "name": loaded.path.stem, "correctness": card.correctness.result,
        "model": card.model, "gpu": card.gpu.type, "status": card.status,
        "workflow": card.workload.workflow or "", "modality": card.workload.modality, "href": href,
        "gpus": (devices(card.gpu)[1] if is_cpu(card.gpu.type) else f"{card.gpu.count} x {card.gpu.type}"),
        "label": card.layout.label, "status_meaning": STATUS_MEANING[card.status],
        "tokens": str(metrics["tokens"]), "usd": str(metrics["usd"]), "mfu": str(metrics["mfu"]),
        "author": card.author.name, "engine": engine_of(loaded), "runnable": other_framework(loaded) is None,
        "depth": depth_of(loaded)[0], "depth_text": depth_of(loaded)[1],
        # what the sortable numeric columns sort by (empty: no value, sorted last)
        "tokens_sort": repr(card.result.tokens_per_s_per_gpu),
        "usd_sort": "" if card.result.usd_per_million_tokens is None else repr(card.result.usd_per_million_tokens),
        "mfu_sort": "" if card.result.mfu is None else repr(card.result.mfu),
        "gpus_sort": str(card.gpu.count),
    }


def _root_of(loaded: LoadedCard, roots: list[Path]) -> Path:
    """The catalog directory a card was found under (the first that holds it)."""
    path = loaded.path.resolve()
    return next((root for root in roots if root.resolve() in path.parents), roots[0])


def render_site(cards: list[LoadedCard], recipes_root: Path | list[Path],
                verifications: list[LoadedVerification] | None = None) -> dict[Path, str]:
    """Every page of the site as text (and each card's YAML beside its page), keyed by its path relative to the site
    root. Several catalogs may be given: each card's page sits at its path under its own catalog. Each verification
    card gets a model page."""
    roots = recipes_root if isinstance(recipes_root, list) else [recipes_root]
    env = _environment()
    css, js = _asset("style.css"), _asset("filters.js")
    pages: dict[Path, str] = {}
    ordered = sorted(cards, key=lambda c: (c.card.model, c.card.gpu.type, str(c.path)))
    rows = []
    for loaded in ordered:
        relative = page_path(loaded, _root_of(loaded, roots))
        if relative in pages or relative == Path("index.html"):
            raise ValueError(f"{loaded.path}: two cards would share the page {relative}")
        root = "../" * (len(relative.parts) - 1)
        curves = loaded.card.curves
        pages[relative] = env.get_template("recipe.html.jinja").render(
            card=loaded.card, m=_metrics(loaded), css=css, root=root,
            author_url=_safe_url(loaded.card.author.url), yaml_file=relative.with_suffix(".yaml").name,
            # quoted like every other link: a file named javascript:x.yaml must be a relative link, not a script
            yaml_href=_href(Path(relative.with_suffix(".yaml").name)),
            plot=loss_plot_svg(curves) if curves else None,
            step_plots=step_plots(curves) if curves else [],
            memory_plot=memory_bars_svg(curves.memory_phases_gib) if curves and curves.memory_phases_gib else None,
            stage_memory_plot=pipeline_memory_svg(curves) if curves else None,
            tuning_plot=tuning_plot_svg(loaded.card.tuning) if loaded.card.tuning else None,
            name=loaded.path.stem, other_framework=other_framework(loaded), copy_js=_asset("copy.js"),
            depth=depth_of(loaded), status_meaning=STATUS_MEANING[loaded.card.status],
            notes=note_blocks(loaded.card.notes) if loaded.card.notes else [],
        )
        pages[relative.with_suffix(".yaml")] = loaded.text  # the card itself, linked from its page
        rows.append(_index_row(loaded, _href(relative)))
    models = []
    for loaded in sorted(verifications or [], key=lambda v: v.card.model):
        relative = model_page_path(loaded)
        if relative in pages:
            raise ValueError(f"{loaded.path}: two verification cards would share the page {relative}")
        links = [("../" + row["href"], f"{row['name']}: {row['gpus']}, {row['label']}") for row in rows
                 if same_model(row["model"], loaded.card.model)]
        pages[relative] = render_model_page(env, loaded, css=css, js=_asset("selector.js"), recipe_links=links)
        models.append({"model": loaded.card.model, "href": _href(relative), "combinations": len(loaded.card.items),
                       "engine": loaded.card.engine})
    pages[Path("index.html")] = env.get_template("index.html.jinja").render(
        rows=rows, filters=filter_options(ordered), filter_labels=FILTER_LABELS,
        css=css, js=js, root="", models=models,
    )
    return pages


def published_catalog() -> Path | None:
    """The published cards' catalog: ./recipes when it holds cards, else the recipes/ of the source checkout this
    package runs from; None when neither exists (an installed package carries no catalog)."""
    import openrecipes

    for candidate in (Path("recipes"), Path(openrecipes.__file__).resolve().parents[2] / "recipes"):
        if candidate.is_dir() and any(candidate.glob("*/*/*.yaml")):
            return candidate
    return None


def build_site(recipes: str | os.PathLike | list[str | os.PathLike], out: str | os.PathLike,
               verification: str | os.PathLike | None = None) -> BuiltSite:
    """Validate every card under ``recipes`` (one catalog or several) and write the site to ``out`` atomically, with
    a model page for each verification card under ``verification``.

    Refuses to build from a catalog with any invalid recipe card, and refuses to replace a non-empty
    directory that an earlier build did not write. A verification item that fails its checks is published with
    the reason (the model page says what the validator rejects); a verification card that does not load is an error.
    """
    roots = [Path(r) for r in recipes] if isinstance(recipes, list) else [Path(recipes)]
    out = Path(out)
    cards, problems = validate_paths(roots)
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        listed = "; ".join(str(p) for p in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise ValueError(f"invalid cards, site not built: {listed}{more}")
    verifications = load_verification_dir(verification) if verification is not None else []
    inputs = roots + ([Path(verification)] if verification is not None else [])
    guard = dict(marker=SITE_MARKER, writer="openrecipes site build", overwrite=True, inputs=inputs)
    check_output_dir(out, **guard)
    pages = render_site(cards, [root if root.is_dir() else root.parent for root in roots], verifications)
    with guarded_output_dir(out, **guard) as staging:
        staging.chmod(0o755)  # mkdtemp makes it private; a static site is meant to be read
        for relative, text in pages.items():
            target = staging / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    models = sorted(model_page_path(v) for v in verifications)
    return BuiltSite(out=out, pages=sorted(p for p in pages if p != Path("index.html") and p.suffix == ".html"
                                           and p not in models),
                     filters=filter_options(cards), model_pages=models)
