"""The index says what it mixes: each card's engine and depth are columns and filters, and a row whose card this
tool cannot run (measured with another framework) says so."""

import re

from .site_fixtures import CATALOG
from .test_site_text import page_text

from openrecipes.site.build import build_site


def _rows(html: str) -> dict[str, str]:
    """Each recipe row's text, by its card name."""
    rows = re.findall(r'<tr class="recipe".*?</tr>', html, flags=re.S)
    return {re.search(r'class="card-name"><a [^>]*>([^<]+)</a>', row).group(1): page_text(row) for row in rows}


def test_the_index_shows_engine_and_depth_and_what_it_cannot_run(tmp_path):
    site = build_site(CATALOG, tmp_path / "site")
    html = (site.out / "index.html").read_text()
    assert site.filters["engine"] == ["miles/Megatron-LM", "openrecipes"]
    assert site.filters["depth"] == ["full depth", "reduced depth"]
    for key in ("engine", "depth"):
        assert f'<select id="filter-{key}" name="{key}">' in html
        assert f'<th data-key="{key}"' in html
    rows = _rows(html)
    qwen, muse = rows["attune-tp1-pp1-ep8-mt16k"], rows["attune-tp4-pp16-ep8"]
    tuned = rows["qwen3-30b-a3b-16l-tune-start-tuned"]
    for seed, layers in ((qwen, 48), (muse, 62)):
        assert "measured with miles/Megatron-LM: openrecipes train does not run it" in seed
        assert f"full depth ({layers} layers)" in seed
    assert "does not run it" not in tuned and "openrecipes" in tuned
    assert "reduced depth: 16 of 48 layers" in tuned
    # the data attributes the filters read
    assert re.search(r'data-engine="openrecipes" data-depth="reduced depth"', html)
    assert len(re.findall(r'data-engine="miles/Megatron-LM" data-depth="full depth"', html)) == 2


def test_a_reduced_depth_cards_page_says_so_at_the_top(tmp_path):
    site = build_site(CATALOG, tmp_path / "site")
    page = (site.out / "qwen3-30b-a3b" / "h200" / "qwen3-30b-a3b-16l-tune-start-tuned.html").read_text()
    top = page_text(page[:page.index('id="metrics"')])
    assert "Reduced depth: 16 of 48 layers: not the whole model" in top
    seed = (site.out / "qwen3-30b-a3b" / "h200" / "attune-tp1-pp1-ep8-mt16k.html").read_text()
    assert 'id="reduced-depth"' not in seed
    assert "openrecipes train does not run it" in page_text(seed[:seed.index('id="metrics"')])
