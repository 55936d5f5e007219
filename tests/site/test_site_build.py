from html.parser import HTMLParser
import shutil
from pathlib import Path

import pytest
import yaml
from .site_fixtures import (CATALOG, card_workflows, catalog_of_workflows, catalog_with_variant, copy_seed_cards,
                            qwen_data, write)

from openrecipes.site.build import SITE_MARKER, build_site


class _Options(HTMLParser):
    """Collects each <select id="filter-*">'s option values."""

    def __init__(self):
        super().__init__()
        self.options: dict[str, list[str]] = {}
        self._current = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "select":
            self._current = attrs["id"].removeprefix("filter-")
            self.options[self._current] = []
        elif tag == "option" and self._current and attrs.get("value"):
            self.options[self._current].append(attrs["value"])

    def handle_endtag(self, tag):
        if tag == "select":
            self._current = None


def _card_values(recipes: Path) -> dict[str, set[str]]:
    values: dict[str, set[str]] = {"model": set(), "gpu": set(), "status": set(), "workflow": set(),
                                   "modality": set(), "engine": set(), "depth": set()}
    for path in recipes.rglob("*.yaml"):
        data = yaml.safe_load(path.read_text())
        values["model"].add(data["model"])
        framework = data["stack"]["framework"].split()[0]
        values["engine"].add(framework if framework == "openrecipes" else f"{framework}/Megatron-LM")
        values["depth"].add("reduced depth" if "num_hidden_layers=" in data["model"] else "full depth")
        values["gpu"].add(data["gpu"]["type"])
        values["status"].add(data["status"])
        if data["workload"].get("workflow"):
            values["workflow"].add(data["workload"]["workflow"])
        values["modality"].add(data["workload"].get("modality", "text"))
    return values


def test_build_writes_index_and_one_page_per_card(tmp_path):
    recipes = catalog_with_variant(tmp_path)
    out = tmp_path / "site"
    site = build_site(recipes, out)
    cards = sorted(p.relative_to(recipes).with_suffix(".html") for p in recipes.rglob("*.yaml"))
    assert site.pages == cards and len(cards) == 3
    assert sorted(p.relative_to(out) for p in out.rglob("*.html")) == sorted(cards + [Path("index.html")])
    index = (out / "index.html").read_text()
    for page in cards:
        assert f'href="{page.as_posix()}"' in index


def test_filter_options_are_exactly_the_card_values(tmp_path):
    recipes = catalog_with_variant(tmp_path)
    out = tmp_path / "site"
    build_site(recipes, out)
    parser = _Options()
    parser.feed((out / "index.html").read_text())
    expected = _card_values(recipes)
    assert {k: set(v) for k, v in parser.options.items()} == expected
    assert all(len(v) == len(set(v)) for v in parser.options.values())
    assert expected["workflow"] == {"sft", "pretrain"}


def test_no_external_assets(tmp_path):
    out = tmp_path / "site"
    build_site(CATALOG, out)
    for page in out.rglob("*.html"):
        html = page.read_text()
        assert "<link" not in html and "<script src" not in html and "@import" not in html
        assert "<style>" in html


