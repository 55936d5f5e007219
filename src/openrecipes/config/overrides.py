"""``--set KEY=VALUE``: a recipe tree changed by dotted keys, each value read as YAML."""

from __future__ import annotations

from typing import Any

from openrecipes.config.safe_yaml import load_plain_yaml


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], value parsed as YAML scalar/flow)."""
    if "=" not in text:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE, e.g. layout.dp=2")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ValueError(f"--set {text!r}: empty key")
    # the recipe file's loader: plain data only (no tags, anchors or aliases, bounded depth), one line on error
    value = load_plain_yaml(raw, source=f"--set {key}")[0] if raw.strip() else ""
    return key.split("."), value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        for part in path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ValueError(f"--set {text!r}: {part} is not a section")
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return tree
