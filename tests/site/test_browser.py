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
from .site_fixtures import REPO, catalog_of_workflows, catalog_with_variant

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
        assert page.locator("#metric-tokens").inner_text() == "6,913.23"
        assert page.locator("#metric-usd").inner_text() == "$0.32"
        assert page.locator("#metric-mfu").inner_text() == "12.8%"
        assert "Unverified" in page.locator("#status").inner_text()
        assert page.locator("#loss-curves svg polyline").count() == 2
        for plot in ("#curve-step-time-s", "#curve-tokens-per-s-per-gpu", "#memory-stages"):
            assert page.locator(plot + " svg").is_visible(), plot
        assert "--max-tokens-per-gpu 16384" in page.locator("#run-script").inner_text()
        assert page.locator("#card-yaml").count() == 0  # the card is a linked file, not a second dump
        page.click('button[data-copy="recipe-yaml"]')
        page.wait_for_function("document.querySelector('button[data-copy=\"recipe-yaml\"]').textContent"
                               " === 'Copied'")
        assert page.evaluate("navigator.clipboard.readText()") == page.locator("#recipe-yaml").inner_text()
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
