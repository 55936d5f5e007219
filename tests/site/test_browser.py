"""Headless Chromium opens the built site, sorts and filters the index (the view kept in the address), opens a
recipe page, copies its recipe, and reads both pages at a phone's width; on a catalog with cards of every workflow, the
workflow filter shows exactly each workflow's cards. One browser serves every test of the module.

Skipped when Chromium or Playwright is missing, unless OPENRECIPES_REQUIRE_BROWSER=1 (CI sets
it), in which case a missing browser is a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import Iterator

import pytest
from .site_fixtures import REPO, catalog_of_workflows, catalog_with_variant, cpu_data, tuned_data, write

from openrecipes.cards.verification_load import load_verification_card, load_verification_dir
from openrecipes.site.build import build_site
from openrecipes.site.serve import make_server

VERIFICATION = REPO / "verification"
CHROMIUM = os.environ.get("OPENRECIPES_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _sync_playwright():
    required = os.environ.get("OPENRECIPES_REQUIRE_BROWSER") == "1"
    missing = []
    if not (os.path.isfile(CHROMIUM) or shutil.which(CHROMIUM)):
        missing.append(f"chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("the playwright Python package")
        sync_playwright = None
    if missing:
        message = "browser test needs " + " and ".join(missing)
        if required:
            pytest.fail(message + " (OPENRECIPES_REQUIRE_BROWSER=1)")
        pytest.skip(message)
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module's tests (a launch costs more than most of their checks)."""
    sync_playwright = _sync_playwright()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield launched
        finally:
            launched.close()