def test_recipe_page_shows_the_headline_figures(tmp_path):
    out = tmp_path / "site"
    build_site(CATALOG, out)
    html = (out / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.html").read_text()
    for text in ("6,913.2", "$0.32", "12.8%", "0.59%", "3,041,656,832", "correlation 0.9999984",
                 "8f76b822a284adbe24faaf3cfe725e65cb5e94f98ba54aceade45b275345f983",
                 "--expert-model-parallel-size 8"):
        assert text in html, text
    # the card is linked, written beside its page, not dumped again into it
    assert 'href="attune-tp1-pp1-ep8-mt16k.yaml"' in html and "schema_version: 1" not in html
    assert (out / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.yaml").read_text() == (
        CATALOG / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.yaml").read_text()
    assert "<svg" not in html  # no curves in this card, so no plot
    muse = (out / "muse-spark-open" / "h200" / "attune-tp4-pp16-ep8.html").read_text()
    assert "333.1<" in muse and "$6.60" in muse and "9.0%" in muse


def test_curves_become_an_inline_svg(tmp_path):
    recipes = catalog_with_variant(tmp_path)
    build_site(recipes, tmp_path / "site")
    html = (tmp_path / "site" / "qwen3-30b-a3b" / "h200" / "variant-with-curves.html").read_text()
    # loss (two arms), then step time, tokens/s, peak memory, gradient norm and learning rate over the steps, and
    # memory per stage of a step
    assert html.count("<polyline") == 7 and 'data-points="20"' in html
    for key in ("step-time-s", "tokens-per-s-per-gpu", "peak-memory-gib", "grad-norm", "lr"):
        assert f'id="curve-{key}"' in html, key
    assert html.count('class="bar"') == 4 and "backward_peak" in html and "60 GiB" in html
    # the resolved recipe as a code block with its copy button
    assert 'data-copy="recipe-yaml"' in html and "global_batch: 128" in html
    # what the data build skipped, as the card counts it
    assert "1 non-text content part, 3 unknown role (invalid conversations)" in html
    assert "4096 tokens in rows skipped without a supervised token" in html


def test_card_text_is_escaped(tmp_path):
    data = qwen_data()
    data["author"] = {"name": "<script>alert('x')</script>", "url": "javascript:alert(1)"}
    data["layout"]["label"] = 'TP1" onmouseover="alert(1)'
    data["notes"] = "</pre><img src=x onerror=alert(1)>"
    recipes = tmp_path / "recipes"
    write(recipes / "m" / "g" / "evil.yaml", data)
    out = tmp_path / "site"
    build_site(recipes, out)
    for page in (out / "index.html", out / "m" / "g" / "evil.html"):
        html = page.read_text()
        assert "<script>alert" not in html and "<img src=x" not in html
        assert 'onmouseover="alert' not in html and 'href="javascript' not in html
    page = (out / "m" / "g" / "evil.html").read_text()
    assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in page
    assert "&lt;/pre&gt;&lt;img src=x onerror=alert(1)&gt;" in page


def test_invalid_catalog_is_not_built(tmp_path):
    data = qwen_data()
    data["gpu"]["count"] = 16
    recipes = tmp_path / "recipes"
    write(recipes / "a.yaml", data)
    with pytest.raises(ValueError, match="tp·pp·cp·dp"):
        build_site(recipes, tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_rebuild_replaces_only_a_site(tmp_path):
    out = tmp_path / "site"
    build_site(CATALOG, out)
    (out / "stale.html").write_text("old")  # a page an earlier build wrote: listed in its marker
    with open(out / SITE_MARKER, "a") as marker:
        marker.write("stale.html\n")
    build_site(CATALOG, out)
    assert not (out / "stale.html").exists() and (out / SITE_MARKER).exists()
    (out / "mine.html").write_text("mine")  # a page of someone else's, put into the site: not replaced
    with pytest.raises(ValueError, match="holds 'mine.html', which openrecipes site build did not write"):
        build_site(CATALOG, out)
    assert (out / "mine.html").read_text() == "mine"
    other = tmp_path / "precious"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not written by"):
        build_site(CATALOG, other)
    assert (other / "keep.txt").read_text() == "mine"


def test_index_shows_each_cards_name_and_correctness_verdict_in_colour(tmp_path):
    data = qwen_data()
    data["status"] = "unverified"
    data["layout"]["label"] = "TP1 PP1 EP8 DP8 failing"
    data["correctness"]["result"] = "fail"
    data["correctness"]["summary"] = "failed: convergence check (final loss)"
    data["correctness"]["convergence"]["result"] = "fail"
    recipes = tmp_path / "recipes"
    copy_seed_cards(recipes)
    write(recipes / "qwen3-30b-a3b" / "h200" / "failing-run.yaml", data)
    out = tmp_path / "site"
    build_site(recipes, out)
    index = (out / "index.html").read_text()
    assert 'class="sort">Card</button>' in index and 'class="sort">Correctness</button>' in index
    assert ">attune-tp1-pp1-ep8-mt16k</a>" in index and ">failing-run</a>" in index
    assert index.count('class="verdict pass"') == 2 and index.count('class="verdict fail"') == 1
    assert ".verdict.fail { background: var(--bad); }" in index
    failing = (out / "qwen3-30b-a3b" / "h200" / "failing-run.html").read_text()
    assert 'id="correctness" class="failed"' in failing and 'id="convergence" class="failed"' in failing
    passing = (out / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.html").read_text()
    assert 'class="failed"' not in passing and 'class="verdict pass" id="verdict"' in passing


def test_seed_cards_say_their_command_is_not_ours(tmp_path):
    data = qwen_data()
    data["stack"] = {"framework": "openrecipes 0.1.0", "pytorch": "2.11.0"}
    recipes = tmp_path / "recipes"
    copy_seed_cards(recipes)
    write(recipes / "qwen3-30b-a3b" / "h200" / "ours.yaml", data)
    out = tmp_path / "site"
    build_site(recipes, out)
    for seed in ("qwen3-30b-a3b/h200/attune-tp1-pp1-ep8-mt16k.html", "muse-spark-open/h200/attune-tp4-pp16-ep8.html"):
        html = (out / seed).read_text()
        assert "Measured with miles/Megatron-LM, not openrecipes: reproduce with their command" in html, seed
    assert 'id="other-framework"' not in (out / "qwen3-30b-a3b" / "h200" / "ours.html").read_text()


def test_several_catalogs_on_one_site_as_the_demo_builds_it(tmp_path, capsys):
    from openrecipes.cli import main
    from openrecipes.site.build import published_catalog

    data = qwen_data()
    data["model"], data["layout"]["label"] = "Demo-Model", "TP1 PP1 EP8 DP8 demo"
    demo = tmp_path / "demo-recipes"
    write(demo / "demo-model" / "cpu" / "demo-candidate.yaml", data)
    assert published_catalog() is not None and published_catalog().resolve() == CATALOG.resolve()
    out = tmp_path / "site"
    assert main(["site", "build", "--recipes", str(demo), "--recipes", str(CATALOG), "--out", str(out)]) == 0
    index = (out / "index.html").read_text()
    published = len([p for p in CATALOG.glob("*/*/*.yaml") if not p.name.endswith(".recipe.yaml")])  # cards only
    assert index.count('class="recipe"') == 1 + published and "Demo-Model" in index and "Muse-Spark-Open-816B-A42B" in index
    assert (out / "demo-model" / "cpu" / "demo-candidate.html").is_file()
    assert (out / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.html").is_file()
    # the numeric columns sort by the number, not its text
    assert 'data-key="tokens" data-kind="number"' in index and 'data-sort="6913.23"' in index


def test_model_pages_hold_exactly_the_recorded_items_escaped(tmp_path):
    import json
    import re

    from openrecipes.cards.verification_load import load_verification_card

    verification = tmp_path / "verification"
    shutil.copytree(CATALOG.parent / "verification", verification)
    # text from a card is escaped on the model page too
    path = verification / "qwen3-moe-tiny.yaml"
    path.write_text(path.read_text().replace("observed: 'Round trip", "observed: '<script>x</script> Round trip", 1))
    site = build_site(CATALOG, tmp_path / "site", verification)
    assert [p.name for p in site.model_pages] == sorted(p.with_suffix(".html").name
                                                       for p in verification.glob("*.yaml"))
    index = (site.out / "index.html").read_text()
    for page in site.model_pages:
        assert f'href="{page.as_posix()}"' in index
        html = (site.out / page).read_text()
        card = load_verification_card(verification / page.with_suffix(".yaml").name).card
        combos = json.loads(re.search(r'<script type="application/json" id="combinations">(.*?)</script>', html).group(1))
        assert [(c["workflow"], c["hardware"], c["precision"], c["combination"]) for c in combos] == [
            (i.workflow, i.hardware.type, i.precision, i.layout.label) for i in card.items]
        assert html.count('<section class="item"') == len(card.items)
    qwen = (site.out / "models" / "qwen3-moe-tiny.html").read_text()
    assert "<script>x</script>" not in qwen and "&lt;script&gt;x&lt;/script&gt;" in qwen


class _Rows(HTMLParser):
    """Each index row's workflow and the page its first link opens."""

    def __init__(self):
        super().__init__()
        self.rows: list[dict[str, str]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and attrs.get("class") == "recipe":
            self.rows.append({"workflow": attrs["data-workflow"], "modality": attrs["data-modality"]})
        elif tag == "a" and self.rows and "href" not in self.rows[-1]:
            self.rows[-1]["href"] = attrs["href"]


def test_every_workflow_is_a_filter_choice_that_shows_its_card(tmp_path):
    """A catalog with a card of each workflow the card schema knows: the index offers each in the workflow filter,
    and the rows that choice keeps (filters.js keeps a row whose data-workflow is the choice; the browser test runs
    it) are exactly that workflow's card."""
    workflows = card_workflows()
    assert {"pretrain", "sft", "long-context-sft", "lora"} <= set(workflows)
    recipes, pages = catalog_of_workflows(tmp_path)
    build_site(recipes, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text()
    options, rows = _Options(), _Rows()
    options.feed(index)
    rows.feed(index)
    assert sorted(options.options["workflow"]) == sorted(workflows)
    for workflow in workflows:
        kept = [row["href"] for row in rows.rows if row["workflow"] == workflow]
        assert kept == pages[workflow]


def test_modality_is_a_filter_choice_that_shows_its_cards(tmp_path):
    """An image-text card beside text cards: the modality filter offers both values the cards hold (a card without
    the field is text), and the rows each choice keeps are exactly its cards."""
    recipes = tmp_path / "recipes"
    for name, modality in (("text", None), ("images", "image-text")):
        data = qwen_data()
        data["layout"]["label"] = f"TP1 PP1 EP8 DP8 {name}"
        if modality:
            data["workload"]["modality"] = modality
        write(recipes / "qwen3-30b-a3b" / "h200" / f"{name}.yaml", data)
    build_site(recipes, tmp_path / "site")
    index = (tmp_path / "site" / "index.html").read_text()
    options, rows = _Options(), _Rows()
    options.feed(index)
    rows.feed(index)
    assert options.options["modality"] == ["image-text", "text"]
    assert [r["href"] for r in rows.rows if r["modality"] == "image-text"] == ["qwen3-30b-a3b/h200/images.html"]
    assert [r["href"] for r in rows.rows if r["modality"] == "text"] == ["qwen3-30b-a3b/h200/text.html"]
