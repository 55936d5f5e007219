"""A card's notes as the page shows them (site/notes.py): each ``- `` note one list item, other lines paragraphs,
an indented block (a recipe quoted in an older card's notes) code."""

import yaml

from .site_fixtures import TUNED_CARD

from openrecipes.site.notes import note_blocks


def test_each_note_is_an_item_and_an_indented_block_is_code():
    text = "- first note\n  continued\n- second\nA paragraph\nthat wraps.\n\n    name: x\n\n    steps: 2\nAfter."
    assert note_blocks(text) == [("list", ["first note continued", "second"]),
                                 ("paragraph", "A paragraph that wraps."), ("code", "name: x\n\nsteps: 2"),
                                 ("paragraph", "After.")]


def test_the_tuned_cards_notes_keep_every_note_and_the_quoted_recipe():
    notes = yaml.safe_load(TUNED_CARD.read_text())["notes"]
    blocks = note_blocks(notes)
    [items] = [block for kind, block in blocks if kind == "list"]
    assert items == [line[2:] for line in notes.splitlines() if line.startswith("- ")]
    [code] = [block for kind, block in blocks if kind == "code"]
    assert yaml.safe_load(code)["name"].startswith("qwen3-30b-a3b-16l-tune-start")