@contextlib.contextmanager
def _serve(site: Path) -> Iterator[str]:
    server = make_server(site, 0, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def served_site(tmp_path):
    recipes = catalog_with_variant(tmp_path)
    build_site(recipes, tmp_path / "site", VERIFICATION)
    with _serve(tmp_path / "site") as url:
        yield url


def test_filter_then_open_a_recipe(served_site, browser):
    context = browser.new_context(permissions=["clipboard-read", "clipboard-write"])
    try:
        page = context.new_page()
        # nothing may be fetched from anywhere but the local server
        outside = []
        page.on("request", lambda r: None if r.url.startswith(served_site) else outside.append(r.url))
        page.goto(served_site + "index.html")
        rows = page.locator("tr.recipe")
        assert rows.count() == 3
        assert page.locator("tr.recipe:visible").count() == 3
        assert "Showing 3 of 3" in page.locator("#match-count").inner_text()

        # sorting: numbers high to low first, then reversed; ties keep the catalog's order
        page.click('th[data-key="tokens"] button')
        models = [row.get_attribute("data-model") for row in rows.all()]
        assert models[-1] == "Muse-Spark-Open-816B-A42B" and "sort=tokens&order=desc" in page.url
        assert page.get_attribute('th[data-key="tokens"]', "aria-sort") == "descending"
        page.click('th[data-key="tokens"] button')
        assert rows.first.get_attribute("data-model") == "Muse-Spark-Open-816B-A42B"

        page.select_option("#filter-status", "unverified")
        assert "status=unverified" in page.url
        page.reload()  # the filter and the order come back from the address
        assert page.locator("#filter-status").input_value() == "unverified"
        assert page.get_attribute('th[data-key="tokens"]', "aria-sort") == "ascending"
        visible = page.locator("tr.recipe:visible")
        assert visible.count() == 1
        assert visible.first.get_attribute("data-model") == "Qwen3-30B-A3B"
        # no unverified Muse Spark card exists, so that choice is disabled, not offered
        assert page.locator('#filter-model option[value="Muse-Spark-Open-816B-A42B"]').is_disabled()
        assert page.locator('#filter-workflow option[value="sft"]').is_disabled()
        assert "Showing 1 of 3" in page.locator("#match-count").inner_text()

        page.select_option("#filter-status", "")
        page.select_option("#filter-model", "Muse-Spark-Open-816B-A42B")
        assert page.locator("tr.recipe:visible").count() == 1
        assert page.locator('#filter-workflow option[value="pretrain"]').is_disabled()

        page.select_option("#filter-model", "")
        page.select_option("#filter-workflow", "pretrain")
        page.locator("tr.recipe:visible a").first.click()
        page.wait_for_load_state()
        assert page.url.endswith("qwen3-30b-a3b/h200/variant-with-curves.html")
        assert page.locator("h1").inner_text() == "Training Qwen3-30B-A3B on H200"
        assert page.locator("#metric-tokens").inner_text() == "6,913.2"
        assert page.locator("#metric-usd").inner_text() == "$0.32"
        assert page.locator("#metric-mfu").inner_text() == "12.8%"
        assert "Unverified" in page.locator("#status").inner_text()
        assert page.locator("#loss-curves svg polyline").count() == 2
        for plot in ("#curve-step-time-s", "#curve-tokens-per-s-per-gpu", "#memory-stages"):
            assert page.locator(plot + " svg").is_visible(), plot
        assert "--max-tokens-per-gpu 16384" in page.locator("#run-script").inner_text()
        assert page.locator("#card-yaml").count() == 0  # the card is a linked file, not a second dump
        # the resolved recipe is closed under its summary; its copy button copies it all the same
        assert page.locator("#recipe").get_attribute("open") is None and not page.locator("#recipe-yaml").is_visible()
        page.click('button[data-copy="recipe-yaml"]')
        page.wait_for_function("document.querySelector('button[data-copy=\"recipe-yaml\"]').textContent"
                               " === 'Copied'")
        assert page.evaluate("navigator.clipboard.readText()") == page.locator("#recipe-yaml").text_content()
        page.click("#recipe summary")
        assert page.locator("#recipe-yaml").is_visible()
        assert outside == []

        # a phone: nothing wider than the screen, the index's rows stacked with their labels
        phone = context.new_page()
        phone.set_viewport_size({"width": 390, "height": 844})
        for path in ("index.html", "qwen3-30b-a3b/h200/variant-with-curves.html"):
            phone.goto(served_site + path)
            width = phone.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, (path, width)
        phone.goto(served_site + "index.html")
        cell = phone.locator("tr.recipe td").first
        assert phone.evaluate("(td) => getComputedStyle(td, '::before').content", cell.element_handle()) \
            == '"Model: "'
        assert outside == []
    finally:
        context.close()


def _shown(page) -> dict[str, str]:
    choice = {key: page.locator(f"#select-{key}").input_value() for key in SELECTOR_KEYS}
    [section] = [s for s in page.locator("section.item").all() if s.is_visible()]
    return {"choice": choice, **{key: section.get_attribute(f"data-{key}") for key in SELECTOR_KEYS},
            "id": section.get_attribute("id"), "command": section.locator(".command, .command-none").inner_text(),
            "result": section.locator(".result").inner_text()}


def test_index_reads_as_text(served_site, browser):
    """What a reader sees on the index: each model with its count of recorded combinations, and no Python repr."""
    from .test_site_text import REPR

    page = browser.new_page()
    try:
        page.goto(served_site + "index.html")
        assert not REPR.search(page.locator("body").inner_text())
        shown = page.locator("#models li").all_inner_texts()
        cards = sorted((loaded.card for loaded in load_verification_dir(VERIFICATION)), key=lambda card: card.model)
        assert len(shown) == len(cards)
        for text, card in zip(shown, cards):
            count = len(card.items)
            assert text.startswith(f"{card.model} ({count} recorded combination{'s' if count != 1 else ''}"), text
    finally:
        page.close()


SELECTOR_KEYS = ("workflow", "hardware", "precision", "combination")


def test_model_page_selector_shows_only_recorded_combinations(served_site, browser):
    card = load_verification_card(VERIFICATION / "muse-spark-open-816b-a42b.yaml").card
    recorded = {(i.workflow, i.hardware.type, i.precision, i.layout.label): i for i in card.items}
    page = browser.new_page()
    try:
        page.goto(served_site + "index.html")
        page.locator("#models a", has_text="Muse-Spark-Open-816B-A42B").click()
        page.wait_for_load_state()
        assert page.url.endswith("models/muse-spark-open-816b-a42b.html")
        assert "Megatron Bridge" in page.locator("#engine-notice").inner_text()
        assert page.locator("#recipe-links a").first.get_attribute("href").endswith("attune-tp4-pp16-ep8.html")
        seen = set()
        # walk every enabled option of every select: each reachable state is one recorded item, shown as written
        for workflow in page.locator("#select-workflow option").all_inner_texts():
            page.select_option("#select-workflow", label=workflow)
            for hardware in page.locator("#select-hardware option:not([disabled])").all():
                page.select_option("#select-hardware", hardware.get_attribute("value"))
                shown = _shown(page)
                key = tuple(shown[k] for k in SELECTOR_KEYS)
                assert key == tuple(shown["choice"][k] for k in SELECTOR_KEYS) and key in recorded
                item = recorded[key]
                assert shown["command"] == (item.command or "No runnable command is recorded for this item.")
                assert shown["result"] == item.observed
                seen.add(key)
        assert seen == set(recorded)  # and every recorded item is reachable
        # a changed selection changes command and result together; a verified GB200 item has metrics and copy
        page.select_option("#select-workflow", "pretrain")
        pretrain = _shown(page)
        page.select_option("#select-workflow", "lora")
        lora = _shown(page)
        assert pretrain["command"] != lora["command"] and pretrain["result"] != lora["result"]
        assert "--mode lora" in lora["command"]
        section = page.locator(f"#{lora['id']}")
        assert section.locator(".metric-final-loss").inner_text() == "0.7489657"
        assert section.locator("button.copy").get_attribute("data-copy") == lora["command"]
        assert "not pinned" in section.locator(".rejected").inner_text()
        # the tiny model's page: its own commands, a loss curve per training item
        page.goto(served_site + "models/qwen3-moe-tiny.html")
        page.select_option("#select-workflow", "sft")
        sft = page.locator(f"#{_shown(page)['id']}")
        assert sft.locator(".command").inner_text().startswith("openrecipes train examples/tiny-qwen3-sft.yaml")
        assert sft.locator(".loss-curve svg polyline").count() == 1
        assert page.locator("#engine-notice").count() == 0
    finally:
        page.close()


def test_workflow_filter_shows_exactly_each_workflows_cards(tmp_path, browser):
    # several cards of some workflows, so that a choice showing the wrong rows also shows the wrong number of them
    recipes, pages = catalog_of_workflows(tmp_path, copies={"sft": 2, "lora": 3})
    assert {"pretrain", "sft", "long-context-sft", "lora"} <= set(pages)
    build_site(recipes, tmp_path / "site")
    total = sum(len(expected) for expected in pages.values())
    page = browser.new_page()
    try:
        with _serve(tmp_path / "site") as url:
            page.goto(url + "index.html")
            assert page.locator("tr.recipe:visible").count() == total
            for workflow, expected in pages.items():
                page.select_option("#filter-workflow", workflow)
                visible = page.locator("tr.recipe:visible").all()
                assert sorted(row.locator("a").first.get_attribute("href") for row in visible) == expected, workflow
                assert {row.get_attribute("data-workflow") for row in visible} == {workflow}
                assert f"workflow={workflow}" in page.url
                assert f"Showing {len(expected)} of {total}" in page.locator("#match-count").inner_text()
            page.select_option("#filter-workflow", "")
            assert page.locator("tr.recipe:visible").count() == total
    finally:
        page.close()


def test_engine_and_depth_filters_on_the_published_catalog(tmp_path, browser):
    build_site(REPO / "recipes", tmp_path / "site")
    page = browser.new_page()
    try:
        with _serve(tmp_path / "site") as url:
            page.goto(url + "index.html")
            total = page.locator("tr.recipe").count()
            page.select_option("#filter-engine", "openrecipes")
            visible = page.locator("tr.recipe:visible")
            assert 0 < visible.count() < total and "engine=openrecipes" in page.url
            assert {row.locator("td.engine").inner_text() for row in visible.all()} == {"openrecipes"}
            # the seed cards are full depth: with the engine filter on theirs, "reduced depth" matches nothing
            page.select_option("#filter-engine", "miles/Megatron-LM")
            assert page.locator('#filter-depth option[value="reduced depth"]').is_disabled()
            assert all("does not run it" in row.locator("td.card-name").inner_text()
                       for row in page.locator("tr.recipe:visible").all())
            page.select_option("#filter-engine", "")
            page.select_option("#filter-depth", "reduced depth")
            texts = [row.locator("td.depth").inner_text() for row in page.locator("tr.recipe:visible").all()]
            assert texts and all(text.startswith("reduced depth: ") for text in texts)
    finally:
        page.close()


def _box(page, selector: str) -> dict[str, float]:
    """The element's first box: its first line's, for text that wraps."""
    return page.evaluate("(s) => { const r = document.querySelector(s).getClientRects()[0];"
                         " return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; }", selector)


def test_the_index_table_fits_the_window_or_scrolls_inside_it_with_a_hint(tmp_path, browser):
    build_site(REPO / "recipes", tmp_path / "site")
    page = browser.new_page()
    try:
        with _serve(tmp_path / "site") as url:
            for width, scrolls in ((1400, False), (1000, True), (390, False)):
                page.set_viewport_size({"width": width, "height": 900})
                page.goto(url + "index.html")
                assert page.evaluate("document.documentElement.scrollWidth") <= width, width  # the page never
                if width == 390:  # a phone: the rows are stacked blocks, each inside the screen
                    assert max(row.bounding_box()["x"] + row.bounding_box()["width"]
                               for row in page.locator("tr.recipe").all()) <= width
                elif not scrolls:  # the whole table, its last column (Author) included, inside the window
                    author = _box(page, '#recipes th[data-key="author"]')
                    assert author["left"] >= 0 and author["right"] <= width, (width, author)
                box = page.evaluate("() => { const s = document.getElementById('recipes-scroll');"
                                    " return [s.scrollWidth, s.clientWidth]; }")
                assert (box[0] > box[1]) == scrolls, (width, box)
                assert page.locator("#recipes-scroll-hint").is_visible() == scrolls, width
                if scrolls:  # the last column comes into view when the table's box is scrolled to its end
                    page.evaluate("document.getElementById('recipes-scroll').scrollLeft = 1e6")
                    author = _box(page, '#recipes th[data-key="author"]')
                    assert author["left"] >= 0 and author["right"] <= _box(page, "#recipes-scroll")["right"] + 0.5
    finally:
        page.close()


def _style(page, element, prop: str) -> str:
    return page.evaluate("([e, p]) => getComputedStyle(e)[p]", [element.element_handle(), prop])


def test_a_tuned_cards_page_reads(tmp_path, browser):
    recipes = catalog_with_variant(tmp_path)
    data = tuned_data(pairs=3, ablations=("offload", "recompute"))
    write(recipes / "qwen3-30b-a3b" / "h200" / "tuned.yaml", data)
    build_site(recipes, tmp_path / "site")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        with _serve(tmp_path / "site") as url:
            page.goto(url + "qwen3-30b-a3b/h200/tuned.html")
            # each note one list item, without its "- "; the recipe quoted in the notes closed under a summary
            notes = [line for line in data["notes"].splitlines() if line.startswith("- ")]
            items = page.locator("#notes li").all_inner_texts()
            assert len(items) == len(notes) and not any(item.startswith("- ") for item in items)
            assert not page.locator("#notes details pre").is_visible()
            assert page.locator("#notes").bounding_box()["height"] < 900  # no longer most of the page
            # the chart: every remeasured sample and each ablation, beside the search trials
            chart = page.locator("#tuning-chart svg")
            gain = data["tuning"]["gain"]
            for role in ("start", "winner"):
                assert chart.locator(f":scope > circle.measured.{role}").count() == len(
                    gain[f"{role}_tokens_per_s_per_gpu"]), role
            assert chart.locator(":scope > polygon.ablation").count() == len(data["tuning"]["ablations"])
            # the legend shows a mark for each kind drawn, styled as the plot's marks of that kind are
            marks = chart.locator("g.legend-mark").all()
            assert {m.get_attribute("class").split()[1] for m in marks} >= {"trial", "start", "winner", "predicted",
                                                                             "failed", "ablation", "dash"}
            for mark in marks:
                kind = mark.get_attribute("class").split()[1]
                shape = mark.locator(":scope > *").first
                tag = shape.evaluate("e => e.tagName")
                plotted = chart.locator(f":scope > {tag}.{shape.get_attribute('class').replace(' ', '.')}").first
                for prop in ("fill", "stroke"):
                    assert _style(page, shape, prop) == _style(page, plotted, prop), (kind, prop)
                assert shape.bounding_box()["width"] > 0, kind  # drawn, not an empty group
    finally:
        page.close()


def test_the_status_badge_says_what_it_means_and_a_cpu_run_counts_processes(tmp_path, browser):
    recipes = catalog_with_variant(tmp_path)
    write(recipes / "qwen3-30b-a3b" / "cpu" / "cpu-run.yaml", cpu_data())
    build_site(recipes, tmp_path / "site")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        with _serve(tmp_path / "site") as url:
            page.goto(url + "qwen3-30b-a3b/cpu/cpu-run.html")
            assert page.locator("#status").inner_text() == "○ Unverified"
            note = page.locator("#status-note")
            assert note.is_visible() and "not marked verified by a person" in note.inner_text()
            badge, beside = _box(page, "#status"), _box(page, "#status-note")
            assert beside["left"] >= badge["right"] and beside["top"] < badge["bottom"]  # on its line, right of it
            devices = page.locator("#devices")
            assert devices.inner_text() == "8 CPU processes"
            assert page.locator("dt", has=page.locator("text=Processes")).count() == 1
            page.goto(url + "index.html")
            row = page.locator('tr.recipe:has(a[href$="cpu-run.html"])')
            assert row.locator('td[data-label="GPUs"]').inner_text() == "8 CPU processes"
            assert "not marked verified" in row.locator(".badge").get_attribute("title")
    finally:
        page.close()


def test_steps_are_shown_from_one_as_the_console_counts_them(served_site, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        page.goto(served_site + "qwen3-30b-a3b/h200/variant-with-curves.html")
        # the card's window is steps 5-19 of 20, counted from 0
        assert "steps 6-20" in page.locator("#metrics .label").first.inner_text()
        tips = page.locator("#loss-curves circle.point.candidate title").all_text_contents()
        assert tips[0].startswith("candidate, step 1: ") and tips[-1].startswith("candidate, step 20: ")
        ticks = page.locator("#loss-curves text.tick.x").all_text_contents()
        assert "20" in ticks and "0" not in ticks
        # a model page: openrecipes' records from 1 too; Megatron's as it counts them (from 1 already)
        page.goto(served_site + "models/qwen3-moe-tiny.html")
        item = load_verification_card(VERIFICATION / "qwen3-moe-tiny.yaml").card.items
        window = next(i.metrics.window for i in item if i.metrics and i.metrics.window)
        label = page.locator("section.item .metric .label", has_text="Step time").first.text_content()
        assert label.endswith(f"steps {window[0] + 1}-{window[1] + 1}"), label
        page.goto(served_site + "models/muse-spark-open-816b-a42b.html")
        muse = load_verification_card(VERIFICATION / "muse-spark-open-816b-a42b.yaml").card.items
        window = next(i.metrics.window for i in muse if i.metrics and i.metrics.window)
        labels = page.locator("section.item .metric .label", has_text="Step time").all_text_contents()
        assert f"Step time · steps {window[0]}-{window[1]}" in labels
    finally:
        page.close()
