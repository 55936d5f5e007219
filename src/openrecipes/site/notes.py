"""A card's notes as the page shows them: its ``- `` lines as one list (each note one item), its other lines as
paragraphs, and its indented blocks (a resolved recipe quoted in older cards' notes) as code to be opened on demand.

The notes are plain text a person or `card new` wrote (``- note`` per line); reading them as that small format,
rather than as one pre-wrapped paragraph, keeps the literal ``- `` out of the page. Nothing here makes markup: the
template escapes every piece.
"""

from __future__ import annotations

import textwrap

CODE_INDENT = 4  # a block indented this far (after a blank line, or under a paragraph) is code, as in Markdown


def note_blocks(text: str) -> list[tuple[str, object]]:
    """The notes as blocks in order: ("list", [item, ...]), ("paragraph", text) or ("code", text). A list item's
    continuation lines (indented, right under it) join it; blank lines end paragraphs and items."""
    blocks: list[tuple[str, object]] = []
    kind = None  # the block the next line may continue: "item", "paragraph", "code" or None after a blank line
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        if kind == "code" and (not stripped or indent >= CODE_INDENT):
            blocks[-1][1].append(line)
        elif not stripped:
            kind = None
        elif line.startswith("- "):
            if not blocks or blocks[-1][0] != "list":
                blocks.append(("list", []))
            blocks[-1][1].append(stripped[2:].strip())
            kind = "item"
        elif kind == "item" and indent > 0:
            blocks[-1][1][-1] += " " + stripped
        elif indent >= CODE_INDENT:
            blocks.append(("code", [line]))
            kind = "code"
        elif kind == "paragraph":
            blocks[-1] = ("paragraph", blocks[-1][1] + " " + stripped)
        else:
            blocks.append(("paragraph", stripped))
            kind = "paragraph"
    return [(k, textwrap.dedent("\n".join(v)).strip("\n") if k == "code" else v) for k, v in blocks]
