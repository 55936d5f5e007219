"""What every value of a card must be beyond its field's type: numbers in a range its derived figures survive, and
text that shows as what it holds.

A card is read from files others write, and shown on the site and in terminals. No figure a real card records comes
near these bounds.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

# past these the checks' arithmetic breaks: an integer beyond 64 bits may not convert to a float (OverflowError),
# and a nonzero float this small underflows to 0 in the products the checks divide by (ZeroDivisionError)
MAX_INT = 2**64
MIN_NONZERO_FLOAT = 1e-100
# control characters (tab and line breaks aside) and bidi embeddings, overrides and isolates: they make a page or a
# terminal show other text than the card holds (a Run command that reads differently from what is copied)
HIDDEN_CHARACTERS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def plain_value(value: Any) -> Any:
    """``value`` when every number and string in it (through lists, and dicts' keys and values) is within the
    bounds above; else a ValueError naming the first that is not."""
    if isinstance(value, (list, tuple, dict)):
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        for where, item in pairs:
            try:
                plain_value(where)
                plain_value(item)
            except ValueError as error:  # the field is named by pydantic; say where in it
                raise ValueError(f"[{where!r:.60}] {error}") from None
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
        raise ValueError(f"an integer of {len(str(abs(value)))} digits is beyond the {MAX_INT:,} a card allows")
    elif isinstance(value, float) and 0 < abs(value) < MIN_NONZERO_FLOAT:
        raise ValueError(f"{value!r} is nonzero but below {MIN_NONZERO_FLOAT:g} in magnitude")
    elif isinstance(value, str) and (found := HIDDEN_CHARACTERS.search(value)):
        raise ValueError(f"holds the control or bidi character {found.group()!r} at index {found.start()}")
    return value


# the schemes a card's link may have: `card new --author-url` takes no other, and the site links no other
WEB_SCHEMES = ("http", "https")


def web_url(url: str | None) -> str | None:
    """``url`` when it is an http(s) address (or None): what `card new --author-url` takes. (The schema still
    accepts any text in author.url, which the site shows unlinked unless it is http(s).)"""
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in WEB_SCHEMES or not parts.netloc:
            raise ValueError(f"not an http(s) address: {url[:80]!r}")
    return url
