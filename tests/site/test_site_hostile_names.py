"""Card file names and links a catalog's contributor chooses: the site quotes them and never reads outside the
catalog."""

from __future__ import annotations

import pytest
from .site_fixtures import qwen_data, write

from openrecipes.site.build import build_site


def test_a_card_named_like_a_script_url_gets_a_relative_link_to_its_yaml(tmp_path):
    recipes = tmp_path / "recipes"
    write(recipes / "m" / "g" / "javascript:alert(1).yaml", qwen_data())
    write(recipes / "m" / "g" / "a b#c?d.yaml", qwen_data() | {"layout": qwen_data()["layout"] | {"label": "other"}})
    out = tmp_path / "site"
    build_site(recipes, out)
    page = (out / "m" / "g" / "javascript:alert(1).html").read_text()
    assert 'href="javascript:' not in page
    assert '<a href="javascript%3Aalert%281%29.yaml">javascript:alert(1).yaml</a>' in page
    # a '#' or '?' in the name is part of the file's name, not the link's fragment or query
    assert '<a href="a%20b%23c%3Fd.yaml">' in (out / "m" / "g" / "a b#c?d.html").read_text()


def test_a_link_in_the_catalog_to_a_card_outside_it_is_refused_by_name(tmp_path):
    outside = write(tmp_path / "elsewhere" / "secret.yaml", qwen_data())
    recipes = tmp_path / "recipes"
    write(recipes / "m" / "g" / "ok.yaml", qwen_data())
    (recipes / "m" / "g" / "link.yaml").symlink_to(outside)
    out = tmp_path / "site"
    with pytest.raises(ValueError, match=r"'m/g/link.yaml' is not a path inside .*resolves to .*secret.yaml"):
        build_site(recipes, out)
    assert not out.exists()


def test_a_link_in_the_catalog_to_a_card_inside_it_is_read(tmp_path):
    recipes = tmp_path / "recipes"
    card = write(recipes / "m" / "g" / "ok.yaml", qwen_data())
    (recipes / "alias.yaml").symlink_to(card)
    # read, and found to be the card it links to: one page, which two cards may not share
    with pytest.raises(ValueError, match="two cards would share the page"):
        build_site(recipes, tmp_path / "site")
