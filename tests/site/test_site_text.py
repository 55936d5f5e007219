"""What a reader sees on the built site's pages is text from the cards, never a Python object's repr."""

import re
from html.parser import HTMLParser
from pathlib import Path

from .site_fixtures import REPO, catalog_with_variant

from openrecipes.cards.verification_load import load_verification_dir
from openrecipes.site.build import _environment, build_site

# what str() of a method, function or object without its own __str__ looks like
REPR = re.compile(r"<(built-in (method|function)|bound method|function|[\w.]+ object)\b| at 0x[0-9a-fA-F]+>")


class _Text(HTMLParser):
    """The page's text as a browser shows it (outside <script> and <style>)."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag, attrs):
        self._hidden += tag in ("script", "style")

    def handle_endtag(self, tag):
        self._hidden -= tag in ("script", "style")

    def handle_data(self, data):
        if not self._hidden:
            self.parts.append(data)


def page_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return " ".join(" ".join(parser.parts).split())


def test_no_page_shows_a_python_repr(tmp_path):
    site = build_site(catalog_with_variant(tmp_path), tmp_path / "site", REPO / "verification")
    pages = sorted(site.out.rglob("*.html"))
    assert len(pages) == len(site.pages) + len(site.model_pages) + 1  # and the index
    for page in pages:
        html = page.read_text()
        assert not REPR.search(page_text(html)), f"{page}: {REPR.search(page_text(html)).group(0)}"
        assert "<built-in" not in html and "&lt;built-in" not in html and not re.search(r" at 0x[0-9a-f]+", html)


def test_the_index_counts_each_models_recorded_combinations(tmp_path):
    site = build_site(catalog_with_variant(tmp_path), tmp_path / "site", REPO / "verification")
    text = page_text((site.out / "index.html").read_text())
    for loaded in load_verification_dir(REPO / "verification"):
        count = len(loaded.card.items)
        assert f"{loaded.card.model} ({count} recorded combination{'s' if count != 1 else ''}" in text


def test_a_dict_key_named_like_a_dict_method_reads_the_key():
    template = _environment().from_string("{{ m.items }} {{ m.keys }} {{ m.model }} {{ t.real }}")
    assert template.render(m={"items": 3, "keys": "k", "model": "x"}, t=2) == "3 k x 2"


def test_a_cards_headline_names_its_window_as_the_model_page_does(tmp_path):
    import yaml

    catalog = catalog_with_variant(tmp_path)
    site = build_site(catalog, tmp_path / "site", REPO / "verification")
    checked = 0
    for card_file in sorted(catalog.rglob("*.yaml")):
        card = yaml.safe_load(card_file.read_text())
        if not isinstance(card, dict) or "result" not in card:
            continue
        page = site.out / card_file.relative_to(catalog).with_suffix(".html")
        first, last = card["result"]["window"]
        # the card counts steps from 0, the page from 1 as the console does
        assert f"Tokens/s/GPU · steps {first + 1}-{last + 1}" in page_text(page.read_text())
        checked += 1
    assert checked >= 3


def test_a_model_page_lists_the_cards_of_its_model_however_its_name_is_spelled():
    from openrecipes.site.build import same_model

    assert same_model("Qwen3-MoE tiny", "qwen3-moe-tiny") and same_model("Qwen3_30B A3B", "qwen3-30b-a3b")
    assert not same_model("qwen3-moe-tiny", "qwen3-moe") and not same_model("Qwen3-30B-A3B", "qwen3-30b-a3b-16l")
