"""Headless Chromium opens the tuned card's page and finds the trials chart: measured points, predictions, the
failed trial marked. Skipped without Chromium and Playwright unless OPENRECIPES_REQUIRE_BROWSER=1 (as tests/site)."""

from __future__ import annotations

import io
import threading

from openrecipes.site.serve import make_server
from openrecipes.tune.progress import Progress
from openrecipes.tune.publish import publish
from openrecipes.tune.search import Search, TuneOptions
from openrecipes.tune.verification import choose_winner

from ..site.test_browser import CHROMIUM, CHROMIUM_ARGS, _sync_playwright
from .conftest import SyntheticRunner


def test_the_card_page_charts_the_trials(start_yaml, tmp_path):
    sync_playwright = _sync_playwright()
    options = TuneOptions(start=start_yaml, out=tmp_path / "out", gpus="cpu", trials=4, trial_steps=8,
                          tries=("debug.fail_at=[0,2]",))
    result = Search(options, SyntheticRunner(), Progress(trials=4, minutes=30, stream=io.StringIO())).run()
    published = publish(result, *choose_winner(result), minutes=0.5)
    server = make_server(published.site, 0, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/qwen3-moe-tiny/cpu/slow-start-tuned.html")
                chart = page.locator("#tuning-chart svg")
                assert chart.is_visible()
                # the plotted marks: the legend draws one of each kind with the same markup (g.legend-mark)
                plotted = lambda kind: chart.locator(f"{kind}:not(.legend-mark):not(.legend-mark *)").count()  # noqa
                assert plotted("circle.measured") == 3
                assert plotted("circle.winner") == 1
                assert plotted("rect.predicted") >= 3
                assert plotted("g.failed") == 1
                assert page.locator("#tuning-trials tr.failed").count() == 1
                assert "tuned to" in page.locator("#tuning-summary").inner_text()
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
